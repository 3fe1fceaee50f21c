"""What every rank runs of a collective: prepare its buffers, then (if every rank could) execute.

Each ``_prepare_*`` reads the command and builds this rank's local buffers
(anything that can fail on one rank only happens here), then returns
``execute()``, which enters the device collective. Every rank reports
"prepared" before any rank executes, so a rank that fails to prepare makes the
others skip the collective instead of waiting in it forever.
"""

import numpy as np

from ..comm.reduction import Reduce
from ..errors import ShapeMismatch
from ..platform.device_arrays import adopt, to_device
from ..platform.internals import store, stored
from ..wire.batch import chunk
from ..wire.collective import Keep, Kind, dtype_groups
from ..wire.plan import InputRef, get_batch
from .executor import rows_of

__all__ = ["prepare_collective"]


def _store(var, value):
    """Keep ``value`` (a device array) as ``var``'s value on this rank's device."""
    if value.dtype != np.dtype(var.type.dtype):
        value = value.astype(var.type.dtype)
    store(var, value)


def _prepare_all_reduce(context, vars_, words):
    comm, rank, master_rank = context.comm, context.rank, context.master_rank
    op, keep = Reduce.of_code(words.get()), words.get()
    for var, expected in zip(vars_, [tuple(words.get_list()) for _ in vars_]):
        own = tuple(np.shape(stored(var)))
        if own != expected:
            raise ShapeMismatch(f"{var} has shape {own} on rank {rank} but {expected} on the master")
    groups = [(idx, [stored(vars_[i]) for i in idx]) for idx in dtype_groups(vars_)]

    def execute():
        results = [None] * len(vars_)
        for idx, values in groups:
            for i, v in zip(idx, comm.all_reduce(values, op)):
                results[i] = v
        if keep == Keep.ALL or (keep == Keep.MASTER and rank == master_rank):
            for var, v in zip(vars_, results):
                _store(var, v)
        return results if keep == Keep.RETURN and rank == master_rank else []
    return execute


def _prepare_broadcast(context, vars_, words):
    comm, rank, root = context.comm, context.rank, context.root_rank
    shapes = [tuple(words.get_list()) for _ in vars_]
    groups = []
    for idx in dtype_groups(vars_):
        if rank == root:
            values = [stored(vars_[i]) for i in idx]
        else:
            # placeholders of the right shape, never read: np.empty touches no memory (device zeros
            # would be written on every worker, a full pass over the broadcast's size)
            values = [np.empty(shapes[i], vars_[i].type.dtype) for i in idx]
        groups.append((idx, values))

    def execute():
        for idx, values in groups:
            for i, v in zip(idx, comm.broadcast(values, root)):
                _store(vars_[i], v)
        return []
    return execute


def _prepare_gather(context, vars_, words):
    """All-gather with zero padding to the longest rank; every rank trims by the known lengths."""
    import jax.numpy as jnp
    comm, rank, master_rank = context.comm, context.rank, context.master_rank
    keep, nd_up = words.get(), words.get()
    lengths = [words.get_list() for _ in vars_]   # per var: length on each rank (-1: 0-d)
    groups = []
    for idx in dtype_groups(vars_):
        padded = []
        for i in idx:
            v = jnp.asarray(stored(vars_[i]))
            longest = max(lengths[i])
            if v.ndim and v.shape[0] < longest:
                v = jnp.concatenate([v, jnp.zeros((longest - v.shape[0],) + v.shape[1:], v.dtype)])
            padded.append(v)
        groups.append((idx, padded))

    def execute():
        results = [None] * len(vars_)
        for idx, padded in groups:
            for i, stacked in zip(idx, comm.all_gather(padded)):
                parts = [stacked[r] if lengths[i][r] < 0 else stacked[r][:lengths[i][r]]
                         for r in range(comm.n_ranks)]
                results[i] = jnp.stack(parts) if nd_up else jnp.concatenate(parts)
        if keep == Keep.ALL:
            for var, v in zip(vars_, results):
                _store(var, v)
            return []
        return results if rank == master_rank else []
    return execute


def _prepare_read_data(context, vars_, words):
    """Every rank puts rows of a Data (all of them, or its chunk) on its device (no collective)."""
    rank, n_ranks, view_of, index_lookup = context.rank, context.n_ranks, context.view, context.index_view
    chunked, index_gen = words.get(), words.get()
    values = []
    for _ in vars_:
        data_id, gen, code, *shape = words.get_list()
        batch = get_batch(words, index_lookup, index_gen)
        view = view_of(InputRef(data_id, gen, code, 0, tuple(shape)))
        if not shape:
            values.append(to_device(view))
            continue
        a, b = chunk(0, batch.total, n_ranks, rank) if chunked else (0, batch.total)
        rows = rows_of(view, batch, a, b, 0)
        # gathered rows are a private aligned buffer already; a view of the Data must be copied
        values.append(to_device(rows) if batch.is_range else adopt(rows))

    def execute():
        for var, value in zip(vars_, values):
            _store(var, value)
        return []
    return execute


#: what each kind of collective prepares on a rank
PREPARE = {Kind.ALL_REDUCE: _prepare_all_reduce, Kind.BROADCAST: _prepare_broadcast, Kind.GATHER: _prepare_gather,
           Kind.READ_DATA: _prepare_read_data}


def prepare_collective(context, words):
    """Prepare this rank's part of the collective encoded in ``words``; return its ``execute()``.

    ``context`` is this rank's :class:`~.context.RankContext`: its node's master
    keeps or returns the results; a broadcast sends from the root rank (node 0's master).

    ``execute()`` runs the collective, waits until it is finished on this
    rank's device, and returns the results the master keeps (empty elsewhere).
    """
    import jax
    kind = words.get()
    vars_ = [context.variable(uid) for uid in words.get_list()]
    prepare = PREPARE.get(kind)
    if prepare is None:
        raise ValueError(f"unknown collective kind {kind}")
    execute = prepare(context, vars_, words)

    def execute_and_wait():
        out = execute()
        # JAX dispatches asynchronously; a collective is finished (its errors raised) on return.
        jax.block_until_ready([stored(v) for v in vars_])
        if context.comm_made:
            context.comm.refresh()
        return out
    return execute_and_wait
