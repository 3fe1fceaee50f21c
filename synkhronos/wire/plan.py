"""A function call as it travels: a validated :class:`CallPlan`, encoded as integers.

The master encodes each call's plan into the control block's ``args``; every
rank decodes it. Training repeats one call shape over and over, so a plan is
named by a slot of a small table that master and workers keep alike
(:class:`PlanSlots`, :class:`PlanMemo`): a repeated plan costs a worker one
header read instead of a decode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from .batch import Batch, split
from .control import RECORD_BYTES, ControlBlock, Words

if TYPE_CHECKING:
    from .spec import FunctionSpec

__all__ = ["InputRef", "CallPlan", "put_batch", "get_batch", "result_record", "PlanSlots",
           "PlanMemo", "PLAN_SLOTS"]

#: ``index_lookup(gen, start, n)``: the ``n`` indices at ``start`` of index segment generation ``gen``
IndexLookup = Callable[[int, int, int], np.ndarray]

@dataclass
class InputRef:
    """Where one input's rows live: a Data segment generation, shape and row offset, and the
    ``axis`` its rows lie along (1 for time-major sequences, see :mod:`synkhronos.api.function_parts.split_axes`)."""

    data_id: int
    gen: int
    code: int
    offset: int
    shape: tuple[int, ...]
    axis: int = 0

    def row_free_shape(self) -> tuple[int, ...]:
        """The shape without the rows' axis: what fixes the shapes of a call's arguments but the rows.

        Examples
        --------
        >>> InputRef(4, 0, 1, 0, (30, 5, 2)).row_free_shape(), InputRef(4, 0, 1, 0, (30, 5, 2), 1).row_free_shape()
        ((5, 2), (30, 2))
        """
        return self.shape[:self.axis] + self.shape[self.axis + 1:]


def _digest(indices: np.ndarray | None) -> str:
    """A short digest of an index array (which node drew which batch)."""
    import hashlib
    return hashlib.blake2b(np.ascontiguousarray(indices).view(np.uint8), digest_size=4).hexdigest()


def put_batch(words: Words, batch: Batch) -> None:
    """Encode a Batch (its indices live in the index segment at ``batch.index_offset``)."""
    words.put(*_batch_words([], batch))


def _batch_words(words: list[int], batch: Batch) -> list[int]:
    words += [batch.total, int(batch.is_range), batch.start, batch.stop, batch.index_offset]
    return words


def get_batch(words: Words, index_lookup: IndexLookup, index_gen: int) -> Batch:
    total, is_range, start, stop, offset = (words.get() for _ in range(5))
    if is_range:
        return Batch(total, start, stop)
    return Batch(total, indices=index_lookup(index_gen, offset, total), index_offset=offset)


@dataclass
class CallPlan:
    """A validated call, as every process needs it.

    ``sliced`` holds, per rank, the Batch of rows of the sliceable shared
    variables that rank uses (empty when the function has none). ``local``:
    the scattered inputs are each node's own shard, split over the node's
    devices only (see :meth:`ranks`).
    """

    fid: int
    num_slices: int
    batch: Batch
    subset: list
    scattered: list[InputRef]
    bcast: list[InputRef]
    sliced: list[Batch] = field(default_factory=list)
    index_gen: int = 0
    local: bool = False
    _words: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _shares: dict = field(default_factory=dict, repr=False, compare=False)    # see share_of
    _record: np.dtype | None | Literal[False] = field(default=False, repr=False, compare=False)  # see result_record
    _shape_key: tuple | None = field(default=None, repr=False, compare=False)  # see shape_key
    _split: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)  # see split

    def split(self, parts: int) -> tuple[tuple[int, int], ...]:
        """Every device's batch positions ``[lo, hi)`` when the batch is split over ``parts``
        devices, computed once per plan (the master's check, its hint and its share use it).

        Examples
        --------
        >>> CallPlan(0, 1, Batch(7, 0, 7), [0], [], []).split(3)
        ((0, 2), (2, 4), (4, 7))
        """
        bounds = self._split
        if len(bounds) != parts:
            bounds = self._split = split(self.batch.total, parts)
        return bounds

    def with_batch(self, batch: Batch) -> CallPlan:
        """This plan with another ``batch`` of as many rows (the same shares, the same record).

        Examples
        --------
        >>> plan = CallPlan(0, 1, Batch(2, indices=np.array([3, 1])), [0], [], [])
        >>> plan.with_batch(Batch(2, indices=np.array([0, 5]))).batch.indices
        array([0, 5])
        """
        plan = copy.copy(self)
        plan.batch, plan._words = batch, None
        return plan

    def with_sliced(self, sliced: list[Batch]) -> CallPlan:
        """This plan with other rows ``sliced`` of the sliceable shared variables, as many per
        rank (the same shares, the same record)."""
        plan = copy.copy(self)
        plan.sliced, plan._words = sliced, None
        return plan

    def shape_key(self) -> tuple:
        """What fixes the shapes every rank's graph is called with: two plans with the same key
        trace alike on every rank (the function, the rows and their split, each input's shape).

        Examples
        --------
        >>> a = CallPlan(0, 1, Batch(8, 0, 8), [0], [InputRef(4, 0, 1, 0, (30, 2))], [])
        >>> b = CallPlan(0, 1, Batch(8, 10, 18), [0], [InputRef(5, 0, 1, 0, (50, 2))], [])
        >>> a.shape_key() == b.shape_key()
        True
        """
        key = self._shape_key
        if key is None:
            key = self._shape_key = (
                self.fid, self.num_slices, self.batch.total, self.local,
                tuple((ref.axis, ref.row_free_shape()) for ref in self.scattered),
                tuple(tuple(ref.shape) for ref in self.bcast), tuple(b.total for b in self.sliced))
        return key

    def arguments_text(self) -> str:
        """What the call computes on, in words every node compares (see ``State.run_call``).

        The batch (a range, or so many indices and their digest), each input's
        Data and shape, ``num_slices``, the outputs selected; a node-local
        call (each node's own shard) leaves its batch and shapes out, which
        differ between nodes by design.

        Examples
        --------
        >>> plan = CallPlan(0, 1, Batch(23, 0, 23), [0], [InputRef(4, 0, 1, 0, (30, 2))], [])
        >>> plan.arguments_text()
        'rows 0:23 of data 4 (30, 2), num_slices 1, outputs [0]'
        """
        text = f"num_slices {self.num_slices}, outputs {self.subset}"
        if self.local:
            return text
        batch = self.batch
        rows = f"rows {batch.start}:{batch.stop}" if batch.is_range else \
            f"{batch.total} indices (digest {_digest(batch.indices)})"
        inputs = ", ".join(f"data {ref.data_id} {tuple(ref.shape)}" for ref in self.scattered)
        if self.bcast:
            inputs += "; whole: " + ", ".join(f"data {ref.data_id} {tuple(ref.shape)}"
                                              for ref in self.bcast)
        sliced = "" if not self.sliced else ", batch_s " + " ".join(
            f"{b.start}:{b.stop}" if b.is_range else f"{b.total}@{_digest(b.indices)}" for b in self.sliced)
        return f"{rows} of {inputs}{sliced}, {text}"

    def ranks(self, rank: int, n_ranks: int, local_rank: int, n_local: int) -> tuple[int, int]:
        """The (rank, count) this plan's rows are split by: the node's own for a local plan."""
        return (local_rank, n_local) if self.local else (rank, n_ranks)

    def index_arrays(self) -> list[Batch]:
        """Batches whose explicit indices must be written to the index segment."""
        if self.batch.is_range and not self.sliced:
            return []
        return [b for b in [self.batch] + self.sliced if not b.is_range]

    def encode(self) -> tuple[int, ...]:
        """The plan as a tuple of ints (for :meth:`decode` from the control block's args).

        A plan with explicit indices is encoded afresh (its ``index_gen`` and
        offsets change from call to call); any other plan once.
        """
        words = self._words
        if words is None:
            words = tuple(self._encode())
            if not self.index_arrays():
                self._words = words
        return words

    def _encode(self) -> list[int]:
        words = [self.fid, self.num_slices, self.index_gen, len(self.subset), *self.subset]
        _batch_words(words, self.batch)
        words += [len(self.scattered), len(self.bcast)]
        for ref in self.scattered + self.bcast:
            words += [ref.data_id, ref.gen, ref.code, ref.offset, ref.axis, len(ref.shape), *ref.shape]
        words.append(len(self.sliced))
        for b in self.sliced:
            _batch_words(words, b)
        words.append(int(self.local))
        return words

    @classmethod
    def decode(cls, args: np.ndarray, index_lookup: IndexLookup) -> CallPlan:
        """Read a plan written by :meth:`encode`; ``index_lookup(gen, start, n)`` returns indices."""
        w = Words(args)
        fid, k, index_gen = w.get(), w.get(), w.get()
        subset = w.get_list()
        batch = get_batch(w, index_lookup, index_gen)
        n_scat, n_bcast = w.get(), w.get()
        refs = []
        for _ in range(n_scat + n_bcast):
            data_id, gen, code, offset, axis = (w.get() for _ in range(5))
            refs.append(InputRef(data_id, gen, code, offset, tuple(w.get_list()), axis))
        sliced = [get_batch(w, index_lookup, index_gen) for _ in range(w.get())]
        return cls(fid, k, batch, subset, refs[:n_scat], refs[n_scat:], sliced, index_gen,
                   bool(w.get()))


def result_record(spec: FunctionSpec, plan: CallPlan) -> np.dtype | None:
    """The structured dtype in which ranks return this call's results, or None.

    When every selected output is a scalar (0-d in the graph) and together they
    fit a rank's record in the control block, each rank writes them there, in
    the outputs' declared dtypes (see :meth:`ControlBlock.records`); any other
    call packs its arrays into the rank's result segment.
    """
    record = plan._record
    if record is False:
        fields = [spec.outputs[i][0].type for i in plan.subset]
        record = None
        if fields and all(t.ndim == 0 for t in fields):
            dtype = np.dtype([(f"o{j}", t.dtype) for j, t in enumerate(fields)])
            record = dtype if dtype.itemsize <= RECORD_BYTES else None
        plan._record = record
    return record


#: plans named at once; a worker keeps the decoded plan of each slot
PLAN_SLOTS = 256


class PlanSlots:
    """The master's side of the plan table: which slot names which encoded plan.

    A new plan takes a free slot, or the least recently used one, and its
    words are written to ``args``; the header names the slot and the slot's
    generation (bumped on every reuse), so a worker decodes exactly when its
    copy of the slot is from another generation. Nothing depends on master and
    worker evicting alike.

    Examples
    --------
    >>> import numpy as np
    >>> slots, header, args = PlanSlots(2), np.zeros(16, np.int64), np.zeros(64, np.int64)
    >>> [slots.publish(w, header, args) for w in [(1,), (2,), (1,), (3,)]]
    [True, True, False, True]
    >>> int(header[ControlBlock.PLAN_SLOT]), int(header[ControlBlock.PLAN_GEN])    # (3,) took (2,)'s
    (1, 2)
    """

    def __init__(self, n_slots: int = PLAN_SLOTS) -> None:
        self.n_slots = n_slots
        self._slot_of: dict[tuple[int, ...], int] = {}                 # encoded plan -> slot, least recently used first
        self._gens = [0] * n_slots

    def publish(self, words: tuple[int, ...], header: np.ndarray, args: np.ndarray) -> bool:
        """Name plan ``words`` (a tuple of ints) in ``header``; write them to ``args`` if new.

        Returns True if the words were written.
        """
        slot = self._slot_of.pop(words, None)
        new = slot is None
        if slot is None:
            if len(self._slot_of) < self.n_slots:
                slot = len(self._slot_of)
            else:
                slot = self._slot_of.pop(next(iter(self._slot_of)))
            self._gens[slot] += 1
            Words(args).put(*words)
        self._slot_of[words] = slot
        header[ControlBlock.PLAN_SLOT] = slot
        header[ControlBlock.PLAN_GEN] = self._gens[slot]
        return new


class PlanMemo:
    """A worker's side of the plan table: the decoded plan of each slot, by generation."""

    def __init__(self, n_slots: int = PLAN_SLOTS) -> None:
        self._slots: list[tuple[int, CallPlan | None]] = [(0, None)] * n_slots

    def plan(self, header: np.ndarray, args: np.ndarray, index_lookup: IndexLookup) -> CallPlan:
        """The plan the header names: from the table, or decoded from ``args`` if newer."""
        slot, gen = int(header[ControlBlock.PLAN_SLOT]), int(header[ControlBlock.PLAN_GEN])
        held, plan = self._slots[slot]
        if held != gen:
            plan = CallPlan.decode(args, index_lookup)
            self._slots[slot] = (gen, plan)
        assert plan is not None, "a slot is named only once a plan was published in it"
        return plan
