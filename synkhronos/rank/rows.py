"""Gathering a rank's rows of a batch from a table in shared memory, block by block."""

import numpy as np

__all__ = ["gather_rows", "GATHER_BLOCK"]

#: rows gathered per block by :func:`gather_rows` (the block stays in the L2 cache)
GATHER_BLOCK = 256
#: rows at least this large get their first element touched first (smaller rows share pages)
TOUCH_MIN_ROW_BYTES = 1024


def gather_rows(table, indices, out):
    """``out[i] = table[indices[i]]`` for validated ``indices`` (no bounds checks).

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
