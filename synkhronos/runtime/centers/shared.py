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

import math
from contextlib import contextmanager

import numpy as np

from ...ipc.buffers import round_up
from ...ipc.segments import Segment
from ...ipc.semaphores import SEMAPHORE_BYTES, semaphores_in
from ...platform.values import stored

__all__ = ["Center"]

_WORDS = 8
_ALIGN = 64


def _layout(shapes, dtypes):
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

    def __init__(self, name, shapes, dtypes, initial=None, merge=None, check=lambda: None):
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
        if create:
            for block, value in zip(self.blocks, initial):
                block[...] = value
            for lock in [self._claim_lock, *self._locks]:
                lock.post()            # a mutex starts free

    @classmethod
    def of(cls, name, params, create, merge=None, check=lambda: None):
        """The center of the shared variables ``params``, one block each, shaped like their values.

        The creator (``create=True``, the master) fills it with their values now.
        """
        values = [np.asarray(stored(p)) for p in params]
        return cls(name, [v.shape for v in values], [p.type.dtype for p in params],
                   initial=values if create else None, merge=merge, check=check)

    @contextmanager
    def _held(self, lock):
        lock.wait(self.check, spin=20e-6, slice_=0.1)
        try:
            yield
        finally:
            lock.post()

    def locked(self, i):
        """Hold block ``i`` (``with center.locked(i): ...``) while reading or writing it."""
        return self._held(self._locks[i])

    def exchange(self, pushes, take=np.array):
        """One device's exchange: block by block, under its mutex, ``take(merge(block, push))``.

        ``take`` makes what the device keeps of the merge's answer (a copy)
        while the block is still held.
        """
        out = []
        for i, pushed in enumerate(pushes):
            with self.locked(i):
                out.append(take(self.merge(self.blocks[i], pushed)))
        return out

    def claim(self, limit):
        """The next unit of work below ``limit`` (the counter moves on by one), or None."""
        with self._held(self._claim_lock):
            unit = int(self.words[self.CLAIMED])
            if unit >= limit:
                return None
            self.words[self.CLAIMED] = unit + 1
            return unit

    def start_claims_at(self, unit):
        """The creator, before any device claims: the first unit claimed is ``unit``."""
        self.words[self.CLAIMED] = unit

    def values(self):
        """A copy of every block, each read under its mutex."""
        out = []
        for i, block in enumerate(self.blocks):
            with self.locked(i):
                out.append(block.copy())
        return out

    def close(self):
        """Drop this mapping; the creator also removes the segment's name."""
        self.blocks = []
        self.words = np.zeros(0, np.int64)      # (not a view: the mapping goes)
        if self._owner:
            self.segment.unlink()
        self.segment.release()
