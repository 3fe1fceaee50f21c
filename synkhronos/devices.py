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

import contextlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys

import numpy as np

from .transport import BufferPool

__all__ = ["backend_exists", "count_devices", "default_platform", "configure_environment",
           "initialize_process", "platform", "cpu_pool_of", "shutdown_process", "ENV_VARS", "set_precision", "to_device", "adopt", "private_empty", "copy_large",
           "limit_blas_threads", "blas_threads", "wait_until_computed", "forget_runtime_in_child",
           "place_on_device"]

ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
            "TF_CPP_MIN_LOG_LEVEL")
_GPU_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-rocm7-plugin", "jax-rocm60-plugin")

log = logging.getLogger(__name__)


def backend_exists():
    """True if this process has already created a JAX backend (device context)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def _has_gpu_plugin():
    for name in _GPU_PLUGINS:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _count_in_subprocess(platform):
    """Count devices of ``platform`` in a throwaway process (no context here)."""
    code = ("import jax, json; "
            f"print(json.dumps(jax.local_device_count({platform!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return 0
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_platform():
    """``"gpu"`` when a JAX GPU plugin is installed and finds a device, else ``"cpu"``."""
    if _has_gpu_plugin() and _count_in_subprocess("gpu") > 0:
        return "gpu"
    return "cpu"


def count_devices(platform=None):
    """Number of devices synkhronos would use, without creating a JAX context here.

    On CPU this is the number of cores available to this process (one process
    per core); on GPU it is counted in a throwaway subprocess.
    """
    platform = platform or default_platform()
    if platform == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return _count_in_subprocess(platform)


def configure_environment(env, platform, threads):
    """Set the variables that must be in place before JAX/BLAS start in a process.

    ``threads`` is the number of CPU threads this process may use (XLA's CPU
    thread pool and BLAS). Processes sharing cores otherwise oversubscribe them,
    and each one's default pools slow the others' steps several-fold.
    """
    env["JAX_PLATFORMS"] = platform
    flags = env.get("XLA_FLAGS", "")
    if platform == "cpu":
        flags += " --xla_force_host_platform_device_count=1"
        if threads == 1:
            flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env["XLA_FLAGS"] = flags.strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    # XLA's C++ warnings (e.g. one per process about the recoverable-task mode we enable)
    # would drown the user's output; errors still show. Set it yourself to see everything.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def platform():
    """The JAX platform this process computes on ("cpu", "gpu", ...)."""
    import jax
    return jax.default_backend()


def set_precision(float_x):
    """Apply the precision policy: ``floatX`` in PyTensor, and 64-bit JAX iff it is float64."""
    import jax
    import pytensor
    import pytensor.link.jax.dispatch  # noqa: F401  (its import sets the flag once; we set it after)
    pytensor.config.floatX = float_x
    jax.config.update("jax_enable_x64", float_x == "float64")


def wait_until_computed(values):
    """Block until every JAX array in ``values`` (any nesting of lists, tuples, dicts) is computed.

    Other leaves (numpy arrays, numbers) are ready already.
    """
    import jax
    for leaf in jax.tree_util.tree_leaves(values):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()


def place_on_device(shared_vars):
    """Keep the host (numpy) values of tensor ``shared_vars`` as arrays on this process's device.

    A jitted function is compiled for its arguments' shardings: a numpy value
    has none, a device array (what every update and collective stores) has
    this device's, so a function first called on numpy values compiled a
    second time on its second call (a ResNet step: seconds). Placing the values
    first makes the first call's shardings the lasting ones.
    """
    from pytensor.tensor.type import TensorType
    for var in shared_vars:
        value = var.container.storage[0]
        if isinstance(value, (np.ndarray, np.generic)) and isinstance(var.type, TensorType):
            var.container.storage[0] = to_device(np.asarray(value, var.type.dtype))


_HOST_POOL = BufferPool()


def to_device(host):
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


def copy_large(dst, src):
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


def private_empty(shape, dtype):
    """A 64-byte aligned host array for :func:`adopt`, reusing a large buffer no device array holds."""
    return _HOST_POOL.empty(shape, dtype)


def adopt(private):
    """Hand ``private`` (from :func:`private_empty`, never written again) to the device.

    On CPU the device array is a view of ``private`` and keeps it alive.
    """
    import jax
    return jax.device_put(private, jax.local_devices()[0])


def keep_freed_memory_for_reuse(max_bytes=1 << 30):
    """Let glibc reuse freed blocks instead of handing their memory back to the OS at once.

    XLA's CPU client allocates a fresh buffer per result and one block of
    temporaries per execution (tens of MB for a large training step). By
    default glibc serves a large block, or one a thread's arena cannot hold,
    from a mapping of its own and unmaps it when it is freed, so every
    execution faults its memory in again, page by page, and memory-bound
    operations (transposes, elementwise) run several times slower inside the
    step than alone. Here every thread allocates from the one main heap, never
    from a mapping of its own, and the heap keeps up to ``max_bytes`` free at
    its top: a repeated step faults no page in.

    The cost: memory a process frees stays in it for its next allocations (a
    block freed below live ones is not returned to the OS until the process
    ends), as with the caching allocators (tcmalloc, jemalloc) often preloaded
    for CPU training. Linux/glibc only; a no-op elsewhere.
    """
    import ctypes
    import ctypes.util
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(m_arena_max, 1)
        libc.mallopt(m_mmap_max, 0)
        libc.mallopt(m_trim_threshold, max_bytes)
    except (OSError, AttributeError):
        log.debug("mallopt is not available here; the allocator keeps its defaults")


#: threads numpy's BLAS was limited to in this process (None: not limited; see limit_blas_threads)
_blas_threads = None
#: the thread-count setters of the OpenBLAS builds numpy ships (64-bit integer builds first)
_OPENBLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads")


def limit_blas_threads(threads):
    """Limit numpy's BLAS (OpenBLAS) in this process to ``threads`` threads; True if it worked.

    numpy reads ``OPENBLAS_NUM_THREADS`` when it is imported, which in the
    master happens before ``fork()``; so the library's own setter is called on
    the OpenBLAS numpy loaded. Products that :mod:`synkhronos.rewrites` hands to
    numpy's BLAS run in the calling XLA thread, on this rank's cores, only once
    this has worked (:func:`blas_threads`); otherwise (numpy with another BLAS,
    a platform without ``/proc``) they stay in XLA.
    """
    global _blas_threads
    import ctypes
    import numpy
    root = os.path.dirname(os.path.dirname(numpy.__file__))
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line.split()[-1].lower()}
    except OSError:
        return False
    for path in sorted(lib for lib in libs if lib.startswith(os.path.join(root, "numpy"))):
        lib = ctypes.CDLL(path)
        setter = next((getattr(lib, name) for name in _OPENBLAS_SETTERS if hasattr(lib, name)), None)
        if setter is not None:
            setter(ctypes.c_int(int(threads)))
            _blas_threads = int(threads)
            return True
    return False


def blas_threads():
    """The threads numpy's BLAS was limited to by :func:`limit_blas_threads`, or None."""
    return _blas_threads


@contextlib.contextmanager
def cpu_pool_of(threads, rank):
    """Give the XLA CPU client made inside this block ``threads`` threads on rank ``rank``'s cores.

    XLA sizes its CPU thread pool from the CPU affinity when the client is
    created and ignores its own thread flags (``intra_op_parallelism_threads``
    leaves a matrix product running on every core).
    So for the block the affinity is narrowed to this rank's share of the
    cores (cores ``[rank * threads, (rank + 1) * threads)`` of those available):
    the pool's threads, created meanwhile, keep that binding, one core set per
    rank as MPI binds its ranks. Then the calling thread's affinity is
    restored, so the rest of the process (the user's script, in the master)
    may run on any core.
    """
    original = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if not threads or threads >= len(original):
        yield
        return
    share = [original[(rank * threads + i) % len(original)] for i in range(threads)]
    os.sched_setaffinity(0, share)
    try:
        yield
    finally:
        os.sched_setaffinity(0, original)


def initialize_process(rank, n_ranks, port, platform, timeout, float_x="float64", threads=None):
    """Join the JAX multi-process runtime as process ``rank`` with one local device.

    On CPU, XLA's thread pool gets ``threads`` threads of this rank's cores (see
    :func:`cpu_pool_of`).
    """
    import jax
    if platform == "cpu":
        keep_freed_memory_for_reuse()
        # numpy's BLAS gets the process's own share of the cores even when XLA's pool spans them
        # all: OpenBLAS's threads wait spinning, and two processes' pools on the same cores slow
        # each other's steps down badly
        share = max(1, (os.cpu_count() or 1) // n_ranks)
        limit_blas_threads(min(threads, share) if threads else share)
    jax.config.update("jax_platforms", platform)
    set_precision(float_x)
    # A dead worker must become an exception in the master, not a process abort.
    jax.config.update("jax_enable_recoverability", True)
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM and only logs it (a `kill`, a scheduler's or `docker
    # stop`'s SIGTERM would no longer end the script); synkhronos has no use for it
    jax.config.update("jax_enable_preemption_service", False)
    address = f"127.0.0.1:{port}"
    with cpu_pool_of(threads if platform == "cpu" else None, rank):
        jax.distributed.initialize(
            coordinator_address=address,
            coordinator_bind_address=address,   # loopback only, never all interfaces
            num_processes=n_ranks,
            process_id=rank,
            local_device_ids=None if platform == "cpu" else [rank],
            initialization_timeout=int(timeout),
            heartbeat_timeout_seconds=max(10, int(timeout)),
            shutdown_timeout_seconds=10,
        )
        return jax.local_devices()[0]      # the backend (and its thread pool) is made here


#: JAX objects a forked child inherited and must never destroy (see forget_runtime_in_child)
_inherited = []


def forget_runtime_in_child():
    """In a child made by ``os.fork()``: detach it from the parent's JAX runtime, touching nothing.

    The child inherits the coordination client, the backend and the compiler's
    thread pool without the threads that serve them; shutting them down at the
    child's exit (JAX's exit hook does) waits for those threads forever or
    crashes, and talks to the parent's coordination service in the parent's
    name. They are kept alive here (one reference more, so their destructors
    never run in the child) and taken out of JAX's global state, so that the
    child's exit leaves them alone.
    """
    if "jax" not in sys.modules:
        return
    import ctypes
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


def shutdown_process():
    """Leave the multi-process runtime and drop the backend, so fork() can run again."""
    if "jax" not in sys.modules:
        return
    import jax
    try:
        jax.distributed.shutdown()
    finally:
        from jax.extend import backend
        backend.clear_backends()
