"""CPU collectives through shared memory: every process of one machine reads its peers' buffers.

Each rank copies its flat buffer into its slot of one shared segment; after a
barrier, rank ``r`` reduces the ``r``-th chunk across all slots (a
reduce-scatter, written in place into slot 0); after a second barrier every
rank copies the whole result out; a third barrier keeps the slots untouched
until everyone has read them. Each byte moves a few times through memory, so
this runs near memory bandwidth where Gloo over loopback reaches a few percent
of it (see bench/RESULTS.md).

The barrier is all-to-all over one process-shared semaphore per rank, kept in
the control block: rank ``r`` posts every peer's semaphore once, then takes
its own ``n - 1`` times. Every wait is sliced, with a liveness check.
"""

import numpy as np

from ..devices import adopt, to_device
from ..shmem import GrowableSegment, SegmentMirror
from ..transport import aligned_empty

__all__ = ["ShmComm"]

_COMBINE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


class ShmComm:
    """Shared-memory collectives among the processes of one runtime (CPU only).

    Parameters
    ----------
    ctl : ControlBlock
        Holds the barrier semaphores and the buffer segment's generation.
    prefix : str
        The runtime's segment prefix.
    rank, n_ranks, master_rank : int
    check : callable
        Called between slices of every wait; raises to abandon it.
    spin : float
        Seconds to poll before sleeping in a barrier.
    """

    name = "shm"
    #: every wait returns to Python between slices and calls ``check``, so the master
    #: can run its part inline instead of in a watched thread
    calls_check_while_waiting = True

    def __init__(self, ctl, prefix, rank, n_ranks, master_rank, check, spin=0.0):
        self.ctl, self.rank, self.n_ranks = ctl, rank, n_ranks
        self.check, self.spin = check, spin
        base = f"{prefix}_cm"
        self.owner = GrowableSegment(base) if rank == master_rank else None
        self.mirror = None if self.owner else SegmentMirror(base)

    # --- buffers ----------------------------------------------------------------------------
    def reserve(self, nbytes):
        """Master, before the command: make every slot hold ``nbytes``."""
        from ..control import ControlBlock
        slot = -(-int(nbytes) // 64) * 64
        if self.owner.ensure(slot * self.n_ranks, oversize=1.25):
            self.ctl.header[ControlBlock.COMM_GEN] = self.owner.gen

    def _slots(self, dtype, count):
        from ..control import ControlBlock
        if self.owner is not None:
            segment = self.owner.segment
        else:
            segment = self.mirror.get(int(self.ctl.header[ControlBlock.COMM_GEN]))
        slot_bytes = segment.size // self.n_ranks // 64 * 64
        itemsize = np.dtype(dtype).itemsize
        if count * itemsize > slot_bytes:
            raise RuntimeError(f"shared collective buffer too small ({slot_bytes} B per rank for "
                               f"{count * itemsize} B); reserve() was not called")
        return [segment.array(dtype, (count,), offset=r * slot_bytes) for r in range(self.n_ranks)]

    def release(self):
        if self.owner is not None:
            self.owner.free()
        else:
            self.mirror.release()

    # --- synchronization --------------------------------------------------------------------
    def barrier(self):
        for q in range(self.n_ranks):
            if q != self.rank:
                self.ctl.barrier[q].post()
        for _ in range(self.n_ranks - 1):
            self.ctl.barrier[self.rank].wait(self.check, spin=self.spin)

    # --- collectives ------------------------------------------------------------------------
    def _layout(self, values):
        hosts = [np.asarray(v) for v in values]    # a CPU device array is viewed, not copied
        sizes = [h.size for h in hosts]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        dtype = hosts[0].dtype if hosts else np.float32
        return hosts, offsets, self._slots(dtype, int(offsets[-1]))

    def _publish(self, values):
        hosts, offsets, slots = self._layout(values)
        mine = slots[self.rank]
        for h, a, b in zip(hosts, offsets[:-1], offsets[1:]):
            mine[a:b] = h.reshape(-1)
        return hosts, offsets, slots

    @staticmethod
    def _read(flat, hosts, offsets):
        return [to_device(flat[a:b].reshape(h.shape))
                for h, a, b in zip(hosts, offsets[:-1], offsets[1:])]

    def all_reduce(self, values, op):
        hosts, offsets, slots = self._publish(values)
        self.barrier()
        total = int(offsets[-1])
        lo, hi = total * self.rank // self.n_ranks, total * (self.rank + 1) // self.n_ranks
        combine = _COMBINE[op]
        for q in range(1, self.n_ranks):
            combine(slots[0][lo:hi], slots[q][lo:hi], out=slots[0][lo:hi])
        self.barrier()
        out = self._read(slots[0], hosts, offsets)
        self.barrier()
        return out

    def all_gather(self, values):
        hosts, offsets, slots = self._publish(values)
        self.barrier()
        out = []
        for h, a, b in zip(hosts, offsets[:-1], offsets[1:]):
            stacked = aligned_empty((self.n_ranks,) + h.shape, h.dtype)
            for r in range(self.n_ranks):
                stacked[r] = slots[r][a:b].reshape(h.shape)
            out.append(adopt(stacked))
        self.barrier()
        return out

    def broadcast(self, values, root):
        if self.rank == root:
            hosts, offsets, slots = self._publish(values)
        else:
            hosts, offsets, slots = self._layout(values)
        self.barrier()
        out = self._read(slots[root], hosts, offsets)
        self.barrier()
        return out
