"""Where Data lives: the master's shared-memory segments, and every worker's mappings of them.

The master owns every segment (:class:`DataStore`). A worker maps a Data
segment the first time a command names it (by Data id and segment generation)
and drops its mapping when the master announces a reallocation, a
``free_memory()`` or that the Data was garbage collected (:class:`DataMirrors`).
Explicitly indexed rows travel through one more segment, the index segment.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..ipc.packing import DTYPES
from ..ipc.segments import GrowableSegment, SegmentMirror

if TYPE_CHECKING:
    from ..wire.batch import Batch
    from ..wire.plan import InputRef

__all__ = ["DataStore", "DataMirrors"]


class DataStore:
    """The master's Data segments, by id, and the index segment.

    Parameters
    ----------
    prefix : str
        The runtime's segment prefix.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        # gone with its Data
        self._segments: weakref.WeakValueDictionary[int, GrowableSegment] = weakref.WeakValueDictionary()
        #: ids of Data the garbage collector freed whose mappings the workers still hold
        self.released: collections.deque[int] = collections.deque()
        self._next_id = 0
        self.indices = GrowableSegment(f"{prefix}_ix")

    def new_segment(self) -> tuple[int, GrowableSegment]:
        """A fresh (unallocated) segment for a Data, and its id."""
        data_id, self._next_id = self._next_id, self._next_id + 1
        segment = self._segments[data_id] = GrowableSegment(f"{self.prefix}_d{data_id}")
        return data_id, segment

    def release_unreferenced(self, data_id: int, segment: GrowableSegment) -> None:
        """Unlink the segment of a Data nobody refers to; the workers let go before the next command.

        Runs from the garbage collector, in whichever thread: it only unlinks
        and queues the id.
        """
        segment.free()
        self.released.append(data_id)

    def view(self, ref: InputRef) -> np.ndarray:
        """The master's numpy view of the Data an :class:`~synkhronos.wire.plan.InputRef` names."""
        return self._segments[ref.data_id].made.view(DTYPES[ref.code], ref.shape)

    def write_indices(self, batches: Sequence[Batch]) -> int:
        """Put the explicit indices of ``batches`` where every rank reads them.

        Sets each batch's ``index_offset`` and returns the segment generation.
        """
        explicit = [cast(np.ndarray, b.indices) for b in batches]
        total = sum(len(indices) for indices in explicit)
        self.indices.ensure(8 * total, oversize=1.5)
        view = self.indices.made.array(np.int64, (total,))
        pos = 0
        for b, indices in zip(batches, explicit):
            view[pos:pos + len(indices)] = indices
            b.index_offset = pos
            pos += len(indices)
        return self.indices.gen

    def index_view(self, gen: int, start: int, n: int) -> np.ndarray:
        return self.indices.made.array(np.int64, (n,), offset=8 * start)

    def release_all(self) -> None:
        """At close: unlink every segment (the workers are gone)."""
        for segment in list(self._segments.values()):
            segment.free()
        self.indices.free()


class DataMirrors:
    """A worker's mappings of the master's Data segments, and of the index segment."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.mirrors: dict[int, SegmentMirror] = {}
        self.indices = SegmentMirror(f"{prefix}_ix")

    def view(self, ref: InputRef) -> np.ndarray:
        """This worker's numpy view of the Data an :class:`~synkhronos.wire.plan.InputRef` names."""
        mirror = self.mirrors.get(ref.data_id)
        if mirror is None:
            mirror = self.mirrors[ref.data_id] = SegmentMirror(f"{self.prefix}_d{ref.data_id}")
        return mirror.get(ref.gen).view(DTYPES[ref.code], ref.shape)

    def index_view(self, gen: int, start: int, n: int) -> np.ndarray:
        return self.indices.get(gen).array(np.int64, (n,), offset=8 * start)

    def drop(self, data_ids: Iterable[int]) -> None:
        for data_id in data_ids:
            mirror = self.mirrors.pop(int(data_id), None)
            if mirror is not None:
                mirror.release()
