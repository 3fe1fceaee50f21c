"""Read data: every rank puts rows of a Data (all of them, or its chunk) on its device.

Not a device collective (nothing travels between ranks), but run as one, so
that every rank's variables change together. Written as ``chunked, index
generation, per variable [data id, gen, dtype code, *shape] and its batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...ipc.packing import dtype_code
from ...platform.device_arrays import adopt, to_device
from ...wire.batch import chunk
from ...wire.collective import Kind
from ...wire.plan import InputRef, get_batch, put_batch
from ..executor import rows_of
from .keep import keep_on_device

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from ...wire.batch import Batch
    from ...wire.control import Words
    from .contract import CollectiveContext

__all__ = ["KIND", "encode", "prepare"]

KIND = Kind.READ_DATA


def encode(words: Words, uids: Sequence[int], chunked: bool, index_gen: int,
           plans: Iterable[tuple[Any, Batch]]) -> None:
    """Write a read of ``plans`` (per variable: its Data and its batch) into the variables ``uids``."""
    words.put(KIND).put_list(uids).put(int(chunked), index_gen)
    for data, batch in plans:
        words.put_list([data.id, data.gen, dtype_code(data.dtype), *data.shape])
        put_batch(words, batch)


def prepare(context: CollectiveContext, vars_: Sequence[SharedVariable], words: Words) -> Callable[[], list[Any]]:
    rank, n_ranks, view_of, index_lookup = context.rank, context.n_ranks, context.view, context.index_view
    chunked, index_gen = words.get(), words.get()
    values: list[Any] = []
    for _ in vars_:
        data_id, gen, code, *shape = words.get_list()
        batch = get_batch(words, index_lookup, index_gen)
        view = view_of(InputRef(data_id, gen, code, 0, tuple(shape)))
        if not shape:
            values.append(to_device(view))
            continue
        a, b = chunk(0, batch.total, n_ranks, rank) if chunked else (0, batch.total)
        rows = rows_of(view, batch, a, b, 0)
        # gathered rows are a private aligned buffer already; a view of the Data must be copied
        values.append(to_device(rows) if batch.is_range else adopt(rows))

    def execute() -> list[Any]:
        for var, value in zip(vars_, values):
            keep_on_device(var, value)
        return []
    return execute
