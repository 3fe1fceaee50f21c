"""All-gather: every rank's values along axis 0 (or stacked), zero-padded to the longest rank.

Written as ``keep, nd_up, per variable its length on every rank (-1: 0-d)``;
every rank trims the padding by the lengths it was told.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...platform.values import stored
from ...wire.collective import Keep, Kind, dtype_groups
from .keep import keep_on_device

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from ...wire.control import Words
    from .contract import CollectiveContext

__all__ = ["KIND", "encode", "prepare"]

KIND = Kind.GATHER


def encode(words: Words, uids: Sequence[int], keep: Keep, nd_up: int,
           shapes_per_rank: Iterable[Iterable[Sequence[int]]]) -> None:
    """Write a gather of the variables ``uids``; ``shapes_per_rank``: per variable, every rank's shape."""
    words.put(KIND).put_list(uids).put(keep, nd_up)
    for per_rank in shapes_per_rank:
        words.put_list(s[0] if s else -1 for s in per_rank)


def prepare(context: CollectiveContext, vars_: Sequence[SharedVariable], words: Words) -> Callable[[], list[Any]]:
    import jax.numpy as jnp
    comm, rank, master_rank = context.comm, context.rank, context.master_rank
    keep, nd_up = words.get(), words.get()
    lengths = [words.get_list() for _ in vars_]
    groups: list[tuple[list[int], list[Any]]] = []
    for idx in dtype_groups(vars_):
        padded = []
        for i in idx:
            v = jnp.asarray(stored(vars_[i]))
            longest = max(lengths[i])
            if v.ndim and v.shape[0] < longest:
                v = jnp.concatenate([v, jnp.zeros((longest - v.shape[0],) + v.shape[1:], v.dtype)])
            padded.append(v)
        groups.append((idx, padded))

    def execute() -> list[Any]:
        results: list = [None] * len(vars_)
        for idx, padded in groups:
            for i, stacked in zip(idx, comm.all_gather(padded)):
                parts = [stacked[r] if lengths[i][r] < 0 else stacked[r][:lengths[i][r]]
                         for r in range(comm.n_ranks)]
                results[i] = jnp.stack(parts) if nd_up else jnp.concatenate(parts)
        if keep == Keep.ALL:
            for var, v in zip(vars_, results):
                keep_on_device(var, v)
            return []
        return results if rank == master_rank else []
    return execute
