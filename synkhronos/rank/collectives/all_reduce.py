"""All-reduce: every rank's values combined by a :class:`~synkhronos.comm.reduction.Reduce`.

Written as ``op code, keep, per variable its shape on the master``; a rank
whose variable has another shape refuses before any rank reduces.
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


def encode(words: Words, uids: Sequence[int], op: Reduce, keep: Keep, shapes: Iterable[Sequence[int]]) -> None:
    """Write an all-reduce of the variables ``uids`` (of ``shapes`` on the master)."""
    words.put(KIND).put_list(uids).put(op.code, keep)
    for shape in shapes:
        words.put_list(shape)


def prepare(context: CollectiveContext, vars_: Sequence[SharedVariable], words: Words) -> Callable[[], list[Any]]:
    comm, rank, master_rank = context.comm, context.rank, context.master_rank
    op, keep = Reduce.of_code(words.get()), words.get()
    for var, expected in zip(vars_, [tuple(words.get_list()) for _ in vars_]):
        own = tuple(np.shape(stored(var)))
        if own != expected:
            raise ShapeMismatch(f"{var} has shape {own} on rank {rank} but {expected} on the master")
    groups = [(idx, [stored(vars_[i]) for i in idx]) for idx in dtype_groups(vars_)]

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
