"""The JAX runtime of one process: platform, threads, multi-process initialization.

Every process (master and workers) runs :func:`initialize_process` with its
own rank. The same code serves CPU and GPU: only the JAX platform differs, and
XLA picks the collective library (Gloo on CPU here, NCCL on NVIDIA GPUs).

Precision policy: JAX computes in 64 bit only with ``jax_enable_x64``, and
PyTensor's JAX backend ties that flag to ``pytensor.config.floatX`` (on for
float64, off for float32) when it is first imported. synkhronos keeps the same
rule but applies it in every process, from the master's current floatX, each
time functions are compiled: ranks that disagreed would exchange buffers of
different sizes in a collective.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import compile_cache, compile_spans, coordination, cpu_blas, cpu_tuning, internals
from .native_output import RECOVERABLE_TASKS, TASK_WATCH_CANCELLED, TASK_WATCH_DETAIL, native_lines_dropped
from .process_changes import changes

if TYPE_CHECKING:
    import jax

__all__ = ["backend_exists", "count_devices", "default_platform", "configure_environment",
           "initialize_process", "device_cores", "platform", "shutdown_process", "ENV_VARS",
           "set_precision", "keep_generated_source", "forget_runtime_in_child", "has_gpu_plugin", "use_compile_cache",
           "import_jax", "import_modules", "global_random_states_kept", "drop_backend"]

ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
            "TF_CPP_MIN_LOG_LEVEL")
_GPU_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-rocm7-plugin", "jax-rocm60-plugin")

log = logging.getLogger(__name__)


@contextlib.contextmanager
def global_random_states_kept() -> Iterator[None]:
    """Give ``numpy.random``'s and ``random``'s global states back as they were when the block began.

    Examples
    --------
    >>> position, python_state = np.random.get_state()[2], random.getstate()
    >>> with global_random_states_kept():
    ...     _ = np.random.rand(10), random.random()
    >>> np.random.get_state()[2] == position, random.getstate() == python_state
    (True, True)
    """
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def import_jax() -> ModuleType:
    """The ``jax`` module, imported without moving the global random states.

    Importing JAX draws from numpy's global generator (its Kubernetes cluster
    module draws retry delays when it is defined), and a script that seeds
    numpy and then calls ``fork()`` would draw other numbers than without
    synkhronos. Every import of JAX in this module goes through here, and
    the master's first one is in :func:`initialize_process` (``fork()``).
    """
    if "jax" in sys.modules:
        return sys.modules["jax"]
    with global_random_states_kept():
        import jax
    return jax


def backend_exists() -> bool:
    """True if this process has already created a JAX backend (device context)."""
    return internals.jax_backend_exists()


def has_gpu_plugin() -> bool:
    return bool(_installed_gpu_plugins())


def _count_in_subprocess(platform: str) -> int:
    """Count devices of ``platform`` in a throwaway process (no context here)."""
    code = ("import jax, json; "
            f"print(json.dumps(jax.local_device_count({platform!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return 0
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_platform() -> str:
    """``"gpu"`` when a JAX GPU plugin is installed and finds a device, else ``"cpu"``; and
    ``"cpu"`` whenever ``JAX_PLATFORMS`` names no GPU platform (``JAX_PLATFORMS=cpu``), as for JAX."""
    named = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if named and not {"gpu", "cuda", "rocm"} & set(named):
        return "cpu"
    if has_gpu_plugin() and _count_in_subprocess("gpu") > 0:
        return "gpu"
    return "cpu"


def count_devices(platform: str | None = None) -> int:
    """Number of devices synkhronos would use, without creating a JAX context here.

    On CPU this is the number of cores available to this process (one process
    per core); on GPU it is counted in a throwaway subprocess.
    """
    platform = platform or default_platform()
    if platform == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cast(int, os.cpu_count())
    return _count_in_subprocess(platform)


def jax_platforms(platform: str) -> str:
    """The value of JAX's ``jax_platforms`` for computing on ``platform`` ("cpu" or "gpu").

    JAX expands "gpu" to every GPU platform it knows (CUDA, ROCm, oneAPI) and
    fails on those whose plugin is missing, so the installed plugin's platform
    is named; the CPU comes second, for host callbacks (``jax.pure_callback``
    runs on a CPU device).

    Examples
    --------
    >>> jax_platforms("cpu"), jax_platforms("gpu") in ("cuda,cpu", "rocm,cpu")
    ('cpu', True)
    """
    if platform != "gpu":
        return platform
    rocm = any(name.startswith("jax-rocm") for name in _installed_gpu_plugins())
    return ("rocm" if rocm else "cuda") + ",cpu"


def _installed_gpu_plugins() -> list[str]:
    found = []
    for name in _GPU_PLUGINS:
        try:
            importlib.metadata.version(name)
            found.append(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


#: the thread flags of this process's runtimes, once chosen: XLA reads its flags once per process (at
#: its first backend), and a program's options hold them, so a runtime with another thread count
#: would have its master compile every program with other options than its workers', and the
#: processes of a host could no longer compile each program once between them
_THREAD_FLAGS: list[list[str]] = []


def _thread_flags(threads: int) -> list[str]:
    """XLA's flags for ``threads`` threads a process: the first runtime's, in every later one."""
    if not _THREAD_FLAGS:
        _THREAD_FLAGS.append(["--xla_cpu_multi_thread_eigen=false"] if threads == 1 else [])
    return _THREAD_FLAGS[0]


def configure_environment(env: dict[str, str], platform: str, threads: int) -> dict[str, str]:
    """Set the variables that must be in place before JAX/BLAS start in a process.

    ``threads`` is the number of CPU threads this process may use (XLA's CPU
    thread pool and BLAS). Processes sharing cores otherwise oversubscribe them,
    and each one's default pools slow the others' steps several-fold. XLA's
    own flags for it are the first runtime's in every later runtime of the
    process: XLA reads them once, and each rank's pool is sized by its cores
    (:func:`device_cores`) anyway.
    """
    env["JAX_PLATFORMS"] = jax_platforms(platform)
    flags = env.get("XLA_FLAGS", "").split()
    if platform == "cpu":
        ours = ["--xla_force_host_platform_device_count=1", *_thread_flags(threads)]
        # once each, however often applied: JAX's compile cache keys programs by these flags
        flags += [f for f in ours if f not in flags]
    env["XLA_FLAGS"] = " ".join(flags)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    # XLA's C++ warnings (e.g. one per process about the recoverable-task mode we enable)
    # would drown the user's output; errors still show. Set it yourself to see everything.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def platform() -> str:
    """The JAX platform this process computes on ("cpu", "gpu", ...)."""
    jax = import_jax()
    return jax.default_backend()


def import_modules() -> None:
    """Import JAX and PyTensor's JAX backend without making a JAX backend (the imports take about
    a second: the master does them while its workers start)."""
    import_jax()
    import pytensor.link.jax.dispatch  # noqa: F401


def set_precision(float_x: str) -> None:
    """Apply the precision policy: ``floatX`` in PyTensor, and 64-bit JAX iff it is float64."""
    import pytensor

    # its import turns 64-bit floats on, as PyTensor's JAX backend needs them (they stay on after
    # close(), as they would for a user of that backend); the flag is set here after it
    import pytensor.link.jax.dispatch  # noqa: F401
    earlier = pytensor.config.floatX
    changes.record("pytensor.config.floatX", lambda: setattr(pytensor.config, "floatX", earlier))
    pytensor.config.floatX = float_x
    _configure_jax("jax_enable_x64", float_x == "float64")
    if float_x != "float64":
        _quiet_truncation_notices()


def keep_generated_source(directory: str) -> None:
    """Have PyTensor keep the Python source of the functions it compiles in ``directory`` (one file
    per distinct source) until the runtime stops, unless the user chose a place
    (``pytensor.config.generated_src_dir``).

    PyTensor's default writes a new file in the temporary directory at every
    compile and never removes it; every rank compiles every function, per
    shape, so a day of runs would leave thousands there.
    """
    import pytensor
    if not hasattr(pytensor.config, "generated_src_dir") or pytensor.config.generated_src_dir:
        return
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError:
        return          # (a read-only home, another user's directory) PyTensor's default place

    def give_back() -> None:
        if pytensor.config.generated_src_dir == directory:      # (not a place the user set since)
            pytensor.config.generated_src_dir = ""
    changes.record("pytensor.config.generated_src_dir", give_back)
    pytensor.config.generated_src_dir = directory


#: JAX's notice, at each trace, that a 64-bit dtype computes in 32 bits (with x64 off, as floatX
#: float32 has it): PyTensor's own graphs hold int64 index arithmetic (``arange``, shapes) and
#: float64 accumulators, so every float32 program would print it
TRUNCATION_NOTICE = r"Explicitly requested dtype \w+ requested in \w+ is not available"


def _quiet_truncation_notices() -> None:
    """Ignore :data:`TRUNCATION_NOTICE` in this process until close (a float64 cast the user wrote is
    said once, in one line, when the function is built: see synkhronos.api.function_parts.recording)."""
    if any(f[0] == "ignore" and getattr(f[1], "pattern", None) == TRUNCATION_NOTICE
           for f in warnings.filters):
        return
    warnings.filterwarnings("ignore", message=TRUNCATION_NOTICE, category=UserWarning)
    entry = warnings.filters[0]

    def restore() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]  # a list at run time
            getattr(warnings, "_filters_mutated", lambda: None)()
    changes.record("the filter of JAX's truncation notices", restore)


def _configure_jax(name: str, value: Any) -> None:
    """Set JAX's configuration ``name``, recording its earlier value in the process's changes."""
    jax = import_jax()
    earlier = jax.config.values[name]
    changes.record(f"JAX's {name}", lambda: jax.config.update(name, earlier))
    jax.config.update(name, value)


#: seconds without a heartbeat after which JAX's coordination service counts a process of several
#: nodes as dead (a dead node is then named within the fault bound of ten seconds)
NODE_HEARTBEAT_TIMEOUT = 4


def use_compile_cache(directory: str | None) -> None:
    """Keep every program this process compiles in JAX's persistent cache at ``directory`` (None: off).

    Every program, however quick to compile or small (JAX's defaults keep only
    those that took a second), within :data:`~.compile_cache.MAX_BYTES`
    (least recently used first out; JAX then locks the directory, so runs at
    once share it), by every process (JAX's own writes from process 0 only).
    See :mod:`synkhronos.platform.compile_cache`.
    """
    if directory is None:
        _configure_jax("jax_enable_compilation_cache", False)
        internals.compile_once_per_host(None)      # and no locks in an earlier runtime's cache
        return
    _configure_jax("jax_enable_compilation_cache", True)
    _configure_jax("jax_compilation_cache_dir", directory)
    _configure_jax("jax_persistent_cache_min_compile_time_secs", 0.0)
    _configure_jax("jax_persistent_cache_min_entry_size_bytes", 0)
    _configure_jax("jax_compilation_cache_max_size", compile_cache.MAX_BYTES)
    internals.cache_writes_from_every_process()
    changes.record("the compile cache's locks", lambda: internals.compile_once_per_host(None))
    locks = os.path.join(directory, "synkhronos-compiling")
    os.makedirs(locks, exist_ok=True)
    internals.compile_once_per_host(locks, while_compiling=cpu_tuning.on_every_core)


def served_apart(several_nodes: bool, master_rank: int) -> bool:
    """Whether JAX's coordination service runs in a process of its own (started by node 0's
    master), not in process 0: on several nodes, whose node 0 may be lost; and where the master
    is not process 0 (a worker would serve it, and JAX ends every process whose service stopped
    before it left: the workers leave first).

    Examples
    --------
    >>> served_apart(False, 0), served_apart(False, 1), served_apart(True, 0)
    (False, True, True)
    """
    return several_nodes or master_rank != 0


def heartbeat_timeout(several_nodes: bool, timeout: float) -> int:
    """Seconds without a heartbeat after which the coordination service counts a process dead:
    :data:`NODE_HEARTBEAT_TIMEOUT` on several nodes, else the start-up ``timeout`` (at least 10)."""
    return NODE_HEARTBEAT_TIMEOUT if several_nodes else max(10, int(timeout))


def initialize_process(rank: int, n_ranks: int, coordinator: str, platform: str, timeout: float,
                       float_x: str = "float64", threads: int | None = None, local_rank: int | None = None,
                       n_local: int | None = None, cores: Iterable[int] | None = None,
                       compile_cache_dir: str | None = None, master_rank: int = 0) -> jax.Device:
    """Join the JAX multi-process runtime as process ``rank`` with one local device.

    ``coordinator`` is the ``host:port`` of JAX's coordination service, which
    process 0 serves, bound to that address only, or a process of its own
    where :func:`served_apart` (:mod:`synkhronos.platform.coordination`);
    ``master_rank`` is the rank of the runtime's master. ``local_rank`` and
    ``n_local`` place the process among its node's processes (default: one
    node, ``rank`` of ``n_ranks``); on several nodes a dead process is noticed
    within :data:`NODE_HEARTBEAT_TIMEOUT` seconds.

    On CPU, the process keeps freed memory for reuse, numpy's BLAS gets the
    process's share of the cores and XLA's thread pool is made on ``cores``,
    this rank's cores (:func:`device_cores`; see :mod:`synkhronos.platform.cpu_tuning`).
    :func:`shutdown_process` undoes these changes where it can. Programs are
    kept in JAX's persistent cache at ``compile_cache_dir`` (None: not kept;
    :func:`use_compile_cache`).
    """
    jax = import_jax()
    if platform == "cpu":
        cpu_tuning.keep_freed_memory_for_reuse()
        # numpy's BLAS gets the process's own share of the cores even when XLA's pool spans them
        # all: OpenBLAS's threads wait spinning, and two processes' pools on the same cores slow
        # each other's steps down badly
        share = max(1, (os.cpu_count() or 1) // (n_local or n_ranks))
        cpu_blas.limit_blas_threads(min(threads, share) if threads else share)
    _configure_jax("jax_platforms", jax_platforms(platform))
    set_precision(float_x)
    keep_generated_source(compile_cache.generated_source_directory())
    # A dead worker must become an exception in the master, not a process abort.
    _configure_jax("jax_enable_recoverability", True)
    if platform == "cpu":
        _configure_jax("jax_cpu_collectives_implementation", "gloo")
        # every process computes on one CPU device and waits for its results anyway: dispatching
        # a program to a thread of its own costs a small step more than running it in the caller
        _configure_jax("jax_cpu_enable_async_dispatch", False)
    # JAX's preemption service catches SIGTERM and only logs it (a `kill`, a scheduler's or `docker
    # stop`'s SIGTERM would no longer end the script); synkhronos has no use for it
    _configure_jax("jax_enable_preemption_service", False)
    use_compile_cache(compile_cache_dir)
    compile_spans.watch()
    local_rank = rank if local_rank is None else local_rank
    several_nodes = n_local is not None and n_local != n_ranks
    # on several nodes the coordination service runs in a process of its own (see
    # synkhronos.platform.coordination), started by node 0's master
    apart = served_apart(several_nodes, master_rank)
    served_elsewhere = internals.service_served_elsewhere() if apart else contextlib.nullcontext()
    # XLA sizes its CPU pool from the affinity when the client is made (inside initialize), and
    # ignores its thread flags; the pool's threads keep the binding, one core set per rank as MPI
    # binds its ranks
    if (apart or rank != 0) and not coordination.wait_until_served(coordinator, timeout):
        raise TimeoutError(f"no coordination service listened at {coordinator} within {timeout:.1f} s")
    # the service (made here in rank 0) says it has recoverable tasks, which synkhronos asks for
    with cpu_tuning.on_cores(cores), served_elsewhere, internals.join_errors_raised(), \
            native_lines_dropped(2, RECOVERABLE_TASKS):
        jax.distributed.initialize(
            coordinator_address=coordinator,
            coordinator_bind_address=coordinator,   # the given address only, never all interfaces
            num_processes=n_ranks,
            process_id=rank,
            local_device_ids=None if platform == "cpu" else [local_rank],
            initialization_timeout=int(timeout),
            heartbeat_timeout_seconds=heartbeat_timeout(several_nodes, timeout),
            shutdown_timeout_seconds=10,
        )
        return jax.local_devices()[0]      # the backend (and its thread pool) is made here


def device_cores(platform: str, threads: int | None, local_rank: int) -> list[int] | None:
    """The cores of local rank ``local_rank``'s XLA pool and computing thread, or None (any core).

    On CPU with ``threads`` per device, the rank's own share
    (:func:`synkhronos.platform.cpu_tuning.cores_of`); elsewhere None: an
    accelerator's host threads are not bound.
    """
    return cpu_tuning.cores_of(threads, local_rank) if platform == "cpu" else None


def drop_backend(collect: bool = True) -> None:
    """Drop this process's JAX backend (fork() runs only in a process without one); with
    ``collect``, garbage is collected until its client is gone."""
    from jax.extend import backend
    clients = internals.backend_clients() if collect else []
    internals.forget_devices()
    backend.clear_backends()
    _collect_until_gone(clients)


def _collect_until_gone(refs: list, generations: tuple[int, ...] = (1, 1, 2, 2, 2)) -> None:
    """Collect garbage until the objects of weak references ``refs`` are gone (at most once per
    generation of ``generations``): what holds a backend can die in stages, a finalizer freeing the
    next holder. The young generations come first: a full collection walks the whole heap."""
    for generation in generations:
        if all(ref() is None for ref in refs):
            return
        gc.collect(generation)


def forget_runtime_in_child() -> None:
    """In a child made by ``os.fork()``: leave the parent's JAX runtime alone (see
    :func:`synkhronos.platform.internals.detach_inherited_jax`)."""
    internals.detach_inherited_jax()


def shutdown_process(collect: bool = True, before_leaving: Callable[[], None] | None = None) -> None:
    """Leave the multi-process runtime and drop the backend and the compile cache, so that fork()
    can run again. What :func:`initialize_process` changed in the process (JAX's settings, the BLAS
    threads, the allocator's settings) is given back by the process's
    :data:`~synkhronos.platform.process_changes.changes`, after this.

    With ``collect``, garbage is collected until the backend is gone, before the coordination
    service stops (a process that ends next has no need). ``before_leaving()`` runs between the
    two: once the backend is gone, the process leaves the runtime at once.
    """
    if "jax" not in sys.modules:
        return
    jax = import_jax()
    from jax.experimental.compilation_cache import compilation_cache
    try:
        # the backend goes first, the reverse of its making: a GPU backend watches the coordination
        # service's tasks, and logs that watch's end (filtered here) or, outliving the service,
        # its failures when it tries again
        with native_lines_dropped(2, TASK_WATCH_CANCELLED, continued_by=TASK_WATCH_DETAIL):
            try:
                drop_backend(collect)
                if before_leaving is not None:
                    before_leaving()
            finally:
                jax.distributed.shutdown()
    finally:
        compilation_cache.reset_cache()     # JAX opens its cache once per process: the next fork anew
