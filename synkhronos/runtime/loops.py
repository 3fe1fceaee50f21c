"""The master's side of a device-driven loop: one entry point, :class:`Loops`.

``train.run`` asks :meth:`Loops.new` for a loop over its step's functions and
data, then runs it phase by phase (:meth:`Loops.run`: global steps
``[first, last)`` on every rank without a command per step) and ends it
(:meth:`Loops.finish`: the rule's final parameters on every device). Each
rank runs its part in :class:`synkhronos.rank.loop.DeviceLoop`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import numpy as np

from ..comm import Reservation
from ..errors import SynkError
from ..platform.values import nbytes_of, stored
from ..rank.commands import loop_phase
from ..tracing import trace
from ..wire.loop import LoopSpec
from .centers.loop_centers import LoopCenters
from .part import Part

if TYPE_CHECKING:
    from ..rank.loop import DeviceLoop
    from ..seams.rule import Rule
    from ..wire.plan import InputRef
    from .nodes import NodeLink

__all__ = ["Loops", "TrainParts", "LoopStopped"]


class LoopStopped(Exception):
    """The master's loop, running in a thread of its own, ended between steps at a Ctrl-C that the
    main thread took (which then tears the runtime down and raises the KeyboardInterrupt)."""


class TrainParts(Protocol):
    """What a loop takes of a training step (``extensions.train.TrainStep`` has it)."""

    functions: tuple
    grad_shared: Any
    params: list
    statistics: list
    optimizer_state: list


class Loops(Part):
    """The device-driven loops of one runtime."""

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self._loops: dict[int, DeviceLoop] = {}  # loop id -> the master's DeviceLoop, from its first phase to finish
        #: a Ctrl-C asked the master's loop thread to end after its step
        self._stop_asked = False
        self._centers = LoopCenters(state)
        self._next_loop = 0

    def new(self, step: TrainParts, inputs: Sequence[InputRef], batch_size: int, shuffle: bool, seed: int,
            rule: Rule, rule_state: Sequence[np.ndarray] | None = None) -> LoopSpec:
        """A new loop's :class:`~synkhronos.wire.loop.LoopSpec` (nothing runs yet).

        Parameters
        ----------
        step : TrainStep
            The training step (``make_train_function``'s): its functions and variables.
        inputs : list of InputRef
            Where the step's scattered inputs live.
        batch_size : int
        shuffle : bool
        seed : int
        rule : Rule
        rule_state : list of numpy.ndarray, optional
            The rule's state a checkpoint kept (a resumed run).
        """
        state = self._state
        uids = state.registry.uids_of
        grad, update = step.functions
        self._next_loop += 1
        loop_id = self._next_loop
        return LoopSpec(loop_id=loop_id, grad_fid=grad.spec.fid, update_fid=update.spec.fid,
                        grad_uid=state.registry.uid_of(step.grad_shared), param_uids=tuple(uids(step.params)),
                        stat_uids=tuple(uids(step.statistics)), state_uids=tuple(uids(step.optimizer_state)),
                        inputs=tuple(inputs), batch_size=int(batch_size), shuffle=bool(shuffle),
                        seed=int(seed), rule=rule,
                        center=f"{state.prefix}_center{loop_id}" if rule.asynchronous else None,
                        rule_state=None if rule_state is None else tuple(rule_state))

    def run(self, spec: LoopSpec, first: int, last: int) -> Any:
        """Run global steps ``[first, last)`` of loop ``spec`` on every rank.

        Returns every rank's counters, shape ``(n_ranks, len(STAT_FIELDS))``.
        """
        return self._phase(spec, "run", first, last)

    def finish(self, spec: LoopSpec) -> None:
        """Leave every device with loop ``spec``'s final parameters; the loop is then forgotten."""
        if spec.rule.asynchronous and not self._centers.opened(spec.loop_id):
            return          # its center was never made: no device ran
        self._phase(spec, "finish")

    def center_values(self, spec: LoopSpec) -> list:
        """Loop ``spec``'s center now (copies), or the master's parameters for a rule without one."""
        loop = self._loops.get(spec.loop_id)
        values = loop.center_values() if loop is not None else None
        if values is None:
            values = [np.array(self._state.registry.shared_by_uid(uid).get_value())
                      for uid in spec.synced_uids]
        return values

    def rule_state(self, spec: LoopSpec) -> list:
        """Loop ``spec``'s rule state as the master's device holds it (arrays; see Rule.saved_state)."""
        loop = self._loops.get(spec.loop_id)
        return loop.saved_rule_state() if loop is not None else []

    def put_back_half_steps(self) -> None:
        """Before a fault's teardown: every master loop's step that stored its state but not its
        update is put back (see :meth:`DeviceLoop.put_back_half_step`)."""
        for loop in self._loops.values():
            loop.put_back_half_step()

    def release(self) -> None:
        """At the runtime's end: close every center."""
        self._centers.release()
        for loop in self._loops.values():
            loop.close_center()
        self._loops = {}

    def _phase(self, spec: LoopSpec, phase: str, first: int = 0, last: int = 0) -> np.ndarray | None:
        state = self._state
        state.registry.ensure_shipped()
        channel = state.channel
        nodes: NodeLink | None = state.nodes
        self._centers.check()
        if not spec.rule.asynchronous:
            state.context.comm.reserve(self._reservation(spec))
            sent = spec
        else:       # the workers attach to the center where it is (on another node: node 0's server)
            sent = replace(spec, center=self._centers.route(spec, first))
        if spec.loop_id in self._loops and spec.rule_state is not None:
            sent = replace(sent, rule_state=None)     # every rank's loop has started from it already
        # cloudpickle: a rule of the user's own may be a class of the script itself (__main__)
        channel.send_payload(cloudpickle.dumps(dict(spec=sent, phase=phase, first=first, last=last),
                                               protocol=pickle.HIGHEST_PROTOCOL))

        def local() -> np.ndarray | None:
            # (a new loop is made here, once the workers have the command: a rule may start with
            # a collective)
            try:
                return loop_phase(self._loops, state.context, spec, phase, first, last,
                                  center=lambda: self._centers.take(spec.loop_id), beat=self._after_step)
            except Exception as e:
                # (an asynchronous rule has no collective across nodes: its error is its own)
                if nodes is None or isinstance(e, SynkError) or spec.rule.asynchronous:
                    raise
                # a collective across nodes failed: a lost node is named, as in a call
                nodes.raise_dead_node("train.run across nodes", e)
        # (one rank has no native collective to watch: it runs here, where Ctrl-C can be held off)
        threaded = not spec.rule.asynchronous and state.n_parallel > 1 and \
            not state.context.comm.waits_in_python
        if trace.on:
            trace.begin("loop", f"train.run {phase}")
        self._stop_asked = False
        try:
            own = channel.loop_phase(local, threaded, stop=self._ask_to_stop)
            self._centers.check()
        finally:
            if trace.on:
                trace.end(None, first=first, last=last)
            if phase == "finish" or not state.is_open:
                self._loops.pop(spec.loop_id, None)
        if phase == "finish":
            if spec.rule.asynchronous:
                self._centers.finished(spec)
            return None
        stats = np.zeros((state.n_local, len(own)))
        stats[state.local_master] = own
        for rank in state.worker_ranks:
            stats[rank] = channel.read_result_arrays(rank)[0]
        if nodes is None:
            return stats
        # an asynchronous run goes on without a lost node (its ranks count nothing); a synchronous
        # one cannot (its collectives need every rank)
        by_node = nodes.exchange(("train.run", phase), stats, tolerate_loss=spec.rule.asynchronous)
        return np.concatenate([np.zeros_like(stats) if got is None else got for got in by_node])

    def lost_nodes(self) -> set[int]:
        """The nodes an asynchronous run went on without (none on one node)."""
        nodes = self._state.nodes
        return set() if nodes is None else set(nodes.lost)

    def _after_step(self) -> None:
        """After every step of the master's device: its workers, and on node 0 its server; and a
        Ctrl-C the main thread took while the loop runs in a thread of its own ends it here,
        between whole steps (:class:`LoopStopped`)."""
        if self._stop_asked:
            raise LoopStopped("train.run was interrupted (Ctrl-C)")
        self._state.channel.watch.during_collective()
        self._centers.check()

    def _ask_to_stop(self) -> None:
        """Have the master's loop end after its step (see :meth:`_after_step`)."""
        self._stop_asked = True

    def _reservation(self, spec: LoopSpec) -> Reservation:
        """What a synchronous loop's collectives need: the flat gradient, or the parameters and state."""
        def nbytes(uid: int) -> int:
            return nbytes_of(stored(self._state.registry.shared_by_uid(uid)))
        if spec.rule.reduces_gradient:
            grad = nbytes(spec.grad_uid)
            return Reservation(nbytes=grad + 64, result_bytes=grad, reduce_bytes=grad,
                               result_consumed=True)
        padded = sum(nbytes(uid) + 64 for uid in spec.synced_uids + spec.state_uids)
        return Reservation(nbytes=padded, reduce_bytes=padded)
