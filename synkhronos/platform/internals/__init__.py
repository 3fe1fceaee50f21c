"""The one place synkhronos reads PyTensor's and JAX's internals, for the versions it supports.

This package; JAX's compiler cache is read in :mod:`.compiler`, and exported here.

Thirteen things have no public API and are reached for here only:

- a shared variable's stored value, read and written as it is (a JAX array
  stays one): ``get_value``/``set_value`` copy, or filter the value to the
  variable's type (:func:`storage_cell`; :mod:`.values` reads and writes it);
- a PyTensor function linked for JAX is one jitted function behind per-call
  bookkeeping; :func:`jit_parts` hands out its pieces so that a call can skip
  that bookkeeping (:func:`synkhronos.rank.jitted.jitted_call`);
- whether this process already made a JAX backend (``fork()`` must come first);
- in a child made by ``os.fork()``, the JAX runtime objects it inherited, to be
  kept alive and forgotten (:func:`detach_inherited_jax`);
- JAX's cluster detection (Slurm, Open MPI, ...), which
  ``jax.distributed.initialize()`` runs but does not hand out
  (:func:`detect_jax_cluster`);
- the client of JAX's coordination service, whose key-value store the masters
  of several nodes use (:func:`distributed_client`);
- the coordination service ``jax.distributed.initialize()`` starts in process
  0, left to a process of its own on several nodes
  (:func:`service_served_elsewhere`), and started there
  (:func:`coordination_service`);
- JAX's persistent compilation cache, which only process 0 of a runtime
  writes (:func:`cache_writes_from_every_process`);
- which random variables PyTensor's JAX backend can sample, which it finds out
  only when JAX traces a graph (:func:`unsampleable_in_jax`);
- what ``pytensor.function`` refuses in a graph before it rewrites it (missing
  or unused inputs, updates of another type, givens that do not fit), checked
  without the rewrites and the linking (:func:`check_function_graph`);
- a CPU device array's memory, seen as a numpy array without a copy
  (:func:`buffer_address`, used by :mod:`.values`);
- the C++ call ``jax.device_put`` ends in, for small arrays whose Python
  bookkeeping would cost more than the copy (:func:`device_put_bare`);
- whether a traced graph calls back into Python (a host callback, which can
  raise while the device computes), read from its jaxpr and every jaxpr
  nested in it (:func:`calls_host_code`).

Every reader returns None (or does nothing) when the internals it expects are
not there, so a PyTensor or JAX release that moves them costs speed, not
correctness. Importing this module checks the installed versions against
synkhronos's own requirements of them (``pyproject.toml``: :func:`supported_versions`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import pathlib
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable, NamedTuple

__all__ = [
    "coordination_service", "READS_INTERNALS_OF", "supported_versions", "check_versions",
    "jit_parts", "JitParts", "jax_backend_exists", "detach_inherited_jax", "detect_jax_cluster",
    "distributed_client", "service_served_elsewhere", "join_errors_raised", "unsampleable_in_jax",
    "cache_writes_from_every_process", "compile_once_per_host", "check_function_graph",
    "calls_host_code", "storage_cell", "buffer_address", "device_put_bare",
]

#: the libraries whose internals are read here: their supported versions are synkhronos's own
#: requirements of them (pyproject.toml, read from the installed package's metadata)
READS_INTERNALS_OF = ("pytensor", "jax", "jaxlib")


def supported_versions() -> dict:
    """``{name: SpecifierSet}`` of the libraries in :data:`READS_INTERNALS_OF`, as synkhronos requires them.

    Read from the installed metadata, or, in a checkout that was never installed, from its
    ``pyproject.toml``; empty when neither is there.

    Examples
    --------
    >>> str(supported_versions()["jax"])
    '<0.13,>=0.11.2'
    """
    from packaging.requirements import Requirement
    try:
        requirements = importlib.metadata.requires("synkhronos") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = _checkout_requirements()
    found = {}
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name in READS_INTERNALS_OF and requirement.marker is None:
            found[requirement.name] = requirement.specifier
    return found


def check_versions() -> None:
    """Raise ImportError if an installed library is outside the versions synkhronos supports.

    Examples
    --------
    >>> check_versions()        # the test environment has supported versions
    """
    for name, specifier in supported_versions().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"synkhronos needs {name}; install it with pip install "
                              f"'{name}{specifier}'") from None
        if not specifier.contains(installed, prereleases=True):
            raise ImportError(f"synkhronos supports {name}{specifier}, but {installed} is installed; "
                              f"install a supported version (pip install -e . picks one)")


class JitParts(NamedTuple):
    """The pieces of a PyTensor function linked by the JAX linker (see :func:`jit_parts`)."""

    jit: Callable[..., Any]       #: the jitted JAX graph, called on every input cell's value
    cells: list                   #: every input's storage cell, explicit inputs first
    n_args: int                   #: how many of ``cells`` are the explicit arguments
    updates: list                 #: (output index, shared variable's storage cell) per update
    n_outputs: int                #: how many of the graph's outputs the function returns
    traced: Callable[..., Any] | None  #: the function ``jit`` traces, None if ``jit`` is not plain


def jit_parts(fn: Any) -> JitParts | None:
    """The jitted graph and storage cells of ``fn``, or None if ``fn`` is not simply one jitted graph.

    Parameters
    ----------
    fn : pytensor.compile.function.types.Function
        Compiled by PyTensor's JAX linker.
    """
    vm = getattr(fn, "vm", None)
    jit, cells = getattr(vm, "jit_fn", None), getattr(vm, "inputs", None)
    explicit = getattr(fn, "_input_storage_data", None)
    updates = getattr(fn, "_update_input_storage", None)
    n_outputs = getattr(fn, "_n_returned_outputs", None)
    if jit is None or cells is None or explicit is None or updates is None or n_outputs is None or \
            any(cell is not own for cell, own in zip(cells, explicit)):
        return None
    n_args = sum(1 for inp in fn.maker.inputs if not inp.implicit)
    # PyTensor's linker returns ``jax.jit(traced)`` itself unless some input is a static shape
    # (then a wrapper that converts those, which has no lower())
    traced = getattr(jit, "__wrapped__", None) if hasattr(jit, "lower") else None
    return JitParts(jit, list(cells), n_args, [(i, c.storage) for i, c in updates], n_outputs, traced)


def jax_backend_exists() -> bool:
    """True if this process has already made a JAX backend (device context)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


#: JAX objects a forked child inherited and must never destroy (see detach_inherited_jax)
_inherited: list = []


def detach_inherited_jax() -> None:
    """In a child made by ``os.fork()``: keep the parent's JAX runtime objects alive, and forget them.

    The child inherits the coordination client, the backend and the compiler's
    thread pool without the threads that serve them; destroying them at the
    child's exit (JAX's exit hook does) waits for those threads forever or
    crashes, and talks to the parent's coordination service in the parent's
    name. They get one reference more here (their destructors never run in the
    child) and are taken out of JAX's global state, so the child's exit leaves
    them alone.
    """
    if "jax" not in sys.modules:
        return
    from jax._src import distributed, xla_bridge
    from jax._src.interpreters import mlir
    state = distributed.global_state
    # the compiler's thread pool too: destroyed at the child's exit, it joins threads the child
    # does not have (a segmentation fault)
    held = [state.client, state.service, state.preemption_sync_manager,
            xla_bridge._default_backend, *xla_bridge._backends.values(), mlir.global_thread_pool]
    for obj in held:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _inherited.extend(held)
    state.client = state.service = state.preemption_sync_manager = None
    xla_bridge._default_backend = None
    xla_bridge._backends = {}


check_versions()

from .compiler import cache_writes_from_every_process, compile_once_per_host  # noqa: E402


def detect_jax_cluster(timeout: int = 60) -> tuple[str, str | None, int | None, int | None] | None:
    """What JAX's own cluster detection finds: ``(name, coordinator, n_tasks, task)`` or None.

    The environments are JAX's (Slurm, Open MPI, Kubernetes, Cloud TPU, ...);
    the opt-in ones (mpi4py) are not tried. Importing JAX here makes no backend.
    """
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return None
    env = next((e for e in getattr(ClusterEnv, "_cluster_types", [])
                if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return None
    address, n_tasks, task, _ = ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, timeout)
    return env.__name__, address, n_tasks, task


def distributed_client() -> Any:
    """This process's client of JAX's coordination service (after ``jax.distributed.initialize``)."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("this process has not joined the JAX distributed runtime")
    return client


@contextlib.contextmanager
def service_served_elsewhere() -> Iterator[None]:
    """Within the block, ``jax.distributed.initialize`` in process 0 starts no coordination
    service of its own: one is served by another process (see
    :mod:`synkhronos.platform.coordination`)."""
    from jax._src import distributed
    make = distributed._jax.get_distributed_runtime_service
    distributed._jax.get_distributed_runtime_service = lambda *args, **kwargs: None
    try:
        yield
    finally:
        distributed._jax.get_distributed_runtime_service = make


@contextlib.contextmanager
def join_errors_raised() -> Iterator[None]:
    """Within the block, a failed ``jax.distributed.initialize`` raises instead of ending the process.

    JAX's coordination client reports its errors through a callback whose
    default ends the process (``LOG(FATAL)``): a peer that never joins would
    end this one with no Python exception and nothing cleaned up. The client
    made in the block gets a callback that keeps the error until its
    ``connect()`` has returned, so the failed join raises there; once joined,
    an error ends the process as JAX's own callback does (a node declared lost
    cannot rejoin).
    """
    from jax._src import distributed
    make = distributed._jax.get_distributed_runtime_client
    joined: list = []

    def on_error(status: Any) -> None:
        if joined:
            sys.stderr.write(f"Terminating process because the JAX distributed service detected "
                             f"fatal errors: {status}\n")
            sys.stderr.flush()
            os.abort()

    def client(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("missed_heartbeat_callback", on_error)
        made = make(*args, **kwargs)
        connect = made.connect

        def connect_then_fatal() -> None:
            connect()
            joined.append(True)
        try:
            made.connect = connect_then_fatal
        except AttributeError:       # a client whose methods cannot be replaced: join as JAX does
            joined.append(True)
        return made
    distributed._jax.get_distributed_runtime_client = client
    try:
        yield
    finally:
        distributed._jax.get_distributed_runtime_client = make


def unsampleable_in_jax(variables: Sequence[Any]) -> list[tuple[Any, str]]:
    """The random variables of the graphs of ``variables`` that PyTensor's JAX backend cannot sample.

    PyTensor looks a distribution's JAX sampler up only when JAX traces the
    graph (the first call); asking here finds the missing ones when a function
    is built. Returns ``(node, PyTensor's message)`` for each.
    """
    try:
        from pytensor.graph.traversal import applys_between, graph_inputs
        from pytensor.link.jax.dispatch.random import jax_sample_fn
        from pytensor.tensor.random.op import RandomVariable
    except ImportError:
        return []
    nodes = applys_between(list(graph_inputs(variables)), variables)
    missing = []
    for node in nodes:
        if isinstance(node.op, RandomVariable):
            try:
                jax_sample_fn(node.op, node=node)
            except NotImplementedError as e:
                missing.append((node, str(e)))
    return missing


def check_function_graph(inputs: Sequence[Any], outputs: Sequence[Any],
                         updates: Sequence[tuple[Any, Any]] = (), givens: Sequence[tuple[Any, Any]] = (),
                         mode: Any = None, **options: Any) -> None:
    """Raise what ``pytensor.function(inputs, outputs, updates=, givens=, **options)`` would raise
    before rewriting the graph, at a fraction of its cost: it stops short of the rewrites and the
    linking (``pytensor.function`` does both in its ``FunctionMaker``).

    >>> import pytensor.tensor as pt
    >>> x, y = pt.vector("x"), pt.vector("y")
    >>> check_function_graph([x], [x + y])
    Traceback (most recent call last):
    ...
    pytensor.graph.utils.MissingInputError: Input 1 (y) of the graph ...
    """
    try:
        from pytensor.compile.maker import FunctionMaker
        from pytensor.compile.mode import get_mode
        from pytensor.compile.rebuild import construct_function_ins_and_outs
    except ImportError:
        return          # the first build raises it instead
    keep = {k: options[k] for k in ("rebuild_strict", "allow_input_downcast", "no_default_updates")
            if k in options}
    ins, outs = construct_function_ins_and_outs(list(inputs), list(outputs), updates=list(updates),
                                                givens=list(givens), **keep)
    FunctionMaker(ins, outs, get_mode(mode), accept_inplace=options.get("accept_inplace", False),
                  on_unused_input=options.get("on_unused_input"), no_fgraph_prep=True)


def calls_host_code(traced: Any) -> bool:
    """True if a traced JAX function (``jax.jit(f).trace(...)``) calls Python on the host anywhere.

    A host callback (``jax.pure_callback``, ``io_callback``, ``jax.debug``
    prints) runs Python while the device computes, and an exception there
    fails the computation after it was dispatched. Unknown internals count as
    a callback: the caller then takes the careful path.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> calls_host_code(jax.jit(lambda x: x + 1).trace(jnp.ones(2)))
    False
    >>> def host(x):
    ...     return x
    >>> calls_host_code(jax.jit(lambda x: jax.pure_callback(host, x, x)).trace(jnp.ones(2)))
    True
    """
    try:
        from jax._src.core import subjaxprs
        pending = [traced.jaxpr]
        while pending:
            jaxpr = pending.pop()
            jaxpr = getattr(jaxpr, "jaxpr", jaxpr)      # a closed jaxpr holds its jaxpr
            if any("callback" in eqn.primitive.name for eqn in jaxpr.eqns):
                return True
            pending.extend(subjaxprs(jaxpr))
    except Exception:
        return True
    return False


def storage_cell(var: Any) -> list:
    """The one-item list in which PyTensor keeps a shared variable's value (every compiled
    function reading the variable reads that list)."""
    return var.container.storage


def device_put_bare(host: Any, device: Any) -> Any:
    """``jax.device_put(host, device)`` for a numpy array of a dtype JAX keeps, through the C++
    call that ``device_put`` ends in, without its Python bookkeeping (about seven times faster
    for a small array); None where that call is not there or does not fit ``host``.

    On CPU the device array adopts ``host``'s memory (64-byte aligned) without a copy, as
    ``device_put`` does.
    """
    if not _BARE_PUT:
        _BARE_PUT.append(_bare_put_parts())
    parts = _BARE_PUT[0]
    if parts is None:
        return None
    put, shaped_array, single_device, canonical = parts
    key = (host.shape, host.dtype, device)
    cached = _BARE_PUT_ARGS.get(key)
    if cached is None:
        if canonical(host.dtype) != host.dtype:
            return None
        if len(_BARE_PUT_ARGS) > 4096:
            _BARE_PUT_ARGS.clear()
        cached = _BARE_PUT_ARGS[key] = (shaped_array(host.shape, host.dtype), single_device(device))
    try:
        return put(cached[0], cached[1], [host], [device], True)
    except Exception:
        return None


def _bare_put_parts() -> tuple[Callable[..., Any], type, type, Callable[[Any], Any]] | None:
    try:
        import jax
        from jax._src import core
        from jax._src.lib import xla_client
        from jax.sharding import SingleDeviceSharding
        return (xla_client.batched_device_put, core.ShapedArray, SingleDeviceSharding,
                jax.dtypes.canonicalize_dtype)
    except Exception:
        return None


#: the C++ call and the classes device_put_bare uses (found at its first use), and per (shape,
#: dtype, device) the abstract value and sharding it hands JAX
_BARE_PUT: list = []
_BARE_PUT_ARGS: dict = {}


def _checkout_requirements() -> list[str]:
    """The dependencies in the ``pyproject.toml`` of the checkout synkhronos runs from, if any."""
    import tomllib
    path = pathlib.Path(__file__).resolve().parents[3] / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []
    return list(project.get("dependencies", [])) if project.get("name") == "synkhronos" else []


def backend_clients() -> list:
    """Weak references to the clients of JAX's backends made so far (none is made here)."""
    from jax._src import xla_bridge
    return [weakref.ref(client) for client in xla_bridge._backends.values()]


def forget_devices() -> None:
    """Drop what this module keeps of the backend's devices, so that the backend, and a GPU's
    memory, can go when the runtime closes."""
    _BARE_PUT_ARGS.clear()


def buffer_address(array: Any) -> int:
    """The address of a CPU device array's memory (``unsafe_buffer_pointer``)."""
    return array.unsafe_buffer_pointer()


def coordination_service(address: str, n_processes: int, heartbeat_timeout: int) -> Any:
    """Start JAX's coordination service in this process (what ``jax.distributed.initialize``
    starts in process 0), recoverable: a task that leaves may join again."""
    from jax._src.lib import _jax
    return _jax.get_distributed_runtime_service(
        address, n_processes, heartbeat_timeout=heartbeat_timeout, shutdown_timeout=10,
        recoverable=True)
