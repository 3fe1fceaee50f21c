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

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Sequence, Union

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable

from ..comm import Reservation
from ..comm.reduction import Reduce
from ..compile import randomness
from ..errors import Failure, ShapeMismatch, WorkerError, is_whole, warn
from ..platform.values import stored
from ..rank import collectives as kinds
from ..runtime.session import State, current, serialized
from ..wire.batch import Batch, chunk
from ..wire.collective import Keep, dtype_groups, group_bytes, shapes_of
from ..wire.control import Words
from ..wire.digests import values_text
from .data import Data, condition_value, release_large_staging, staging_data
from .function_parts.batch import parse_batch
from .function_parts.shapes import check_shared_shape

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "get_value", "set_value", "get_lengths", "get_shapes", "resolve_shareds"]

#: one shared variable or its name, or a list of those
Shareds = Union[SharedVariable, str, Sequence[Union[SharedVariable, str]]]
#: what a message suggests for a value that does not cast safely to a shared variable's dtype
_COLLECTIVE_CAST = "make the shared variable of that dtype"


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------

def resolve_shareds(shared_vars: Shareds) -> tuple[list[SharedVariable], bool]:
    """Return (list of shared variables, was_single) from one variable/name or a list."""
    state = current()
    single = not isinstance(shared_vars, (list, tuple))
    items = list(shared_vars) if isinstance(shared_vars, (list, tuple)) else [shared_vars]
    if not items:
        raise ValueError("no shared variables given")
    known = {id(var): var for var in state.registry.known_shared()}
    out: list[SharedVariable] = []
    for item in items:
        if isinstance(item, str):
            found = [v for v in known.values() if v.name == item]
            if len(found) != 1:
                raise ValueError(f"no shared variable named {item!r} is used by a synk.function"
                                 if not found else
                                 f"{len(found)} shared variables are named {item!r}; pass the object")
            out.append(found[0])
        elif id(item) in known:
            out.append(known[id(item)])
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


def _old_nccl(state: State, nccl: bool | None, what: str) -> None:
    """Accept the original's ``nccl=`` where it still holds; say where the choice moved otherwise.

    The original chose per call between NCCL (``nccl=True``) and a CPU path;
    synkhronos chooses per runtime (``fork(collectives=...)``): the JAX runtime
    (NCCL on GPUs), or shared memory on CPU.
    """
    if nccl is None:
        return
    if not nccl and state.comm_kind != "shm":
        raise TypeError(f"{what}(nccl=False): the collective path is chosen per runtime now; for the "
                        f"shared-memory CPU path use synk.fork(collectives='shm') (CPU only)")
    warn(f"{what}(nccl=...) is no longer needed: the path is chosen by "
         f"synk.fork(collectives=...), here {state.comm_kind!r}", DeprecationWarning)


def _check_rank(state: State, rank: Any) -> int:
    if not is_whole(rank, at_least=0, below=state.n_parallel):
        raise ValueError(f"rank must be an int in [0, {state.n_parallel}), got {rank!r}")
    return int(rank)


def _check_op(op: str, vars_: Sequence[SharedVariable]) -> Reduce:
    op = Reduce.named(op)
    if op == Reduce.AVG:
        for var in vars_:
            if not np.issubdtype(np.dtype(var.type.dtype), np.floating) and \
                    not np.issubdtype(np.dtype(var.type.dtype), np.complexfloating):
                raise TypeError(f"op 'avg' cannot average {var} of dtype {var.type.dtype} exactly; "
                                f"use 'sum'")
    return op


def _values_list(values: Any, n: int, what: str) -> list[Any]:
    values = [values] if n == 1 and not isinstance(values, (list, tuple)) else list(values)
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} shared variables")
    return values


# ------------------------------------------------------------------------------------------------
# The master's side
# ------------------------------------------------------------------------------------------------

@serialized
def get_shapes(shared_vars: Shareds) -> list:
    """Shape of each variable on every rank: a list over ranks (a list of those for a list).

    Examples
    --------
    >>> w = pytensor.shared(np.zeros((5, 3)), name="w")
    >>> total = synk.function([], (w.sum(), "sum"))      # the devices hold w once a function uses it
    >>> synk.set_value(1, w, np.zeros((6, 3)))
    >>> synk.get_shapes(w)
    [(5, 3), (6, 3)]
    """
    state = current()
    vars_, single = resolve_shareds(shared_vars)
    shapes = state.collectives.all_shapes(vars_)
    return shapes[0] if single else shapes


def get_lengths(shared_vars: Shareds) -> list:
    """Length (axis 0) of each variable on every rank, like :func:`get_shapes`."""
    shapes = get_shapes(shared_vars)
    single = not isinstance(shared_vars, (list, tuple))
    lengths = [[s[0] if s else 1 for s in per_var] for per_var in ([shapes] if single else shapes)]
    return lengths[0] if single else lengths


def _require_equal_shapes(vars_: Sequence[SharedVariable], shapes: Sequence[Sequence[tuple[int, ...]]],
                          what: str) -> None:
    for var, per_rank in zip(vars_, shapes):
        if len(set(per_rank)) > 1:
            raise ValueError(f"{what} needs {var} to have the same shape on every rank, but the "
                             f"shapes are {per_rank} (rank order)")


@serialized
def all_reduce(shared_vars: Shareds, op: str = "avg", nccl: bool | None = None,
               by_rows: bool | None = None) -> None:
    """Reduce across ranks; every rank's copy becomes the result.

    An average can weigh each rank by the rows its value came from (see
    :mod:`synkhronos.runtime.rows_behind`): where the last call that wrote a
    variable computed it from its rows and gave the ranks unequal rows, a mean
    of per-rank means over rows is then the mean over all the call's rows, as
    one process computes it.

    Parameters
    ----------
    shared_vars : shared variable, name, or list of them
    op : {"avg", "sum", "prod", "min", "max"}
    by_rows : bool, optional
        Weigh an average by rows: None (default) for the gradient vectors of
        :mod:`synkhronos.extensions.updates` (a mean loss's gradient, stored
        by one call), True for every variable a call wrote from its rows (their
        values are means over rows), False for none (the plain mean over ranks).
        A plain average of values of unequal rows says so once
        (:class:`~synkhronos.SynkWarning`).

    Examples
    --------
    >>> g = pytensor.shared(np.zeros(3), name="g")
    >>> total = synk.function([], (g.sum(), "sum"))
    >>> synk.set_value(1, g, np.array([2.0, 4.0, 6.0]))     # rank 0 holds zeros
    >>> synk.all_reduce(g, op="avg")
    >>> g.get_value(), synk.get_value(1, g)
    (array([1., 2., 3.]), array([1., 2., 3.]))
    """
    _old_nccl(current(), nccl, "all_reduce")
    _reduce(shared_vars, op, Keep.ALL, by_rows)


@serialized
def reduce(shared_vars: Shareds, op: str = "avg", in_place: bool = True,
           nccl: bool | None = None, by_rows: bool | None = None) -> np.ndarray | list[np.ndarray] | None:
    """Reduce across ranks into the master.

    With ``in_place=True`` the master's copy becomes the result (workers keep
    theirs); with ``in_place=False`` the result is returned (the caller's own, writable)
    and no copy changes.
    ``by_rows``: as in :func:`all_reduce`.
    """
    _old_nccl(current(), nccl, "reduce")
    out = _reduce(shared_vars, op, Keep.MASTER if in_place else Keep.RETURN, by_rows)
    return None if in_place else out


def _reduce(shared_vars: Shareds, op: str, keep: Keep, by_rows: bool | None = None
            ) -> np.ndarray | list[np.ndarray] | None:
    """All-reduce / reduce with no shape round trip: the master sends its shapes and every rank
    checks its own while preparing; only a mismatch asks every rank for its shapes, to say which."""
    state = current()
    vars_, single = resolve_shareds(shared_vars)
    if by_rows not in (None, True, False):
        raise TypeError(f"by_rows must be None, True or False, got {by_rows!r}")
    _check_op(op, vars_)
    rows, plain = _rows_behind(state, vars_, op, by_rows)
    for var, behind in plain:            # (before the collective: an error filter stops it)
        _say_plain_mean(var, behind, "all_reduce" if keep == Keep.ALL else "reduce")
    fill, reservation = reduction_command(state, vars_, op, keep, rows=rows)
    with shapes_named_on_mismatch(state, vars_, f"{op} reduction"):
        out = state.collectives.run(fill, reservation, given=f", op {op}, kept by {keep.name.lower()}")
    state.rows_behind.said_plain_mean([var for var, _ in plain])
    if keep == Keep.RETURN:
        out = _owned(out)
        return out[0] if single else out
    return None


def _rows_behind(state: State, vars_: Sequence[SharedVariable], op: str, by_rows: bool | None
                 ) -> tuple[list[tuple[int, ...] | None] | None, list[tuple[SharedVariable, tuple[int, ...]]]]:
    """For an average: per variable, the rows to weigh each device's value by (see
    :func:`all_reduce`'s ``by_rows``), or None (None for any other reduction, or where no
    variable is weighed); and the variables of unequal rows whose plain mean is to be said."""
    if op != Reduce.AVG or by_rows is False:
        return None, []
    rows: list[tuple[int, ...] | None] = []
    plain: list[tuple[SharedVariable, tuple[int, ...]]] = []
    for var in vars_:
        behind = state.rows_behind.rows_of(var) if np.dtype(var.type.dtype).kind in "fc" else None
        if behind is not None and by_rows is None and not getattr(var.tag, "synk_gradient", False):
            if not state.rows_behind.plain_mean_said(var):
                plain.append((var, behind))
            behind = None
        rows.append(behind)
    return (rows if any(r is not None for r in rows) else None), plain


def _say_plain_mean(var: SharedVariable, rows: Sequence[int], what: str) -> None:
    """Warn that an average weighs alike values of unequal rows (once per variable: see
    :meth:`~synkhronos.runtime.rows_behind.RowsBehind.said_plain_mean`)."""
    warn(
        f"{what}(op='avg') of {var}: the call that wrote it gave the devices {list(rows)} rows, "
        f"and the plain mean over the devices weighs their values alike. If each is a mean over "
        f"its device's rows (a gradient of a mean loss), pass by_rows=True for the mean over all "
        f"the rows, as one process computes it; by_rows=False keeps the plain mean and says "
        f"nothing")


def reduction_command(state: State, vars_: Sequence[SharedVariable], op: str, keep: Keep = Keep.ALL,
                      rows: Sequence[Sequence[int] | None] | None = None
                      ) -> tuple[Callable[[Words], None], Reservation]:
    """What a reduction of ``vars_`` sends: ``(fill, reservation)``.

    ``fill(words)`` writes the collective (with the master's shapes, which every
    rank checks while preparing); ``reservation`` is what it needs of the
    collective implementation. ``rows``: per variable, the rows each rank's value
    comes from, by which an average weighs the ranks (None: alike).
    """
    op = _check_op(op, vars_)
    own = shapes_of(stored(v) for v in vars_)
    nbytes = group_bytes(vars_, [math.prod(s) for s in own])
    one_launch = len(list(dtype_groups(vars_))) == 1

    def fill(w: Words) -> None:
        kinds.all_reduce.encode(w, state.registry.uids_of(vars_), op, keep, own, rows)
    return fill, Reservation(nbytes, nbytes if one_launch else 0, nbytes)


@contextmanager
def shapes_named_on_mismatch(state: State, vars_: Sequence[SharedVariable], what: str) -> Iterator[None]:
    """Turn a rank's :class:`ShapeMismatch` inside the block into an error listing every rank's shapes."""
    try:
        yield
    except WorkerError as e:
        if e.how is Failure.RAISED and e.exc_type.endswith(ShapeMismatch.__qualname__):
            _require_equal_shapes(vars_, state.collectives.all_shapes(vars_), what)
        raise


@serialized
def broadcast(shared_vars: Shareds, values: Any = None, nccl: bool | None = None) -> None:
    """Copy the master's value(s) to every rank, optionally setting them first.

    ``values`` may be numpy arrays or :class:`Data`; a Data value is read from
    shared memory by every rank itself.
    """
    state = current()
    _old_nccl(state, nccl, "broadcast")
    vars_, single = resolve_shareds(shared_vars)
    if values is not None:
        values = _values_list(values, len(vars_), "values")
        if all(isinstance(v, Data) for v in values):
            return _read_data(state, vars_, values, None, chunked=False)
        for var, value in zip(vars_, values):
            value = value.data if isinstance(value, Data) else value
            var.set_value(condition_value(value, var.type.dtype, var.type.ndim,
                                          what=f"value for {var}",
                                          cast_hint=_COLLECTIVE_CAST))
    state.collectives.broadcast_from_master(vars_)


@serialized
def scatter(shared_vars: Shareds, values: Any, batch: Any = None) -> None:
    """Split each value along axis 0 across ranks (near-equal contiguous chunks).

    Parameters
    ----------
    shared_vars : shared variable, name, or list of them
    values : numpy array or Data, or a list of them (one per variable)
    batch : int, slice or sequence of int, optional
        Rows of every value to scatter (as ``batch`` in a function call).
    """
    state = current()
    vars_, _ = resolve_shareds(shared_vars)
    values = _values_list(values, len(vars_), "values")
    datas, arrays = [], []
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
            arrays.append(arr)
            datas.append(staging_data(state, ("scatter", i), arr))
    # on several nodes every node gives each value whole, and its devices take their rows of it:
    # the nodes compare what they give, as the variables take it (a Data's contents are taken alike)
    given = "" if state.nodes is None else values_text([*arrays, batch])
    _read_data(state, vars_, datas, batch, chunked=True, given=given)
    release_large_staging(state.staging)


def _read_data(state: State, vars_: Sequence[SharedVariable], datas: Sequence[Data], batch: Any,
               chunked: bool, given: str = "") -> None:
    state.rows_behind.forget(vars_)
    plans: list[tuple[Data, Batch]] = []
    for var, d in zip(vars_, datas):
        if d.shape is None:
            raise TypeError(f"Data for {var} holds no value")
        if d.ndim == 0:
            if chunked:
                raise TypeError(f"cannot scatter a 0-d Data to {var}; use broadcast")
            b = Batch(total=0)
        else:
            b, _ = parse_batch(batch, [d], [str(var)])
        rows = [hi - lo for lo, hi in (chunk(0, b.total, state.n_parallel, r) for r in range(state.n_parallel))] \
            if chunked else [b.total] * state.n_parallel
        for n in rows:
            check_shared_shape(var, (n,) + d.shape[1:] if d.ndim else (),
                                  "scatter" if chunked else "broadcast")
        plans.append((d, b))
    with_indices = [b for _, b in plans if not b.is_range]
    # every batch here comes from the same ``batch``, so one copy of its indices serves all
    index_gen = state.data.write_indices(with_indices[:1]) if with_indices else 0

    def fill(w: Words) -> None:
        kinds.read_data.encode(w, state.registry.uids_of(vars_), chunked, index_gen, plans)
    state.collectives.run(fill, given=given)


@serialized
def gather(shared_vars: Shareds, nd_up: int = 1,
           nccl: bool | None = None) -> np.ndarray | list[np.ndarray]:
    """Collect every rank's copy in the master, in rank order.

    ``nd_up=1`` stacks on a new leading axis (shapes must be equal); ``nd_up=0``
    concatenates along axis 0 (lengths may differ). Nothing is changed. The result
    is the caller's own (writable, no view of runtime memory).
    """
    state = current()
    _old_nccl(state, nccl, "gather")
    vars_, single = resolve_shareds(shared_vars)
    if nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 (concatenate) or 1 (stack), got {nd_up!r}")
    out = _owned(_gather(state, vars_, Keep.RETURN, nd_up))
    return out[0] if single else out


def _owned(values: list[np.ndarray]) -> list[np.ndarray]:
    """``values`` as arrays of the user's own: a read-only view (of a device array that the JAX
    runtime's collectives left on a CPU device, which would also keep JAX's backend alive after
    close()) is copied."""
    return [v if v.flags.writeable else np.array(v) for v in values]


@serialized
def all_gather(shared_vars: Shareds, nccl: bool | None = None) -> None:
    """Every rank's copy becomes the concatenation (axis 0) of all ranks' copies."""
    state = current()
    _old_nccl(state, nccl, "all_gather")
    vars_, _ = resolve_shareds(shared_vars)
    _gather(state, vars_, Keep.ALL, 0)


def _gather(state: State, vars_: Sequence[SharedVariable], keep: Keep, nd_up: int) -> list[np.ndarray]:
    shapes = state.collectives.all_shapes(vars_)
    if keep == Keep.ALL:
        for var, per_rank in zip(vars_, shapes):
            if all(per_rank):
                check_shared_shape(var, (sum(s[0] for s in per_rank),) + per_rank[0][1:],
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

    def fill(w: Words) -> None:
        kinds.gather.encode(w, state.registry.uids_of(vars_), keep, nd_up, shapes)
    padded = [max(math.prod(s) for s in per_rank) for per_rank in shapes]
    return state.collectives.run(fill, Reservation(group_bytes(vars_, padded)),
                                 given=f", kept by {keep.name.lower()}, nd_up {nd_up}")


# ------------------------------------------------------------------------------------------------
# One rank's copy (host paths)
# ------------------------------------------------------------------------------------------------

@serialized
def get_value(rank: int, shared_vars: Shareds) -> np.ndarray | list[np.ndarray]:
    """Return the value(s) of shared variable(s) on device ``rank`` (master included).

    On several nodes ``rank`` is global and every node makes the same call: each
    gets the values of ``rank``, which the node holding it sends.

    Examples
    --------
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> total = synk.function([], (w.sum(), "sum"))
    >>> synk.set_value(1, w, np.ones(2))
    >>> synk.get_value(1, w), w.get_value()
    (array([1., 1.]), array([0., 0.]))
    """
    state = current()
    rank = _check_rank(state, rank)
    vars_, single = resolve_shareds(shared_vars)
    values = state.collectives.get_values(rank, vars_)
    return values[0] if single else values


@serialized
def set_value(rank: int, shared_vars: Shareds, values: Any, batch: Any = None) -> None:
    """Set the value(s) of shared variable(s) on device ``rank`` only.

    ``batch`` (int, slice or index list) selects rows of each value first. On
    several nodes ``rank`` is global and every node makes the same call, of the
    same variables (nodes naming others raise NodesDiverged before any sets
    them); the node holding ``rank`` applies its ``values``.
    """
    state = current()
    try:
        rank = _check_rank(state, rank)
        vars_, _ = resolve_shareds(shared_vars)
        values = _values_list(values, len(vars_), "values")
        arrays = []
        for var, value in zip(vars_, values):
            arr = np.asarray(value.data if isinstance(value, Data) else value)
            if batch is not None:
                arr = arr[slice(0, batch) if isinstance(batch, (int, np.integer)) else batch]
            arrays.append(condition_value(arr, var.type.dtype, var.type.ndim, what=f"value for {var}",
                                          cast_hint=_COLLECTIVE_CAST))
            check_shared_shape(var, arrays[-1].shape, f"set_value({rank}, ...)")
    except Exception as e:
        state.tell_nodes_refused("set_value", e)
        raise
    if state.nodes is not None:       # (nodes naming other variables raise before any sets them)
        names = ", ".join(str(var) for var in vars_)
        state.nodes.exchange(("set_value", rank, f"of {names}"), None)
    state.collectives.set_values(rank, vars_, arrays)
