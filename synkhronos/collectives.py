"""Collectives on shared variables: moving device-resident state between ranks.

Each function takes one shared variable or a list, as objects or by name; every
variable must be used by some ``synk.function`` (only then do the workers hold
it). The master validates everything (shapes on every rank included) before
any process enters a collective, so a wrong argument raises here and never
leaves ranks waiting in a collective. Reductions check shapes in the
collective's prepare phase instead (no extra round trip per call): a rank
whose shape differs from the master's makes every rank skip the collective.

Device collectives (all_reduce, reduce, broadcast, gather, all_gather) run on
every process through :mod:`synkhronos.comm`; several variables of one dtype
travel as one flat buffer, so one call makes one collective launch per dtype.
``scatter`` and broadcasting a ``Data`` are host paths: every process reads its
own rows from shared memory and puts them on its device.
"""


import math
import warnings

import numpy as np

from . import lifecycle, randomness
from .control import Op, Words
from .data import Data, condition_value, release_large_staging
from .devices import adopt, place_on_device, to_device
from .errors import WorkerError
from .function import put_batch
from .scatter import Batch, chunk, parse_batch
from .transport import dtype_code

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "get_value", "set_value", "get_lengths", "get_shapes", "resolve_shareds",
           "prepare_collective", "shapes_of"]

REDUCE_OPS = ("avg", "sum", "prod", "min", "max")
#: what a message suggests for a value that does not cast safely to a shared variable's dtype
_COLLECTIVE_CAST = "make the shared variable of that dtype"

# collective kinds, as written into the control block
_ALL_REDUCE, _BROADCAST, _GATHER, _READ_DATA = range(1, 5)
# who keeps an all-reduce's or gather's result
_KEEP_ALL, _KEEP_MASTER, _RETURN = range(3)


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------

def resolve_shareds(shared_vars):
    """Return (list of shared variables, was_single) from one variable/name or a list."""
    rt = lifecycle.current()
    single = not isinstance(shared_vars, (list, tuple))
    items = [shared_vars] if single else list(shared_vars)
    if not items:
        raise ValueError("no shared variables given")
    known = {id(var): var for _, var in rt._shared_vars.values()}
    out = []
    for item in items:
        if isinstance(item, str):
            found = [v for v in known.values() if v.name == item]
            if len(found) != 1:
                raise ValueError(f"no shared variable named {item!r} is used by a synk.function"
                                 if not found else
                                 f"{len(found)} shared variables are named {item!r}; pass the object")
            out.append(found[0])
        elif id(item) in known:
            out.append(item)
        else:
            raise ValueError(f"shared variable {item} is not used by any synk.function, so the "
                             f"workers do not hold it; build a function that uses it first")
    if len({id(v) for v in out}) != len(out):
        raise ValueError("a shared variable is listed more than once")
    for var in out:
        if randomness.is_generator(var):
            raise TypeError(f"{var} is a random generator: each device draws from a stream of its "
                            f"own (see the user guide), and collectives move tensors only")
    return out, single


def _old_nccl(rt, nccl, what):
    """Accept the original's ``nccl=`` where it still holds; say where the choice moved otherwise.

    The original chose per call between NCCL (``nccl=True``) and a CPU path;
    synkhronos chooses per runtime (``fork(collectives=...)``): the JAX runtime
    (NCCL on GPUs), or shared memory on CPU.
    """
    if nccl is None:
        return
    if not nccl and rt.comm_kind != "shm":
        raise TypeError(f"{what}(nccl=False): the collective path is chosen per runtime now; for the "
                        f"shared-memory CPU path use synk.fork(collectives='shm') (CPU only)")
    warnings.warn(f"{what}(nccl=...) is no longer needed: the path is chosen by "
                  f"synk.fork(collectives=...), here {rt.comm_kind!r}", DeprecationWarning, stacklevel=3)


def _check_rank(rt, rank):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < rt.n_parallel:
        raise ValueError(f"rank must be an int in [0, {rt.n_parallel}), got {rank!r}")
    return int(rank)


def _check_declared_shape(var, shape, what):
    """Raise ValueError if ``what`` would give ``var`` a ``shape`` its declared static shape forbids.

    Every rank compiles its functions for the declared shape, so a value of
    another shape would be computed on wrongly.
    """
    declared = var.type.shape
    if len(declared) != len(shape) or any(d is not None and d != n for d, n in zip(declared, shape)):
        raise ValueError(f"{what} would give {var} shape {tuple(shape)} on some rank, but it is "
                         f"declared with static shape {declared}; make it with "
                         f"pytensor.shared(value, shape=(None, ...)) to let that axis change")


def _check_op(op, vars_):
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {list(REDUCE_OPS)}, got {op!r}")
    if op == "avg":
        for var in vars_:
            if not np.issubdtype(np.dtype(var.type.dtype), np.floating) and \
                    not np.issubdtype(np.dtype(var.type.dtype), np.complexfloating):
                raise TypeError(f"op 'avg' cannot average {var} of dtype {var.type.dtype} exactly; "
                                f"use 'sum'")
    return op


def _values_list(values, n, what):
    values = [values] if n == 1 and not isinstance(values, (list, tuple)) else list(values)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} shared variables")
    return values


def _uids(rt, vars_):
    return [rt.uid_of(v) for v in vars_]


# ------------------------------------------------------------------------------------------------
# The part every rank runs
# ------------------------------------------------------------------------------------------------

def shapes_of(values):
    return [tuple(np.shape(v)) for v in values]


def _store(var, value):
    """Keep ``value`` (a device array) as ``var``'s value on this rank's device."""
    if value.dtype != np.dtype(var.type.dtype):
        value = value.astype(var.type.dtype)
    var.container.storage[0] = value


def _dtype_groups(vars_):
    groups = {}
    for i, var in enumerate(vars_):
        groups.setdefault(var.type.dtype, []).append(i)
    return groups.values()


# Each ``_prepare_*`` reads the command and builds this rank's local buffers (anything that can
# fail on one rank only happens here), then returns ``execute()``, which enters the device
# collective. Every rank reports "prepared" before any rank executes, so a rank that fails to
# prepare makes the others skip the collective instead of waiting in it forever.

class ShapeMismatch(ValueError):
    """A rank's value has another shape than the master's (found while preparing a collective)."""


def _prepare_all_reduce(comm, vars_, words, rank, master_rank):
    op, keep = REDUCE_OPS[words.get()], words.get()
    for var, expected in zip(vars_, [tuple(words.get_list()) for _ in vars_]):
        own = tuple(np.shape(var.container.storage[0]))
        if own != expected:
            raise ShapeMismatch(f"{var} has shape {own} on rank {rank} but {expected} on the master")
    groups = [(idx, [vars_[i].container.storage[0] for i in idx]) for idx in _dtype_groups(vars_)]

    def execute():
        results = [None] * len(vars_)
        for idx, values in groups:
            for i, v in zip(idx, comm.all_reduce(values, op)):
                results[i] = v
        if keep == _KEEP_ALL or (keep == _KEEP_MASTER and rank == master_rank):
            for var, v in zip(vars_, results):
                _store(var, v)
        return results if keep == _RETURN and rank == master_rank else []
    return execute


def _prepare_broadcast(comm, vars_, words, rank, master_rank):
    shapes = [tuple(words.get_list()) for _ in vars_]
    groups = []
    for idx in _dtype_groups(vars_):
        if rank == master_rank:
            values = [vars_[i].container.storage[0] for i in idx]
        else:
            # placeholders of the right shape, never read: np.empty touches no memory (device zeros
            # would be written on every worker, a full pass over the broadcast's size)
            values = [np.empty(shapes[i], vars_[i].type.dtype) for i in idx]
        groups.append((idx, values))

    def execute():
        for idx, values in groups:
            for i, v in zip(idx, comm.broadcast(values, master_rank)):
                _store(vars_[i], v)
        return []
    return execute


def _prepare_gather(comm, vars_, words, rank, master_rank):
    """All-gather with zero padding to the longest rank; every rank trims by the known lengths."""
    import jax.numpy as jnp
    keep, nd_up = words.get(), words.get()
    lengths = [words.get_list() for _ in vars_]   # per var: length on each rank (-1: 0-d)
    groups = []
    for idx in _dtype_groups(vars_):
        padded = []
        for i in idx:
            v = jnp.asarray(vars_[i].container.storage[0])
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
        if keep == _KEEP_ALL:
            for var, v in zip(vars_, results):
                _store(var, v)
            return []
        return results if rank == master_rank else []
    return execute


def _prepare_read_data(vars_, words, rank, n_ranks, view_of, index_lookup):
    """Every rank puts rows of a Data (all of them, or its chunk) on its device (no collective)."""
    from .function import InputRef, _rows, get_batch
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
        rows = _rows(view, batch, a, b, 0)
        # gathered rows are a private aligned buffer already; a view of the Data must be copied
        values.append(to_device(rows) if batch.is_range else adopt(rows))

    def execute():
        for var, value in zip(vars_, values):
            _store(var, value)
        return []
    return execute


def prepare_collective(comm, words, rank, n_ranks, master_rank, var_of, view_of, index_lookup):
    """Prepare this rank's part of the collective encoded in ``words``; return its ``execute()``.

    ``execute()`` runs the collective, waits until it is finished on this
    rank's device, and returns the results the master keeps (empty elsewhere).
    """
    import jax
    kind = words.get()
    vars_ = [var_of(uid) for uid in words.get_list()]
    if kind == _ALL_REDUCE:
        execute = _prepare_all_reduce(comm, vars_, words, rank, master_rank)
    elif kind == _BROADCAST:
        execute = _prepare_broadcast(comm, vars_, words, rank, master_rank)
    elif kind == _GATHER:
        execute = _prepare_gather(comm, vars_, words, rank, master_rank)
    elif kind == _READ_DATA:
        execute = _prepare_read_data(vars_, words, rank, n_ranks, view_of, index_lookup)
    else:
        raise ValueError(f"unknown collective kind {kind}")

    def execute_and_wait():
        out = execute()
        # JAX dispatches asynchronously; a collective is finished (its errors raised) on return.
        jax.block_until_ready([v.container.storage[0] for v in vars_])
        if hasattr(comm, "refresh"):
            comm.refresh()
        return out
    return execute_and_wait


# ------------------------------------------------------------------------------------------------
# The master's side
# ------------------------------------------------------------------------------------------------

def _run(rt, words_fill, reserve=0, result_bytes=0, reduce_bytes=0):
    """Encode a collective with ``words_fill(Words)`` and run it on every rank.

    ``reserve``: the largest per-rank buffer (bytes) the collective moves;
    ``result_bytes``: the size of its one all-reduce result, if it makes just one;
    ``reduce_bytes``: the size of the all-reduce it runs, if any.
    """
    rt.ensure_shipped()
    if reserve and hasattr(rt.comm, "reserve"):
        rt.comm.reserve(reserve, result_bytes, reduce_bytes)
    words_fill(Words(rt.ctl.args))

    def local_prepare():
        return prepare_collective(rt.comm, Words(rt.ctl.args), rt.master_rank, rt.n_parallel,
                                  rt.master_rank, rt.shared_by_uid, rt.data_view, rt.index_view)
    return [np.asarray(v) for v in rt.collective_command(local_prepare)]


def _all_shapes(rt, vars_):
    """Per variable, its shape on every rank (one round trip)."""
    rt.ensure_shipped()
    Words(rt.ctl.args).put_list(_uids(rt, vars_))
    own = shapes_of(v.container.storage[0] for v in vars_)
    rt.command(Op.GET_SHAPES)
    per_rank = {rt.master_rank: own}
    for rank in rt.worker_ranks:
        per_rank[rank] = [tuple(int(s) for s in a) for a in rt.read_result_arrays(rank)]
    return [[per_rank[r][i] for r in range(rt.n_parallel)] for i in range(len(vars_))]


@lifecycle.serialized
def get_shapes(shared_vars):
    """Shape of each variable on every rank: a list over ranks (a list of those for a list).

    Examples
    --------
    >>> synk.get_shapes(w)            # doctest: +SKIP
    [(5, 3), (6, 3)]
    """
    rt = lifecycle.current()
    vars_, single = resolve_shareds(shared_vars)
    shapes = _all_shapes(rt, vars_)
    return shapes[0] if single else shapes


def get_lengths(shared_vars):
    """Length (axis 0) of each variable on every rank, like :func:`get_shapes`."""
    shapes = get_shapes(shared_vars)
    single = not isinstance(shared_vars, (list, tuple))
    lengths = [[s[0] if s else 1 for s in per_var] for per_var in ([shapes] if single else shapes)]
    return lengths[0] if single else lengths


def _group_bytes(vars_, sizes):
    """Largest byte size over the dtype groups, given each variable's item count.

    Each variable may start on a 64-byte boundary in a group's flat buffer.
    """
    return max(sum(sizes[i] * np.dtype(vars_[i].type.dtype).itemsize + 64 for i in idx)
               for idx in _dtype_groups(vars_))


def _require_equal_shapes(vars_, shapes, what):
    for var, per_rank in zip(vars_, shapes):
        if len(set(per_rank)) > 1:
            raise ValueError(f"{what} needs {var} to have the same shape on every rank, but the "
                             f"shapes are {per_rank} (rank order)")


@lifecycle.serialized
def all_reduce(shared_vars, op="avg", nccl=None):
    """Reduce across ranks; every rank's copy becomes the result.

    Parameters
    ----------
    shared_vars : shared variable, name, or list of them
    op : {"avg", "sum", "prod", "min", "max"}

    Examples
    --------
    >>> synk.all_reduce(grad_shared, op="avg")     # doctest: +SKIP
    """
    _old_nccl(lifecycle.current(), nccl, "all_reduce")
    _reduce(shared_vars, op, _KEEP_ALL)


@lifecycle.serialized
def reduce(shared_vars, op="avg", in_place=True, nccl=None):
    """Reduce across ranks into the master.

    With ``in_place=True`` the master's copy becomes the result (workers keep
    theirs); with ``in_place=False`` the result is returned and no copy changes.
    """
    _old_nccl(lifecycle.current(), nccl, "reduce")
    out = _reduce(shared_vars, op, _KEEP_MASTER if in_place else _RETURN)
    return None if in_place else out


def _reduce(shared_vars, op, keep):
    """All-reduce / reduce with no shape round trip: the master sends its shapes and every rank
    checks its own while preparing; only a mismatch asks every rank for its shapes, to say which."""
    rt = lifecycle.current()
    vars_, single = resolve_shareds(shared_vars)
    _check_op(op, vars_)
    own = shapes_of(v.container.storage[0] for v in vars_)
    nbytes = _group_bytes(vars_, [math.prod(s) for s in own])
    one_launch = len(list(_dtype_groups(vars_))) == 1

    def fill(w):
        w.put(_ALL_REDUCE).put_list(_uids(rt, vars_)).put(REDUCE_OPS.index(op), keep)
        for shape in own:
            w.put_list(shape)
    try:
        out = _run(rt, fill, reserve=nbytes, result_bytes=nbytes if one_launch else 0,
                   reduce_bytes=nbytes)
    except WorkerError as e:
        if e.how == "raised" and e.exc_type.endswith(ShapeMismatch.__qualname__):
            _require_equal_shapes(vars_, _all_shapes(rt, vars_), f"{op} reduction")
        raise
    if keep == _RETURN:
        return out[0] if single else out


@lifecycle.serialized
def broadcast(shared_vars, values=None, nccl=None):
    """Copy the master's value(s) to every rank, optionally setting them first.

    ``values`` may be numpy arrays or :class:`Data`; a Data value is read from
    shared memory by every rank itself.
    """
    rt = lifecycle.current()
    _old_nccl(rt, nccl, "broadcast")
    vars_, single = resolve_shareds(shared_vars)
    if values is not None:
        values = _values_list(values, len(vars_), "values")
        if all(isinstance(v, Data) for v in values):
            return _read_data(rt, vars_, values, None, chunked=False)
        for var, value in zip(vars_, values):
            value = value.data if isinstance(value, Data) else value
            var.set_value(condition_value(value, var.type.dtype, var.type.ndim,
                                          what=f"value for {var}",
                                          cast_hint=_COLLECTIVE_CAST))
    shapes = shapes_of(v.container.storage[0] for v in vars_)

    def fill(w):
        w.put(_BROADCAST).put_list(_uids(rt, vars_))
        for shape in shapes:
            w.put_list(shape)
    sizes = [math.prod(shape) for shape in shapes]
    _run(rt, fill, reserve=_group_bytes(vars_, sizes))


@lifecycle.serialized
def scatter(shared_vars, values, batch=None):
    """Split each value along axis 0 across ranks (near-equal contiguous chunks).

    Parameters
    ----------
    shared_vars : shared variable, name, or list of them
    values : numpy array or Data, or a list of them (one per variable)
    batch : int, slice or sequence of int, optional
        Rows of every value to scatter (as ``batch`` in a function call).
    """
    rt = lifecycle.current()
    vars_, _ = resolve_shareds(shared_vars)
    values = _values_list(values, len(vars_), "values")
    datas = []
    for i, (var, value) in enumerate(zip(vars_, values)):
        if isinstance(value, Data):
            if value.dtype != var.type.dtype or value.ndim != var.type.ndim:
                raise TypeError(f"Data for {var} has dtype {value.dtype} and ndim {value.ndim}; "
                                f"expected {var.type.dtype} and {var.type.ndim}")
            datas.append(value)
        else:
            arr = condition_value(value, var.type.dtype, var.type.ndim, what=f"value for {var}",
                                  cast_hint=_COLLECTIVE_CAST)
            if arr.ndim == 0:
                raise TypeError(f"cannot scatter a 0-d value to {var}; use broadcast")
            datas.append(rt.scratch_data(("scatter", i), arr))
    _read_data(rt, vars_, datas, batch, chunked=True)
    release_large_staging(rt.staging)


def _read_data(rt, vars_, datas, batch, chunked):
    plans = []
    for var, d in zip(vars_, datas):
        if d.shape is None:
            raise TypeError(f"Data for {var} holds no value")
        if d.ndim == 0:
            if chunked:
                raise TypeError(f"cannot scatter a 0-d Data to {var}; use broadcast")
            b = Batch(total=0)
        else:
            b, _ = parse_batch(batch, [d], [str(var)])
        rows = [hi - lo for lo, hi in (chunk(0, b.total, rt.n_parallel, r) for r in range(rt.n_parallel))] \
            if chunked else [b.total] * rt.n_parallel
        for n in rows:
            _check_declared_shape(var, (n,) + d.shape[1:] if d.ndim else (),
                                  "scatter" if chunked else "broadcast")
        plans.append((d, b))
    with_indices = [b for _, b in plans if not b.is_range]
    # every batch here comes from the same ``batch``, so one copy of its indices serves all
    index_gen = rt.write_indices(with_indices[:1]) if with_indices else 0

    def fill(w):
        w.put(_READ_DATA).put_list(_uids(rt, vars_)).put(int(chunked), index_gen)
        for d, b in plans:
            w.put_list([d.id, d.gen, dtype_code(d.dtype), *d.shape])
            put_batch(w, b)
    _run(rt, fill)


@lifecycle.serialized
def gather(shared_vars, nd_up=1, nccl=None):
    """Collect every rank's copy in the master, in rank order.

    ``nd_up=1`` stacks on a new leading axis (shapes must be equal); ``nd_up=0``
    concatenates along axis 0 (lengths may differ). Nothing is changed.
    """
    rt = lifecycle.current()
    _old_nccl(rt, nccl, "gather")
    vars_, single = resolve_shareds(shared_vars)
    if nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 (concatenate) or 1 (stack), got {nd_up!r}")
    out = _gather(rt, vars_, _RETURN, nd_up)
    return out[0] if single else out


@lifecycle.serialized
def all_gather(shared_vars, nccl=None):
    """Every rank's copy becomes the concatenation (axis 0) of all ranks' copies."""
    rt = lifecycle.current()
    _old_nccl(rt, nccl, "all_gather")
    vars_, _ = resolve_shareds(shared_vars)
    _gather(rt, vars_, _KEEP_ALL, 0)


def _gather(rt, vars_, keep, nd_up):
    shapes = _all_shapes(rt, vars_)
    if keep == _KEEP_ALL:
        for var, per_rank in zip(vars_, shapes):
            if all(per_rank):
                _check_declared_shape(var, (sum(s[0] for s in per_rank),) + per_rank[0][1:],
                                      "all_gather")
    if nd_up:
        _require_equal_shapes(vars_, shapes, "gather with nd_up=1")
    else:
        for var, per_rank in zip(vars_, shapes):
            if any(len(s) == 0 for s in per_rank):
                raise ValueError(f"{var} is 0-d on some rank, so it cannot be concatenated; "
                                 f"use gather(..., nd_up=1)")
            if len({s[1:] for s in per_rank}) > 1:
                raise ValueError(f"{var} has different trailing shapes across ranks {per_rank}; "
                                 f"only axis 0 may differ")

    def fill(w):
        w.put(_GATHER).put_list(_uids(rt, vars_)).put(keep, nd_up)
        for per_rank in shapes:
            w.put_list(s[0] if s else -1 for s in per_rank)
    padded = [max(math.prod(s) for s in per_rank) for per_rank in shapes]
    return _run(rt, fill, reserve=_group_bytes(vars_, padded))


# ------------------------------------------------------------------------------------------------
# One rank's copy (host paths)
# ------------------------------------------------------------------------------------------------

@lifecycle.serialized
def get_value(rank, shared_vars):
    """Return the value(s) of shared variable(s) on device ``rank`` (master included).

    Examples
    --------
    >>> w1 = synk.get_value(1, w)       # doctest: +SKIP
    """
    rt = lifecycle.current()
    rank = _check_rank(rt, rank)
    vars_, single = resolve_shareds(shared_vars)
    rt.ensure_shipped()
    if rank == rt.master_rank:
        values = [np.array(v.get_value()) for v in vars_]
    else:
        rt.send_pickled(_uids(rt, vars_))
        rt.command(Op.GET_SHARED, ranks=[rank])
        values = rt.read_result_arrays(rank)
    return values[0] if single else values


@lifecycle.serialized
def set_value(rank, shared_vars, values, batch=None):
    """Set the value(s) of shared variable(s) on device ``rank`` only.

    ``batch`` (int, slice or index list) selects rows of each value first.
    """
    rt = lifecycle.current()
    rank = _check_rank(rt, rank)
    vars_, _ = resolve_shareds(shared_vars)
    values = _values_list(values, len(vars_), "values")
    arrays = []
    for var, value in zip(vars_, values):
        arr = np.asarray(value.data if isinstance(value, Data) else value)
        if batch is not None:
            arr = arr[slice(0, batch) if isinstance(batch, (int, np.integer)) else batch]
        arrays.append(condition_value(arr, var.type.dtype, var.type.ndim, what=f"value for {var}",
                                          cast_hint=_COLLECTIVE_CAST))
        _check_declared_shape(var, arrays[-1].shape, f"set_value({rank}, ...)")
    rt.ensure_shipped()
    if rank == rt.master_rank:
        for var, arr in zip(vars_, arrays):
            var.set_value(arr)
        place_on_device(vars_)
    else:
        rt.send_pickled(dict(zip(_uids(rt, vars_), arrays)))
        rt.command(Op.SET_SHARED, ranks=[rank])
