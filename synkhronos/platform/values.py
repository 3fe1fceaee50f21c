"""A shared variable's value as synkhronos reads and writes it: a device array, or its host face.

Every rank computes on device arrays. User code in the master must see numpy
arrays: on CPU a :func:`host_face` is one, over the device array's own memory,
made without a copy; :func:`device_face` gives the device array back.
:func:`stored` and :func:`store` read and write a shared variable's value as it
is (``get_value``/``set_value`` copy, or filter the value to the variable's
type), reading a face as its device array, and storing faces while
:func:`hold_faces` is on (other threads of the master may read the variables
during a command).
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from .internals import buffer_address, storage_cell

if TYPE_CHECKING:
    import jax

__all__ = ["stored", "store", "host_face", "device_face", "hold_faces", "faces_held", "KeptFace",
           "use_host_faces", "host_faces_on", "host_faces_wanted", "HOST_FACES_VARIABLE", "nbytes_of",
           "reference"]


def stored(var: Any) -> Any:
    """The value a shared variable holds, as it is (no copy; a JAX array stays one, and a
    :func:`host_face` is read as its device array).

    ``var.get_value(borrow=True)`` returns the same object, but only through
    PyTensor's container; synkhronos reads it on every call and step.
    """
    value = storage_cell(var)[0]
    return device_face(value) if type(value) is np.ndarray else value


def store(var: Any, value: Any) -> None:
    """Make ``value`` the shared variable's value as it is, with no filter to its type (as its
    :func:`host_face` while :func:`faces_held`).

    ``set_value`` would filter a JAX array to numpy (a host copy); the caller
    gives a value of the variable's dtype and shape.
    """
    storage_cell(var)[0] = host_face(value) if _faces_held[0] else value


#: whether this process's shared variables keep numpy faces through a command (see hold_faces)
_faces_held = [False]
#: whether user code sees a CPU device's arrays as numpy faces (see use_host_faces)
_host_faces = [True]
#: the environment variable that turns the faces off (``SYNK_HOST_FACES=0``)
HOST_FACES_VARIABLE = "SYNK_HOST_FACES"


def use_host_faces(on: bool) -> None:
    """Whether :func:`host_face` makes numpy faces of CPU device arrays (set at ``fork()``).

    Off (``SYNK_HOST_FACES=0`` in the environment), CPU devices keep their
    values as device arrays through every call, exactly as a GPU does: user
    code reads them as JAX arrays, and the CPU runs the code a GPU runs.
    """
    _host_faces[0] = bool(on)


def nbytes_of(value: Any) -> int:
    """A numpy or device array's bytes from its shape and dtype (a device array stays where it is).

    Examples
    --------
    >>> nbytes_of(np.zeros((3, 4), "float32"))
    48
    """
    if type(value) is np.ndarray:
        return value.nbytes
    return math.prod(np.shape(value)) * np.dtype(value.dtype).itemsize


def host_faces_on() -> bool:
    """True unless ``SYNK_HOST_FACES=0`` turned the faces off at ``fork()`` (see :func:`use_host_faces`)."""
    return _host_faces[0]


def host_faces_wanted(environ: Any) -> bool:
    """Whether ``environ`` asks for host faces (anything but ``SYNK_HOST_FACES=0``)."""
    return environ.get(HOST_FACES_VARIABLE, "1").strip() != "0"


def hold_faces(on: bool) -> None:
    """Have :func:`store` (and a jitted call's updates) keep values as their :func:`host_face`.

    While other threads of the master may read its shared variables, a
    command must never leave a device array in them (a plain PyTensor
    function cannot read one, and a donated one is deleted under its reader):
    every value stays a numpy face of a device array that nothing overwrites.
    """
    _faces_held[0] = on


def faces_held() -> bool:
    """True while :func:`hold_faces` is on."""
    return _faces_held[0]


def host_face(value: Any) -> Any:
    """``value`` as user code may hold it: a writeable numpy array over a CPU device array's memory.

    A shared variable read by a plain PyTensor function (the default numba
    mode, the C backend) must hold a numpy array. On CPU the device's memory is
    the host's: the face is a view of the device array, made without a copy
    once its computation has finished, and it keeps the device array alive. An
    edit of the face in place is an edit of the device array.
    :func:`device_face` gives the device array back. Anything else (a value on
    an accelerator, a numpy array, a random generator) is returned as it is.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> face = host_face(jnp.arange(3.0))
    >>> type(face).__name__, face.flags.writeable, device_face(face).tolist()
    ('ndarray', True, [0.0, 1.0, 2.0])
    """
    jax = sys.modules.get("jax")
    if not _host_faces[0] or jax is None or not isinstance(value, jax.Array):
        return value            # (no faces wanted, or no JAX imported: no device array)
    if next(iter(value.devices())).platform != "cpu":
        return value
    shape, dtype = value.shape, value.dtype
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return value
    value.block_until_ready()
    memory = _bytes_type(nbytes).from_address(buffer_address(value))
    memory.device_array = value  # type: ignore[attr-defined]  # ctypes arrays take attributes
    return np.ndarray(shape, dtype, buffer=memory)


def _bytes_type(nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
    """The ctypes array type of ``nbytes`` bytes (made once per size: making one costs more than
    the face)."""
    made = _BYTES_TYPES.get(nbytes)
    if made is None:
        if len(_BYTES_TYPES) > 4096:
            _BYTES_TYPES.clear()
        made = _BYTES_TYPES[nbytes] = ctypes.c_char * nbytes
    return made


_BYTES_TYPES: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}


def device_face(value: Any) -> Any:
    """The device array behind ``value``, a whole :func:`host_face`; any other value as it is."""
    memory = value.base if type(value) is np.ndarray else None
    device = getattr(memory, "device_array", None)
    if (device is None or value.shape != device.shape or value.dtype != device.dtype
            or not value.flags.c_contiguous
            or value.ctypes.data != ctypes.addressof(memory)  # type: ignore[arg-type]  # has a device_array
            or device.is_deleted()):
        return value
    return device


class KeptFace:
    """The :func:`host_face` user code was given of a shared variable's device array, kept for
    the next call.

    Between calls a variable holds its face; during a call, its device array
    (:meth:`~synkhronos.runtime.registry.Registry.values_to_devices`). A call
    that leaves the device array in place hands back the same face, the same
    numpy object, without making a new one (:meth:`restore`).

    A face keeps its device array alive, and a donating call copies a value
    that anything else refers to (``copy_values_held_elsewhere``). So while a
    call runs, a face that nothing but this object holds lets its device array
    go (:meth:`lend`), and gets it back after the call if the array is still
    the variable's value. A face held elsewhere (the user's
    ``get_value(borrow=True)``, a view of it) keeps its array, which is
    then not donated.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> device = jnp.arange(3.0)
    >>> kept = KeptFace(device, host_face(device))
    >>> kept.device_if_current(kept.face) is device, kept.device_if_current(jnp.zeros(3))
    (True, None)
    >>> kept.lend(); kept.restore(device).tolist()
    [0.0, 1.0, 2.0]

    A face written in place since it was made (an edit of the borrowed value,
    or the user's own PyTensor function updating the variable in place, as
    PyTensor's default and C modes do) is a new value of the master's script,
    found by its checksum (:meth:`written_since`):

    >>> face = np.arange(3.0)
    >>> kept = KeptFace(device, face)
    >>> kept.written_since(face), kept.written_since(np.arange(3.0))
    (False, False)
    >>> face += 1; kept.written_since(face)
    True
    """

    __slots__ = ("face", "_device", "_digest")

    def __init__(self, device: jax.Array, face: np.ndarray, watched: bool = True) -> None:
        self.face, self._device = face, weakref.ref(device)
        self._digest = _digest(face) if watched else None

    def watch_again(self) -> None:
        """Take the face's bytes as they are now for the ones to compare with."""
        if self._digest is not None:
            self._digest = _digest(self.face)

    def written_since(self, value: Any) -> bool:
        """Whether ``value`` is this face, written in place since it was made (never, for a face
        made with ``watched=False``: a value that is each device's own)."""
        return value is self.face and self._digest is not None and _digest(value) != self._digest

    def device_if_current(self, value: Any) -> jax.Array | None:
        """The face's device array if ``value`` is that array, or the face still over all of
        it, and the array is alive and not donated; else None."""
        device = self._device()
        if device is None or device.is_deleted():
            return None
        if value is device:
            return device
        if value is not self.face or value.shape != device.shape or value.dtype != device.dtype or \
                not value.flags.c_contiguous:      # (the face's shape or dtype set in place)
            return None
        return device

    def lend(self) -> None:
        """Let the device array go for a call, unless something besides this object holds the face."""
        face = self.face
        if sys.getrefcount(face) <= _FACE_ONLY_KEPT and sys.getrefcount(face.base) <= _MEMORY_ONLY_IN_FACE:
            face.base.device_array = None  # type: ignore[union-attr]  # the face's ctypes memory

    def restore(self, device: jax.Array) -> np.ndarray:
        """The face, over ``device`` again (the value :meth:`device_if_current` found)."""
        self.face.base.device_array = device  # type: ignore[union-attr]  # the face's ctypes memory
        return self.face


def reference(value: Any) -> Callable[[], Any]:
    """A reference to ``value`` that does not keep it alive where it can (a device array): called,
    it gives ``value``, or None once it is gone.

    Examples
    --------
    >>> held = np.zeros(2); ref = reference(held)
    >>> ref() is held, reference(1.5)()
    (True, 1.5)
    """
    try:
        return weakref.ref(value)
    except TypeError:           # (a value that takes no weak reference is held)
        return lambda: value


def _digest(face: np.ndarray) -> int:
    """A checksum of a face's bytes (at memory speed: xxh3)."""
    return xxhash.xxh3_64_intdigest(face if face.flags.c_contiguous else np.ascontiguousarray(face))


#: references to a face held only by its KeptFace, counted inside KeptFace.lend (the slot, the
#: local name, getrefcount's argument)
_FACE_ONLY_KEPT = 3
#: references to a face's memory held only by the face (its base, getrefcount's argument)
_MEMORY_ONLY_IN_FACE = 2
