"""CPU collectives through shared memory: every process of one machine reads its peers' buffers.

All-reduce is a reduce-scatter then an all-gather through one shared segment
with a slot per rank: rank ``r`` publishes the parts of its values that its
peers reduce, reduces chunk ``r`` across the slots into the result and, for a
private result, publishes that chunk and copies the peers' reduced chunks.
Buffers larger than the caches can be pipelined instead: the published parts
stream through small per-pair rings and are reduced while still in the cache;
the master picks one of the two ways for each large all-reduce from the
times it measured (:mod:`synkhronos.comm.shm.paths`).
Gather and broadcast publish whole values. Results are private, 64-byte
aligned host buffers that the CPU device adopts without another copy, reused
once no device array holds them. Each byte moves a few times through memory,
so this runs at a good fraction of memory bandwidth where Gloo over loopback
reaches a few percent of it (see bench/RESULTS.md).

The barrier is all-to-all over one process-shared semaphore per rank, kept
with the master's choices in :class:`~.control.ShmControl`: rank ``r`` posts
every peer's semaphore once, then takes its own ``n - 1`` times. Every wait is
sliced, with a liveness check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...ipc.buffers import ceil_div, round_up
from ...ipc.segments import GrowableSegment, SegmentMirror
from ...platform.device_arrays import adopt, copy_large, private_empty, to_device
from ..base import Comm, CommContext, Reservation
from ..reduction import COMBINE, Reduce
from .control import ShmControl
from .layout import FlatLayout
from .paths import PIPELINED, PathChooser
from .regions import SharedResults

__all__ = ["ShmComm"]

#: every slot starts on a page boundary, at the same page offset as the values copied into it:
#: a slot a few bytes off makes a large copy's loads and stores alias modulo 4 KiB, which stalls
#: the CPU's store forwarding check and runs that rank's copy several times slower.
SLOT_ALIGN = 4096

#: the pipelined all-reduce (large buffers) streams chunks of CHUNK_BYTES through a ring of
#: RING_CHUNKS slots per pair of ranks: small enough that the peer reads each chunk from the
#: cache it was just written to, so only the values and the result cross the memory bus. It
#: beats publishing everything and then reducing for buffers from PIPELINE_MIN_BYTES on, while
#: the two cores share a cache; when they do not, publishing is faster, so the master chooses
#: between the two from the times it measures (synkhronos.comm.shm.paths).
CHUNK_BYTES = 1 << 20
RING_CHUNKS = 2
PIPELINE_MIN_BYTES = 8 << 20


class ShmComm(Comm):
    """Shared-memory collectives among the processes of one runtime (CPU only).

    Parameters
    ----------
    context : CommContext
        ``check`` is called between slices of every wait; ``spin`` is how long a
        barrier polls before it sleeps.
    """

    name = "shm"
    #: every wait returns to Python between slices and calls ``check``, so the master
    #: can run its part inline instead of in a watched thread
    waits_in_python = True
    platforms = ("cpu",)

    def __init__(self, context: CommContext) -> None:
        super().__init__(context)
        self.check, self.spin = context.check, context.spin
        is_master = context.rank == context.master_rank
        self.control = ShmControl(context.prefix, context.n_ranks, create=is_master)
        base = f"{context.prefix}_cm"
        self.owner = GrowableSegment(base) if is_master else None
        self.mirror = None if is_master else SegmentMirror(base)
        self.results = SharedResults(context.prefix, context.rank, context.n_ranks,
                                     context.master_rank)
        #: the master's choice between the two ways of a large all-reduce (see .paths)
        self.paths = PathChooser() if is_master else None
        self._cold = False

    # --- buffers ----------------------------------------------------------------------------
    def reserve(self, reservation: Reservation) -> None:
        """Master, before the command: make every slot hold ``reservation.nbytes``.

        The one all-reduce result of ``reservation.result_bytes`` (if any) goes
        to a shared region (a small one only when ``result_consumed``); the path
        (pipelined or published) of an all-reduce of ``reservation.reduce_bytes``
        is chosen here for every rank.
        """
        assert self.owner is not None and self.paths is not None, "the master reserves"
        slot = round_up(int(reservation.nbytes), SLOT_ALIGN)
        regions_made = int(self.results.gens.sum())
        grew = self.owner.ensure(slot * self.n_ranks, oversize=1.25)
        words, reduce_bytes = self.control.words, reservation.reduce_bytes
        if grew:
            words[ShmControl.BUFFER_GEN] = self.owner.gen
        words[ShmControl.RESULT_REGION] = (
            self.results.choose(int(reservation.result_bytes), any_size=reservation.result_consumed)
            if reservation.result_bytes else -1)
        words[ShmControl.REDUCE_PATH] = (
            self.paths.choose(reduce_bytes) if self._pipelinable(reduce_bytes) else PIPELINED)
        # a call that first touches new shared memory is slow on either path: not timed
        self._cold = grew or int(self.results.gens.sum()) != regions_made

    @property
    def chosen_path(self) -> int:
        """The path the master chose for the latest large all-reduce (:mod:`.paths`)."""
        return int(self.control.words[ShmControl.REDUCE_PATH])

    @property
    def chosen_region(self) -> int:
        """The shared region the latest single all-reduce result went to (-1: a private result)."""
        return int(self.control.words[ShmControl.RESULT_REGION])

    def refresh(self) -> None:
        """After a collective: let go of the shared results no array of this rank holds."""
        self.results.refresh()

    def _result_buffer(self, dtype: np.dtype, count: int) -> tuple[np.ndarray, bool]:
        """Where this all-reduce's result goes: the shared region the master picked, or private."""
        region = int(self.control.words[ShmControl.RESULT_REGION])
        if region >= 0 and count * np.dtype(dtype).itemsize <= self.results.sizes[region]:
            return self.results.array(region, dtype, count), True
        return private_empty((count,), dtype), False

    def _slots(self, dtype: np.dtype, count: int) -> list[np.ndarray]:
        if self.owner is not None:
            segment = self.owner.made
        else:
            assert self.mirror is not None
            segment = self.mirror.get(int(self.control.words[ShmControl.BUFFER_GEN]))
        slot_bytes = segment.size // self.n_ranks // SLOT_ALIGN * SLOT_ALIGN
        itemsize = np.dtype(dtype).itemsize
        if count * itemsize > slot_bytes:
            raise RuntimeError(f"shared collective buffer too small ({slot_bytes} B per rank for "
                               f"{count * itemsize} B); reserve() was not called")
        return [segment.array(dtype, (count,), offset=r * slot_bytes) for r in range(self.n_ranks)]

    def release(self) -> None:
        if self.owner is not None:
            self.owner.free()
        elif self.mirror is not None:
            self.mirror.release()
        self.results.release()
        self.control.release()

    # --- synchronization --------------------------------------------------------------------
    def barrier(self) -> None:
        for q in range(self.n_ranks):
            if q != self.rank:
                self.control.barrier[q].post()
        for _ in range(self.n_ranks - 1):
            self.control.barrier[self.rank].wait(self.check, spin=self.spin)

    # --- collectives ------------------------------------------------------------------------
    def _layout(self, values: Sequence[Any]) -> tuple[FlatLayout, list[np.ndarray]]:
        """The flat layout of ``values`` and every rank's slot for it."""
        layout = FlatLayout.of(values)
        return layout, self._slots(layout.dtype, layout.total)

    def all_reduce(self, values: Sequence[Any], op: str) -> list[Any]:
        """Reduce-scatter, then all-gather through shared memory (see :meth:`_reduce`)."""
        layout, out = self._reduce(values, op)
        return layout.device_parts(out)

    def all_reduce_host(self, values: Sequence[Any], op: str) -> list[np.ndarray]:
        """:meth:`all_reduce`, the results left as host arrays (no device array made)."""
        layout, out = self._reduce(values, op)
        return layout.host_parts(out)

    def _reduce(self, values: Sequence[Any], op: str) -> tuple[FlatLayout, np.ndarray]:
        """Reduce-scatter, then all-gather through shared memory: (the layout, the flat result).

        Rank ``r`` reduces chunk ``r``, so it publishes only the other chunks of
        its values and reads its own chunk straight from its values. With a
        shared result region every rank writes its reduced chunk there and
        every device adopts the whole region: per rank about 1.5 reads and 1
        write of the buffer. Without one, each rank also publishes its reduced
        chunk and copies its peers' into a private result (2.5 reads, 2 writes).
        ``op="avg"`` divides each chunk by the number of ranks as it is reduced.
        From ``PIPELINE_MIN_BYTES`` on, the parts go the way the master chose for
        this call (:mod:`synkhronos.comm.shm.paths`): through the rings, or published.
        """
        layout, slots = self._layout(values)
        nbytes = layout.total * layout.dtype.itemsize
        if not self._pipelinable(nbytes):
            return layout, self._all_reduce_published(layout, slots, op)
        path = int(self.control.words[ShmControl.REDUCE_PATH])
        start = time.perf_counter()
        if path == PIPELINED:
            out = self._all_reduce_pipelined(layout, slots, op, CHUNK_BYTES // layout.dtype.itemsize)
        else:
            out = self._all_reduce_published(layout, slots, op)
        if self.paths is not None and not self._cold:
            # the master's time is the collective's: the call ends in a barrier
            self.paths.record(nbytes, path, time.perf_counter() - start)
        return layout, out

    def _pipelinable(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` may stream through the rings (else it publishes)."""
        ring_bytes = (self.n_ranks - 1) * RING_CHUNKS * CHUNK_BYTES    # every peer's ring
        return nbytes >= PIPELINE_MIN_BYTES and ring_bytes <= nbytes

    def _all_reduce_published(self, layout: FlatLayout, slots: list[np.ndarray], op: str) -> np.ndarray:
        """Every rank publishes the parts its peers reduce, then reduces its own from memory."""
        bounds = layout.chunk_bounds(self.n_ranks)
        peers = [q for q in range(self.n_ranks) if q != self.rank]
        mine = slots[self.rank]
        for q in peers:
            for part, a, b in layout.pieces(bounds[q], bounds[q + 1]):
                mine[a:b] = part
        out, shared = self._result_buffer(layout.dtype, layout.total)
        self.barrier()
        self._reduce_chunk(layout, slots, peers, out, bounds, op)
        if not shared:
            self._gather_reduced_chunks(layout, slots, out, bounds, peers)
        self.barrier()        # every part of the result is written; peers read our slot until here
        return out

    def _all_reduce_pipelined(self, layout: FlatLayout, slots: list[np.ndarray], op: str,
                              step: int) -> np.ndarray:
        """Reduce-scatter streamed through per-pair rings, for buffers larger than the caches.

        At step ``i`` every rank copies chunk ``i`` of each peer's part into its
        ring toward that peer (``filled`` posts it), then reduces chunk ``i`` of
        its own part from its values and every peer's ring (``freed`` gives the
        ring slot back). A producer waits for ``freed`` only ``RING_CHUNKS``
        chunks ahead, so no rank waits on one that is not moving. Per rank the
        memory bus carries its values once and its part of the result once;
        the published copies stay in the cache.
        """
        me, n = self.rank, self.n_ranks
        peers = [q for q in range(n) if q != me]
        bounds = layout.chunk_bounds(n)
        counts = [ceil_div(bounds[q + 1] - bounds[q], step) for q in range(n)]
        ring_items = RING_CHUNKS * step

        def ring(owner: int, reader: int) -> np.ndarray:
            k = [q for q in range(n) if q != owner].index(reader)
            return slots[owner][k * ring_items:(k + 1) * ring_items]
        outgoing = {q: ring(me, q) for q in peers}
        incoming = {r: ring(r, me) for r in peers}
        out, shared = self._result_buffer(layout.dtype, layout.total)
        filled, freed = self.control.filled, self.control.freed
        for i in range(max(counts)):
            at = (i % RING_CHUNKS) * step
            for q in peers:
                if i < counts[q]:
                    lo = bounds[q] + i * step
                    if i >= RING_CHUNKS:
                        freed[me][q].wait(self.check, spin=self.spin)
                    dst = outgoing[q]
                    for part, a, b in layout.pieces(lo, min(lo + step, bounds[q + 1])):
                        dst[at + a - lo:at + b - lo] = part
                    filled[me][q].post()
            if i < counts[me]:
                lo = bounds[me] + i * step
                for r in peers:
                    filled[r][me].wait(self.check, spin=self.spin)
                for part, a, b in layout.pieces(lo, min(lo + step, bounds[me + 1])):
                    self._reduce_into(out[a:b], part,
                                      [incoming[r][at + a - lo:at + b - lo] for r in peers], op)
                for r in peers:
                    freed[r][me].post()
        for q in peers:            # every chunk sent to q was read: the ring may be reused
            for _ in range(min(counts[q], RING_CHUNKS)):
                freed[me][q].wait(self.check, spin=self.spin)
        if not shared:
            self._gather_reduced_chunks(layout, slots, out, bounds, peers)
        self.barrier()             # every rank's part of the result is written
        return out

    def _gather_reduced_chunks(self, layout: FlatLayout, slots: list[np.ndarray], out: np.ndarray,
                               bounds: list[int], peers: list[int]) -> None:
        """Private results: publish this rank's reduced chunk, copy the peers' into ``out``.

        The chunk goes where this rank never published anything its peers read
        (its own range, or a ring every peer has finished with).
        """
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        slots[self.rank][lo:hi] = out[lo:hi]
        self.barrier()
        for q in peers:
            for _, a, b in layout.pieces(bounds[q], bounds[q + 1]):
                copy_large(out[a:b], slots[q][a:b])

    def _reduce_chunk(self, layout: FlatLayout, slots: list[np.ndarray], peers: list[int], out: np.ndarray,
                      bounds: list[int], op: str) -> None:
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        for part, a, b in layout.pieces(lo, hi):
            self._reduce_into(out[a:b], part, [slots[q][a:b] for q in peers], op)

    def _reduce_into(self, out: np.ndarray, own: np.ndarray, peer_parts: Sequence[np.ndarray], op: str) -> None:
        """``out`` = ``own`` combined with every one of ``peer_parts`` by ``op`` (avg: then / n)."""
        if not peer_parts:          # one rank: the reduction is its own values
            np.copyto(out, own)
            return
        combine = COMBINE[Reduce.SUM if op == Reduce.AVG else op]
        src = own
        for part in peer_parts:
            combine(src, part, out=out)
            src = out
        if op == "avg":
            np.divide(out, self.n_ranks, out=out)

    def all_gather(self, values: Sequence[Any]) -> list[Any]:
        layout, slots = self._layout(values)
        layout.publish(slots[self.rank])
        self.barrier()
        out: list[Any] = []
        for h, a in zip(layout.hosts, layout.offsets):
            stacked = private_empty((self.n_ranks,) + h.shape, h.dtype)
            for r in range(self.n_ranks):
                copy_large(stacked[r, ...], slots[r][a:a + h.size].reshape(h.shape))
            out.append(adopt(stacked))
        self.barrier()
        return out

    def broadcast(self, values: Sequence[Any], root: int) -> list[Any]:
        layout, slots = self._layout(values)
        if self.rank == root:
            layout.publish(slots[root])
        self.barrier()
        out = [to_device(part) for part in layout.host_parts(slots[root])]
        self.barrier()
        return out
