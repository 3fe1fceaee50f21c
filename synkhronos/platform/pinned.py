"""Page-locked host buffers that rows are gathered into and sent to a GPU from.

A GPU copies from page-locked ("pinned") host memory by DMA, at several times
the rate it copies from ordinary (pageable) memory, which the driver first
stages through a pinned buffer of its own. JAX allocates pinned memory as
arrays of the ``pinned_host`` memory kind. :class:`PinnedBuffers` keeps a few
of them per shape, hands out a writeable numpy face of one (the caller gathers
rows into it), and sends it to the device (``jax.device_put`` between memory
kinds: one asynchronous DMA).

A buffer is written again only once nothing holds its face and its last
transfer has finished (the device array sent from it, which the buffer holds,
is ready): a JAX array is otherwise immutable, and this is the one place that
writes into one, under those two conditions.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from .internals import jax_backend_exists

__all__ = ["PinnedBuffers", "use_pinned", "pinned_buffers", "PINNED_MIN_BYTES"]

#: smaller host arrays go the ordinary way (a pinned transfer pays off on megabytes)
PINNED_MIN_BYTES = 1 << 20
#: buffers kept per shape (a step's rows in flight, the next step's being gathered, one spare)
SLOTS_PER_SHAPE = 3


class _Slot:
    """One pinned host array, the lease on its face, and the last device array sent from it."""

    __slots__ = ("host", "address", "nbytes", "lease", "sent")

    def __init__(self, host: Any) -> None:
        self.host = host
        self.address = host.unsafe_buffer_pointer()
        self.nbytes = host.nbytes
        self.lease: Any = None            # weak reference to the ctypes memory of the face handed out
        # the device array sent from it, held: a dropped array's transfer may still be in flight
        self.sent: Any = None

    def free(self) -> bool:
        if self.lease is not None and self.lease() is not None:
            return False
        sent = self.sent
        # (a deleted array was donated to a program, which ran after its transfer; rows never are)
        return sent is None or sent.is_deleted() or sent.is_ready()


class PinnedBuffers:
    """Pinned host buffers of one device, reused per shape (see the module notes).

    Parameters
    ----------
    device : jax.Device
    max_bytes : int
        Pinned memory kept in all; past it, :meth:`empty` returns None.

    Examples
    --------
    >>> import jax
    >>> buffers = PinnedBuffers(jax.devices()[0])
    >>> rows = buffers.empty((512, 1024), "float32")
    >>> rows[:] = 1.0
    >>> sent = buffers.send(rows)
    >>> float(sent.sum()), sent.sharding.memory_kind
    (524288.0, 'device')
    """

    def __init__(self, device: Any, max_bytes: int = 512 << 20) -> None:
        import jax
        self._on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self._on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self._slots: dict = {}
        self._by_address: dict = {}
        self._bytes, self._max = 0, max_bytes

    @property
    def kept_bytes(self) -> int:
        """The pinned memory this process keeps, in bytes."""
        return self._bytes

    def empty(self, shape: tuple, dtype: Any) -> np.ndarray | None:
        """A writeable numpy array over a free pinned buffer of ``shape``/``dtype``, or None (too
        small to pay off, or the pinned memory kept is full)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < PINNED_MIN_BYTES:
            return None
        key = (tuple(shape), dtype.str)
        slots = self._slots.setdefault(key, [])
        slot = next((s for s in slots if s.free()), None)
        if slot is None:
            if len(slots) >= SLOTS_PER_SHAPE or self._bytes + nbytes > self._max:
                return None
            slot = self._new_slot(shape, dtype)
            slots.append(slot)
        memory = (ctypes.c_char * slot.nbytes).from_address(slot.address)
        slot.lease = weakref.ref(memory)
        return np.ndarray(shape, dtype, buffer=memory)

    def _new_slot(self, shape: tuple, dtype: np.dtype) -> _Slot:
        import jax
        slot = _Slot(jax.device_put(np.zeros(shape, dtype), self._on_host).block_until_ready())
        self._by_address[slot.address] = slot
        self._bytes += slot.nbytes
        return slot

    def send(self, face: np.ndarray) -> Any:
        """The device array of ``face`` (from :meth:`empty`, whole), sent by one asynchronous DMA;
        None if ``face`` is not one."""
        slot = self._by_address.get(face.ctypes.data)
        if slot is None or face.nbytes != slot.nbytes:
            return None
        import jax
        sent = slot.sent = jax.device_put(slot.host, self._on_device)
        return sent


#: [whether to use pinned buffers, the PinnedBuffers made at first use (or False: none here)]
_pinned: list = [False, None]


def use_pinned(on: bool) -> None:
    """Gather large host rows into pinned buffers of this process's device and send them from
    there (see :mod:`.pinned`). Set at ``fork()`` where values stay device arrays (a GPU, or
    ``SYNK_HOST_FACES=0``); made at first use, if the device has ``pinned_host`` memory."""
    _pinned[:] = [on, None]


def pinned_buffers() -> PinnedBuffers | None:
    """This process's :class:`PinnedBuffers`, or None (see :func:`use_pinned`)."""
    made = _pinned[1]
    if made is None and _pinned[0]:
        if not jax_backend_exists():
            return None         # (outside a runtime's JAX backend: never make one here)
        import jax
        device = jax.local_devices()[0]
        kinds = {m.kind for m in device.addressable_memories()}
        made = _pinned[1] = PinnedBuffers(device) if "pinned_host" in kinds else False
    return made or None
