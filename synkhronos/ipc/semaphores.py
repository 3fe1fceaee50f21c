"""Process-shared POSIX semaphores placed inside a shared-memory segment.

A :class:`Semaphore` is a ``sem_t`` at an offset of a segment every process maps;
waits are sliced, calling a check between slices, so no wait can hang on a
process that died. A wait spins first, to wake microseconds sooner, only while
spinning costs nobody: once a spin is preempted (the machine's cores are all
taken, by other jobs or more processes than cores), this process's waits block
at once for a while, longer each time it happens again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import time
from collections.abc import Sequence
from typing import Callable, Protocol

from .segments import Segment

__all__ = ["Semaphore", "semaphores_in", "SEMAPHORE_BYTES", "PREEMPTED_S", "BACK_OFF_S"]

#: bytes a semaphore takes in a segment (a sem_t, padded to its own cache line)
SEMAPHORE_BYTES = 64

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


for _fn, _args in (("sem_init", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]),
                   ("sem_post", [ctypes.c_void_p]),
                   ("sem_trywait", [ctypes.c_void_p]),
                   ("sem_timedwait", [ctypes.c_void_p, ctypes.POINTER(_Timespec)]),
                   ("sem_destroy", [ctypes.c_void_p])):
    getattr(_libc, _fn).argtypes = _args
    getattr(_libc, _fn).restype = ctypes.c_int


class SemaphoreLike(Protocol):
    """What a holder of a semaphore uses: a :class:`Semaphore`, or the :class:`ClosedSemaphore`
    it becomes once its segment is let go."""

    def post(self) -> None: ...

    def try_acquire(self) -> bool: ...

    def acquire(self, timeout: float) -> bool: ...

    def wait(self, check: Callable[[], None], spin: float = ..., slice_: float = ...) -> None: ...


class Semaphore:
    """A process-shared POSIX semaphore living at ``address`` inside a segment.

    ``memory`` (the segment's mapping) is kept alive as long as the semaphore is.
    """

    def __init__(self, address: int, memory: mmap.mmap | None = None) -> None:
        self.address = address
        self._memory = memory

    def init(self) -> None:
        if _libc.sem_init(self.address, 1, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self) -> None:
        _libc.sem_post(self.address)

    def try_acquire(self) -> bool:
        return _libc.sem_trywait(self.address) == 0

    def acquire(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; return True if acquired."""
        deadline = time.time() + timeout
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        while True:
            if _libc.sem_timedwait(self.address, ctypes.byref(ts)) == 0:
                return True
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                return False
            if err != errno.EINTR:
                raise OSError(err, "sem_timedwait failed")
            # EINTR: return to Python so a pending KeyboardInterrupt is raised.
            return False

    def wait(self, check: Callable[[], None], spin: float = 100e-6, slice_: float = 0.1) -> None:
        """Acquire, spinning up to ``spin`` seconds first while spinning is free (see
        :data:`PREEMPTED_S`), then calling ``check()`` between slices.

        ``check`` raises to abandon the wait (a dead peer, a timeout).
        """
        if spin > 0 and _may_spin():
            now = time.perf_counter()
            end, last = now + spin, now
            while now < end:
                if self.try_acquire():
                    _back_off_s[0] = BACK_OFF_S[0]
                    return
                now = time.perf_counter()
                if now - last > PREEMPTED_S:      # the kernel gave this core to another task
                    _back_off(now)
                    break
                last = now
        while not self.acquire(slice_):
            check()


class ClosedSemaphore:
    """What a :class:`Semaphore` of a segment that was let go becomes: one nobody posts any more
    (a post is lost; a wait calls ``check()`` between slices, as for a peer that never posts).

    Examples
    --------
    >>> closed = ClosedSemaphore()
    >>> closed.post(); closed.try_acquire(), closed.acquire(0.001)
    (False, False)
    """

    def post(self) -> None:
        pass

    def try_acquire(self) -> bool:
        return False

    def acquire(self, timeout: float) -> bool:
        time.sleep(timeout)
        return False

    def wait(self, check: Callable[[], None], spin: float = 0.0, slice_: float = 0.1) -> None:
        while not self.acquire(slice_):
            check()


#: a gap this long between two looks of a spinning wait means the kernel took its core away for
#: another task: the machine has no core to spare, and a spin there takes the time slice a peer
#: needs to finish what the wait waits for
PREEMPTED_S = 1e-3
#: how long this process's waits block without spinning after a spin was preempted: the first
#: time the shortest (a lone preemption is mostly the kernel's own work), doubling with each spin
#: preempted again up to the longest (other jobs keep the cores), back to the shortest once a spin
#: acquires
BACK_OFF_S = (0.01, 1.0)
#: the perf_counter time from which waits may spin again, and the back-off the next preemption gets
_spin_from = [0.0]
_back_off_s = [BACK_OFF_S[0]]


def _may_spin() -> bool:
    return time.perf_counter() >= _spin_from[0]


def _back_off(now: float) -> None:
    _spin_from[0] = now + _back_off_s[0]
    _back_off_s[0] = min(2 * _back_off_s[0], BACK_OFF_S[1])


def semaphores_in(segment: Segment, offset: int, count: int, create: bool) -> Sequence[SemaphoreLike]:
    """``count`` semaphores at ``offset`` of ``segment``, one per ``SEMAPHORE_BYTES``.

    ``create`` initializes them (the segment's creator does, once).
    """
    base = ctypes.addressof(ctypes.c_char.from_buffer(segment.mm, offset))
    sems = [Semaphore(base + SEMAPHORE_BYTES * i, segment.mm) for i in range(count)]
    if create:
        for sem in sems:
            sem.init()
    return sems
