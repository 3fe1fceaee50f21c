"""Central parameters in shared memory, for the asynchronous rules of a device-driven loop.

Layout (one segment ``<prefix>_center<loop id>``, made by the master)::

    words    int64[8]          the next unit of work to claim
    mutexes  sem_t[1 + blocks] the claim counter's, then one per parameter block
    blocks   [per parameter]   its central value, 64-byte aligned

Every parameter is one block with its own mutex (a process-shared POSIX
semaphore holding 1 when free): a push or pull of a block is atomic, and a
device exchanging one parameter never waits for another device exchanging a
different one. Devices claim the minibatches they train on from one shared
counter, so a fast device takes more of them than a slow one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ...ipc.buffers import round_up
from ...ipc.segments import Segment
from ...ipc.semaphores import SEMAPHORE_BYTES, SemaphoreLike, semaphores_in
from ...platform.values import stored

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["Center"]

#: a rule's merge: ``merge(block, pushed)`` applies a push to a block in place, returns what the device takes back
Merge = Callable[[np.ndarray, np.ndarray], np.ndarray]

_WORDS = 8
_ALIGN = 64


def _layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[npt.DTypeLike]) -> tuple[list[int], int]:
    """Byte offset of every block after the header and the mutexes, and the segment size."""
    offset = round_up(8 * _WORDS + SEMAPHORE_BYTES * (1 + len(shapes)), _ALIGN)
    offsets = []
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(offset)
        offset += round_up(math.prod(shape) * np.dtype(dtype).itemsize, _ALIGN)
    return offsets, max(offset, 1)


class Center:
    """The central parameter values every device of one node exchanges with.

    Parameters
    ----------
    name : str
        The segment's name.
    shapes, dtypes : sequence
        One per parameter block.
    initial : sequence of array, optional
        The initial central values: given by the creator (the master), which
        creates the segment; omitted by the devices that attach to it.
    merge : callable
        ``merge(block, pushed)``: a device's push applied to a block in place
        (the rule's :meth:`~synkhronos.rank.sync.Downpour.merge`); returns what
        the device takes back.
    check : callable
        Called while a mutex is waited for (raises to abandon the wait).
    """

    CLAIMED = 0

    def __init__(self, name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[npt.DTypeLike],
                 initial: Sequence[npt.ArrayLike] | None = None, merge: Merge | None = None,
                 check: Callable[[], None] = lambda: None) -> None:
        create = initial is not None
        offsets, size = _layout(shapes, dtypes)
        self.segment = Segment(name, size, create=create)
        self.words = self.segment.array(np.int64, (_WORDS,))
        self._claim_lock, *self._locks = semaphores_in(self.segment, 8 * _WORDS, 1 + len(shapes),
                                                       create)
        self.blocks = [self.segment.array(dtype, tuple(shape), offset)
                       for shape, dtype, offset in zip(shapes, dtypes, offsets)]
        self.check, self.merge = check, merge
        self._owner = create
        if initial is not None:
            for block, value in zip(self.blocks, initial):
                block[...] = value
            for lock in [self._claim_lock, *self._locks]:
                lock.post()            # a mutex starts free

    @classmethod
    def of(cls, name: str, params: Sequence[SharedVariable], create: bool, merge: Merge | None = None,
           check: Callable[[], None] = lambda: None) -> Center:
        """The center of the shared variables ``params``, one block each, shaped like their values.

        The creator (``create=True``, the master) fills it with their values now.
        """
        values = [np.asarray(stored(p)) for p in params]
        return cls(name, [v.shape for v in values], [p.type.dtype for p in params],
                   initial=values if create else None, merge=merge, check=check)

    @contextmanager
    def _held(self, lock: SemaphoreLike) -> Iterator[None]:
        lock.wait(self.check, spin=20e-6, slice_=0.1)
        try:
            yield
        finally:
            lock.post()

    def locked(self, i: int) -> AbstractContextManager[None]:
        """Hold block ``i`` (``with center.locked(i): ...``) while reading or writing it."""
        return self._held(self._locks[i])

    def exchange(self, pushes: Sequence[np.ndarray], take: Callable[[np.ndarray], Any] = np.array) -> list[Any]:
        """One device's exchange: block by block, under its mutex, ``take(merge(block, push))``.

        ``take`` makes what the device keeps of the merge's answer (a copy)
        while the block is still held.
        """
        assert self.merge is not None, "a center made without a merge takes no push"
        out = []
        for i, pushed in enumerate(pushes):
            with self.locked(i):
                block = self.blocks[i]
                out.append(take(_as_block(self.merge(block, pushed), block, self.merge)))
        return out

    def claim(self, limit: int) -> int | None:
        """The next unit of work below ``limit`` (the counter moves on by one), or None."""
        with self._held(self._claim_lock):
            unit = int(self.words[self.CLAIMED])
            if unit >= limit:
                return None
            self.words[self.CLAIMED] = unit + 1
            return unit

    def start_claims_at(self, unit: int) -> None:
        """The creator, before any device claims: the first unit claimed is ``unit``."""
        self.words[self.CLAIMED] = unit

    def values(self) -> list[np.ndarray]:
        """A copy of every block, each read under its mutex."""
        out = []
        for i, block in enumerate(self.blocks):
            with self.locked(i):
                out.append(block.copy())
        return out

    def close(self) -> None:
        """Drop this mapping; the creator also removes the segment's name."""
        self.blocks = []
        self.words = np.zeros(0, np.int64)      # (not a view: the mapping goes)
        if self._owner:
            self.segment.unlink()
        self.segment.release()


def _as_block(answer: Any, block: np.ndarray, merge: Merge) -> np.ndarray:
    """A merge's ``answer`` as what every device takes back: an array of ``block``'s shape and
    dtype, wherever the push came from (node 0's devices take it here, the other nodes' through
    the center server).

    Raises
    ------
    ValueError
        ``answer`` is not of the block's shape, or not numbers.
    """
    value = np.asarray(answer)
    if value.shape != block.shape or value.dtype.kind not in "biufc":
        raise ValueError(f"the rule's merge {getattr(merge, '__qualname__', merge)} answered "
                         f"{type(answer).__name__} of shape {value.shape} and dtype {value.dtype} for "
                         f"a center block of shape {block.shape} and dtype {block.dtype}: merge(center, "
                         f"pushed) returns what the device takes back, an array of the block's shape "
                         f"(the block, or a pull)")
    return value.astype(block.dtype, copy=False)
