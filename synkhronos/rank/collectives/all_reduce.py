"""All-reduce: every rank's values combined by a :class:`~synkhronos.comm.reduction.Reduce`.

Written as ``op code, keep, per variable its shape on the master``, then the
rows behind each variable's values (see :mod:`synkhronos.runtime.rows_behind`):
the distinct per-rank row lists, and per variable which of them (0: none). A
rank whose variable has another shape refuses before any rank reduces. An
average of values behind unequal rows weighs each rank by its rows: every rank
scales its value by ``n_ranks * its_rows / all_rows`` before the plain mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...comm.reduction import Reduce
from ...errors import ShapeMismatch
from ...platform.values import stored
from ...wire.collective import Keep, Kind, dtype_groups
from .keep import keep_on_device

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from ...wire.control import Words
    from .contract import CollectiveContext

__all__ = ["KIND", "encode", "prepare"]

KIND = Kind.ALL_REDUCE


def encode(words: Words, uids: Sequence[int], op: Reduce, keep: Keep, shapes: Iterable[Sequence[int]],
           rows: Sequence[Sequence[int] | None] | None = None) -> None:
    """Write an all-reduce of the variables ``uids`` (of ``shapes`` on the master); ``rows``: per
    variable, the rows behind each rank's value (None: a plain reduction)."""
    words.put(KIND).put_list(uids).put(op.code, keep)
    for shape in shapes:
        words.put_list(shape)
    table: list[tuple[int, ...]] = []
    which = []
    for per_rank in rows or [None] * len(uids):
        if per_rank is None:
            which.append(0)
            continue
        if tuple(per_rank) not in table:
            table.append(tuple(per_rank))
        which.append(table.index(tuple(per_rank)) + 1)
    words.put(len(table))
    for per_rank in table:
        words.put_list(per_rank)
    words.put_list(which)


def prepare(context: CollectiveContext, vars_: Sequence[SharedVariable], words: Words) -> Callable[[], list[Any]]:
    comm, rank, master_rank = context.comm, context.rank, context.master_rank
    op, keep = Reduce.of_code(words.get()), words.get()
    for var, expected in zip(vars_, [tuple(words.get_list()) for _ in vars_]):
        own = tuple(np.shape(stored(var)))
        if own != expected:
            raise ShapeMismatch(f"{var} has shape {own} on rank {rank} but {expected} on the master")
    table = [words.get_list() for _ in range(words.get())]
    weights = [_weight(table[k - 1], rank) if k else None for k in words.get_list()]
    groups = [(idx, [_weighed(stored(vars_[i]), weights[i]) for i in idx]) for idx in dtype_groups(vars_)]

    def execute() -> list[Any]:
        results: list[Any] = [None] * len(vars_)
        for idx, values in groups:
            for i, v in zip(idx, comm.all_reduce(values, op)):
                results[i] = v
        if keep == Keep.ALL or (keep == Keep.MASTER and rank == master_rank):
            for var, v in zip(vars_, results):
                keep_on_device(var, v)
        return results if keep == Keep.RETURN and rank == master_rank else []
    return execute


def _weight(rows: Sequence[int], rank: int) -> float:
    """What ``rank`` scales its value by, so that the plain mean over ranks weighs each by ``rows``."""
    return len(rows) * rows[rank] / sum(rows)


def _weighed(value: Any, weight: float | None) -> Any:
    """``value`` scaled by ``weight`` (a new array: the rank's own value stays), or as it is."""
    if weight is None:
        return value
    return value * np.asarray(weight, value.dtype)
