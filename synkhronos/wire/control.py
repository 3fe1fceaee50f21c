"""The control block: one shared-memory segment through which the master commands workers.

Layout (all in one segment created by the master)::

    header   int64[16]        opcode, payload gen/size, master rank, decision, plan slot/generation,
                              a step's update function
    args     int64[ARGS]      the command's integer arguments (hot path, no pickling); a step's
                              collective from STEP_COLLECTIVE_AT on
    status   int64[n, 8]      per rank: state, result generation and size, rows, warnings,
                              steps of a device-driven loop (the master's stall watch)
    records  bytes[n, 256]    per rank: a call's scalar results (see ``ControlBlock.records``)
    go       sem_t[n]         master -> rank r: "a command is ready"
    done     sem_t            rank r -> master: "finished" (counting)

Semaphores are process-shared POSIX semaphores (:class:`synkhronos.ipc.segments.Semaphore`)
placed inside the segment. Every blocking wait is sliced into short timed waits
with a liveness check between slices, so nothing waits forever on a dead peer.
What a collective implementation needs in shared memory it keeps in segments of
its own (:mod:`synkhronos.comm.shm`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..ipc.buffers import round_up
from ..ipc.segments import Segment
from ..ipc.semaphores import SEMAPHORE_BYTES, ClosedSemaphore, SemaphoreLike, semaphores_in

__all__ = [
    "ControlBlock", "Op", "op_name", "enum_name", "Status", "Decision", "Header", "Field", "Words",
    "STEP_COLLECTIVE_AT",
]

ARGS = 1 << 16
#: where a STEP command's collective words start in ``args`` (its call's plan starts at 0)
STEP_COLLECTIVE_AT = ARGS // 2
#: bytes per rank for a call's scalar results, written in place instead of packed
RECORD_BYTES = 256
_HEADER = 16
_STATUS_FIELDS = 8


class Op(enum.IntEnum):
    """Command opcodes."""
    STOP = 1
    SHIP = 2          # payload: pickled functions and shared-variable values
    CALL = 3          # args: a CallPlan (synkhronos.wire.plan)
    DROP_DATA = 4     # args: data ids whose mappings to release
    GET_SHARED = 5    # payload: shared-variable uids -> result: their values
    SET_SHARED = 6    # payload: {uid: value} for one rank
    COLLECTIVE = 7    # args: a collective (synkhronos.wire.collective)
    GET_SHAPES = 8    # args: shared-variable uids -> result: one int64 shape array each
    LOOP = 9          # payload: a LoopSpec and its phase (synkhronos.wire.loop) -> result: its stats
    TIMELINE = 10     # args[0]: 1 start recording, 0 stop -> result: the pickled spans
    STEP = 11         # a CALL, then (if every rank computed) an all-reduce, then an update function:
                      # args: the plan, and the collective from STEP_COLLECTIVE_AT; header: UPDATE_FID
    UNDO = 12         # put back what the last CALL or STEP replaced (it failed on some rank)


def op_name(opcode: int) -> str:
    """An opcode's name for messages and timelines (``"call"``), or its number if it has none.

    Examples
    --------
    >>> op_name(3), op_name(99)
    ('call', '99')
    """
    return enum_name(Op, opcode, str(opcode))


def enum_name(kind: type[enum.IntEnum], code: int, default: str) -> str:
    """The lower-case name of ``kind``'s member ``code``, or ``default`` if it has none.

    Examples
    --------
    >>> enum_name(Decision, 1, "?"), enum_name(Decision, 7, "?")
    ('go', '?')
    """
    try:
        return kind(code).name.lower()
    except ValueError:
        return default


class Status(enum.IntEnum):
    """Per-rank status codes written by a rank after a command."""
    IDLE = 0
    OK = 1
    ERROR = 2         # result segment holds a pickled (type, message, traceback, graph line)
    PREPARED = 3      # a collective's local buffers are ready; waiting for the go-ahead


class Decision(enum.IntEnum):
    """The master's word to ranks that prepared a collective."""
    SKIP = 0
    GO = 1


class Header(enum.IntEnum):
    """The fields of the control block's header."""
    OPCODE = 0
    PAYLOAD_GEN = 1
    PAYLOAD_NBYTES = 2
    MASTER_RANK = 3
    DECISION = 4
    PLAN_SLOT = 5
    PLAN_GEN = 6
    UPDATE_FID = 7
    KEEP_UNDO = 8     # a CALL or STEP: 1 if every rank keeps what all its updates replace (see rank.undo)
    FUSED = 9         # a STEP: 1 if every rank runs it as one program, in one phase (see rank.fused)


class Field(enum.IntEnum):
    """The fields of a rank's status row."""
    STATE = 0
    RESULT_GEN = 1
    RESULT_NBYTES = 2
    ROWS = 3
    WARN_GEN = 4
    WARN_NBYTES = 5
    PROGRESS = 6


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

    def __init__(self, args: np.ndarray) -> None:
        self.args = args
        self.pos = 0
        self._cache: list[int] | None = None   # reading: Python ints of args[:len(_cache)], fetched in blocks

    def put(self, *values: int) -> Words:
        n = len(values)
        if self.pos + n > len(self.args):
            raise ValueError(f"command needs more than {len(self.args)} control words")
        self.args[self.pos:self.pos + n] = values
        self.pos += n
        return self

    def put_list(self, values: Iterable[int]) -> Words:
        values = list(values)
        return self.put(len(values), *values)

    def _ints(self, n: int) -> list[int]:
        end = self.pos + n
        if self._cache is None or end > len(self._cache):
            self._cache = self.args[:max(end, self._READ_AHEAD)].tolist()
        out = self._cache[self.pos:end]
        self.pos = end
        return out

    def get(self) -> int:
        return self._ints(1)[0]

    def get_list(self) -> list[int]:
        return self._ints(self.get())


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

    go: Sequence[SemaphoreLike]
    done: SemaphoreLike

    def __init__(self, name: str, n_ranks: int, create: bool = False) -> None:
        self.n_ranks = n_ranks
        int_bytes = 8 * (_HEADER + ARGS + n_ranks * _STATUS_FIELDS)
        self._records_offset = int_bytes
        sem_offset = round_up(int_bytes + n_ranks * RECORD_BYTES, SEMAPHORE_BYTES)
        self.segment = Segment(name, sem_offset + SEMAPHORE_BYTES * (n_ranks + 1), create=create)
        self.header = self.segment.array(np.int64, (_HEADER,))
        self.args = self.segment.array(np.int64, (ARGS,), offset=8 * _HEADER)
        self.status = self.segment.array(np.int64, (n_ranks, _STATUS_FIELDS),
                                         offset=8 * (_HEADER + ARGS))
        self._record_fields: dict[np.dtype, tuple[np.ndarray, ...]] = {}
        self.rows = self.status[:, self.ROWS]       # rows each rank computed in the last call
        *self.go, self.done = semaphores_in(self.segment, sem_offset, n_ranks + 1, create)

    # the header's fields and a status row's, as names of the block: plain ints, because numpy
    # indexes with an int subclass (an IntEnum member) by a slower path, on every command
    OPCODE, PAYLOAD_GEN, PAYLOAD_NBYTES, MASTER_RANK, DECISION, PLAN_SLOT, PLAN_GEN, UPDATE_FID, \
        KEEP_UNDO, FUSED = map(int, Header)
    STATE, RESULT_GEN, RESULT_NBYTES, ROWS, WARN_GEN, WARN_NBYTES, PROGRESS = map(int, Field)

    def state(self, rank: int) -> int:
        """Rank ``rank``'s :class:`Status`, as a Python int: a numpy scalar compared with an IntEnum
        member takes numpy's slow generic path, and the master checks every rank's state per command."""
        return int(self.status[rank, self.STATE])

    def post_command(self, opcode: int, ranks: Iterable[int]) -> None:
        """Publish the command already written to ``args`` to ``ranks``."""
        self.header[self.OPCODE] = opcode
        self.release(ranks)

    def release(self, ranks: Iterable[int]) -> None:
        """Let ``ranks`` go on (a new command, or the next phase of one)."""
        for r in ranks:
            self.status[r, self.STATE] = Status.IDLE
            self.go[r].post()

    def set_status(self, rank: int, state: int, result_gen: int = 0, result_nbytes: int = 0,
                   rows: int = 0) -> None:
        row = self.status[rank]
        row[self.RESULT_GEN], row[self.RESULT_NBYTES], row[self.ROWS] = result_gen, result_nbytes, rows
        row[self.STATE] = state

    def record_fields(self, dtype: np.dtype) -> tuple[np.ndarray, ...]:
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
            assert dtype.names is not None, "a result record's dtype is structured"
            records = np.ndarray((self.n_ranks,), dtype, buffer=self.segment.mm,
                                 offset=self._records_offset, strides=(RECORD_BYTES,))
            fields = self._record_fields[dtype] = tuple(records[name] for name in dtype.names)
        return fields

    def put_record(self, dtype: np.dtype, rank: int, values: Iterable[Any]) -> None:
        """Write ``rank``'s scalar results (device or numpy values) into its record of ``dtype``."""
        for field, value in zip(self.record_fields(dtype), values):
            field[rank] = np.asarray(value)     # (assigning a JAX array itself is slower)

    def unlink(self) -> None:
        self.segment.unlink()

    def close(self) -> None:
        """Let this process's mapping go (a runtime that closed keeps no descriptor of a block it
        no longer uses): the header and statuses become copies of their last values, to report
        from, and the semaphores ones nobody posts."""
        self.header, self.args, self.status = self.header.copy(), self.args.copy(), self.status.copy()
        self.rows = self.status[:, self.ROWS]
        self._record_fields = {}
        self.go, self.done = [ClosedSemaphore() for _ in self.go], ClosedSemaphore()
        self.segment.release()
