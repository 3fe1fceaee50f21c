"""Where a collective's values lie in one flat buffer of the shared-memory collectives.

Every value starts on a 64-byte line (no two ranks write one cache line);
an all-reduce splits the flat range into one chunk per rank, on line bounds.

Examples
--------
>>> import numpy as np
>>> layout = FlatLayout.of([np.ones(3), np.zeros((2, 2))])
>>> layout.offsets, layout.total, layout.chunk_bounds(2)
([0, 8], 16, [0, 8, 16])
>>> [(len(part), a, b) for part, a, b in layout.pieces(2, 10)]
[(1, 2, 3), (2, 8, 10)]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...ipc.buffers import round_up
from ...platform.device_arrays import adopt

__all__ = ["FlatLayout"]


@dataclass
class FlatLayout:
    """Host views of a collective's values and their aligned offsets in one flat buffer."""

    hosts: list[np.ndarray]
    offsets: list[int]
    total: int
    dtype: np.dtype

    @classmethod
    def of(cls, values: Sequence[Any]) -> FlatLayout:
        """The layout of ``values`` (host or CPU device arrays of one dtype, viewed, not copied)."""
        hosts = [np.asarray(v) for v in values]
        dtype = hosts[0].dtype if hosts else np.dtype(np.float32)
        per_line = max(1, 64 // dtype.itemsize)
        offsets: list[int] = []
        end = 0
        for h in hosts:
            offsets.append(end)
            end = round_up(end + h.size, per_line)
        return cls(hosts, offsets, end, dtype)

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[np.ndarray, int, int]]:
        """(flat part of a value, start, stop) for every value overlapping flat range [lo, hi)."""
        for h, a in zip(self.hosts, self.offsets):
            start, stop = max(a, lo), min(a + h.size, hi)
            if start < stop:
                yield h.reshape(-1)[start - a:stop - a], start, stop

    def chunk_bounds(self, n_ranks: int) -> list[int]:
        """Where each rank's chunk of the flat range starts (on line bounds), then the end."""
        per_line = max(1, 64 // self.dtype.itemsize)
        return [self.total * q // n_ranks // per_line * per_line for q in range(n_ranks)] + [self.total]

    def publish(self, slot: np.ndarray) -> None:
        """Copy every value into its place in ``slot``."""
        for part, a, b in self.pieces(0, len(slot)):
            slot[a:b] = part

    def device_parts(self, flat: np.ndarray) -> list[Any]:
        """Each value's part of the flat result ``flat``, adopted by the device (no copy)."""
        return [adopt(flat[a:a + h.size].reshape(h.shape)) for h, a in zip(self.hosts, self.offsets)]

    def host_parts(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each value's part of the flat result ``flat``, as host views."""
        return [flat[a:a + h.size].reshape(h.shape) for h, a in zip(self.hosts, self.offsets)]
