"""Broadcast: the root rank's values (node 0's master's) to every rank.

Written as ``per variable its shape`` on the root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...platform.values import stored
from ...wire.collective import Kind, dtype_groups
from .keep import keep_on_device

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from ...wire.control import Words
    from .contract import CollectiveContext

__all__ = ["KIND", "encode", "prepare"]

KIND = Kind.BROADCAST


def encode(words: Words, uids: Sequence[int], shapes: Iterable[Sequence[int]]) -> None:
    """Write a broadcast of the variables ``uids`` (of ``shapes`` on the root)."""
    words.put(KIND).put_list(uids)
    for shape in shapes:
        words.put_list(shape)


def prepare(context: CollectiveContext, vars_: Sequence[SharedVariable], words: Words) -> Callable[[], list[Any]]:
    comm, rank, root = context.comm, context.rank, context.root_rank
    shapes = [tuple(words.get_list()) for _ in vars_]
    groups: list[tuple[list[int], list[Any]]] = []
    for idx in dtype_groups(vars_):
        if rank == root:
            values = [stored(vars_[i]) for i in idx]
        else:
            # placeholders of the right shape, never read: np.empty touches no memory (device zeros
            # would be written on every worker, a full pass over the broadcast's size)
            values = [np.empty(shapes[i], vars_[i].type.dtype) for i in idx]
        groups.append((idx, values))

    def execute() -> list[Any]:
        for idx, values in groups:
            for i, own, v in zip(idx, values, comm.broadcast(values, root)):
                # the root's device array stays its value (the script may hold its face); a value
                # just set there (numpy) goes on the device as the others' do
                if rank != root or isinstance(own, np.ndarray):
                    keep_on_device(vars_[i], v)
        return []
    return execute
