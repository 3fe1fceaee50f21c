"""``Data``: arrays in OS shared memory that every process maps.

The master owns every segment (:class:`synkhronos.runtime.data_store.DataStore`);
a worker maps a Data segment the first time a command names it and drops its
mapping when the master announces a reallocation, ``free_memory()`` or that
the Data was garbage collected.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Hashable, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ipc.packing import dtype_code
from ..runtime.session import current, serialized
from .function_parts.split_axes import check_data_axis

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

    from ..ipc.segments import GrowableSegment
    from ..runtime.state import State

__all__ = ["Data", "data", "condition_value", "as_pytensor_takes", "release_large_staging", "staging_data",
           "STAGING_KEEP_BYTES"]

#: a Data that stages numpy arguments is kept for the next call only up to this size
STAGING_KEEP_BYTES = 64 << 20


def condition_value(value: Any, dtype: Any, ndim: int, force_cast: bool = False, what: str = "value",
                    cast_hint: str | None = None) -> np.ndarray:
    """Return ``value`` as a numpy array of ``dtype``, checking ndim and safe casting.

    ``cast_hint`` is what the message suggests for an unsafe cast (default:
    ``force_cast=True``, which the Data methods take).

    Raises
    ------
    TypeError
        If ``value`` has the wrong number of dimensions, or its dtype does not
        up-cast safely to ``dtype`` and ``force_cast`` is False.
    """
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise TypeError(f"{what} has ndim {arr.ndim}, expected ndim {ndim} "
                        f"(shape {arr.shape}); reshape it or use a Data of the right ndim")
    if arr.dtype != dtype:
        if not force_cast and not np.can_cast(arr.dtype, dtype, casting="safe"):
            raise TypeError(f"{what} has dtype {arr.dtype}, which does not cast safely to {dtype}; "
                            f"convert it first (.astype({str(np.dtype(dtype))!r})) or "
                            f"{cast_hint or 'pass force_cast=True'}")
        arr = arr.astype(dtype)
    return arr


def as_pytensor_takes(var: Variable, value: Any, what: str, downcast: bool = False) -> Any:
    """A value that is not a numpy array (a Python or numpy scalar, a list) as ``pytensor.function``
    takes it for input ``var``: weakly typed, so an ``int`` fits an ``iscalar`` and a ``float`` a
    ``float32`` input when it keeps its value (a float always fits a ``floatX`` input).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> as_pytensor_takes(pt.iscalar("i"), 3, "i").dtype
    dtype('int32')
    """
    try:
        return var.type.filter(value, strict=False, allow_downcast=True if downcast else None)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{what}: {e}; convert it first, or build the function with "
                        f"synk.function(..., allow_input_downcast=True)") from None


def _check_oversize(oversize: float) -> None:
    if not 1 <= oversize <= 2:
        raise ValueError(f"oversize must be between 1 and 2, got {oversize}")


class Data:
    """An array in shared memory, readable by every process of the runtime.

    Create with :func:`data`, not directly. Indexing reads and writes the
    master's view (``d[3:5] = x``); ``d.data`` is that numpy view.
    """

    def __init__(self, state: State, dtype: Any, ndim: int, minibatch: bool = False, name: str | None = None,
                 sharded: bool = False, split_axis: int | None = None) -> None:
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # rejects unsupported dtypes early
        self._split_axis = check_data_axis(split_axis, int(ndim))
        state.check_open()
        self._state = state
        self.id, self._segment = state.data.new_segment()
        self._ndim = int(ndim)
        self.minibatch = bool(minibatch)
        #: this node's own shard of the rows: ``batch=`` indices are local to it and the rows are
        #: split over this node's devices only
        self.sharded = bool(sharded)
        self.name = name
        self._shape: tuple[int, ...] | None = None
        # dropped with its last reference, as a numpy array is (the workers let go at the next command)
        release = weakref.finalize(self, _release_unreferenced, self._segment, state, self.id,
                                   os.getpid())
        release.atexit = False  # type: ignore[misc]  # a documented attribute typeshed's slots omit

    # --- properties -------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (fixed at creation)."""
        return self._dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions (fixed at creation)."""
        return self._ndim

    @property
    def split_axis(self) -> int | None:
        """The axis a call splits this Data along as a scattered input (None: the function's, else 0)."""
        return self._split_axis

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The current shape, or None before a value is set or after ``free_memory()``."""
        return self._shape

    @property
    def size(self) -> int:
        """The number of items in the current shape."""
        return 0 if self._shape is None else math.prod(self._shape)

    @property
    def alloc_size(self) -> int:
        """Number of items the current allocation can hold."""
        return self._segment.nbytes // self._dtype.itemsize

    @property
    def gen(self) -> int:
        """The generation of the segment holding the value (a new one at each reallocation)."""
        return self._segment.gen

    def belongs_to(self, state: State | None) -> bool:
        """True if this Data was made in the runtime ``state`` (not in one closed since)."""
        return self._state is state

    def segment_name(self) -> str | None:
        """The name of the shared-memory segment holding the value (in ``/dev/shm``), or None."""
        segment = self._segment.segment
        return None if segment is None else segment.name

    @property
    def data(self) -> Any:
        """The numpy view of the master's shared memory (None before allocation)."""
        if self._shape is None:
            return None
        self._state.check_open()
        return self._segment.made.array(self._dtype, self._shape)

    def __len__(self) -> int:
        if self._shape is None:
            raise TypeError(f"{self!r} holds no value yet; call set_value() or set_shape() first")
        return self._shape[0] if self._ndim else 1

    def __getitem__(self, key: Any) -> Any:
        return self._view_or_raise()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._view_or_raise()[key] = value

    def __repr__(self) -> str:
        return f"Data(name={self.name!r}, dtype={self._dtype}, shape={self._shape}, minibatch={self.minibatch})"

    def _view_or_raise(self) -> np.ndarray:
        view = self.data
        if view is None:
            raise TypeError(f"{self!r} holds no value yet; call set_value() or set_shape() first")
        return view

    # --- values -----------------------------------------------------------------------------
    def condition_data(self, value: Any, force_cast: bool = False) -> np.ndarray:
        """Return ``value`` as an array this Data can hold (dtype and ndim checked)."""
        return condition_value(value, self._dtype, self._ndim, force_cast, what=f"value for {self!r}")

    @serialized
    def set_value(self, value: Any, force_cast: bool = False, oversize: float = 1) -> None:
        """Write ``value``, reshaping the view if it fits, else reallocating.

        A reallocation makes a new segment of ``prod(shape) * oversize`` items
        and writes only the new value into it.
        """
        _check_oversize(oversize)
        value = self.condition_data(value, force_cast)
        self._resize(value.shape, oversize)
        self.data[...] = value

    @serialized
    def set_length(self, length: int, oversize: float = 1) -> None:
        """Change the number of rows; existing rows are kept, added rows are zero."""
        _check_oversize(oversize)
        if self._ndim == 0:
            raise TypeError("set_length() needs a Data with ndim >= 1")
        if int(length) < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if self._shape is None and self._ndim > 1:
            raise ValueError(f"set_length() keeps the shape past the rows, and {self!r} holds no value "
                             f"(never given one, or freed): give it one with set_value() or set_shape()")
        old = None if self._shape is None else np.array(self.data)
        self._resize((int(length),) + tuple(self._shape[1:] if self._shape else ()), oversize)
        view = self.data
        view[...] = 0
        if old is not None:
            keep = min(len(old), len(view))
            view[:keep] = old[:keep]

    @serialized
    def set_shape(self, shape: tuple[int, ...], oversize: float = 1) -> None:
        """Set a new shape of the same ndim; the contents are zero afterwards."""
        _check_oversize(oversize)
        shape = tuple(int(s) for s in shape)
        if len(shape) != self._ndim:
            raise ValueError(f"set_shape() must keep ndim {self._ndim}, got shape {shape}")
        if any(s < 0 for s in shape):
            raise ValueError(f"shape entries must be >= 0, got {shape}")
        self._resize(shape, oversize)
        self.data[...] = 0

    @serialized
    def free_memory(self) -> None:
        """Release the shared memory in the master and every worker."""
        self._state.check_open()
        self._segment.free()
        self._shape = None
        self._state.registry.drop_data([self.id])

    def _resize(self, shape: tuple[int, ...], oversize: float) -> None:
        self._state.check_open()
        needed = math.prod(shape) * self._dtype.itemsize
        had = self._segment.segment is not None
        if self._segment.ensure(needed, oversize=oversize) and had:
            self._state.registry.drop_data([self.id])
        self._shape = tuple(shape)


@serialized
def release_large_staging(staging: MutableMapping[Any, Data]) -> None:
    """Free and forget the Data in dict ``staging`` that hold more than ``STAGING_KEEP_BYTES``.

    numpy arguments travel through a Data kept for the next call of the same
    shape, which saves a segment per call for minibatches; one that large is
    let go right after its call instead of holding /dev/shm until ``close()``.
    """
    for key, d in list(staging.items()):
        if d.alloc_size * d.dtype.itemsize > STAGING_KEEP_BYTES:
            del staging[key]
            d.free_memory()


def _release_unreferenced(segment: GrowableSegment, state: State, data_id: int, owner_pid: int) -> None:
    """Free the shared memory of a Data nobody refers to any more.

    Runs from the garbage collector, in whichever thread: the segment is
    unlinked and its id queued for the workers, which drop their mappings
    before the runtime's next command. In a child made by ``os.fork()`` it
    does nothing: the segment is the parent's.
    """
    if os.getpid() != owner_pid or not state.is_open or segment.segment is None:
        return
    state.data.release_unreferenced(data_id, segment)


def staging_data(state: State, key: Hashable, value: np.ndarray) -> Data:
    """A Data of ``state`` kept under ``key`` that holds ``value`` (staging numpy values for the workers)."""
    d = state.staging.get(key)
    if d is None or d.dtype != value.dtype or d.ndim != value.ndim:
        d = state.staging[key] = Data(state, value.dtype, value.ndim, name=f"scratch:{key}")
    d.set_value(value, oversize=1 if d.alloc_size >= value.size else 1.25)
    return d


def data(value: Any = None, var: Any = None, dtype: Any = None, ndim: int | None = None,
         shape: tuple[int, ...] | None = None, minibatch: bool = False, force_cast: bool = False,
         oversize: float = 1, name: str | None = None, sharded: bool = False,
         split_axis: int | None = None) -> Data:
    """Make a :class:`Data` in shared memory visible to every process.

    Parameters
    ----------
    value : array_like, optional
        Initial contents (allocates and writes).
    var : pytensor Variable, optional
        Takes dtype and ndim from this variable's type.
    dtype, ndim : optional
        Used when neither ``var`` nor ``value`` fixes them.
    shape : tuple of int, optional
        Allocate this shape (zeros) without a value.
    minibatch : bool
        The Data holds only a batch: row 0 stands for the lowest batch index.
    force_cast : bool
        Allow unsafe casts of ``value`` to the dtype.
    oversize : float
        Allocate this factor (1 to 2) more than needed, to grow without reallocating.
    name : str, optional
    sharded : bool
        On several nodes: ``value`` is this node's own shard of the rows (each
        node passes its own). A call on sharded Data takes ``batch=`` indices
        into the shard, splits them over this node's devices only, and reduces
        the outputs over every device of every node. On one node it changes
        nothing.
    split_axis : int, optional
        The axis that holds one entry per example, which a call splits over
        the devices and ``batch=`` selects along, for a function that declares
        none for the input (see ``split_axes`` of :func:`synkhronos.function`):
        1 for time-major sequences (time, samples). Default: axis 0.

    Returns
    -------
    Data

    Examples
    --------
    >>> x_dat = synk.data(np.zeros((100, 5), "float32"))
    >>> x_dat.shape, x_dat.dtype
    ((100, 5), dtype('float32'))
    >>> y = pt.vector("y")
    >>> y_dat = synk.data(var=y, shape=(100,))                  # allocated, to be filled
    >>> y_dat.shape, y_dat.dtype == y.dtype
    ((100,), True)
    >>> seqs = synk.data(np.zeros((50, 8), "float32"), split_axis=1)    # (time, samples)
    >>> seqs.split_axis
    1
    """
    state = current()
    _check_oversize(oversize)
    if var is not None:
        dtype, ndim = var.type.dtype, var.type.ndim
    elif value is not None:
        value = np.asarray(value)
        dtype = dtype or value.dtype
        ndim = value.ndim if ndim is None else ndim
    elif dtype is not None and shape is not None:
        ndim = len(shape) if ndim is None else ndim
    if dtype is None or ndim is None:
        raise TypeError("data() needs var=, value=, or dtype= with ndim= or shape= to know its "
                        "dtype and ndim")
    d = Data(state, dtype, ndim, minibatch=minibatch, name=name, sharded=sharded, split_axis=split_axis)
    if value is not None:
        d.set_value(value, force_cast=force_cast, oversize=oversize)
    elif shape is not None:
        d.set_shape(shape, oversize=oversize)
    return d
