"""All-reduce results in shared memory, adopted by every rank's CPU device without a copy.

An all-reduce result is the same on every rank, so the ranks can share one
copy: each writes its reduced chunk into a shared *region* and every rank's
device array views the whole region. That removes the all-gather copy into
a private buffer, the largest memory pass of the shared-memory all-reduce.

A region is reused only when no rank still holds a view of it. Each rank
hands out a region as a fresh ``np.frombuffer`` array over its mapping (a
*lease*): every view derived from it, and a device array that adopted it,
keeps the lease alive, so a weak reference tells when none is left. Each
rank publishes a *held* flag per region in a shared table. The master picks the region for the
next all-reduce while the workers are idle, from flags every rank refreshed
after its last collective; a stale flag only ever says "held", so a region in
use is never picked. When every region is held (the program keeps many
results alive), the all-reduce falls back to private results.
"""

from __future__ import annotations

import weakref

import numpy as np
import numpy.typing as npt

from ...ipc.buffers import round_up
from ...ipc.segments import Segment

__all__ = ["SharedResults", "MAX_REGIONS", "MIN_REGION_BYTES"]

MAX_REGIONS = 16
#: smaller results are private: malloc reuses small buffers without page faults
MIN_REGION_BYTES = 1 << 20


class SharedResults:
    """The region table and this rank's mappings of the regions.

    Parameters
    ----------
    prefix : str
        The runtime's segment prefix.
    rank, n_ranks, master_rank : int
    """

    def __init__(self, prefix: str, rank: int, n_ranks: int, master_rank: int) -> None:
        self.prefix, self.rank = prefix, rank
        self.is_master = rank == master_rank
        self.table_segment = Segment(f"{prefix}_rt", 8 * (n_ranks + 2) * MAX_REGIONS,
                                     create=self.is_master)
        table = self.table_segment.array(np.int64, (n_ranks + 2, MAX_REGIONS))
        self.held, self.sizes, self.gens = table[:n_ranks], table[n_ranks], table[n_ranks + 1]
        #: region -> (gen, Segment) mapped in this process
        self.mapped: dict[int, tuple[int, Segment]] = {}
        #: region -> weak references to the views handed out here
        self.leases: dict[int, list[weakref.ref[np.ndarray]]] = {}

    def _name(self, region: int, gen: int) -> str:
        return f"{self.prefix}_rr{region}g{gen}"

    # --- the master, while workers are idle --------------------------------------------------
    def choose(self, nbytes: int, any_size: bool = False) -> int:
        """Pick (making it if needed) a region for a result of ``nbytes``; -1 for a private result.

        Results under ``MIN_REGION_BYTES`` are private unless ``any_size`` (the caller is done with
        each result before the next all-reduce: a region then saves the result's gathering pass).
        """
        if nbytes < MIN_REGION_BYTES and not any_size:
            return -1
        self.refresh()
        free = [r for r in range(MAX_REGIONS) if not self.held[:, r].any()]
        for r in free:
            if nbytes <= self.sizes[r] <= 2 * nbytes:
                return r
        if not free:
            return -1
        region = next((r for r in free if self.sizes[r] == 0), free[0])
        self._make(region, nbytes)
        return region

    def _make(self, region: int, nbytes: int) -> None:
        if region in self.mapped:
            self._unmap(region)
        gen = int(self.gens[region]) + 1
        size = round_up(nbytes, 1 << 16)
        self.mapped[region] = (gen, Segment(self._name(region, gen), size, create=True))
        self.gens[region], self.sizes[region] = gen, size

    # --- every rank --------------------------------------------------------------------------
    def array(self, region: int, dtype: npt.DTypeLike, count: int) -> np.ndarray:
        """A fresh view of ``count`` items at the start of ``region``, marked held by this rank."""
        gen = int(self.gens[region])
        entry = self.mapped.get(region)
        if entry is None or entry[0] != gen:
            if entry is not None:
                self._unmap(region)
            entry = self.mapped[region] = (gen, Segment(self._name(region, gen)))
        self.held[self.rank, region] = 1
        lease = np.frombuffer(entry[1].mm, dtype, count)
        self.leases.setdefault(region, []).append(weakref.ref(lease))
        return lease

    def refresh(self) -> None:
        """Clear this rank's flag on every region none of its arrays views any more."""
        for region in self.mapped:
            # only the live leases are kept: a loop makes one per step and keeps the latest
            leases = self.leases[region] = [lease for lease in self.leases.get(region, [])
                                            if lease() is not None]
            if self.held[self.rank, region] and not leases:
                self.held[self.rank, region] = 0

    def _unmap(self, region: int) -> None:
        _, segment = self.mapped.pop(region)
        if self.is_master:         # the master made every region: its name goes too
            segment.unlink()
        segment.release()          # the mapping lives on while a view of it does

    def release(self) -> None:
        """Unmap everything; the master also removes the segments' names."""
        for region in list(self.mapped):
            self._unmap(region)
        self.table_segment.release()
        if self.is_master:
            self.table_segment.unlink()
