"""Moving arrays and small Python objects through shared memory without per-call pickling.

Arrays are packed as an int64 header (count, then per array: dtype code, ndim,
shape, byte offset, byte size) followed by their bytes, 64-byte aligned.
Pickling is kept for the cold paths only: shipping functions, errors, values
of shared variables.
"""

from __future__ import annotations

import functools
import math
import mmap
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .buffers import round_up
from .segments import GrowableSegment, Segment

__all__ = ["DTYPES", "dtype_code", "packed_nbytes", "pack_arrays", "unpack_arrays", "write_pickle",
           "write_bytes", "read_pickle"]

DTYPES = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                "uint32", "uint64", "float16", "float32", "float64",
                                "complex64", "complex128")]
_CODES = {dt: i for i, dt in enumerate(DTYPES)}
_ALIGN = 64


def dtype_code(dtype: npt.DTypeLike) -> int:
    """Return the small integer that stands for ``dtype`` in the control block."""
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported by synkhronos; "
                        f"use one of {[str(d) for d in DTYPES]}") from None


def _layout(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int], int]:
    """(int64 header, byte offset of each array, total bytes) of a packing of ``arrays``.

    Calls repeat a few result signatures (dtype and shape of each output), so
    layouts are kept by signature: packing a scalar result then costs a header
    copy and one write.
    """
    return _layout_of(tuple((a.dtype, a.shape) for a in arrays))


@functools.lru_cache(maxsize=256)
def _layout_of(signature: tuple[tuple[np.dtype, tuple[int, ...]], ...]) -> tuple[np.ndarray, list[int], int]:
    """:func:`_layout` of arrays of ``signature`` ((dtype, shape) each); the header is read only."""
    offset = round_up(8 * (1 + sum(4 + len(shape) for _, shape in signature)))
    header: list[int] = [len(signature)]
    offsets: list[int] = []
    for dtype, shape in signature:
        nbytes = math.prod(shape) * dtype.itemsize
        offsets.append(offset)
        header += [dtype_code(dtype), len(shape), *shape, offset, nbytes]
        offset = round_up(offset + nbytes)
    return np.array(header, np.int64), offsets, offset


def packed_nbytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes needed to pack ``arrays``."""
    return _layout(arrays)[2]


def pack_arrays(buffer: mmap.mmap, arrays: Sequence[np.ndarray]) -> int:
    """Write ``arrays`` (numpy) into ``buffer`` (a writable mmap); return bytes used."""
    header, offsets, total = _layout(arrays)
    np.frombuffer(buffer, np.int64, len(header))[:] = header
    for a, off in zip(arrays, offsets):
        np.frombuffer(buffer, a.dtype, a.size, off).reshape(a.shape)[...] = a
    return total


def unpack_arrays(buffer: mmap.mmap) -> list[np.ndarray]:
    """Return views of the arrays packed in ``buffer`` (copy them before reuse)."""
    count = int(np.frombuffer(buffer, np.int64, 1)[0])
    if count == 0:
        return []
    # one read of the header (it is short), then plain Python ints
    header = np.frombuffer(buffer, np.int64, min(len(buffer) // 8, 1 + count * 36)).tolist()
    arrays: list[np.ndarray] = []
    pos = 1
    for _ in range(count):
        code, ndim = header[pos], header[pos + 1]
        shape = tuple(header[pos + 2:pos + 2 + ndim])
        off = header[pos + 2 + ndim]
        size = 1
        for s in shape:
            size *= s
        arrays.append(np.frombuffer(buffer, DTYPES[code], size, off).reshape(shape))
        pos += 4 + ndim
    return arrays


def write_pickle(growable: GrowableSegment, obj: object) -> int:
    """Pickle ``obj`` into a GrowableSegment, growing it if needed; return the byte count."""
    return write_bytes(growable, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def write_bytes(growable: GrowableSegment, blob: bytes) -> int:
    """Copy ``blob`` into a GrowableSegment, growing it if needed; return the byte count."""
    growable.ensure(len(blob), oversize=1.5)
    growable.made.mm[:len(blob)] = blob
    return len(blob)


def read_pickle(segment: Segment, nbytes: int) -> Any:
    return pickle.loads(segment.mm[:nbytes])
