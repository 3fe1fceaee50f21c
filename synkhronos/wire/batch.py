"""A validated batch of rows, and how a batch's rows are split over the ranks.

Rows of a batch are split into ``n`` near-equal contiguous chunks, rank ``r``
taking positions ``[T*r//n, T*(r+1)//n)`` of the ``T`` batch positions; each
rank then splits its chunk the same way into ``num_slices`` slices.
"""

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Batch", "chunk"]


def chunk(lo, hi, parts, index):
    """Positions ``[a, b)`` of chunk ``index`` when ``[lo, hi)`` is split into ``parts``.

    Plain integer arithmetic: this runs on every call in every process.
    """
    size = hi - lo
    return lo + size * index // parts, lo + size * (index + 1) // parts


@dataclass
class Batch:
    """A validated batch: either the row range ``[start, stop)`` or explicit ``indices``."""

    total: int
    start: int = 0
    stop: int = 0
    indices: np.ndarray | None = None
    index_offset: int = 0   # where ``indices`` start in the shared index segment
    _bounds: tuple | None = field(default=None, repr=False, compare=False)   # see _index_bounds

    @property
    def is_range(self):
        return self.indices is None

    def lowest(self):
        if self.total == 0:
            return 0
        return self.start if self.is_range else self._index_bounds()[0]

    def highest(self):
        """The largest row index the batch touches (-1 if empty)."""
        if self.total == 0:
            return -1
        return self.stop - 1 if self.is_range else self._index_bounds()[1]

    def _index_bounds(self):
        """(lowest, highest) of the explicit indices, computed once."""
        if self._bounds is None:
            indices = np.asarray(self.indices)
            self._bounds = (int(indices.min()), int(indices.max()))
        return self._bounds
