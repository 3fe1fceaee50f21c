"""What every rank runs of a call: its share of the rows, in slices, accumulated.

The master and every worker run :func:`run_share` on their own rank; the
master then reduces the ranks' results (:mod:`synkhronos.api.function`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from ..comm.reduction import Accumulator
from ..platform.device_arrays import adopt, private_empty, to_device
from ..platform.values import stored
from ..tracing import trace
from ..wire.batch import chunk
from .rows import gather_rows

if TYPE_CHECKING:
    import jax

    from ..comm import ProgramReducer
    from ..wire.batch import Batch
    from ..wire.control import Words
    from ..wire.plan import CallPlan, InputRef
    from .compiled import CompiledFunction
    from .fused import StepProgram, StepPrograms
    from .undo import UndoLog

__all__ = ["Share", "share_of", "run_share", "run_update", "rows_of", "along", "fused_step_of",
           "run_fused_share", "device_rows", "ArgUploads"]


class CallContext(Protocol):
    """What a call's share takes of its rank (:class:`~.context.RankContext` has it)."""

    n_ranks: int
    undo: UndoLog

    def function(self, fid: int) -> CompiledFunction: ...

    def variable(self, uid: int) -> Any: ...

    def view(self, ref: InputRef) -> Any: ...

    @property
    def step_programs(self) -> StepPrograms: ...

    @property
    def uploads(self) -> ArgUploads: ...

    def program_reducer(self) -> ProgramReducer | None: ...

    def share_of_call(self, plan: CallPlan) -> tuple[int, int]: ...


def along(axis: int, rows: slice) -> slice | tuple[slice, ...]:
    """The index that selects ``rows`` (a slice) along ``axis`` of an array.

    Examples
    --------
    >>> along(0, slice(2, 5)), along(2, slice(2, 5))
    (slice(2, 5, None), (slice(None, None, None), slice(None, None, None), slice(2, 5, None)))
    """
    return rows if axis == 0 else (slice(None),) * axis + (rows,)


def rows_of(view: Any, batch: Batch, a: int, b: int, offset: int,
            into: Callable[[tuple[int, ...], np.dtype], np.ndarray] = private_empty, axis: int = 0) -> Any:
    """Rows at batch positions [a, b) of a numpy or device array, along ``axis``: a view for ranges.

    Explicit indices of a host array are gathered straight into
    ``into(shape, dtype)``, a 64-byte aligned buffer, which the CPU device
    adopts as it is; numpy's own fancy indexing result would be copied once
    more on its way to the device. A range along another axis than 0 is a
    strided view, which JAX copies once as it takes it.
    """
    if batch.is_range:
        return view[along(axis, slice(batch.start + a - offset, batch.start + b - offset))]
    assert batch.indices is not None
    indices = batch.indices[a:b] - offset if offset else batch.indices[a:b]
    if not isinstance(view, np.ndarray):       # device rows: one program, the indices sent
        return take_rows(view, adopt(np.array(indices, dtype=np.int32)))
    if axis:
        shape = view.shape[:axis] + indices.shape + view.shape[axis + 1:]
        return np.take(view, indices, axis=axis, mode="clip", out=into(shape, view.dtype))
    return gather_rows(view, indices, into(indices.shape + view.shape[1:], view.dtype))


def take_rows(table: jax.Array, indices: jax.Array) -> jax.Array:
    """``table[indices]`` of a device array, as one compiled program (launched as ``synk_take``);
    indexing it directly runs op after op, each a program of its own."""
    global _take
    if _take is None:
        import jax
        import jax.numpy as jnp

        def synk_take(table: jax.Array, indices: jax.Array) -> jax.Array:
            return jnp.take(table, indices, axis=0, mode="clip")
        _take = jax.jit(synk_take)
    return _take(table, indices)


_take: Any = None


@dataclass(frozen=True)
class Share:
    """What one rank computes of a plan: batch positions ``[lo, hi)`` in ``n_slices`` slices.

    ``rows`` is what the rank's results are weighted by (its row count, or 1 for
    a function with no scattered inputs; 0 if it computes nothing). ``cuts``
    is set when the share is one range of rows and nothing else is sliced:
    per scattered input ``(InputRef, index)``, the index of its rows in its
    Data's view (along the input's axis), so a call needs nothing but the views.
    """

    lo: int
    hi: int
    n_slices: int
    rows: int
    counts_rows: bool
    cuts: tuple | None = None


def share_of(plan: CallPlan, rank: int, n_ranks: int) -> Share:
    """The :class:`Share` of ``rank`` in ``plan`` (computed once per plan and rank)."""
    share = plan._shares.get(rank)
    if share is None:
        share = plan._shares[rank] = _share(plan, rank, n_ranks)
    return share


def _share(plan: CallPlan, rank: int, n_ranks: int) -> Share:
    sliced = plan.sliced[rank] if plan.sliced else None
    if plan.scattered:
        lo, hi = plan.split(n_ranks)[rank]
        n_slices = plan.num_slices
    elif sliced is not None:
        lo, hi, n_slices = 0, sliced.total, plan.num_slices
    else:
        lo, hi, n_slices = 0, 1, 1
    counts_rows = bool(plan.scattered) or sliced is not None
    rows = 0 if hi == lo else (hi - lo) if counts_rows else 1
    n_slices = min(n_slices, max(hi - lo, 1))    # at most a slice per row
    one_range = plan.batch.is_range and sliced is None and min(n_slices, hi - lo) == 1
    cuts = tuple((ref, along(ref.axis, slice(plan.batch.start + lo - ref.offset,
                                             plan.batch.start + hi - ref.offset)))
                 for ref in plan.scattered) if one_range else None
    return Share(lo, hi, n_slices, rows, counts_rows, cuts)


def run_share(context: CallContext, plan: CallPlan) -> tuple[int, list[Any]]:
    """Compute this rank's share of a call.

    Parameters
    ----------
    context : RankContext
        This rank: its compiled functions and its views of the Data.
    plan : CallPlan

    Returns
    -------
    rows : int
        Rows this rank computed (1 for a function with no scattered inputs; 0 if
        its share was empty, in which case nothing ran).
    outputs : list
        Per selected output, the rank's accumulation over its slices (device arrays).
    """
    compiled, view_of = context.function(plan.fid), context.view
    rank, n_ranks = context.share_of_call(plan)
    share = share_of(plan, rank, n_ranks)
    if share.rows == 0:
        return 0, []
    if share.cuts is not None:
        # the common call (a range of rows, one slice): views in, nothing to decide or accumulate;
        # this path is shorter per process than the general one below
        values = compiled.run([view_of(ref)[rows] for ref, rows in share.cuts]
                              + [view_of(ref) for ref in plan.bcast], context.undo)
        if trace.on:
            trace.mark("compute")
        return share.rows, [values[i] for i in plan.subset]
    scattered = [view_of(ref) for ref in plan.scattered]
    bcast = [view_of(ref) for ref in plan.bcast]
    spec = compiled.spec
    sliceables = [stored(s) for s in spec.sliceable_shareds]
    sliced = plan.sliced[rank] if plan.sliced else None
    lo, hi = share.lo, share.hi
    pieces = [(a, b) for a, b in (chunk(lo, hi, share.n_slices, s) for s in range(share.n_slices))
              if b > a]

    def args_for(a: int, b: int) -> list[Any]:
        args = [rows_of(v, plan.batch, a, b, ref.offset, compiled.gather_buffers[j], ref.axis)
                for j, (v, ref) in enumerate(zip(scattered, plan.scattered))]
        args += bcast
        if sliceables:
            assert sliced is not None
            args += [rows_of(v, sliced, a - lo, b - lo, 0) for v in sliceables]
        if trace.on:
            trace.mark("gather rows")
        return args

    def traced[T](result: T) -> T:
        if trace.on:
            trace.mark("compute")
        return result

    if len(pieces) == 1:
        values = traced(compiled.run(args_for(lo, hi), context.undo))
        return share.rows, [values[i] for i in plan.subset]
    import jax.numpy as jnp
    outs = [Accumulator(compiled.output_modes[i], jnp, spec.gather_axis(i)) for i in plan.subset]
    upds = [Accumulator(mode, jnp, origin=stored(shared) if spec.sums_changes_of(i) else None)
            for i, (shared, _, mode) in enumerate(spec.updates)]
    for a, b in pieces:
        n = (b - a) if share.counts_rows else 1
        values, new = traced(compiled.run_deferred(args_for(a, b), context.undo) if upds else
                             (compiled.run(args_for(a, b), context.undo), []))
        for acc, v in zip(upds, new):
            acc.add(v, n)
        for acc, i in zip(outs, plan.subset):
            acc.add(values[i], n)
    if upds:
        compiled.apply([acc.result() for acc in upds], context.undo)
    return share.rows, [acc.result() for acc in outs]


def run_update(compiled: CompiledFunction, undo: UndoLog | None = None) -> None:
    """Run a function without inputs (a training step's update) on this rank; its results are dropped.

    A timeline shows it as a call of its own, inside the command that ran it.
    ``undo``: the rank's :class:`~.undo.UndoLog` (see :meth:`CompiledFunction.run`).
    """
    if trace.on:
        trace.begin("call", compiled.spec.name)
    compiled.run([], undo)
    if trace.on:
        trace.end("compute")


class ArgUploads:
    """A fused step's host arguments on the device, each sent by one explicit transfer.

    Rows are copied into private buffers first (a Data's memory may be
    rewritten as soon as the call returns, while the program still runs). A
    small argument (a step's batch rows) that holds the same bytes as at the
    last call is not sent again: the device copy made then is reused.
    """

    SMALL = 256

    def __init__(self) -> None:
        self._small: dict = {}

    def put(self, position: Hashable, host: npt.ArrayLike) -> jax.Array:
        """``host`` (numpy) on this process's device."""
        host = np.asarray(host)
        if host.nbytes <= self.SMALL:
            key = (host.dtype.str, host.shape, host.tobytes())
            kept = self._small.get(position)
            if kept is not None and kept[0] == key:
                return kept[1]
            device = to_device(host)
            self._small[position] = (key, device)
            return device
        return to_device(host)


def device_rows(host: np.ndarray, private: bool = False) -> jax.Array:
    """Rows gathered on the host as a device array, sent by one explicit transfer.

    ``private``: ``host`` is a buffer of :func:`~synkhronos.platform.device_arrays.private_empty`
    that nothing writes again, which the device adopts (on CPU without a copy); anything else (a
    view of a Data, which the user may rewrite while the program still runs) is copied first.
    """
    return adopt(host) if private else to_device(host)


def fused_step_of(context: CallContext, plan: CallPlan, tail_words: Words, update_fid: int) -> StepProgram | None:
    """The fused program of a step (``plan``'s share, its tail's all-reduce, ``update_fid``) on
    this rank, built at first use; None if the step cannot run as one program here."""
    from ..comm.reduction import Reduce
    from .fused import FUSED_MODES, StepProgram, fused_graph
    tail_words.get()                        # (an all-reduce: a step's tail is one)
    uids, op_code = tail_words.get_list(), tail_words.get()
    # what fixes this rank's program: the plan's shapes (the rows of every rank follow), the
    # outputs it returns, the update function and what is reduced
    key = (plan.shape_key(), tuple(plan.subset), update_fid, tuple(uids), op_code)
    if len(uids) != 1:
        return None

    def build() -> StepProgram | None:
        compiled, update = context.function(plan.fid), context.function(update_fid)
        reduced = context.variable(uids[0])
        op = Reduce.of_code(op_code)
        shapes = _row_shapes_of(context, plan, compiled)
        runner = compiled.settled_runner(shapes)
        upd_runner = update.settled_runner(())
        if runner is None or upd_runner is None:
            return None
        grad_graph, upd_graph = fused_graph(runner.fn), fused_graph(upd_runner.fn)
        modes = [compiled.output_modes[i] for i in plan.subset]
        if grad_graph is None or upd_graph is None or any(m not in FUSED_MODES for m in modes):
            return None
        reducer = context.program_reducer()
        if reducer is None:
            return None
        import jax
        dtypes = [jax.dtypes.canonicalize_dtype(compiled.spec.outputs[i][0].type.dtype) for i in plan.subset]
        n_plain = len(compiled.spec.all_inputs)
        gathers = tuple(range(n_plain, n_plain + len(compiled.spec.sliceable_shareds)))
        # a graph calling host code can fail after the program started: on one device it donates
        # nothing and keeps what it replaces (see .undo); on several it is never one program, since
        # its peers would wait in the program's collective for a rank that failed before it (the
        # two phases keep them out of the all-reduce)
        host = runner.runs_host_code() or upd_runner.runs_host_code()
        if host and context.n_ranks > 1:
            return None
        program = StepProgram(grad_graph, upd_graph, reduced.container.storage, op, plan.subset,
                              modes, dtypes, reducer, gathers, may_fail=host)
        program.runners = (compiled, runner, update, upd_runner)
        return program
    return context.step_programs.get(key, build)


def _row_shapes_of(context: CallContext, plan: CallPlan, compiled: CompiledFunction) -> tuple[tuple[int, ...], ...]:
    """The shapes of this rank's arguments in ``plan`` that pick the graph: the row-carrying ones and
    the broadcast arrays (see :class:`~.compiled.CompiledFunction`)."""
    rank, n_ranks = context.share_of_call(plan)
    share = share_of(plan, rank, n_ranks)
    rows = share.hi - share.lo
    shapes: list[tuple[int, ...]] = []
    for ref in plan.scattered:
        shape = list(ref.shape)
        shape[ref.axis] = rows
        shapes.append(tuple(shape))
    shapes += [tuple(ref.shape) for ref in plan.bcast if len(ref.shape)]
    if compiled.spec.sliceable_shareds:
        sliced = plan.sliced[rank]
        for s in compiled.spec.sliceable_shareds:
            shapes.append((sliced.total,) + tuple(np.shape(stored(s))[1:]))
    return tuple(shapes)


def run_fused_share(context: CallContext, plan: CallPlan, program: StepProgram) -> tuple[int, list[Any]]:
    """This rank's share of a step, run as one program (see :mod:`.fused`): the rows gathered on
    the host and sent, or the indices of device-resident rows; returns ``(rows, outputs)``, the
    outputs reduced across ranks inside the program (device arrays)."""
    compiled, view_of = context.function(plan.fid), context.view
    rank, n_ranks = context.share_of_call(plan)
    share = share_of(plan, rank, n_ranks)
    uploads = context.uploads
    args: list[Any] = []
    for ref in plan.scattered:
        rows = rows_of(view_of(ref), plan.batch, share.lo, share.hi, ref.offset, private_empty, ref.axis)
        args.append(device_rows(rows, private=not plan.batch.is_range))    # (a range is a view)
    n = len(args)
    args += [uploads.put((plan.fid, n + k), view_of(ref)) for k, ref in enumerate(plan.bcast)]
    if compiled.spec.sliceable_shareds:
        sliced = plan.sliced[rank]
        indices = sliced.indices if not sliced.is_range else np.arange(sliced.start, sliced.stop)
        device_indices = adopt(np.array(indices, dtype=np.int32))       # (a copy of its own)
        args += [(stored(s), device_indices) for s in compiled.spec.sliceable_shareds]
    grad, runner, update, upd_runner = program.runners
    grad.continue_streams(runner)
    update.continue_streams(upd_runner)
    if program.may_fail:
        context.undo.keep(program.written_cells)
    if trace.on:
        trace.mark("gather rows")
    results = program(args)
    if trace.on:
        trace.mark("compute")
    return share.rows, results
