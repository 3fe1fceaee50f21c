"""Moving arrays and small Python objects through shared memory without per-call pickling.

Arrays are packed as an int64 header (count, then per array: dtype code, ndim,
shape, byte offset, byte size) followed by their bytes, 64-byte aligned.
Pickling is kept for the cold paths only: shipping functions, errors, values
of shared variables.
"""

import math
import pickle
import weakref

import numpy as np

__all__ = ["DTYPES", "dtype_code", "aligned_empty", "BufferPool", "packed_nbytes", "pack_arrays", "unpack_arrays",
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
    (``jax.device_put``); an unaligned one it copies, well below memory bandwidth.

    Examples
    --------
    >>> aligned_empty((3, 4), "float32").ctypes.data % 64
    0
    """
    dtype = np.dtype(dtype)
    nbytes = _nbytes(shape, dtype)
    return _aligned_view(np.empty(nbytes + _ALIGN, np.uint8), shape, dtype, nbytes)


def _nbytes(shape, dtype):
    return math.prod(shape) * dtype.itemsize


def _aligned_view(owner, shape, dtype, nbytes):
    """``shape``/``dtype`` view of ``owner`` (uint8, ``nbytes`` + 64 long) from its first 64-byte boundary."""
    start = -owner.ctypes.data % _ALIGN
    return owner[start:start + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Reuses large 64-byte aligned host buffers once nothing else refers to them.

    A buffer handed to the CPU device (see :func:`synkhronos.device_arrays.adopt`) stays
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

    def __init__(self, max_bytes=1 << 30, min_bytes=1 << 20):
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._stores = []        # [uint8 array owning its memory, weak reference to its lease]

    def empty(self, shape, dtype):
        """An aligned array of ``shape``/``dtype`` in a buffer no one else refers to."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        if nbytes < self.min_bytes:
            return aligned_empty(shape, dtype)
        entry = self._free_store(nbytes)
        lease = np.frombuffer(memoryview(entry[0]), np.uint8)
        entry[1] = weakref.ref(lease)
        return _aligned_view(lease, shape, dtype, nbytes)

    def _free_store(self, nbytes):
        for entry in self._stores:
            if not _leased(entry) and nbytes <= entry[0].size - _ALIGN <= 2 * nbytes:
                return entry
        entry = [np.empty(nbytes + _ALIGN, np.uint8), None]
        if self._kept_bytes() + entry[0].size > self.max_bytes:
            self._stores = [e for e in self._stores if _leased(e)]
        if self._kept_bytes() + entry[0].size <= self.max_bytes:
            self._stores.append(entry)
        return entry

    def _kept_bytes(self):
        return sum(store.size for store, _ in self._stores)


def _leased(entry):
    """True while the lease of a pool entry (see :class:`BufferPool`) or a view of it lives."""
    return entry[1] is not None and entry[1]() is not None


def _layout(arrays):
    """(int64 header, byte offset of each array, total bytes) of a packing of ``arrays``.

    Calls repeat a few result signatures (dtype and shape of each output), so
    layouts are kept by signature: packing a scalar result then costs a header
    copy and one write.
    """
    signature = tuple((a.dtype, a.shape) for a in arrays)
    layout = _LAYOUTS.get(signature)
    if layout is None:
        offset = _align(8 * (1 + sum(4 + a.ndim for a in arrays)))
        header, offsets = [len(arrays)], []
        for a in arrays:
            offsets.append(offset)
            header += [dtype_code(a.dtype), a.ndim, *a.shape, offset, a.nbytes]
            offset = _align(offset + a.nbytes)
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        layout = _LAYOUTS[signature] = (np.array(header, np.int64), offsets, offset)
    return layout


_LAYOUTS = {}
_LAYOUTS_KEPT = 256


def packed_nbytes(arrays):
    """Bytes needed to pack ``arrays``."""
    return _layout(arrays)[2]


def pack_arrays(buffer, arrays):
    """Write ``arrays`` (numpy) into ``buffer`` (a writable mmap); return bytes used."""
    header, offsets, total = _layout(arrays)
    np.frombuffer(buffer, np.int64, len(header))[:] = header
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
