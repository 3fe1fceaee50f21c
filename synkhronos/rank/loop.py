"""What every rank runs of a device-driven training loop: many steps per command.

A step is the training step of ``make_train_function`` without the master:
the rank takes its rows of the step's global batch from the epoch's order
(:func:`~synkhronos.wire.loop.epoch_order`), gathers them from the Data in
shared memory, runs the gradient function, lets the sync rule all-reduce the
flat gradient if it does (:mod:`synkhronos.rank.sync`), runs the update
function, and hands the step to the rule. Synchronous rules run the same
global steps on every rank; under an asynchronous rule every rank claims its
next minibatch (one device's part of a global step) from a counter the
ranks share, so a fast device trains on more of them than a slow one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..platform.device_arrays import adopt, to_device
from ..platform.values import store, stored
from ..seams.loop import CenterClient
from ..seams.rule import Rule, RuleState
from ..tracing import trace
from ..wire.batch import chunk
from ..wire.collective import dtype_groups
from ..wire.loop import LoopStats, epoch_order
from .blocks import Blocks
from .collectives.contract import CollectiveContext
from .rows import gather_rows
from .undo import HalfStep, half_step

if TYPE_CHECKING:
    import jax

    from ..comm import Comm
    from ..wire.loop import LoopSpec
    from .compiled import CompiledFunction, GatherBuffer

__all__ = ["DeviceLoop", "HOST_GRADIENT_MAX_BYTES"]

#: a flat gradient up to this size goes from the all-reduce to the update program as a host array
#: (making a device array of it costs more than the update's own copy of a small input); a larger
#: one as a device array, which on CPU views the result without a copy
HOST_GRADIENT_MAX_BYTES = 1 << 20


class LoopContext(CollectiveContext, Protocol):
    """What a loop takes of its rank (:class:`~.context.RankContext` has it): what a collective's
    part takes, and its compiled functions.

    The rank context imports the loop, so the loop takes it through this contract instead.
    """

    def function(self, fid: int) -> CompiledFunction: ...


class DeviceLoop:
    """One rank's part of a loop, kept from its first phase to ``finish``.

    Parameters
    ----------
    spec : LoopSpec
    context : RankContext
        This rank (its functions, shared variables, Data views, collectives).
    center : CenterClient or None
        The central parameters (asynchronous rules).
    beat : callable
        Called after every step (progress for the master's watch, liveness checks).
    """

    def __init__(self, spec: LoopSpec, context: LoopContext, center: CenterClient | None,
                 beat: Callable[[], None]) -> None:
        self.spec = spec
        self.rule: Rule = spec.rule
        self.rank, self.n_ranks, self.master_rank = context.rank, context.n_ranks, context.master_rank
        self.root_rank = context.root_rank
        self.grad, self.update = context.function(spec.grad_fid), context.function(spec.update_fid)
        self.grad_var = context.variable(spec.grad_uid)
        #: what the rule keeps together: the parameters, then the model's statistics
        self.params = [context.variable(uid) for uid in spec.synced_uids]
        self.n_statistics = len(spec.stat_uids)
        self.state_vars = [context.variable(uid) for uid in spec.state_uids]
        self.views = [context.view(ref) for ref in spec.inputs]
        # a rule without a collective never builds one
        self.comm = context.comm if not spec.rule.asynchronous else None
        self._center: CenterClient | None = center
        self.beat = beat
        self._rows_dtype = np.dtype(self.grad_var.type.dtype)
        grad = stored(self.grad_var)
        small = np.dtype(grad.dtype).itemsize * np.size(grad) <= HOST_GRADIENT_MAX_BYTES
        # (a host array only from an implementation that reduces on the host)
        host_reduce = self.comm is not None and self.comm.program_reducer() is None
        self._all_reduce_gradient = None if self.comm is None else \
            self.comm.all_reduce_host if small and host_reduce else self.comm.all_reduce
        #: steps run as one program each block (see .blocks), where the rule and the data allow
        self.blocks = Blocks(self, context)
        #: on a node's master, whose values the script keeps when the run fails or is interrupted:
        #: the state a step's gradient stores, put back if the step ends before its update stored
        self._half_step: HalfStep | None = half_step(self.grad.spec.updates, self.update.spec.updates) \
            if self.rank == self.master_rank else None
        #: this phase's losses still on the device: (summed loss, rows of each step summed)
        self._losses: list = []
        self._orders: dict[int, np.ndarray] = {}
        #: this rank's seconds spent syncing, and busy in phases, over the whole run
        self.sync_seconds = 0.0
        self._busy_before = 0.0
        self._phase_start = time.perf_counter()
        #: syncs a rate-limited rule skipped (this phase)
        self.skipped = 0
        #: this rank's state of the rule (its counters, a synchronous center, DiLoCo's round)
        self.rule_state: RuleState = (self.rule.start(self) if spec.rule_state is None
                                      else self.rule.resume(self, list(spec.rule_state)))

    # --- what the rules use -----------------------------------------------------------------
    def elapsed(self) -> float:
        """This rank's seconds inside the run's phases so far."""
        return self._busy_before + time.perf_counter() - self._phase_start

    def param_values(self) -> list[np.ndarray]:
        """The parameters' values as host arrays (views on CPU)."""
        return [np.asarray(stored(v)) for v in self.params]

    @staticmethod
    def device_copy(host: np.ndarray) -> jax.Array:
        """A device array with the values ``host`` has now (one copy)."""
        return to_device(host)

    def set_values(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        """Make ``values`` (host or device arrays) the values of ``variables`` on this device."""
        for var, value in zip(variables, values):
            if isinstance(value, (np.ndarray, np.generic)):
                value = to_device(value.astype(var.type.dtype, copy=False))
            elif value.dtype != np.dtype(var.type.dtype):
                value = value.astype(var.type.dtype)
            store(var, value)

    def all_reduce(self, variables: Sequence[Any], values: Sequence[Any], op: str) -> list:
        """Reduce ``values`` (host or device, one per shared variable of ``variables``) over the
        ranks, one launch per dtype."""
        comm, out = self._collectives(), [None] * len(values)
        for idx in dtype_groups(variables):
            for i, r in zip(idx, comm.all_reduce([values[i] for i in idx], op)):
                out[i] = r
        comm.refresh()
        return out

    def broadcast_from_master(self, values: Sequence[Any]) -> list:
        """``values`` as node 0's master holds them, on every rank of every node (one root for all:
        each node's own master would make the nodes' broadcasts disagree)."""
        return self._collectives().broadcast(values, self.root_rank)

    @property
    def center(self) -> CenterClient:
        """The central parameters (asynchronous rules only)."""
        if self._center is None:
            raise RuntimeError(f"{type(self.rule).__name__} runs synchronously: its loop has no center")
        return self._center

    def _collectives(self) -> Comm:
        """The rank's collectives (an asynchronous rule's loop has none: it meets a center)."""
        if self.comm is None:
            raise RuntimeError(f"{type(self.rule).__name__} runs asynchronously: its loop has no "
                               f"collectives")
        return self.comm

    # --- steps ------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 1:
                self._orders.pop(min(self._orders))
            spec = self.spec
            order = self._orders[epoch] = epoch_order(spec.n_rows, epoch, spec.seed, spec.shuffle)
        return order

    def _gathered(self, view: np.ndarray, buffer: GatherBuffer, indices: np.ndarray) -> np.ndarray:
        return gather_rows(view, indices, buffer((len(indices),) + view.shape[1:], view.dtype))

    def _step(self, step: int, part: int, stats: LoopStats) -> None:
        """Global step ``step``'s part ``part``: gather, gradient, (all-reduce), update, rule."""
        indices, batch_rows = self.step_rows(step, part)
        rows = len(indices)
        if trace.on:
            trace.begin("step", "step")
        rows_in = [self._gathered(view, buffer, indices)
                   for view, buffer in zip(self.views, self.grad.gather_buffers)]
        if trace.on:
            trace.mark("gather rows")
        if self._half_step is None:
            self._gradient_then_update(rows_in, rows, batch_rows, stats)
        else:
            self._half_step.begin()
            try:
                self._gradient_then_update(rows_in, rows, batch_rows, stats)
            except BaseException:       # a Ctrl-C, or another rank's failure met in the all-reduce
                self._half_step.put_back_if_half()
                raise
        self.blocks.stepped_apart(rows)
        done = time.perf_counter()
        if trace.on:
            trace.mark("update")
        synced = self.rule.after_update(self.rule_state, self, rows, batch_rows)
        if synced:
            self.sync_seconds += time.perf_counter() - done
            stats.values[LoopStats.SYNCS] += 1
        if trace.on:
            trace.end("sync" if synced else None, step=step, part=part, rows=rows)
        v = stats.values
        v[LoopStats.STEPS] += 1
        v[LoopStats.ROWS] += rows
        self.beat()

    def _gradient_then_update(self, rows_in: list, rows: int, batch_rows: int, stats: LoopStats) -> None:
        """The gradient on this rank's rows, the all-reduce (if the rule reduces it), the update."""
        # a rule without a gradient all-reduce steps on this rank's own mean gradient
        loss = self.grad.run(rows_in + [self.weight_rows(rows, batch_rows)])[0]
        self._losses.append((loss, rows))
        if trace.on:
            trace.mark("gradient")
        if self.rule.reduces_gradient:
            reducing = time.perf_counter()
            reduce_gradient, comm = self._all_reduce_gradient, self._collectives()
            assert reduce_gradient is not None, "made with the collectives"
            reduced, = reduce_gradient([stored(self.grad_var)], "avg")
            comm.refresh()
            # (a host result, adopted by the CPU device that computes the update before this
            # returns: the next all-reduce writes the region only then)
            store(self.grad_var, adopt(reduced) if isinstance(reduced, np.ndarray) else reduced)
            self.sync_seconds += time.perf_counter() - reducing
            stats.values[LoopStats.SYNCS] += 1
            if trace.on:
                trace.mark("all-reduce")
        self.update.run([])

    def step_rows(self, step: int, part: int) -> tuple[np.ndarray, int]:
        """``(indices, batch_rows)``: the rows of the epoch's order that part ``part`` of global step
        ``step`` takes, and the rows of the whole step."""
        spec = self.spec
        epoch, i = divmod(step, spec.steps_per_epoch)
        lo = i * spec.batch_size
        hi = min(lo + spec.batch_size, spec.n_rows)
        a, b = chunk(lo, hi, self.n_ranks, part)
        return self._order(epoch)[a:b], hi - lo

    def weight_rows(self, rows: int, batch_rows: int) -> np.ndarray:
        """The rows a step's gradient is weighted by: the global batch's under a rule that
        all-reduces the gradient, else this rank's as if every rank had as many."""
        return np.asarray(batch_rows if self.rule.reduces_gradient else rows * self.n_ranks,
                          self._rows_dtype)

    def after_steps(self, rows: int, batch_rows: int, n_steps: int, stats: LoopStats) -> None:
        """After ``n_steps`` local steps of a block: the rule after each, the counters."""
        for _ in range(n_steps):
            done = time.perf_counter()
            if self.rule.after_update(self.rule_state, self, rows, batch_rows):
                self.sync_seconds += time.perf_counter() - done
                stats.values[LoopStats.SYNCS] += 1
        if self.rule.reduces_gradient:
            stats.values[LoopStats.SYNCS] += n_steps
        v = stats.values
        v[LoopStats.STEPS] += n_steps
        v[LoopStats.ROWS] += rows * n_steps
        self.beat()

    def run(self, first: int, last: int) -> np.ndarray:
        """Run global steps ``[first, last)``; return this rank's :class:`LoopStats` array."""
        stats = LoopStats()
        self._phase_start = time.perf_counter()
        sync_before, self.skipped = self.sync_seconds, 0
        if self.rule.asynchronous:
            while (unit := self.center.claim(last * self.n_ranks)) is not None:
                step, rank = divmod(unit, self.n_ranks)
                self._step(step, rank, stats)
        else:
            step = first
            while step < last:
                ran = self.blocks.run(step, last, stats)
                if not ran:
                    self._step(step, self.rank, stats)
                step += ran or 1
        self._settle_losses(stats)
        self.set_values([self.grad_var], [stored(self.grad_var)])
        busy = time.perf_counter() - self._phase_start
        self._busy_before += busy
        stats.values[LoopStats.SYNC_SECONDS] = self.sync_seconds - sync_before
        stats.values[LoopStats.BUSY_SECONDS] = busy
        stats.values[LoopStats.SKIPPED] = self.skipped
        return stats.values

    def add_loss(self, loss_sum: jax.Array, rows: int) -> None:
        """A block's summed step losses (a device scalar), each step of ``rows`` rows."""
        self._losses.append((loss_sum, rows))

    def _settle_losses(self, stats: LoopStats) -> None:
        """The phase's losses, read from the device at once (one transfer, at the phase's end)."""
        import jax
        if self._losses:
            values = jax.device_get([loss for loss, _ in self._losses])
            stats.values[LoopStats.LOSS_SUM] += sum(float(v) * rows
                                                    for v, (_, rows) in zip(values, self._losses))
            self._losses = []

    def finish(self) -> None:
        """Leave every device with the final parameters (the rule's), on this rank."""
        self.rule.finish(self.rule_state, self)
        self.close_center()

    def center_values(self) -> list | None:
        """The rule's center now (copies), or None for a rule without one."""
        return self.rule.center_values(self.rule_state, self)

    def saved_rule_state(self) -> list:
        """What a checkpoint keeps of the rule's state on this rank (arrays)."""
        return self.rule.saved_state(self.rule_state, self)

    def put_back_half_step(self) -> None:
        """Before a fault's teardown: if a step's gradient stored its state and its update did not
        store yet, put the state back (a whole step's values are what the script keeps)."""
        if self._half_step is not None:
            self._half_step.put_back_if_half()

    def close_center(self) -> None:
        """Let go of the central parameters, if the rule has them."""
        if self._center is not None:
            self._center.close()
