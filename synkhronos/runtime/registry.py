"""What the workers hold: the functions and shared variables of a runtime, and bringing them up to date.

A :class:`Registry` keeps every function built in the master (its spec, to
ship, and the master's own compiled copy) and every shared variable a
function uses, under a uid every process knows it by. Before each command it
ships the functions built since (:meth:`Registry.ensure_shipped`). It also
keeps the master's values presentable: between synkhronos calls user code
sees numpy arrays (:meth:`Registry.values_to_user`), synkhronos computes on
device arrays (:meth:`Registry.values_to_devices`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from pytensor.tensor.type import TensorType

from ..compile import randomness, rewrites, shipping
from ..platform.device_arrays import device_face, host_face, to_device
from ..platform.internals import storage_cell
from ..platform.values import KeptFace, faces_held, host_faces_on, nbytes_of, reference, store, stored
from ..rank.compiled import release_programs
from ..wire.control import ARGS, Op
from .part import Part

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from ..rank.compiled import CompiledFunction
    from ..wire.spec import FunctionSpec

__all__ = ["Registry", "WATCHED_BYTES"]

#: no shape a value has (a variable no call has left a value in yet)
_ANY = object()
#: the largest value whose change in place between calls is found (by a checksum read at each call
#: that uses it, and when a call gives it a new value); a larger one changed in place stays the
#: master's until ``synk.broadcast``
WATCHED_BYTES = 16 << 20


class Registry(Part):
    """The functions and shared variables of one runtime, and what the workers already hold."""

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self.specs: dict[int, FunctionSpec] = {}            # function id -> its spec
        self.compiled: dict[int, CompiledFunction] = {}     # function id -> this process's function
        self._unshipped: list[int] = []        # function ids not yet sent to the workers
        self._next_fid = 0
        self._shared: dict[int, tuple[int, SharedVariable]] = {}      # id(var) -> (uid, var)
        self._by_uid: dict[int, SharedVariable] = {}
        self._tensors: list[SharedVariable] = []    # the tensors among them: what user code reads as numpy
        self._faces: dict[SharedVariable, KeptFace] = {}      # var -> the face user code was given
        self._shapes_left: dict[SharedVariable, object] = {}  # var -> the shape the last call left it
        # var -> the device array the last command left it (where no face stands for it)
        self._arrays_left: dict[SharedVariable, Callable[[], Any]] = {}
        self._shipped_uids: set[int] = set()
        self._scattered_set: set[SharedVariable] | None = None
        # var -> whether a change of its face in place can be the script's (see _watched), kept
        # until the functions registered change
        self._watchable: dict[SharedVariable, bool] = {}
        # id -> generator already made this node master's own stream
        self._own_streams: dict[int, SharedVariable] = {}

    # --- functions ----------------------------------------------------------------------------
    def next_function_id(self) -> int:
        return self._next_fid

    def register_function(self, spec: FunctionSpec, compiled: CompiledFunction) -> None:
        """Keep ``spec`` (to ship) and this process's ``compiled`` function (to run calls)."""
        self.specs[spec.fid], self.compiled[spec.fid] = spec, compiled
        self._unshipped.append(spec.fid)
        self._functions_changed()
        self._next_fid = spec.fid + 1
        for var in spec.shared_variables():
            self.uid_of(var)

    def is_registered(self, fid: int) -> bool:
        """False once a function that could not be shipped was unregistered."""
        return fid in self.specs

    # --- shared variables -----------------------------------------------------------------------
    def uid_of(self, var: SharedVariable) -> int:
        """The stable id under which every process knows shared variable ``var``."""
        entry = self._shared.get(id(var))
        if entry is None:
            entry = self._shared[id(var)] = (len(self._shared), var)
            self._by_uid[entry[0]] = var
            if isinstance(var.type, TensorType):
                self._tensors.append(var)
        return entry[0]

    def uids_of(self, vars_: Iterable[SharedVariable]) -> list[int]:
        return [self.uid_of(v) for v in vars_]

    def known_shared(self) -> list[SharedVariable]:
        """Every shared variable some function of this runtime uses."""
        return [var for _, var in self._shared.values()]

    def scattered_shared(self) -> list[SharedVariable]:
        """Every shared variable some function slices (``sliceable_shareds``: data, not state)."""
        return [var for spec in self.specs.values() for var in spec.sliceable_shareds]

    def _watched(self, var: SharedVariable, value: Any) -> bool:
        """Whether a change in place of ``var``'s face is the script's new value for every device:
        not for data given out by rows (each device's own), a training step's flat gradient
        (synkhronos's own buffer, which only its steps write), nor a value over
        :data:`WATCHED_BYTES` (a table every call would read once more to check)."""
        watchable = self._watchable.get(var)
        if watchable is None:
            watchable = self._watchable[var] = var not in self._scattered() and \
                not getattr(var.tag, "synk_gradient", False)
        return watchable and nbytes_of(value) <= WATCHED_BYTES

    def _functions_changed(self) -> None:
        """Forget what was derived from the registered functions (:meth:`_scattered`, and
        :meth:`_watched`'s decisions)."""
        self._scattered_set = None
        self._watchable.clear()

    def _scattered(self) -> set[SharedVariable]:
        """:meth:`scattered_shared` as a set, kept until the next function is registered."""
        if self._scattered_set is None:
            self._scattered_set = set(self.scattered_shared())
        return self._scattered_set

    def shared_by_uid(self, uid: int) -> SharedVariable:
        return self._by_uid[uid]

    # --- the master's values, as user code and as synkhronos see them ---------------------------
    def values_to_user(self, scope: Collection[SharedVariable] | None = None) -> None:
        """Give user code the master's shared values as numpy arrays (:func:`host_face`).

        Called whenever a synkhronos call returns: the user's own PyTensor
        functions, in any mode, read the same shared variables. A variable
        whose device array the call left in place gets back the face it had
        (:class:`~synkhronos.platform.values.KeptFace`). ``scope``: the
        variables the call touched (those :meth:`values_to_devices` was given;
        None: every one).
        """
        faces, left = self._faces, self._shapes_left
        plain = not host_faces_on() and not faces_held()
        for var in self._in(scope):
            cell = storage_cell(var)
            if plain and var not in faces:        # a device array stays one: only its shape is kept
                left[var] = np.shape(cell[0])
                self._arrays_left[var] = reference(cell[0])
                continue
            kept, device = self._kept_face(var, cell[0])
            if device is not None:
                assert kept is not None, "a device array comes with its face"
                cell[0] = kept.restore(device)
                left[var] = device.shape
                continue
            device = stored(var)
            left[var] = np.shape(device)
            face = host_face(device)
            store(var, face)
            if face is not device:
                faces[var] = KeptFace(device, face, watched=self._watched(var, face))
            else:           # (no face any more: faces are no longer held) the array is what is left
                faces.pop(var, None)
                self._arrays_left[var] = reference(device)

    def _in(self, scope: Collection[SharedVariable] | None) -> Collection[SharedVariable]:
        """The tensors a command touches: ``scope`` (a function's own), or every one (None)."""
        return self._tensors if scope is None else scope

    def _kept_face(self, var: SharedVariable, value: Any) -> tuple[KeptFace | None, Any]:
        """``(kept, device)``: ``var``'s KeptFace (or None), and its device array if ``value`` is
        still that face or that array (else None)."""
        kept = self._faces.get(var)
        return kept, (kept.device_if_current(value) if kept is not None else None)

    def values_to_devices(self, scope: Collection[SharedVariable] | None = None) -> list[SharedVariable]:
        """Take the master's shared values back as device arrays, before a synkhronos call
        (``scope``: only those variables, the call's own; None: every one); return the variables
        the master's script set since the last call, which every device is to take.

        A host face becomes its device array again; a numpy value the user set
        is copied to the device (every rank computes on device arrays). While
        faces are held (:func:`~synkhronos.platform.internals.hold_faces`: other
        threads may read the variables), every value becomes, or stays, the
        host face of its device array instead.
        """
        held, left, faces = faces_held(), self._shapes_left, self._faces
        set_here = []
        for var in self._in(scope):
            value = storage_cell(var)[0]
            shape = getattr(value, "shape", None)
            if not held and type(value) is not np.ndarray and shape is not None and var not in faces:
                # a device array (or a value of the user's own with its shape), as it stays
                if shape != left.get(var, _ANY):
                    self._state.calls.forget_shapes()
                    left[var] = shape
                last = self._arrays_left.get(var)
                if last is not None and last() is not value:
                    set_here.append(var)    # another array, the script's (its own mode="JAX" update)
                    store(var, _of_its_type(var, value))
                continue
            if np.shape(value) != left.get(var, _ANY):
                # a shape other than the one a call left: the user's own function set it
                self._state.calls.forget_shapes()
                left[var] = np.shape(value)
            kept, device = self._kept_face(var, value)
            if device is not None and kept is not None and kept.written_since(value):
                # the script wrote the face in place (an edit of the borrowed value, its own
                # PyTensor function's update in place): a new value, every device's
                if device_face(value) is device:    # the face is the master's array: it holds it
                    kept.watch_again()
                    set_here.append(var)
                else:                               # a copy of it (a GPU's): the value goes up
                    del self._faces[var]
                    kept, device, value = None, None, np.array(value)
            if device is None and type(value) is np.ndarray:
                device = device_face(value)
                if device is value:         # an array of the user's own
                    device = None
                else:                       # a face the user set: it stays the variable's face
                    kept = self._faces[var] = KeptFace(device, value, watched=self._watched(var, value))
            if device is not None:
                assert kept is not None, "a device array comes with its face"
                if not held and value is not device:
                    storage_cell(var)[0] = value = device     # (lend counts who else holds the face)
                    kept.lend()
                continue
            if isinstance(value, np.ndarray):      # set by the user: maybe of another shape
                value = to_device(value.astype(var.type.dtype, copy=False))
                self._state.calls.forget_shapes()
                set_here.append(var)
            elif kept is not None:                 # a device array of the script's own, for the face
                set_here.append(var)
                value = _of_its_type(var, value)
            store(var, value)
        return self._for_every_device(set_here)

    def _for_every_device(self, set_here: list[SharedVariable]) -> list[SharedVariable]:
        """Of the variables the master's script set (``set_value``, or a plain PyTensor function's
        update), those every device takes at this call: all but the scattered data (whose rows
        differ by device: set them with ``synk.scatter``)."""
        if not set_here:
            return []
        scattered = set(self.scattered_shared())
        return [var for var in set_here if var not in scattered]

    def detach_values(self) -> None:
        """Move the master's shared values to numpy arrays of their own, which outlive the JAX backend."""
        import jax
        for _, var in self._shared.values():
            value = device_face(stored(var))
            # (a deleted array, which no held Ctrl-C should leave, stays as it is: the teardown
            # that follows must finish for fork() to work again)
            if isinstance(value, jax.Array) and not value.is_deleted():
                store(var, np.array(value))
        self._faces.clear()         # a face's memory is its device array's

    def release_programs(self) -> None:
        """Drop every function's compiled programs: they hold the JAX backend, which must be able
        to go when the runtime closes though the user keeps the functions."""
        for compiled in self.compiled.values():
            release_programs(compiled)

    # --- bringing the workers up to date ---------------------------------------------------------
    def ensure_shipped(self) -> None:
        """Bring the workers up to date before a command: new functions shipped, freed Data dropped.

        Checked on every call: keep it O(1).
        """
        state = self._state
        state.check_open()
        if state.data.released:
            self._drop_released_data()
        if self._unshipped:
            self.ship(sync_values=False)

    def drop_data(self, data_ids: Iterable[int]) -> None:
        """Have the workers let go of their mappings of ``data_ids``."""
        channel = self._state.channel
        self._state.check_open()
        ids = list(data_ids)
        channel.ctl.args[0] = len(ids)
        channel.ctl.args[1:1 + len(ids)] = ids
        channel.command(Op.DROP_DATA)

    def _drop_released_data(self) -> None:
        ids: list[int] = []
        released = self._state.data.released
        while released and len(ids) < ARGS - 1:
            ids.append(released.popleft())
        self.drop_data(ids)

    def ship(self, sync_values: bool) -> None:
        """Send every function not yet shipped to every worker, which compiles them.

        With ``sync_values``, every shared variable the workers already hold is
        set to the master's value.
        """
        state = self._state
        state.check_open()
        state.calls.forget_shapes()
        specs = [self.specs[fid] for fid in self._unshipped]
        new_shared: dict[int, SharedVariable] = {}
        values: dict[int, Any] = {}
        for spec in specs:
            for var in spec.shared_variables():
                uid = self.uid_of(var)
                if uid not in self._shipped_uids:
                    new_shared[uid] = var
        if sync_values:
            for uid, var in self._shared.values():
                if uid in self._shipped_uids:
                    value = var.get_value(borrow=True)
                    values[uid] = value if randomness.is_generator(var) else np.asarray(value)
        shipped = self._shipped_uids

        def uid_of_shipped(obj: object) -> int | None:
            entry = self._shared.get(id(obj))
            return entry[0] if entry is not None and entry[0] in shipped and entry[1] is obj else None

        # every rank compiles as the master does: with its precision and its choice of products
        cpu_rewrite = rewrites.use_cpu_rewrite() if state.platform == "cpu" else False
        payload = dict(functions=specs, shared=new_shared, values=values, float_x=state.float_x(),
                       cpu_rewrite=cpu_rewrite)
        graph_vars = [v for spec in specs for v in spec.graph_vars()]
        try:
            blob = shipping.dumps(payload, graph_vars, uid_of_shipped)
        except Exception as e:
            # what cannot travel now never will: unregister it, so other functions still ship
            for spec in specs:
                del self.specs[spec.fid], self.compiled[spec.fid]
            self._unshipped = []
            self._functions_changed()
            names = ", ".join(spec.name for spec in specs)
            raise TypeError(f"{names} cannot be sent to the workers ({type(e).__name__}: {e}); "
                            f"they were unregistered, other functions still work") from e
        state.channel.send_payload(blob)
        state.channel.command(Op.SHIP)
        self._shipped_uids.update(new_shared)
        self._unshipped = []

    def own_streams(self, variables: Iterable[SharedVariable]) -> None:
        """Before the master compiles a function: on a node after the first, its new generators
        become its own device's streams.

        Every node's script seeded them alike; node 0's master keeps the draws of the
        single-process function and every other device (this master included) draws from that
        stream jumped by its rank's distance, as the workers do (theirs are the master's jumped
        by their distance from it). A compiled function keeps a copy of its generators' state,
        so this happens before compiling, once per generator.
        """
        state = self._state
        distance = (state.master_rank - state.root_rank) % state.n_parallel
        for var in variables:
            if distance and randomness.is_generator(var) and id(var) not in self._own_streams:
                self._own_streams[id(var)] = var        # (kept: the id stays this variable's)
                var.set_value(randomness.device_stream(var.get_value(borrow=True), distance))


def _of_its_type(var: SharedVariable, value: Any) -> Any:
    """A device array the script left in ``var``, in ``var``'s dtype as JAX holds it (PyTensor's
    JAX backend may compute another: float64 for a float32 variable under floatX float64)."""
    import jax
    dtype = jax.dtypes.canonicalize_dtype(var.type.dtype)
    return value.astype(dtype) if getattr(value, "dtype", dtype) != dtype else value
