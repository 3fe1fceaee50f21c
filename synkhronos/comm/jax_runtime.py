"""Collectives through the JAX multi-process runtime: jitted ``shard_map`` over a 1-D mesh.

Each process contributes its local device array as one shard of a global
array (``jax.make_array_from_single_device_arrays``); XLA lowers ``psum`` /
``pmax`` / ``pmin`` / ``all_gather`` to the platform's collective library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from ..platform.device_arrays import to_device
from ..platform.native_output import GLOO_CONNECTED, native_lines_dropped
from ..platform.values import device_face
from .base import NOTHING_TO_KEEP, Comm, CommContext, ProgramReducer
from .reduction import GATHER, Reduce

__all__ = ["JaxComm", "MeshReducer"]

if TYPE_CHECKING:
    from jax.sharding import Mesh

_AXIS = "d"

#: a collective's body: this rank's flat values to the result every rank holds
type Body = Callable[[Any], Any]


def _psum_from_root(root: int) -> Body:
    import jax
    import jax.numpy as jnp

    def body(a: Any) -> Any:
        keep = jax.lax.axis_index(_AXIS) == root
        return jax.lax.psum(jnp.where(keep, a, jnp.zeros_like(a)), _AXIS)
    return body


def _bodies() -> dict[str, Body]:
    """The shard_map body of each collective (JAX imported on first use, not with synkhronos).

    A body takes this rank's flat values and returns the result every rank
    holds alike (replicated), so the program's output needs no slicing.
    """
    import jax
    import jax.numpy as jnp
    return {
        Reduce.SUM: lambda a: jax.lax.psum(a, _AXIS),
        Reduce.AVG: lambda a: jax.lax.pmean(a, _AXIS),
        Reduce.MAX: lambda a: jax.lax.pmax(a, _AXIS),
        Reduce.MIN: lambda a: jax.lax.pmin(a, _AXIS),
        Reduce.PROD: lambda a: jnp.prod(jax.lax.all_gather(a, _AXIS), axis=0),
        GATHER: lambda a: jax.lax.all_gather(a, _AXIS),
    }


class JaxComm(Comm):
    """Collectives over every process's single local device, through the JAX runtime.

    Parameters
    ----------
    context : CommContext
        Only the ranks are used: the JAX runtime watches its peers itself, and
        the master runs this rank's part in a thread it watches.
    devices : list of jax.Device, optional
        The devices taking part, in rank order (default: every device of the
        runtime, by process); only their processes call the collectives.
    """

    name = "jax"

    def __init__(self, context: CommContext, devices: Sequence[Any] | None = None) -> None:
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        super().__init__(context)
        if devices is None:
            devices = sorted(jax.devices(), key=lambda d: d.process_index)
        if len(devices) != self.n_ranks:
            raise RuntimeError(f"the JAX runtime has {len(devices)} devices for {self.n_ranks} ranks")
        self.device = jax.local_devices()[0]
        self.mesh = Mesh(np.array(devices), (_AXIS,))
        self.spec = PartitionSpec(_AXIS)
        self.sharding = NamedSharding(self.mesh, self.spec)
        self._bodies = _bodies()
        self._programs: dict[Hashable, Body] = {}
        self._meeting = _FirstMeeting()
        self._reducer: MeshReducer | None = None

    def _program(self, key: Hashable, body: Body) -> Body:
        import jax
        from jax.sharding import PartitionSpec
        fn = self._programs.get(key)
        if fn is None:
            # an all_gather's result is the same on every rank, but JAX's replication check
            # cannot tell (it types it as varying): unchecked for the gathering bodies only
            gathers = key in (GATHER, Reduce.PROD)
            fn = self._programs[key] = jax.jit(jax.shard_map(
                body, mesh=self.mesh, in_specs=self.spec, out_specs=PartitionSpec(),
                check_vma=not gathers))
        return fn

    def _run(self, key: Hashable, body: Body, x: Any) -> Any:
        """``body`` over every rank's flat ``x``: this rank's flat vector is its shard of one global
        vector, and the replicated result is read from this rank's device without a copy."""
        import jax
        import jax.numpy as jnp
        local = jax.device_put(x, self.device)
        bool_input = local.dtype == jnp.bool_
        if bool_input:  # collectives do not take bool: travel as int8
            local = local.astype(jnp.int8)
        glob = jax.make_array_from_single_device_arrays(
            (self.n_ranks * local.shape[0],), self.sharding, [local])
        with self._meeting.running():
            out = self._program(key, body)(glob).addressable_data(0)
        return out.astype(jnp.bool_) if bool_input else out

    def program_reducer(self) -> MeshReducer:
        if self._reducer is None:
            self._reducer = MeshReducer(self.mesh, self.n_ranks, self._meeting)
        return self._reducer

    def all_reduce(self, values: Sequence[Any], op: str) -> list[Any]:
        return _unflat(self._run(op, self._bodies[op], _flat(values)), values)

    def release(self) -> None:
        """Let go of the mesh, its programs and this rank's device: they hold the JAX backend (a
        GPU's memory), which must be able to go at close though the user keeps what ran here."""
        self._programs.clear()
        self._reducer = None
        for held in ("mesh", "sharding", "device"):
            vars(self).pop(held, None)      # (released twice: nothing left the second time)

    def all_gather(self, values: Sequence[Any]) -> list[Any]:
        import jax.numpy as jnp
        stacked = self._run(GATHER, self._bodies[GATHER], _flat(values))     # (n_ranks, size)
        return [jnp.reshape(part, (self.n_ranks,) + np.shape(v))
                for part, v in zip(_split(stacked, values, axis=1), values)]

    def broadcast(self, values: Sequence[Any], root: int) -> list[Any]:
        return _unflat(self._run(("bcast", root), _psum_from_root(root), _flat(values)), values)


class _FirstMeeting:
    """Whether the ranks of one runtime have met in a collective yet: Gloo prints "[Gloo] Rank r is
    connected to ..." on stdout as they first do, in whichever program that is (a collective of
    the implementation's own, or a training step's program reducing inside itself)."""

    def __init__(self) -> None:
        self.met = False

    def running(self) -> AbstractContextManager[None]:
        """Around a run of a program holding a collective."""
        return NOTHING_TO_KEEP if self.met else self._first()

    @contextlib.contextmanager
    def _first(self) -> Iterator[None]:
        # (Gloo serves CPU devices, whose programs run in the caller: the runtime turns their
        # asynchronous dispatch off)
        with native_lines_dropped(1, GLOO_CONNECTED):
            yield
        self.met = True


class MeshReducer(ProgramReducer):
    """Reductions inside one program over the runtime's 1-D mesh of every process's device.

    The program is ``shard_map`` of the per-rank body over the mesh. Every
    rank's value enters as it is on its device: each is declared the replica
    of one global value (``PartitionSpec()``), and the body, unchecked
    (``check_vma=False``), reads its own device's; its results are read back
    the same way. So nothing is copied or reshaped on the way in or out, a
    donated value's buffer can take its new value, and ranks may hold
    different values (their own rows), as long as every rank's have the same
    shapes: the program is one for all of them.
    """

    def __init__(self, mesh: Mesh, n_ranks: int, meeting: _FirstMeeting | None = None) -> None:
        self.mesh, self.n_ranks = mesh, n_ranks
        self._reduce = _bodies()
        self._meeting = meeting or _FirstMeeting()

    def running(self) -> AbstractContextManager[None]:
        return self._meeting.running()

    def reduce(self, x: Any, mode: str | None) -> Any:
        return x if mode is None else self._reduce[mode](x)

    def wrap(self, body: Callable[..., Any]) -> Callable[..., Any]:
        import jax
        from jax.sharding import PartitionSpec

        def program(*glob: Any) -> Any:
            return jax.shard_map(body, mesh=self.mesh, in_specs=PartitionSpec(),
                                 out_specs=PartitionSpec(), check_vma=False)(*glob)
        return program

    def globals_of(self, tree: Any) -> Any:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_single_device_arrays(a.shape, replicated, [_on_device(a)]), tree)

    def locals_of(self, tree: Any) -> Any:
        import jax
        return jax.tree_util.tree_map(lambda a: a.addressable_data(0), tree)


def _on_device(value: Any) -> Any:
    """``value`` as a device array: itself, the device array behind a host face (values are
    faces while another thread of the script may read them: see
    :func:`~synkhronos.platform.values.hold_faces`), or a copy sent explicitly."""
    import jax
    if isinstance(value, jax.Array):
        return value
    device = device_face(value)
    return device if isinstance(device, jax.Array) else to_device(value)


def _flat(values: Sequence[Any]) -> Any:
    """One flat vector of ``values`` (one collective launch for all of them); a single flat value
    is itself."""
    import jax.numpy as jnp
    if len(values) == 1 and np.ndim(values[0]) == 1:
        return values[0]
    return jnp.concatenate([jnp.ravel(jnp.asarray(v)) for v in values])


def _split(flat: Any, like: Sequence[Any], axis: int = 0) -> list[Any]:
    """``flat`` cut along ``axis`` into the sizes of ``like`` (the whole of it for one value)."""
    if len(like) == 1:
        return [flat]
    bounds = np.cumsum([int(np.prod(np.shape(v), dtype=np.int64)) for v in like])[:-1]
    import jax.numpy as jnp
    return jnp.split(flat, bounds, axis=axis)


def _unflat(flat: Any, like: Sequence[Any]) -> list[Any]:
    return [part if np.shape(part) == np.shape(v) else part.reshape(np.shape(v))
            for part, v in zip(_split(flat, like), like)]
