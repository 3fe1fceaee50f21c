"""A collective as it travels: its kind, who keeps the result, and how buffers are grouped.

The master writes a collective into the control block's ``args`` as::

    kind, [shared-variable uids], then per kind:
    ALL_REDUCE  op code (synkhronos.comm.reduction.Reduce.code), keep, per variable its shape on the master
    BROADCAST   per variable its shape
    GATHER      keep, nd_up, per variable its length on every rank (-1: 0-d)
    READ_DATA   chunked, index generation, per variable [data id, gen, dtype code, *shape]
                and its batch (synkhronos.wire.plan.put_batch)

and every rank reads it back in :func:`synkhronos.rank.collectives.prepare_collective`.
"""

import enum

import numpy as np

from .control import enum_name

__all__ = ["Kind", "Keep", "kind_name", "dtype_groups", "shapes_of"]


class Kind(enum.IntEnum):
    """The kinds of collective."""
    ALL_REDUCE = 1
    BROADCAST = 2
    GATHER = 3
    READ_DATA = 4


class Keep(enum.IntEnum):
    """Who keeps an all-reduce's or gather's result: every rank, the master, or nobody (returned)."""
    ALL = 0
    MASTER = 1
    RETURN = 2


def kind_name(code):
    """A collective kind's name for messages and timelines (``"all_reduce"``), else ``"collective"``.

    Examples
    --------
    >>> kind_name(1), kind_name(0)
    ('all_reduce', 'collective')
    """
    return enum_name(Kind, code, "collective")


def shapes_of(values):
    """The shape of each of ``values`` (device or host arrays) as a tuple of ints."""
    return [tuple(np.shape(v)) for v in values]


def dtype_groups(vars_):
    """Indices of ``vars_`` grouped by dtype: each group travels as one flat buffer.

    Examples
    --------
    >>> import pytensor, numpy as np
    >>> a, b, c = (pytensor.shared(np.zeros(2, t)) for t in ("float32", "int64", "float32"))
    >>> list(dtype_groups([a, b, c]))
    [[0, 2], [1]]
    """
    groups = {}
    for i, var in enumerate(vars_):
        groups.setdefault(var.type.dtype, []).append(i)
    return groups.values()
