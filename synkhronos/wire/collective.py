"""A collective as it travels: its kind, who keeps the result, and how buffers are grouped.

The master writes a collective into the control block's ``args`` as::

    kind, [shared-variable uids], then per kind:
    ALL_REDUCE  op index, keep, per variable its shape on the master
    BROADCAST   per variable its shape
    GATHER      keep, nd_up, per variable its length on every rank (-1: 0-d)
    READ_DATA   chunked, index generation, per variable [data id, gen, dtype code, *shape]
                and its batch (synkhronos.wire.plan.put_batch)

and every rank reads it back in :func:`synkhronos.rank.collectives.prepare_collective`.
"""

import numpy as np

__all__ = ["REDUCE_OPS", "ALL_REDUCE", "BROADCAST", "GATHER", "READ_DATA", "KIND_NAMES", "KEEP_ALL",
           "KEEP_MASTER", "RETURN", "dtype_groups", "shapes_of"]

REDUCE_OPS = ("avg", "sum", "prod", "min", "max")

# collective kinds
ALL_REDUCE, BROADCAST, GATHER, READ_DATA = range(1, 5)
#: each kind's name in messages and timelines
KIND_NAMES = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", GATHER: "gather", READ_DATA: "read_data"}
# who keeps an all-reduce's or gather's result: every rank, the master, or nobody (returned)
KEEP_ALL, KEEP_MASTER, RETURN = range(3)


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
