"""Where and when :func:`synkhronos.extensions.train.run` saves, and the step it resumes from."""

from __future__ import annotations

import os

import numpy as np

from ..api import checkpoint, collectives
from ..errors import is_whole
from ..runtime.session import current
from ..seams.rule import rule_difference, rule_record
from .run_options import Checkpointing

__all__ = ["RunCheckpoints", "next_multiple", "order_record"]


def order_record(order, batch_size, n_rows, run_data, checkpointing):
    """What a checkpoint records of the run's data order, which a resumed run must share: the order's
    settings and a digest of the data (taken only with checkpoints)."""
    recorded = dict(seed=order.seed, shuffle=order.shuffle, batch_size=batch_size, n_rows=n_rows)
    if checkpointing is not None:
        recorded["data_digest"] = checkpoint.digest(run_data)
    return recorded


def next_multiple(step, period):
    return (step // period + 1) * period


class RunCheckpoints:
    """Where and when :func:`run` saves, and the step it resumes from.

    The checkpoint is ``<checkpoint_dir>/checkpoint.safetensors``, replaced
    atomically every ``every`` global steps; its ``extra`` records the run's
    data order (seed, shuffle, batch size, rows) and the rule (its type and
    settings, :func:`~synkhronos.seams.rule.rule_record`), which a resumed run
    must share.
    """

    FILE = "checkpoint.safetensors"

    def __init__(self, checkpointing: Checkpointing | None, step, order, rule):
        self.path: str = ""          # set with a Checkpointing (empty: no checkpoints)
        self.every: int | None = None
        self.variables, self.order, self.rule = step.state_variables, order, rule
        self.n_params = len(step.params)
        #: the parameters a rule's center holds (statistics included)
        self.synced = step.params + step.statistics
        #: what each device keeps for itself: restored by rank on another number of devices
        self.own_state = step.optimizer_state
        self._resumed = 0
        #: the sync rule's state the checkpoint holds (see Rule.saved_state), or None
        self.rule_state: list | None = None
        #: (nodes, devices) the resumed checkpoint was written on, or None
        self.written_on: tuple | None = None
        if checkpointing is None:
            return
        directory = os.fspath(checkpointing.directory)
        os.makedirs(directory, exist_ok=True)
        self.path, self.every = os.path.join(directory, self.FILE), checkpointing.every
        if checkpointing.resume and checkpoint.exists(self.path):
            self._resumed = self._restore()

    def _restore(self):
        contents = checkpoint.read_on_every_node(self.path)
        meta, saved, tensors = contents
        saved = saved if isinstance(saved, dict) else {}
        differences = _order_difference(saved.get("order"), self.order)
        if differences is None:
            differences = rule_difference(saved.get("rule") or {}, self.rule)
        if differences is not None:
            raise ValueError(f"the checkpoint {self.path} was written by another run: {differences}; "
                             f"resume with the same data, batch size, seed and rule, or use another "
                             f"checkpoint_dir")
        held = saved.get("rule_state", 0)
        keys = [f"{checkpoint.ARRAY_PREFIX}rule/{i}" for i in range(held)] if is_whole(held, at_least=0) else []
        if not is_whole(held, at_least=0) or any(k not in tensors for k in keys):
            raise ValueError(f"the checkpoint {self.path} records {held!r} arrays of the rule's state "
                             f"but holds {sum(k in tensors for k in keys)}; it is damaged: use another "
                             f"checkpoint_dir")
        self.rule_state = [tensors[k] for k in keys]
        if len(meta["variables"]) != len(self.variables):
            raise ValueError(f"the checkpoint {self.path} holds {len(meta['variables'])} variables where "
                             f"this training has {len(self.variables)}: it was written for another "
                             f"model; use another checkpoint_dir")
        n_devices = current().n_parallel
        self.rule.check_saved(self.rule_state, n_devices, self.n_params)
        from_center = self.rule.saves_center and bool(self.rule_state)
        self._check_devices(meta, n_devices, from_center)
        layout = saved.get("layout") or {}
        self.written_on = (layout.get("nodes"), meta["n_devices"])
        # the center is the run's parameters: every device starts from it, on any number of devices
        any_count = self.own_state + (self.synced if from_center else [])
        step = checkpoint.restore_read(self.path, contents, self.variables, any_count=any_count)["step"]
        if not is_whole(step, at_least=0):          # a str or a float is not whole either
            raise ValueError(f"the checkpoint {self.path} records the step {step!r}, not a whole "
                             f"number of steps; it is damaged: use another checkpoint_dir")
        if from_center:
            self._start_from_center(self.rule_state)
            self.rule_state = []
        return int(step)

    def _check_devices(self, meta, n_devices, from_center):
        """Refuse parameters that differed between the devices of a checkpoint written on another count."""
        if meta["n_devices"] == n_devices or from_center:
            return
        differed = [entry["name"] for entry, var in zip(meta["variables"], self.variables)
                    if entry["per_rank"] and any(var is v for v in self.synced)]
        if differed:
            raise ValueError(f"the checkpoint {self.path} was written on {meta['n_devices']} devices "
                             f"whose parameters differed ({differed[0]}, ...: {self.rule!r} had not "
                             f"synchronised them); resume it on {meta['n_devices']} devices, or on "
                             f"{n_devices} from a checkpoint where they agree (checkpoint_every a "
                             f"multiple of the rule's every)")

    def _start_from_center(self, center):
        """Every device's parameters (and statistics) from the center the checkpoint holds."""
        fits = len(center) == len(self.synced) and all(
            np.shape(c) == np.shape(v.get_value(borrow=True)) for c, v in zip(center, self.synced))
        if not fits:
            raise ValueError(f"the checkpoint {self.path} holds a center of {len(center)} arrays "
                             f"that does not fit this model's {len(self.synced)} parameters; it was "
                             f"written for another model: use another checkpoint_dir")
        for var, value in zip(self.synced, center):
            var.set_value(np.asarray(value, var.dtype))
        collectives.broadcast(self.synced)

    def resumed_step(self):
        """The global step the run starts from (0 unless resumed)."""
        return self._resumed

    def next_step(self, done):
        return next_multiple(done, self.every) if self.path else float("inf")

    def maybe_save(self, done, rule_state=lambda: []):
        """Save at a multiple of the period; ``rule_state()`` gives the sync rule's state (arrays)."""
        if self.path and done % self.every == 0:
            held = rule_state()
            state = current()
            checkpoint.save(self.path, self.variables, step=done,
                            extra=dict(order=self.order, rule=rule_record(self.rule),
                                       rule_state=len(held),
                                       layout=dict(nodes=state.topology.n_nodes, devices=state.n_parallel)),
                            arrays={f"rule/{i}": a for i, a in enumerate(held)})


def _order_difference(saved, order):
    """How the data order ``order`` differs from the checkpoint's ``saved``, in words; None if not."""
    if not isinstance(saved, dict):
        return f"it records no data order ({saved!r})"
    differ = [f"{k} is {saved.get(k)!r} in the checkpoint, {order.get(k)!r} here"
              for k in sorted(set(saved) | set(order)) if saved.get(k) != order.get(k)]
    return "; ".join(differ) or None
