"""Moving arrays and small Python objects through shared memory without per-call pickling.

Arrays are packed as an int64 header (count, then per array: dtype code, ndim,
shape, byte offset, byte size) followed by their bytes, 64-byte aligned.
Pickling is kept for the cold paths only: shipping functions, errors, values
of shared variables.
"""

import pickle

import numpy as np

__all__ = ["DTYPES", "dtype_code", "aligned_empty", "packed_nbytes", "pack_arrays", "unpack_arrays",
           "write_pickle", "write_bytes", "read_pickle"]

DTYPES = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                "uint32", "uint64", "float16", "float32", "float64",
                                "complex64", "complex128")]
_CODES = {dt: i for i, dt in enumerate(DTYPES)}
_ALIGN = 64


def dtype_code(dtype):
    """Return the small integer that stands for ``dtype`` in the control block."""
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported by synkhronos; "
                        f"use one of {[str(d) for d in DTYPES]}") from None


def _align(n):
    return -(-n // _ALIGN) * _ALIGN


def aligned_empty(shape, dtype):
    """A new numpy array whose data starts on a 64-byte boundary.

    XLA's CPU client adopts such a buffer as a device array without copying it
    (``jax.device_put``); an unaligned one it copies at about a quarter of memory
    bandwidth (40 MB: 0.1 ms vs 23 ms, measured here).

    Examples
    --------
    >>> aligned_empty((3, 4), "float32").ctypes.data % 64
    0
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _layout(arrays):
    header_items = 1 + sum(4 + a.ndim for a in arrays)
    offset = _align(8 * header_items)
    offsets = []
    for a in arrays:
        offsets.append(offset)
        offset = _align(offset + a.nbytes)
    return header_items, offsets, offset


def packed_nbytes(arrays):
    """Bytes needed to pack ``arrays``."""
    return _layout(arrays)[2]


def pack_arrays(buffer, arrays):
    """Write ``arrays`` (numpy) into ``buffer`` (a writable mmap); return bytes used."""
    header_items, offsets, total = _layout(arrays)
    header = [len(arrays)]
    for a, off in zip(arrays, offsets):
        header += [dtype_code(a.dtype), a.ndim, *a.shape, off, a.nbytes]
    np.frombuffer(buffer, np.int64, header_items)[:] = header
    for a, off in zip(arrays, offsets):
        np.frombuffer(buffer, a.dtype, a.size, off).reshape(a.shape)[...] = a
    return total


def unpack_arrays(buffer):
    """Return views of the arrays packed in ``buffer`` (copy them before reuse)."""
    count = int(np.frombuffer(buffer, np.int64, 1)[0])
    if count == 0:
        return []
    # one read of the header (it is short), then plain Python ints
    header = np.frombuffer(buffer, np.int64, min(len(buffer) // 8, 1 + count * 36)).tolist()
    arrays, pos = [], 1
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


def write_pickle(growable, obj):
    """Pickle ``obj`` into a GrowableSegment, growing it if needed; return the byte count."""
    return write_bytes(growable, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def write_bytes(growable, blob):
    """Copy ``blob`` into a GrowableSegment, growing it if needed; return the byte count."""
    growable.ensure(len(blob), oversize=1.5)
    growable.segment.mm[:len(blob)] = blob
    return len(blob)


def read_pickle(segment, nbytes):
    return pickle.loads(segment.mm[:nbytes])
