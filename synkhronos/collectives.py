"""Collectives on shared variables: moving device-resident state between ranks.

Every shared variable must be known to some ``synk.function`` (the workers
hold it only then). Variables are accepted as objects or by name.
"""

import io
import pickle

import numpy as np

from . import lifecycle
from .control import ControlBlock, Op
from .transport import write_bytes

__all__ = ["get_value", "set_value", "resolve_shareds"]


def resolve_shareds(shared_vars):
    """Return (list of shared variables, was_single) from one variable/name or a list."""
    rt = lifecycle.current()
    single = not isinstance(shared_vars, (list, tuple))
    items = [shared_vars] if single else list(shared_vars)
    known = {id(var): var for _, var in rt._shared_vars.values()}
    by_name = {}
    for var in known.values():
        by_name.setdefault(var.name, []).append(var)
    out = []
    for item in items:
        if isinstance(item, str):
            found = by_name.get(item, [])
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
    return out, single


def _check_rank(rt, rank):
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < rt.n_parallel:
        raise ValueError(f"rank must be an int in [0, {rt.n_parallel}), got {rank!r}")
    return int(rank)


def _send_payload(rt, obj):
    nbytes = write_bytes(rt.payload, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    rt.ctl.header[ControlBlock.PAYLOAD_GEN] = rt.payload.gen
    rt.ctl.header[ControlBlock.PAYLOAD_NBYTES] = nbytes


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
        _send_payload(rt, [rt.uid_of(v) for v in vars_])
        rt.command(Op.GET_SHARED, ranks=[rank])
        values = rt.read_result_arrays(rank)
    return values[0] if single else values


def set_value(rank, shared_vars, values, batch=None):
    """Set the value(s) of shared variable(s) on device ``rank`` only.

    ``batch`` (int, slice or index list) selects rows of each value first.
    """
    rt = lifecycle.current()
    rank = _check_rank(rt, rank)
    vars_, single = resolve_shareds(shared_vars)
    values = [values] if single else list(values)
    if len(values) != len(vars_):
        raise ValueError(f"got {len(values)} values for {len(vars_)} shared variables")
    arrays = []
    for var, value in zip(vars_, values):
        value = value.data if hasattr(value, "minibatch") else value
        arr = np.asarray(value)
        if batch is not None:
            arr = arr[batch if not isinstance(batch, int) else slice(0, batch)]
        arrays.append(var.type.filter(arr, allow_downcast=False) if arr.dtype != var.type.dtype
                      else arr)
    rt.ensure_shipped()
    if rank == rt.master_rank:
        for var, arr in zip(vars_, arrays):
            var.set_value(arr)
    else:
        _send_payload(rt, {rt.uid_of(v): a for v, a in zip(vars_, arrays)})
        rt.command(Op.SET_SHARED, ranks=[rank])
