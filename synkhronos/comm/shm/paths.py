"""Which way a large shared-memory all-reduce moves its bytes, chosen from measured times.

The shared-memory all-reduce has two ways to hand the parts of a large buffer
to the peer that reduces them:

*pipelined*
    1 MB chunks stream through small per-pair rings and are read back while
    still in the cache: per rank the memory bus carries the values once and
    the result once. Every chunk crosses from one core's cache to another's.
*published*
    each rank copies its peers' whole parts into its shared slot first (glibc
    copies that much with non-temporal stores, straight to memory), then
    every rank reduces from memory: one more pass over the bus, but no
    core-to-core transfer of recently written lines.

Which is faster depends on how far apart the cores are: with cores that
share a cache, pipelining wins; with cores that do not (on a virtual machine
the hypervisor may move the vCPUs apart, and back, while a program runs),
every chunk's trip between the cores costs more than the extra pass over
memory, and publishing wins (bench/RESULTS.md splits the all-reduce rounds by
how far apart the cores were). So the master times every large all-reduce and :class:`PathChooser` takes
the path with the lower recent time per byte, trying the other one every
``explore_every`` calls of the same size class so that a change of placement
is noticed within that many calls. Both paths add the same numbers in the
same order: the result does not depend on the path.
"""

from __future__ import annotations

import enum

__all__ = ["Path", "PIPELINED", "PUBLISHED", "PathChooser"]


class Path(enum.IntEnum):
    """The two ways a large all-reduce moves its bytes."""
    PIPELINED = 0
    PUBLISHED = 1


PIPELINED, PUBLISHED = Path


class PathChooser:
    """The master's record of how fast each path ran, and its pick for the next all-reduce.

    Sizes are grouped by their power of two (a 40 MB and a 400 MB all-reduce
    are timed apart). Per class and path the estimate is an exponentially
    weighted mean of seconds per byte; a path's first call in a class is not
    counted (it pays the first touch of new shared memory).

    Parameters
    ----------
    explore_every : int
        Every this many calls of a size class take the path not currently the faster.
    weight : float
        Weight of the newest time in the mean, in (0, 1].
    fixed : int, optional
        Always take this path (:data:`PIPELINED` or :data:`PUBLISHED`); for tests and experiments.

    Examples
    --------
    >>> paths = PathChooser(explore_every=4)
    >>> for seconds in (0.5, 0.05):                    # the first time is not counted
    ...     paths.record(400 << 20, paths.choose(400 << 20), seconds)
    >>> for seconds in (0.5, 0.08):
    ...     paths.record(400 << 20, paths.choose(400 << 20), seconds)
    >>> Path(paths.choose(400 << 20)).name.lower()
    'pipelined'
    """

    def __init__(self, explore_every: int = 10, weight: float = 0.5, fixed: int | None = None) -> None:
        self.explore_every, self.weight, self.fixed = explore_every, weight, fixed
        self.estimates: dict[tuple[int, int], float] = {}  # (size class, path) -> seconds per byte
        self.tried: set[tuple[int, int]] = set()  # (size class, path) whose first, uncounted call is done
        self.calls: dict[int, int] = {}  # size class -> calls chosen since the class was first seen

    @staticmethod
    def size_class(nbytes: int) -> int:
        return int(nbytes).bit_length()

    def choose(self, nbytes: int) -> int:
        """The path the next all-reduce of ``nbytes`` takes."""
        if self.fixed is not None:
            return self.fixed
        c = self.size_class(nbytes)
        for path in (PIPELINED, PUBLISHED):           # measure both first, the default first
            if (c, path) not in self.estimates:
                return path
        n = self.calls[c] = self.calls.get(c, 0) + 1
        best = min((PIPELINED, PUBLISHED), key=lambda p: self.estimates[c, p])
        return 1 - best if n % self.explore_every == 0 else best

    def record(self, nbytes: int, path: int, seconds: float) -> None:
        """Count an all-reduce of ``nbytes`` that took ``seconds`` on ``path``."""
        key = (self.size_class(nbytes), path)
        if key not in self.tried:
            self.tried.add(key)
            return
        rate = seconds / max(int(nbytes), 1)
        old = self.estimates.get(key)
        self.estimates[key] = rate if old is None else old + self.weight * (rate - old)
