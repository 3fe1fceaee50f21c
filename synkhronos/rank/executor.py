"""What every rank runs of a call: its share of the rows, in slices, accumulated.

The master and every worker run :func:`run_share` on their own rank; the
master then reduces the ranks' results (:mod:`synkhronos.api.function`).
"""

from dataclasses import dataclass

import numpy as np

from ..comm.reduction import Accumulator
from ..platform.device_arrays import private_empty
from ..platform.values import stored
from ..tracing import trace
from ..wire.batch import chunk
from .rows import gather_rows

__all__ = ["Share", "share_of", "run_share", "run_update", "rows_of", "along"]


def along(axis, rows):
    """The index that selects ``rows`` (a slice) along ``axis`` of an array.

    Examples
    --------
    >>> along(0, slice(2, 5)), along(2, slice(2, 5))
    (slice(2, 5, None), (slice(None, None, None), slice(None, None, None), slice(2, 5, None)))
    """
    return rows if axis == 0 else (slice(None),) * axis + (rows,)


def rows_of(view, batch, a, b, offset, into=private_empty, axis=0):
    """Rows at batch positions [a, b) of a numpy or device array, along ``axis``: a view for ranges.

    Explicit indices of a host array are gathered straight into
    ``into(shape, dtype)``, a 64-byte aligned buffer, which the CPU device
    adopts as it is; numpy's own fancy indexing result would be copied once
    more on its way to the device. A range along another axis than 0 is a
    strided view, which JAX copies once as it takes it.
    """
    if batch.is_range:
        return view[along(axis, slice(batch.start + a - offset, batch.start + b - offset))]
    indices = batch.indices[a:b] - offset if offset else batch.indices[a:b]
    if not isinstance(view, np.ndarray):
        return view[indices]
    if axis:
        shape = view.shape[:axis] + indices.shape + view.shape[axis + 1:]
        return np.take(view, indices, axis=axis, mode="clip", out=into(shape, view.dtype))
    return gather_rows(view, indices, into(indices.shape + view.shape[1:], view.dtype))


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


def share_of(plan, rank, n_ranks):
    """The :class:`Share` of ``rank`` in ``plan`` (computed once per plan and rank)."""
    share = plan._shares.get(rank)
    if share is None:
        share = plan._shares[rank] = _share(plan, rank, n_ranks)
    return share


def _share(plan, rank, n_ranks):
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


def run_share(context, plan):
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

    def args_for(a, b):
        args = [rows_of(v, plan.batch, a, b, ref.offset, compiled.gather_buffers[j], ref.axis)
                for j, (v, ref) in enumerate(zip(scattered, plan.scattered))]
        args += bcast
        args += [rows_of(v, sliced, a - lo, b - lo, 0) for v in sliceables]
        if trace.on:
            trace.mark("gather rows")
        return args

    def traced(result):
        if trace.on:
            trace.mark("compute")
        return result

    if len(pieces) == 1:
        values = traced(compiled.run(args_for(lo, hi), context.undo))
        return share.rows, [values[i] for i in plan.subset]
    import jax.numpy as jnp
    outs = [Accumulator(compiled.output_modes[i], jnp, spec.gather_axis(i)) for i in plan.subset]
    upds = [Accumulator(mode, jnp) for _, _, mode in spec.updates]
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


def run_update(compiled, undo=None):
    """Run a function without inputs (a training step's update) on this rank; its results are dropped.

    A timeline shows it as a call of its own, inside the command that ran it.
    ``undo``: the rank's :class:`~.undo.UndoLog` (see :meth:`CompiledFunction.run`).
    """
    if trace.on:
        trace.begin("call", compiled.spec.name)
    compiled.run([], undo)
    if trace.on:
        trace.end("compute")
