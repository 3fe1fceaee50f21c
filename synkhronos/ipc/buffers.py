"""Host buffers aligned to 64 bytes, and a pool that reuses large ones once nothing holds them.

A buffer the CPU device adopts must be 64-byte aligned; a large one is worth
reusing (fresh pages cost their first touch) once no device array or view of it
is left (:class:`BufferPool`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["aligned_empty", "BufferPool", "round_up", "ceil_div"]

_ALIGN = 64


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, for whole numbers.

    Examples
    --------
    >>> ceil_div(10, 4), ceil_div(8, 4)
    (3, 2)
    """
    return -(-n // d)


def round_up(n: int, multiple: int = _ALIGN) -> int:
    """The least multiple of ``multiple`` that is ``n`` or more (64: a cache line).

    Examples
    --------
    >>> round_up(65), round_up(4097, 4096)
    (128, 8192)
    """
    return ceil_div(n, multiple) * multiple


def aligned_empty(shape: Sequence[int], dtype: npt.DTypeLike) -> np.ndarray:
    """A new numpy array whose data starts on a 64-byte boundary.

    XLA's CPU client adopts such a buffer as a device array without copying it
    (``jax.device_put``); an unaligned one it copies, well below memory bandwidth.

    Examples
    --------
    >>> aligned_empty((3, 4), "float32").ctypes.data % 64
    0
    """
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    return _aligned_view(np.empty(nbytes + _ALIGN, np.uint8), shape, dtype, nbytes)


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _aligned_view(owner: np.ndarray, shape: Sequence[int], dtype: np.dtype, nbytes: int) -> np.ndarray:
    """``shape``/``dtype`` view of ``owner`` (uint8, ``nbytes`` + 64 long) from its first 64-byte boundary."""
    start = -owner.ctypes.data % _ALIGN
    return owner[start:start + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Reuses large 64-byte aligned host buffers once nothing else refers to them.

    A buffer handed to the CPU device (see :func:`synkhronos.platform.device_arrays.adopt`) stays
    referenced by its device array; when that array dies the buffer is free
    again. A fresh large buffer costs a page fault per 4 KB on first touch,
    which would dominate a collective that runs near memory bandwidth.

    Each loan of a buffer is a *lease*: an array made with ``np.frombuffer``
    over the buffer. numpy points every view derived from an array at the
    first array up the chain that sits on a non-numpy buffer, so every view
    of the loan (a slice, a reshape, a device array adopting it) keeps the
    lease alive, and the buffer is free exactly when the lease has died: a
    weak reference tells, with no reliance on reference counts.

    Parameters
    ----------
    max_bytes : int
        Buffers kept for reuse, in bytes; beyond it new buffers are not kept.
    min_bytes : int
        Smaller buffers come from :func:`aligned_empty` (malloc reuses those itself).
    """

    def __init__(self, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20) -> None:
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._stores: list[list[Any]] = []        # [uint8 array owning its memory, weak reference to its lease]

    def empty(self, shape: Sequence[int], dtype: npt.DTypeLike) -> np.ndarray:
        """An aligned array of ``shape``/``dtype`` in a buffer no one else refers to."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        if nbytes < self.min_bytes:
            return aligned_empty(shape, dtype)
        entry = self._free_store(nbytes)
        lease = np.frombuffer(memoryview(entry[0]), np.uint8)
        entry[1] = weakref.ref(lease)
        return _aligned_view(lease, shape, dtype, nbytes)

    def _free_store(self, nbytes: int) -> list[Any]:
        for entry in self._stores:
            if not _leased(entry) and nbytes <= entry[0].size - _ALIGN <= 2 * nbytes:
                return entry
        entry = [np.empty(nbytes + _ALIGN, np.uint8), None]
        if self._kept_bytes() + entry[0].size > self.max_bytes:
            self._stores = [e for e in self._stores if _leased(e)]
        if self._kept_bytes() + entry[0].size <= self.max_bytes:
            self._stores.append(entry)
        return entry

    def _kept_bytes(self) -> int:
        return sum(store.size for store, _ in self._stores)


def _leased(entry: list[Any]) -> bool:
    """True while the lease of a pool entry (see :class:`BufferPool`) or a view of it lives."""
    return entry[1] is not None and entry[1]() is not None
