"""Moving values between host memory and this process's JAX device.

Every process has exactly one local device. Values from shared memory are
copied once into private, 64-byte aligned host buffers that the CPU client
adopts without another copy (on a GPU, ``device_put`` copies them over).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ..ipc.buffers import BufferPool
from .internals import device_put_bare
from .pinned import PINNED_MIN_BYTES, pinned_buffers
from .values import device_face, host_face, store, stored

if TYPE_CHECKING:
    import jax

__all__ = ["to_device", "adopt", "private_empty", "copy_large", "place_on_device",
           "wait_until_computed", "host_face", "device_face", "COPY_PIECE_BYTES", "arguments_on_device"]


def wait_until_computed(values: Any) -> None:
    """Block until every JAX array in ``values`` (any nesting of lists, tuples, dicts) is computed.

    Other leaves (numpy arrays, numbers) are ready already.
    """
    import jax
    for leaf in jax.tree_util.tree_leaves(values):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()


def place_on_device(shared_vars: Iterable[Any]) -> None:
    """Keep the host (numpy) values of tensor ``shared_vars`` as arrays on this process's device.

    A jitted function is compiled for its arguments' shardings: a numpy value
    has none, a device array (what every update and collective stores) has
    this device's, so a function first called on numpy values compiled a
    second time on its second call (a ResNet step: seconds). Placing the values
    first makes the first call's shardings the lasting ones.
    """
    from pytensor.tensor.type import TensorType
    for var in shared_vars:
        value = stored(var)
        if isinstance(value, (np.ndarray, np.generic)) and isinstance(var.type, TensorType):
            store(var, to_device(np.asarray(value, var.type.dtype)))


_HOST_POOL = BufferPool()


def to_device(host: ArrayLike) -> jax.Array:
    """A device array with the values of ``host``, sharing no memory with it.

    ``host`` may be reused as soon as this returns (a shared-memory slot, say).
    The values are copied once, into a private 64-byte aligned buffer, which the
    CPU client then adopts without a second copy; on a GPU, ``device_put`` copies
    that buffer to the device.

    Parameters
    ----------
    host : array_like

    Returns
    -------
    jax.Array
        On this process's (only) local device.
    """
    host = np.asarray(host)
    private = private_empty(host.shape, host.dtype)
    copy_large(private, host)
    return adopt(private)


#: :func:`copy_large` copies arrays larger than this in pieces of this size
COPY_PIECE_BYTES = 16 << 20


def copy_large(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for arrays of one shape; large ones in pieces of ``COPY_PIECE_BYTES``.

    glibc copies very large blocks another way (non-temporal stores, several
    pages at a time), which from shared memory into a private buffer runs far
    slower than the same copy in pieces.
    """
    if dst.nbytes <= COPY_PIECE_BYTES or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        np.copyto(dst, src)
        return
    d, s = dst.reshape(-1), src.reshape(-1)
    step = max(1, COPY_PIECE_BYTES // dst.itemsize)
    for a in range(0, d.size, step):
        d[a:a + step] = s[a:a + step]


def private_empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A 64-byte aligned host array for :func:`adopt`, reusing a large buffer no device array holds
    (on a device with pinned host memory, a large one is pinned: see :mod:`.pinned`)."""
    pinned = pinned_buffers()
    made = pinned.empty(shape, dtype) if pinned is not None else None
    return made if made is not None else _HOST_POOL.empty(shape, dtype)


def arguments_on_device(values: Iterable[Any]) -> list[Any]:
    """``values`` with every numpy array put on this process's device, explicitly.

    What a jitted call would transfer implicitly, transferred by the caller
    (on CPU an aligned array is taken without a copy, as the call would take
    it): the caller then waits for the computation before the arrays may
    change (``jax.transfer_guard("disallow")`` allows these transfers).
    """
    return [adopt(v) if type(v) is np.ndarray else v for v in values]


def adopt(private: np.ndarray) -> jax.Array:
    """Hand ``private`` (from :func:`private_empty`, never written again) to the device.

    On CPU the device array is a view of ``private`` and keeps it alive.
    """
    import jax
    pinned = pinned_buffers()
    if pinned is not None and private.nbytes >= PINNED_MIN_BYTES:
        sent = pinned.send(private)
        if sent is not None:
            return sent
    device = jax.local_devices()[0]
    adopted = device_put_bare(private, device)
    return adopted if adopted is not None else jax.device_put(private, device)
