"""A validated batch of rows (built from the user's ``batch`` here), and how a batch's rows are
split over the ranks.

Rows of a batch are split into ``n`` near-equal contiguous chunks, rank ``r``
taking positions ``[T*r//n, T*(r+1)//n)`` of the ``T`` batch positions; each
rank then splits its chunk the same way into ``num_slices`` slices.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Batch", "batch_from_spec", "chunk", "split"]


def chunk(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Positions ``[a, b)`` of chunk ``index`` when ``[lo, hi)`` is split into ``parts``.

    Plain integer arithmetic: this runs on every call in every process.
    """
    size = hi - lo
    return lo + size * index // parts, lo + size * (index + 1) // parts


def split(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Every chunk's positions ``[a, b)`` when ``total`` positions are split into ``parts``.

    Examples
    --------
    >>> split(7, 3)
    ((0, 2), (2, 4), (4, 7))
    """
    return tuple(chunk(0, total, parts, index) for index in range(parts))


@dataclass
class Batch:
    """A validated batch: either the row range ``[start, stop)`` or explicit ``indices``."""

    total: int
    start: int = 0
    stop: int = 0
    indices: np.ndarray | None = None
    index_offset: int = 0   # where ``indices`` start in the shared index segment
    _bounds: tuple[int, int] | None = field(default=None, repr=False, compare=False)   # see _index_bounds

    @property
    def is_range(self) -> bool:
        return self.indices is None

    def lowest(self) -> int:
        if self.total == 0:
            return 0
        return self.start if self.is_range else self._index_bounds()[0]

    def highest(self) -> int:
        """The largest row index the batch touches (-1 if empty)."""
        if self.total == 0:
            return -1
        return self.stop - 1 if self.is_range else self._index_bounds()[1]

    def _index_bounds(self) -> tuple[int, int]:
        """(lowest, highest) of the explicit indices, computed once."""
        if self._bounds is None:
            indices = np.asarray(self.indices)
            self._bounds = (int(indices.min()), int(indices.max()))
        return self._bounds


def _as_index_array(batch: list | tuple | np.ndarray) -> np.ndarray:
    idx = np.asarray(batch)
    if idx.size == 0:
        return idx.astype(np.int64).reshape(0)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise TypeError(f"batch as explicit indices must be a 1-D list or array of ints, "
                        f"got {idx.dtype} with shape {idx.shape}")
    if idx.dtype.kind == "u" and idx.dtype.itemsize == 8:
        highest = int(idx.max())
        if highest > np.iinfo(np.int64).max:      # would wrap to a negative number below
            raise IndexError(f"batch index {highest} is out of range (no Data has that many rows)")
    return idx.astype(np.int64, copy=False)


def batch_from_spec(batch: Any, length: int) -> Batch:
    """Turn the user's ``batch`` into a Batch; ``length`` bounds int and open slices."""
    if isinstance(batch, bool):
        raise TypeError("batch must be an int, a slice, or a list/array of indices, not a bool")
    if isinstance(batch, (int, np.integer)):
        n = int(batch)
        if n < 0:
            raise ValueError(f"batch={n}: an int batch is a row count and must be >= 0")
        return Batch(total=n, start=0, stop=n)
    if isinstance(batch, slice):
        if batch.step not in (None, 1):
            raise ValueError(f"batch slice {batch} has a step; use explicit indices "
                             f"(e.g. np.arange(start, stop, step)) instead")
        start = 0 if batch.start is None else operator.index(batch.start)
        stop = length if batch.stop is None else operator.index(batch.stop)
        if start < 0 or stop < 0:
            raise ValueError(f"batch slice {batch} has a negative bound; use non-negative row numbers")
        if stop < start:
            raise ValueError(f"batch slice {batch} has stop < start")
        return Batch(total=stop - start, start=start, stop=stop)
    if isinstance(batch, (list, tuple, np.ndarray)):
        idx = _as_index_array(batch)
        spec = Batch(total=len(idx), indices=idx)
        if spec.lowest() < 0:
            bad = int(idx[np.argmax(idx < 0)])
            raise IndexError(f"batch index {bad} is negative; indices must be row numbers >= 0")
        return spec
    raise TypeError(f"batch must be None, an int, a slice, or a list/array of indices, "
                    f"got {type(batch).__name__}")
