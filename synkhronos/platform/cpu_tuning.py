"""CPU-only tuning of a process: the allocator, and the cores XLA's thread pool and the rank's
computing thread run on.

:func:`restore_allocator_defaults` undoes what :func:`keep_freed_memory_for_reuse`
changed, as far as glibc allows. A rank's cores (:func:`cores_of`) take its XLA
pool (made inside :func:`on_cores`) and the thread that runs its programs: a worker's
main thread for good (:func:`stay_on_cores`), the master's only while it runs
its device's part of a loop phase or of a command that proved long
(:func:`on_cores`, used by :class:`synkhronos.runtime.channel.Channel`), so the
user's script is otherwise free to run on any core.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Iterable, Iterator

from .process_changes import changes

__all__ = ["keep_freed_memory_for_reuse", "restore_allocator_defaults", "cores_of", "on_cores", "on_every_core",
           "stay_on_cores"]

log = logging.getLogger(__name__)


def keep_freed_memory_for_reuse(max_bytes: int = 1 << 30) -> None:
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
    changes.record("the allocator's settings", restore_allocator_defaults)
    _mallopt((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, max_bytes))


def restore_allocator_defaults() -> None:
    """Give glibc back the defaults :func:`keep_freed_memory_for_reuse` changed, where it can.

    Arenas per thread, large blocks in mappings of their own and the trim
    threshold return to glibc's defaults. One change stays: glibc stops
    adjusting its mapping and trim thresholds to the program once either was
    set, and cannot be told to start again.
    """
    _mallopt((_M_ARENA_MAX, 0), (_M_MMAP_MAX, _DEFAULT_MMAP_MAX),
             (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD))


_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024


def _mallopt(*settings: tuple[int, int]) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        for param, value in settings:
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        log.debug("mallopt is not available here; the allocator keeps its settings")


def cores_of(threads: int | None, rank: int) -> list[int] | None:
    """The cores of rank ``rank`` with ``threads`` threads: ``[rank * threads, (rank + 1) * threads)``.

    Counted among the cores this process may run on, wrapping around; None
    when ``threads`` is not given or spans all of them (nothing to bind).

    Examples
    --------
    >>> cores_of(None, 1) is None
    True
    """
    original = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if not threads or threads >= len(original):
        return None
    return [original[(rank * threads + i) % len(original)] for i in range(threads)]


_pinned = threading.local()
#: the cores this process may run on, as it started (before any thread of it was bound)
_STARTED_ON = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


@contextlib.contextmanager
def on_every_core() -> Iterator[None]:
    """Run the calling thread on every core the process started with, for the block.

    For an XLA compile: XLA compiles a program on threads it starts for it,
    which take the calling thread's cores, and a compile on two cores takes
    about half the time of one on a single core. The other ranks of the host
    are idle meanwhile (they wait for the compile to load its program), so
    their cores are free for it.
    """
    if not _STARTED_ON:
        yield
        return
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _STARTED_ON)
    try:
        yield
    finally:
        os.sched_setaffinity(0, original)


@contextlib.contextmanager
def on_cores(cores: Iterable[int] | None) -> Iterator[None]:
    """Run the calling thread on ``cores`` for the block (None: leave it where it may run).

    With async dispatch off, a JAX program runs in the thread that calls it,
    which hands its matrix products to XLA's pool; a caller free to run on any
    core then competes with the other ranks' pools for their cores. A thread
    started inside the block keeps the binding: so does the pool of an XLA CPU
    client made inside it (XLA sizes its pool from the affinity and ignores its
    thread flags). Nested blocks bind once.
    """
    if cores is None or getattr(_pinned, "depth", 0) > 0:
        yield
        return
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    _pinned.depth = 1
    try:
        yield
    finally:
        _pinned.depth = 0
        os.sched_setaffinity(0, original)


def stay_on_cores(cores: Iterable[int] | None) -> None:
    """Bind the calling thread to ``cores`` for good (None: nothing to do); a worker's main thread."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
