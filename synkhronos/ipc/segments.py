"""Named POSIX shared-memory segments, and growable segments addressed by generation.

Every segment of one runtime is named ``<prefix>_<kind><generation>`` where the
prefix holds the master's pid and 64 random bits, so names cannot be guessed
from outside the process group; segments are created with owner-only
permissions (0600).

A run is alive while a process holds the lock on its ``<prefix>_live``
segment (a :class:`Claim`), not while the pid in its name runs: a run in a
container that shares ``/dev/shm`` with the host (``docker run --ipc=host``)
names its segments with a pid of its own PID namespace, which means nothing
here. The kernel lets go of the lock when the holder dies, however it dies, so
a run killed whole (its resource trackers too) leaves segments that
:func:`stale_segments` finds. An entry of ``/dev/shm`` that is not this user's
regular file is never ours to remove, whatever its name.

We map segments with :mod:`mmap` over ``_posixshmem`` (what
:class:`multiprocessing.shared_memory.SharedMemory` uses underneath) instead of
``SharedMemory`` itself, because on Python 3.12 ``SharedMemory`` registers even
*attached* segments with the resource tracker (which then unlinks the master's
segments when a worker exits), and its ``close()`` fails while numpy views of
the buffer are alive. Here a mapping is released when its last view dies.
"""

from __future__ import annotations

import _posixshmem
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .buffers import round_up

__all__ = ["new_prefix", "Claim", "Segment", "GrowableSegment", "SegmentMirror", "unlink", "unlink_if_ours",
           "Sweep", "stale_segments", "remove_stale_segments", "SEGMENT_DIRECTORY"]

log = logging.getLogger(__name__)

_ALIGN = 64


#: where the system lists POSIX shared-memory segments (Linux); elsewhere nothing is swept
SEGMENT_DIRECTORY = "/dev/shm"
#: a segment's name: the run's prefix (a pid, an optional number, 64 random bits), then its kind
_NAME = re.compile(r"^(synk_\d+_(?:\d+_)?[0-9a-f]{16})_")
#: the kind of the segment whose lock says that a run is alive
_LIVE = "live"
#: how often a claim is made again when a sweep removed it before it was held
_CLAIM_TRIES = 5


def new_prefix() -> str:
    """Return a fresh, unguessable name prefix for one runtime's segments: its master's pid (to
    tell a reader whose they are) and 64 random bits."""
    return f"synk_{os.getpid()}_{secrets.token_hex(8)}"


# --- which run is alive --------------------------------------------------------------------------

class Claim:
    """A run's hold on its segment prefix: a lock on ``<prefix>_live``, kept for the run's life.

    Make it before any other segment of ``prefix`` and :meth:`release` it
    after the last: a sweep removes the segments of a prefix whose lock
    nobody holds, or that has no lock segment. The lock is a shared
    ``flock`` on an open file description, which the kernel drops when the
    holder's process ends however it ends; children made by ``os.fork()``
    close their copy (they would otherwise keep a killed master's run
    looking alive), which leaves the master's lock held.

    Parameters
    ----------
    prefix : str
        The run's prefix (:func:`new_prefix`).

    Examples
    --------
    >>> claim = Claim(new_prefix())
    >>> any(name.startswith(claim.prefix) for name in stale_segments().stale)
    False
    >>> claim.release()
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.name = f"{prefix}_{_LIVE}"
        self._lock = threading.Lock()
        self._fd: int | None = None
        if os.path.isdir(SEGMENT_DIRECTORY):
            self._fd = _hold(os.path.join(SEGMENT_DIRECTORY, self.name))
            _claims.add(self)
            resource_tracker.register("/" + self.name, "shared_memory")

    def release(self) -> None:
        """Remove the lock segment, then let go of the lock (idempotent)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        _claims.discard(self)
        try:
            unlink(self.name, tracked=True)
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


#: the claims this process holds
_claims: set[Claim] = set()


def _forget_claims_in_child() -> None:
    for claim in list(_claims):
        claim._forget_in_child()
    _claims.clear()


os.register_at_fork(after_in_child=_forget_claims_in_child)


def _hold(path: str) -> int:
    """Create the file ``path`` and hold a shared lock on it; return its descriptor.

    Between the creation and the lock a sweep may find the file unheld and
    remove it; then it is made again.
    """
    for _ in range(_CLAIM_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)      # waits while a sweep that found it unheld removes it
            if _names(path, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise RuntimeError(f"could not hold the lock segment {path}: something removes it as soon "
                       f"as it is made; check what else sweeps {os.path.dirname(path)}")


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@contextmanager
def _unheld(directory: str, prefix: str) -> Iterator[bool]:
    """Within: whether no process holds the lock of run ``prefix`` (held here meanwhile, so that
    a second sweep does not work on the same run)."""
    try:
        fd = os.open(os.path.join(directory, f"{prefix}_{_LIVE}"),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:         # made first, removed last: no live run lacks it or has another's
        yield True
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


# --- finding and removing what runs that ended left -----------------------------------------------

class Sweep(NamedTuple):
    """What a sweep of the segment directory found."""

    #: names of this user's segments of runs that ended (removed, by :func:`remove_stale_segments`)
    stale: list[str]
    #: ``(name, why)`` of each entry named like a segment that is not this user's segment
    skipped: list[tuple[str, str]]


def stale_segments(directory: str = SEGMENT_DIRECTORY, remove: bool = False) -> Sweep:
    """Find (and with ``remove``, unlink) the segments of this user's runs that ended.

    A run has ended when nobody holds the lock of its ``<prefix>_live``
    segment (see :class:`Claim`), or it has none. Only this user's regular
    files are segments: a directory, a link (never followed), a fifo or
    another user's file named like one is listed in :attr:`Sweep.skipped`
    and left alone. Nothing is found where ``directory`` does not exist.

    Returns
    -------
    Sweep
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return Sweep([], [])
    runs: dict[str, list[str]] = {}
    skipped: list[tuple[str, str]] = []
    for name in names:
        found = _NAME.match(name)
        if found is None:
            continue
        why = _not_ours(os.path.join(directory, name))
        if why == "":
            runs.setdefault(found.group(1), []).append(name)
        elif why is not None:
            skipped.append((name, why))
    stale: list[str] = []
    for prefix, members in runs.items():
        members.sort(key=lambda name: name == f"{prefix}_{_LIVE}")     # its lock segment last
        with _unheld(directory, prefix) as ended:
            if ended:
                stale += _sweep_run(directory, members, remove, skipped)
    return Sweep(stale, skipped)


def remove_stale_segments(directory: str = SEGMENT_DIRECTORY) -> Sweep:
    """Unlink every segment :func:`stale_segments` finds; return the :class:`Sweep` (``stale``:
    the names removed)."""
    return stale_segments(directory, remove=True)


def _not_ours(path: str) -> str | None:
    """Why the entry at ``path`` is not this user's segment; "" if it is one; None if it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                else "a fifo" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device")
        return f"{kind}, not a segment"
    if st.st_uid != os.geteuid():
        return f"another user's (uid {st.st_uid})"
    return ""


def _sweep_run(directory: str, names: Iterable[str], remove: bool, skipped: list[tuple[str, str]]) -> list[str]:
    """The ``names`` of an ended run (unlinked, with ``remove``); add what resisted to ``skipped``."""
    swept = []
    for name in names:
        try:
            if remove:
                os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        except OSError as e:
            skipped.append((name, f"could not be removed ({e.strerror})"))
            continue
        swept.append(name)
    return swept


def unlink(name: str, tracked: bool = False) -> bool:
    """Unlink segment ``name``; a segment already gone is not an error."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    finally:
        if tracked:
            _unregister(name)
    return True


def unlink_if_ours(name: str) -> bool:
    """Unlink segment ``name`` if it is this user's regular file (a name another user made, say to
    squat the run's next names, is left alone); True if it was unlinked."""
    if _not_ours(os.path.join(SEGMENT_DIRECTORY, name)) != "":
        return False
    return unlink(name)


def _unregister(name: str) -> None:
    try:
        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:  # the tracker may already be gone at interpreter exit
        log.debug("could not unregister segment %s from the resource tracker", name, exc_info=True)


def _reserve(fd: int, size: int) -> None:
    """Give the new segment ``fd`` its ``size`` bytes of shared memory now, or raise MemoryError.

    A segment is sparse until written: without this, writing past the free
    space of /dev/shm (64 MB in a default Docker container) kills the process
    with SIGBUS instead of raising.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = _shm_free_bytes()
        raise MemoryError(
            f"shared memory is full: a segment of {size:,} bytes does not fit in /dev/shm "
            f"({'unknown' if free is None else format(free, ',')} bytes free); free Data you no "
            f"longer use, or give /dev/shm more space (Docker: docker run --shm-size=8g ...)"
        ) from None


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Segment:
    """One mapped shared-memory segment.

    Parameters
    ----------
    name : str
        Segment name without the leading slash.
    size : int
        Size in bytes; required with ``create=True``.
    create : bool
        Create the segment (it must not exist) instead of attaching to it.
    track : bool
        Register a created segment with the resource tracker, which unlinks it
        if this process dies without cleaning up. Only the process that owns a
        segment tracks it.
    """

    def __init__(self, name: str, size: int | None = None, create: bool = False, track: bool = True) -> None:
        self.name = name
        self.tracked = create and track
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                assert size is not None
                size = max(int(size), 1)
                os.ftruncate(fd, size)
                _reserve(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if create:       # nothing half-made stays behind
                unlink(name)
            raise
        finally:
            os.close(fd)
        self.size = size
        self._views: dict[tuple[np.dtype, tuple[int, ...]], np.ndarray] = {}
        if self.tracked:
            resource_tracker.register("/" + name, "shared_memory")

    def array(self, dtype: npt.DTypeLike, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """Return a numpy view of ``shape`` items of ``dtype`` at byte ``offset``."""
        return np.frombuffer(self.mm, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Like :meth:`array` at offset 0, kept for the next call with the same dtype and shape.

        Every function call views its input Data this way; the few views a
        segment is seen through are remembered instead of built each time.
        """
        key = (dtype, shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 8:
                self._views.clear()
            view = self._views[key] = self.array(dtype, shape)
        return view

    def release(self) -> None:
        """Drop this process's mapping (freed once no view of it remains); the segment is not read
        again."""
        self.mm = None  # type: ignore[assignment]
        self._views = {}

    def unlink(self) -> None:
        """Remove the segment's name; mappings stay valid until released."""
        unlink(self.name, tracked=self.tracked)
        self.tracked = False


#: names of a growable segment tried before giving up (each taken by another file is skipped)
NAME_TRIES = 1000


class GrowableSegment:
    """A segment owned by one process that is replaced by a larger one when needed.

    Each replacement bumps ``gen``; readers in other processes learn the
    generation from the control block and re-attach (see :class:`SegmentMirror`).

    Parameters
    ----------
    base : str
        Name prefix; the segment of generation ``g`` is ``f"{base}g{g}"``.
    track : bool
        Whether created segments are registered with the resource tracker.
    """

    def __init__(self, base: str, track: bool = True) -> None:
        self.base = base
        self.track = track
        self.gen = 0
        self.segment: Segment | None = None

    def name(self, gen: int | None = None) -> str:
        return f"{self.base}g{self.gen if gen is None else gen}"

    @property
    def nbytes(self) -> int:
        return 0 if self.segment is None else self.segment.size

    @property
    def made(self) -> Segment:
        """The current segment (an error before :meth:`ensure` made one, or after :meth:`free`)."""
        if self.segment is None:
            raise RuntimeError(f"shared-memory segment {self.base} was not made or was freed")
        return self.segment

    def ensure(self, nbytes: int, oversize: float = 1.0) -> bool:
        """Make the segment hold at least ``nbytes``; return True if it was replaced.

        The larger segment is made before the old one is freed, so a segment
        that cannot be made (``MemoryError``: ``/dev/shm`` full) leaves the old
        one, and what it holds, as it was. A name that another process holds
        (``/dev/shm`` is listable by every local user, and the names are
        predictable) is skipped for the next generation's.
        """
        if self.segment is not None and self.segment.size >= nbytes:
            return False
        size = round_up(int(max(nbytes, 1) * oversize), _ALIGN)
        gen = self.gen
        for _ in range(NAME_TRIES):
            gen += 1
            try:
                made = Segment(self.name(gen), size, create=True, track=self.track)
                break
            except FileExistsError:
                continue
        else:
            raise RuntimeError(f"the next {NAME_TRIES} names of shared-memory segment {self.base} "
                               f"are all held by other files in /dev/shm: another local user may "
                               f"be squatting them; remove them, or close() and fork() again "
                               f"(a new run draws a new random prefix)")
        self.free()
        self.segment, self.gen = made, gen
        return True

    def free(self) -> None:
        if self.segment is not None:
            self.segment.unlink()
            self.segment.release()
            self.segment = None


class SegmentMirror:
    """The reading side of a :class:`GrowableSegment` in another process."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.gen: int | None = None
        self.segment: Segment | None = None

    def get(self, gen: int) -> Segment:
        """Return the attached segment of generation ``gen``."""
        segment = self.segment
        if gen != self.gen or segment is None:
            self.release()
            self.segment = segment = Segment(f"{self.base}g{gen}")
            self.gen = gen
        return segment

    def release(self) -> None:
        if self.segment is not None:
            self.segment.release()
        self.segment, self.gen = None, None
