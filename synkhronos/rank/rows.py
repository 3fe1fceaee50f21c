"""Gathering a rank's rows of a batch from a table in shared memory, block by block."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["gather_rows", "GATHER_BLOCK", "set_gather_threads", "THREADED_MIN_BYTES", "MAX_GATHER_THREADS"]

#: rows gathered per block by :func:`gather_rows` (the block stays in the L2 cache)
GATHER_BLOCK = 256
#: rows at least this large get their first element touched first (smaller rows share pages)
TOUCH_MIN_ROW_BYTES = 1024


#: a gather of at least this many bytes is split over the rank's threads (numpy copies rows
#: without holding Python's lock, so the threads gather at once)
THREADED_MIN_BYTES = 4 << 20
#: the most threads one rank gathers with
MAX_GATHER_THREADS = 8


class _Gatherers:
    """The threads a rank gathers large batches with: its share of the cores, at most eight."""

    def __init__(self) -> None:
        self.threads = 1
        self.pool: ThreadPoolExecutor | None = None

    def set(self, threads: int) -> None:
        threads = max(1, min(int(threads), MAX_GATHER_THREADS))
        if threads != self.threads and self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None
        self.threads = threads

    def executor(self) -> ThreadPoolExecutor:
        if self.pool is None:
            # marked as synkhronos's own: they never read a user's shared variables
            self.pool = ThreadPoolExecutor(self.threads, "synk-gather", initializer=_mark_own)
        return self.pool


def _mark_own() -> None:
    threading.current_thread()._synkhronos_own = True  # type: ignore[attr-defined]


_gatherers = _Gatherers()


def set_gather_threads(threads: int) -> None:
    """Gather large batches with ``threads`` threads (this rank's share of the cores; 1: alone)."""
    _gatherers.set(threads)


def gather_rows(table: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = table[indices[i]]`` for validated ``indices`` (no bounds checks).

    A gather of :data:`THREADED_MIN_BYTES` or more is split over the rank's
    gathering threads (:func:`set_gather_threads`).

    Gathering shuffled rows is bound by memory latency: one ``np.take`` copies
    row after row, and each row starts with a TLB miss and a cache miss that
    the copy of the row before cannot overlap. For large rows the gathering
    runs in blocks of ``GATHER_BLOCK`` rows, each first touching one element
    of every row in the block (independent loads, whose misses overlap), then
    copying the rows, now starting in cache with their pages translated, which
    shortens the gathering of large rows from a large table.

    Examples
    --------
    >>> table = np.arange(12.).reshape(6, 2)
    >>> gather_rows(table, np.array([4, 0, 4]), np.empty((3, 2)))
    array([[8., 9.],
           [0., 1.],
           [8., 9.]])
    """
    n, threads = len(indices), _gatherers.threads
    if threads > 1 and out.nbytes >= THREADED_MIN_BYTES and n >= 2 * threads:
        bounds = np.linspace(0, n, threads + 1).astype(int)
        parts = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        for done in _gatherers.executor().map(
                lambda ab: _gather(table, indices[ab[0]:ab[1]], out[ab[0]:ab[1]]), parts):
            del done
        return out
    return _gather(table, indices, out)


def _gather(table: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`gather_rows` in this thread."""
    n = len(indices)
    if table.ndim < 2 or table[:1].nbytes < TOUCH_MIN_ROW_BYTES or n <= GATHER_BLOCK \
            or not table.flags.c_contiguous:
        # mode="clip": validated indices; with out=, numpy's default "raise" gathers into a
        # temporary first (several times slower)
        return np.take(table, indices, axis=0, mode="clip", out=out)
    firsts = table.reshape(len(table), -1)[:, 0]
    for a in range(0, n, GATHER_BLOCK):
        block = indices[a:a + GATHER_BLOCK]
        firsts[block]
        np.take(table, block, axis=0, mode="clip", out=out[a:a + GATHER_BLOCK])
    return out
