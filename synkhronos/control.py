"""The control block: one shared-memory segment through which the master commands workers.

Layout (all in one segment created by the master)::

    header   int64[16]        opcode, payload gen/size, master rank, collective state, plan id
    args     int64[ARGS]      the command's integer arguments (hot path, no pickling)
    status   int64[n, 8]      per rank: state, result generation and size, rows, warnings
    records  bytes[n, 256]    per rank: a call's scalar results (see ``ControlBlock.records``)
    go       sem_t[n]         master -> rank r: "a command is ready"
    done     sem_t            rank r -> master: "finished" (counting)
    barrier  sem_t[n]         rank -> rank: the shared-memory collectives' barrier
    filled   sem_t[n, n]      rank r -> rank q: a chunk of the pipelined all-reduce is ready
    freed    sem_t[n, n]      rank q -> rank r: that chunk's ring slot may be written again

Semaphores are process-shared POSIX semaphores (futexes) placed inside the
segment. A waiter spins briefly on ``sem_trywait`` before blocking: a round
trip through a spinning waiter is several times faster than one through a
sleeping one. Every
blocking wait is sliced into short timed waits with a liveness check between
slices, so nothing waits forever on a dead peer.
"""

import ctypes
import ctypes.util
import errno
import time

import numpy as np

from .shmem import Segment

__all__ = ["ControlBlock", "Op", "Status", "Decision", "Words"]

ARGS = 1 << 16
#: bytes per rank for a call's scalar results, written in place instead of packed
RECORD_BYTES = 256
#: decoded call plans a worker keeps; the master never names an older one (Runtime._publish_plan)
PLAN_CACHE = 256
_HEADER = 16
_STATUS_FIELDS = 8
_SEM_SLOT = 64

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


class Op:
    """Command opcodes."""
    STOP = 1
    SHIP = 2          # payload: pickled functions and shared-variable values
    CALL = 3          # args: see function.encode_call
    DROP_DATA = 4     # args: data ids whose mappings to release
    GET_SHARED = 5    # payload: shared-variable uids -> result: their values
    SET_SHARED = 6    # payload: {uid: value} for one rank
    COLLECTIVE = 7    # args: see collectives.CollectivePlan
    GET_SHAPES = 8    # args: shared-variable uids -> result: one int64 shape array each

    @classmethod
    def name(cls, opcode):
        names = cls.__dict__.get("_names")
        if names is None:
            names = {v: k.lower() for k, v in vars(cls).items() if k.isupper()}
            cls._names = names
        return names.get(opcode, str(opcode))


class Status:
    """Per-rank status codes written by a rank after a command."""
    IDLE = 0
    OK = 1
    ERROR = 2         # result segment holds a pickled (type, message, traceback)
    PREPARED = 3      # a collective's local buffers are ready; waiting for the go-ahead


class Decision:
    """The master's word to ranks that prepared a collective."""
    SKIP = 0
    GO = 1


class Words:
    """Sequential reader/writer of integers in the command's int64 ``args`` array.

    Examples
    --------
    >>> import numpy as np
    >>> args = np.zeros(8, np.int64)
    >>> Words(args).put(3).put_list([7, 8])
    ... # doctest: +ELLIPSIS
    <...Words object at ...>
    >>> r = Words(args); r.get(), r.get_list()
    (3, [7, 8])
    """

    _READ_AHEAD = 256

    def __init__(self, args):
        self.args = args
        self.pos = 0
        self._cache = None   # reading: Python ints of args[:len(_cache)], fetched in blocks

    def put(self, *values):
        n = len(values)
        if self.pos + n > len(self.args):
            raise ValueError(f"command needs more than {len(self.args)} control words")
        self.args[self.pos:self.pos + n] = values
        self.pos += n
        return self

    def put_list(self, values):
        values = list(values)
        return self.put(len(values), *values)

    def _ints(self, n):
        end = self.pos + n
        if self._cache is None or end > len(self._cache):
            self._cache = self.args[:max(end, self._READ_AHEAD)].tolist()
        out = self._cache[self.pos:end]
        self.pos = end
        return out

    def get(self):
        return self._ints(1)[0]

    def get_list(self):
        return self._ints(self.get())


class Semaphore:
    """A process-shared POSIX semaphore living at ``address`` inside a segment."""

    def __init__(self, address):
        self.address = address

    def init(self):
        if _libc.sem_init(self.address, 1, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self):
        _libc.sem_post(self.address)

    def try_acquire(self):
        return _libc.sem_trywait(self.address) == 0

    def acquire(self, timeout):
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

    def wait(self, check, spin=100e-6, slice_=0.1):
        """Acquire, spinning ``spin`` seconds first, then calling ``check()`` between slices.

        ``check`` raises to abandon the wait (a dead peer, a timeout).
        """
        if spin > 0:
            end = time.perf_counter() + spin
            while time.perf_counter() < end:
                if self.try_acquire():
                    return
        while not self.acquire(slice_):
            check()


class ControlBlock:
    """The master's command block, created by the master and attached by workers.

    Parameters
    ----------
    name : str
        Segment name.
    n_ranks : int
        Number of processes, master included.
    create : bool
        Create (master) or attach (worker).
    """

    def __init__(self, name, n_ranks, create=False):
        self.n_ranks = n_ranks
        int_bytes = 8 * (_HEADER + ARGS + n_ranks * _STATUS_FIELDS)
        self._records_offset = int_bytes
        sem_offset = -(-(int_bytes + n_ranks * RECORD_BYTES) // _SEM_SLOT) * _SEM_SLOT
        size = sem_offset + _SEM_SLOT * (2 * n_ranks + 1 + 2 * n_ranks * n_ranks)
        self.segment = Segment(name, size, create=create)
        self.header = self.segment.array(np.int64, (_HEADER,))
        self.args = self.segment.array(np.int64, (ARGS,), offset=8 * _HEADER)
        self.status = self.segment.array(np.int64, (n_ranks, _STATUS_FIELDS),
                                         offset=8 * (_HEADER + ARGS))
        self._record_fields = {}
        self.rows = self.status[:, self.ROWS]       # rows each rank computed in the last call
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.segment.mm, sem_offset))
        self.go = [Semaphore(base + _SEM_SLOT * r) for r in range(n_ranks)]
        self.done = Semaphore(base + _SEM_SLOT * n_ranks)
        self.barrier = [Semaphore(base + _SEM_SLOT * (n_ranks + 1 + r)) for r in range(n_ranks)]
        pipes = base + _SEM_SLOT * (2 * n_ranks + 1)
        self.filled = [[Semaphore(pipes + _SEM_SLOT * (r * n_ranks + q)) for q in range(n_ranks)]
                       for r in range(n_ranks)]
        pipes += _SEM_SLOT * n_ranks * n_ranks
        self.freed = [[Semaphore(pipes + _SEM_SLOT * (r * n_ranks + q)) for q in range(n_ranks)]
                      for r in range(n_ranks)]
        if create:
            for sem in self.go + [self.done] + self.barrier + sum(self.filled + self.freed, []):
                sem.init()

    # header fields
    OPCODE, PAYLOAD_GEN, PAYLOAD_NBYTES, MASTER_RANK, DECISION, FAULT, COMM_GEN, PLAN_ID, \
        RESULT_REGION, REDUCE_PATH = range(10)
    # status fields
    STATE, RESULT_GEN, RESULT_NBYTES, ROWS, WARN_GEN, WARN_NBYTES = range(6)

    def post_command(self, opcode, ranks):
        """Publish the command already written to ``args`` to ``ranks``."""
        self.header[self.OPCODE] = opcode
        self.release(ranks)

    def release(self, ranks):
        """Let ``ranks`` go on (a new command, or the next phase of one)."""
        for r in ranks:
            self.status[r, self.STATE] = Status.IDLE
            self.go[r].post()

    def set_status(self, rank, state, result_gen=0, result_nbytes=0, rows=0):
        row = self.status[rank]
        row[self.RESULT_GEN], row[self.RESULT_NBYTES], row[self.ROWS] = result_gen, result_nbytes, rows
        row[self.STATE] = state

    def record_fields(self, dtype):
        """Every rank's result record, one array over ranks per field of ``dtype`` (structured).

        A call whose results are a few scalars (a loss, an accuracy) has each
        rank assign them to its record; the master reduces each output over the
        ranks in one ufunc call. That replaces a pack into the rank's result
        segment, an unpack and a reduction by rank, on the critical path of
        every call that returns a loss.
        """
        fields = self._record_fields.get(dtype)
        if fields is None:
            if dtype.itemsize > RECORD_BYTES:
                raise ValueError(f"a result record holds at most {RECORD_BYTES} bytes")
            records = np.ndarray((self.n_ranks,), dtype, buffer=self.segment.mm,
                                 offset=self._records_offset, strides=(RECORD_BYTES,))
            fields = self._record_fields[dtype] = tuple(records[name] for name in dtype.names)
        return fields

    def put_record(self, dtype, rank, values):
        """Write ``rank``'s scalar results (device or numpy values) into its record of ``dtype``."""
        for field, value in zip(self.record_fields(dtype), values):
            field[rank] = np.asarray(value)     # (assigning a JAX array itself is slower)

    def unlink(self):
        self.segment.unlink()
