"""Named POSIX shared-memory segments, and growable segments addressed by generation.

Every segment of one runtime is named ``<prefix>_<kind><generation>`` where the
prefix holds the master's pid and start time and 64 random bits, so names
cannot be guessed from outside the process group; segments are created with
owner-only permissions (0600). The pid and start time tell whose a segment is:
a run killed whole (its resource trackers too) leaves its segments, and
:func:`stale_segments` finds them, the master's process being gone (a pid
reused by another process has another start time).

We map segments with :mod:`mmap` over ``_posixshmem`` (what
:class:`multiprocessing.shared_memory.SharedMemory` uses underneath) instead of
``SharedMemory`` itself, because on Python 3.12 ``SharedMemory`` registers even
*attached* segments with the resource tracker (which then unlinks the master's
segments when a worker exits), and its ``close()`` fails while numpy views of
the buffer are alive. Here a mapping is released when its last view dies.
"""

import _posixshmem
import errno
import logging
import math
import mmap
import os
import re
import secrets
from multiprocessing import resource_tracker

import numpy as np

from .buffers import round_up

__all__ = ["new_prefix", "Segment", "GrowableSegment", "SegmentMirror", "unlink", "stale_segments",
           "remove_stale_segments", "SEGMENT_DIRECTORY"]

log = logging.getLogger(__name__)

_ALIGN = 64


#: where the system lists POSIX shared-memory segments (Linux); elsewhere nothing is swept
SEGMENT_DIRECTORY = "/dev/shm"
_NAME = re.compile(r"^synk_(\d+)_(?:(\d+)_)?[0-9a-f]{16}_")


def new_prefix():
    """Return a fresh, unguessable name prefix for one runtime's segments: its master's pid and
    start time, and 64 random bits."""
    pid = os.getpid()
    return f"synk_{pid}_{_started(pid) or 0}_{secrets.token_hex(8)}"


def _started(pid):
    """When process ``pid`` started (clock ticks since boot, from /proc), or None if it does not run."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def stale_segments(directory=SEGMENT_DIRECTORY):
    """The names of the synkhronos segments whose master no longer runs (a run killed whole).

    A segment is its master's while a process with the pid in its name runs
    and started when the name says (a name without a start time: while the pid
    runs). Nothing is listed where ``directory`` does not exist.

    Examples
    --------
    >>> any(name.startswith(new_prefix()[:12]) for name in stale_segments())    # never our own
    False
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    stale = []
    for name in names:
        found = _NAME.match(name)
        if found is None:
            continue
        pid, start = int(found.group(1)), found.group(2)
        running = _started(pid)
        if running is None or (start is not None and int(start) and running != int(start)):
            stale.append(name)
    return stale


def remove_stale_segments(directory=SEGMENT_DIRECTORY):
    """Unlink every segment :func:`stale_segments` lists; return the names removed.

    A segment another user owns, or one already gone, is left to its owner.
    """
    removed = []
    for name in stale_segments(directory):
        try:
            if unlink(name):
                removed.append(name)
        except PermissionError:
            continue
    return removed


def unlink(name, tracked=False):
    """Unlink segment ``name``; a segment already gone is not an error."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    finally:
        if tracked:
            _unregister(name)
    return True


def _unregister(name):
    try:
        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:  # the tracker may already be gone at interpreter exit
        log.debug("could not unregister segment %s from the resource tracker", name, exc_info=True)


def _reserve(fd, size):
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


def _shm_free_bytes():
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

    def __init__(self, name, size=None, create=False, track=True):
        self.name = name
        self.tracked = create and track
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
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
        self._views = {}
        if self.tracked:
            resource_tracker.register("/" + name, "shared_memory")

    def array(self, dtype, shape, offset=0):
        """Return a numpy view of ``shape`` items of ``dtype`` at byte ``offset``."""
        return np.frombuffer(self.mm, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)

    def view(self, dtype, shape):
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

    def release(self):
        """Drop this process's mapping (freed once no view of it remains)."""
        self.mm = None
        self._views = {}

    def unlink(self):
        """Remove the segment's name; mappings stay valid until released."""
        unlink(self.name, tracked=self.tracked)
        self.tracked = False


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

    def __init__(self, base, track=True):
        self.base = base
        self.track = track
        self.gen = 0
        self.segment = None

    def name(self, gen=None):
        return f"{self.base}g{self.gen if gen is None else gen}"

    @property
    def nbytes(self):
        return 0 if self.segment is None else self.segment.size

    def ensure(self, nbytes, oversize=1.0):
        """Make the segment hold at least ``nbytes``; return True if it was replaced."""
        if self.segment is not None and self.segment.size >= nbytes:
            return False
        self.free()
        self.gen += 1
        size = round_up(int(max(nbytes, 1) * oversize), _ALIGN)
        self.segment = Segment(self.name(), size, create=True, track=self.track)
        return True

    def free(self):
        if self.segment is not None:
            self.segment.unlink()
            self.segment.release()
            self.segment = None


class SegmentMirror:
    """The reading side of a :class:`GrowableSegment` in another process."""

    def __init__(self, base):
        self.base = base
        self.gen = None
        self.segment = None

    def get(self, gen):
        """Return the attached segment of generation ``gen``."""
        if gen != self.gen:
            self.release()
            self.segment = Segment(f"{self.base}g{gen}")
            self.gen = gen
        return self.segment

    def release(self):
        if self.segment is not None:
            self.segment.release()
        self.segment, self.gen = None, None
