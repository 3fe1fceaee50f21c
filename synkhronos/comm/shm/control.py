"""The shared-memory collectives' own control segment: the master's choices and the semaphores.

Layout (one segment ``<prefix>_cmctl``, made by the master's :class:`ShmComm`)::

    words    int64[8]         buffer generation, shared result region, all-reduce path
    barrier  sem_t[n]         rank -> rank: the all-to-all barrier
    filled   sem_t[n, n]      rank r -> rank q: a chunk of the pipelined all-reduce is ready
    freed    sem_t[n, n]      rank q -> rank r: that chunk's ring slot may be written again

The master writes the words before it posts the collective's command, so every
rank reads them after its go-ahead.
"""

from __future__ import annotations

import numpy as np

from ...ipc.segments import Segment
from ...ipc.semaphores import SEMAPHORE_BYTES, semaphores_in

__all__ = ["ShmControl"]

_WORDS = 8


class ShmControl:
    """The words and semaphores of the shared-memory collectives of one runtime.

    Parameters
    ----------
    prefix : str
        The runtime's segment prefix.
    n_ranks : int
    create : bool
        Create (the master) or attach (a worker).
    """

    BUFFER_GEN, RESULT_REGION, REDUCE_PATH = range(3)

    def __init__(self, prefix: str, n_ranks: int, create: bool) -> None:
        n_sems = n_ranks + 2 * n_ranks * n_ranks
        self.segment = Segment(f"{prefix}_cmctl", SEMAPHORE_BYTES * (1 + n_sems), create=create)
        self.words = self.segment.array(np.int64, (_WORDS,))
        sems = semaphores_in(self.segment, SEMAPHORE_BYTES, n_sems, create)
        self.barrier, pairs = sems[:n_ranks], sems[n_ranks:]
        self.filled = [pairs[r * n_ranks:(r + 1) * n_ranks] for r in range(n_ranks)]
        pairs = pairs[n_ranks * n_ranks:]
        self.freed = [pairs[r * n_ranks:(r + 1) * n_ranks] for r in range(n_ranks)]
        self._owner = create

    def release(self) -> None:
        """The master unlinks the segment; a worker drops its mapping with its last view."""
        if self._owner:
            self.segment.unlink()
