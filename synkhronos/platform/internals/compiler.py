"""JAX's compiler, as synkhronos reads it: a host's processes compile each program once, and every
process writes JAX's persistent cache (part of :mod:`synkhronos.platform.internals`, which exports
these)."""

from __future__ import annotations

import contextlib
import os
from typing import IO, TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np

__all__ = ["cache_writes_from_every_process", "compile_once_per_host"]


def cache_writes_from_every_process() -> None:
    """Have JAX's persistent compilation cache written by every process of the runtime, not only process 0.

    JAX skips the write in any other process, so that many hosts do not write
    one shared file system at once. synkhronos keeps one cache per host, and
    its processes compile programs of their own (on CPU JAX keys a program by
    the device it runs on), which would otherwise be compiled again every run.
    The write itself stays JAX's (``put_executable_and_time``, under the
    cache's lock); only the process check is left out. Idempotent.
    """
    try:
        from jax._src import compilation_cache, compiler, config, distributed
        write = compiler._cache_write
    except (ImportError, AttributeError):
        return
    if getattr(write, "synkhronos", False):
        return

    def _cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any,
                     executable: Any) -> None:
        if distributed.global_state.process_id == 0:
            return write(cache_key, compile_time_secs, module_name, backend, executable)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:        # as JAX's own write: a failed write is a warning, never an error
            import warnings
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(e).__name__}: {e}")
        return None
    _cache_write.synkhronos = True     # type: ignore[attr-defined]
    compiler._cache_write = _cache_write


#: the compile locks of this process's runtime: their directory (None: compiles take no lock, as
#: when its cache is off or it was closed) and what surrounds each compile; set at every fork, since
#: the master outlives its runtimes (the workers are new processes each time)
_compile_locks: dict = {"directory": None, "while_compiling": None}


def compile_once_per_host(lock_directory: str | None, while_compiling: Callable | None = None) -> None:
    """Have the processes of one host compile each program once between them, through JAX's cache.

    Two things JAX does not: on CPU its cache key holds the device a program
    runs on (it leaves it out on GPU, so that processes share entries), so
    each rank's copy of a program got a key of its own; and processes that
    miss the same entry at once all compile it. Here the key leaves the
    device out on every platform, as JAX's does on GPU (the devices are given
    when an entry is loaded), and a process that misses an entry compiles it
    holding a lock on its key (a file in ``lock_directory``): another process
    missing the same entry meanwhile waits, then loads what the first one
    wrote. A lock is released when its process ends, however it ends.
    ``while_compiling()``, a context manager, surrounds each compile (the
    cores it may use).

    Each call replaces the directory of the one before: a runtime's locks sit
    in its own cache, and ``lock_directory=None`` (its cache off, or the
    runtime closed) has compiles take no lock anywhere. The functions of JAX
    are replaced once per process.
    """
    _compile_locks.update(directory=lock_directory, while_compiling=while_compiling)
    if lock_directory is None:
        return
    try:
        from jax._src import cache_key, compiler, monitoring
        hash_options = cache_key._hash_serialized_compile_options
        hash_accelerators = cache_key._hash_accelerator_config
        hash_kinds = cache_key._hash_devices
        compile_and_write = compiler._compile_and_write_cache
        read = compiler._cache_read
    except (ImportError, AttributeError):
        return
    if getattr(compile_and_write, "synkhronos", False):
        return

    def _hash_serialized_compile_options(hash_obj: Any, compile_options_obj: Any,
                                         strip_device_assignment: bool = False) -> None:
        return hash_options(hash_obj, compile_options_obj, strip_device_assignment=True)

    def _hash_accelerator_config(hash_obj: Any, accelerators: np.ndarray) -> None:
        # a CPU topology's fingerprint names the process; the host is in the cache's directory name
        if all(d.platform == "cpu" for d in accelerators.flat):
            return hash_kinds(hash_obj, accelerators)
        return hash_accelerators(hash_obj, accelerators)

    def _compile_and_write_cache(backend: Any, computation: Any, executable_devices: Any,
                                 compile_options: Any, host_callbacks: Any, module_name: str,
                                 cache_key: str) -> Any:
        def compile_it() -> Any:
            surround = _compile_locks["while_compiling"]
            with surround() if surround is not None else contextlib.nullcontext():
                return compile_and_write(backend, computation, executable_devices, compile_options,
                                         host_callbacks, module_name, cache_key)
        lock = _open_compile_lock(_compile_locks["directory"], cache_key)
        if lock is None:
            return compile_it()
        import fcntl
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            executable, _ = read(module_name, cache_key, compile_options, backend, executable_devices,
                                 host_callbacks)
            if executable is not None:          # another process compiled it meanwhile
                monitoring.record_event("/jax/compilation_cache/cache_hits")
                return executable
            executable = compile_it()
            # no lock file outlives its compile: a process that opens a new one finds the entry
            with contextlib.suppress(OSError):
                os.unlink(lock.name)
            return executable
    _compile_and_write_cache.synkhronos = True     # type: ignore[attr-defined]
    cache_key._hash_serialized_compile_options = _hash_serialized_compile_options
    cache_key._hash_accelerator_config = _hash_accelerator_config
    compiler._compile_and_write_cache = _compile_and_write_cache


def _open_compile_lock(directory: str | None, key: str) -> IO[str] | None:
    """The lock file of the program ``key`` in ``directory``, opened; None without a directory or
    where it cannot be made (the program is then compiled without a lock: a lock only saves work)."""
    if directory is None:
        return None
    try:
        os.makedirs(directory, exist_ok=True)      # the cache may have been removed since
        return open(os.path.join(directory, key + ".lock"), "a")
    except OSError:
        return None
