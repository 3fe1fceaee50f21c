"""Moving arrays and small Python objects through shared memory without per-call pickling.

Arrays are packed as an int64 header (count, then per array: dtype code, ndim,
shape, byte offset, byte size) followed by their bytes, 64-byte aligned.
Pickling is kept for the cold paths only: shipping functions, errors, values
of shared variables.
"""

import pickle

import numpy as np

from .buffers import round_up

__all__ = ["DTYPES", "dtype_code", "packed_nbytes", "pack_arrays", "unpack_arrays", "write_pickle",
           "write_bytes", "read_pickle"]

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


def _layout(arrays):
    """(int64 header, byte offset of each array, total bytes) of a packing of ``arrays``.

    Calls repeat a few result signatures (dtype and shape of each output), so
    layouts are kept by signature: packing a scalar result then costs a header
    copy and one write.
    """
    signature = tuple((a.dtype, a.shape) for a in arrays)
    layout = _LAYOUTS.get(signature)
    if layout is None:
        offset = round_up(8 * (1 + sum(4 + a.ndim for a in arrays)))
        header, offsets = [len(arrays)], []
        for a in arrays:
            offsets.append(offset)
            header += [dtype_code(a.dtype), a.ndim, *a.shape, offset, a.nbytes]
            offset = round_up(offset + a.nbytes)
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
