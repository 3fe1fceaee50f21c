"""A collective as it travels: its kind, who keeps the result, and how buffers are grouped.

The master writes a collective into the control block's ``args`` as its
:class:`Kind`, the uids of its shared variables, then what the kind's own module
of :mod:`synkhronos.rank.collectives` writes; every rank reads it back there
(its ``prepare``), so each kind's writing and reading sit side by side.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence, ValuesView
from typing import Any

import numpy as np

from .control import enum_name

__all__ = ["Kind", "Keep", "kind_name", "dtype_groups", "group_bytes", "shapes_of"]


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


def kind_name(code: int) -> str:
    """A collective kind's name for messages and timelines (``"all_reduce"``), else ``"collective"``.

    Examples
    --------
    >>> kind_name(1), kind_name(0)
    ('all_reduce', 'collective')
    """
    return enum_name(Kind, code, "collective")


def shapes_of(values: Iterable[Any]) -> Any:
    """The shape of each of ``values`` (device or host arrays) as a tuple of ints."""
    return [tuple(np.shape(v)) for v in values]


def dtype_groups(vars_: Iterable[Any]) -> ValuesView[list[int]]:
    """Indices of ``vars_`` grouped by dtype: each group travels as one flat buffer.

    Examples
    --------
    >>> import pytensor, numpy as np
    >>> a, b, c = (pytensor.shared(np.zeros(2, t)) for t in ("float32", "int64", "float32"))
    >>> list(dtype_groups([a, b, c]))
    [[0, 2], [1]]
    """
    groups: dict[Any, list[int]] = {}
    for i, var in enumerate(vars_):
        groups.setdefault(var.type.dtype, []).append(i)
    return groups.values()


def group_bytes(vars_: Sequence[Any], sizes: Sequence[int]) -> int:
    """Largest byte size over the dtype groups of ``vars_``, given each variable's item count.

    Each variable may start on a 64-byte boundary in a group's flat buffer.
    """
    return max(sum(sizes[i] * np.dtype(vars_[i].type.dtype).itemsize + 64 for i in idx)
               for idx in dtype_groups(vars_))
