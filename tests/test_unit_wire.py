"""Unit tests of the wire encoding (synkhronos.wire): what the master writes, a worker reads back.

Everything here runs on plain int64 arrays standing in for the control block's header and args,
and a numpy array standing in for the index segment: no process, no shared memory.
"""

import math
import types

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from synkhronos.wire.batch import Batch, batch_from_spec, chunk, split
from synkhronos.wire.collective import Keep, Kind, dtype_groups, group_bytes, kind_name, shapes_of
from synkhronos.wire.control import ARGS, STEP_COLLECTIVE_AT, ControlBlock, Field, Header, Op, Words, op_name
from synkhronos.wire.loop import epoch_order, steps_per_epoch
from synkhronos.wire.plan import CallPlan, InputRef, PlanMemo, PlanSlots, result_record
from synkhronos.wire.spec import JAX_MODE, FunctionSpec
from synkhronos.wire.topology import Topology

WORD = st.integers(0, 2**62)
SMALL = st.integers(0, 1000)


class IndexSegment:
    """The index segment: explicit batch indices at their offsets, read back by (gen, offset, n)."""

    def __init__(self, gen: int) -> None:
        self.gen, self.words = gen, np.zeros(0, np.int64)

    def write(self, indices: np.ndarray) -> int:
        offset, self.words = len(self.words), np.concatenate([self.words, indices])
        return offset

    def lookup(self, gen: int, offset: int, n: int) -> np.ndarray:
        assert gen == self.gen, "a worker read the indices of another generation"
        return self.words[offset:offset + n]


@st.composite
def batches(draw: st.DrawFn, segment: IndexSegment) -> Batch:
    if draw(st.booleans()):
        start, total = draw(WORD), draw(SMALL)
        return Batch(total, start, start + total)
    indices = draw(hnp.arrays(np.int64, st.integers(0, 12), elements=st.integers(0, 2**40)))
    return Batch(len(indices), indices=indices, index_offset=segment.write(indices))


@st.composite
def input_refs(draw: st.DrawFn) -> InputRef:
    shape = tuple(draw(st.lists(SMALL, min_size=1, max_size=4)))
    return InputRef(draw(SMALL), draw(SMALL), draw(st.integers(0, 20)), draw(WORD), shape,
                    draw(st.integers(0, len(shape) - 1)))


@st.composite
def plans(draw: st.DrawFn) -> tuple[CallPlan, IndexSegment]:
    segment = IndexSegment(draw(SMALL))
    plan = CallPlan(draw(SMALL), draw(st.integers(1, 64)), draw(batches(segment)), draw(st.lists(SMALL, max_size=5)),
                    draw(st.lists(input_refs(), max_size=4)), draw(st.lists(input_refs(), max_size=3)),
                    draw(st.lists(batches(segment), max_size=3)), segment.gen, draw(st.booleans()))
    return plan, segment


def same_batch(a: Batch, b: Batch) -> bool:
    if a.total != b.total or a.is_range != b.is_range:
        return False
    if a.is_range:
        return (a.start, a.stop) == (b.start, b.stop)
    return a.index_offset == b.index_offset and np.array_equal(a.indices, b.indices)


def assert_same_plan(got: CallPlan, want: CallPlan) -> None:
    assert (got.fid, got.num_slices, got.subset, got.index_gen, got.local) == \
        (want.fid, want.num_slices, want.subset, want.index_gen, want.local)
    assert (got.scattered, got.bcast) == (want.scattered, want.bcast)
    assert same_batch(got.batch, want.batch)
    assert len(got.sliced) == len(want.sliced) and all(map(same_batch, got.sliced, want.sliced))


@settings(max_examples=30)
@given(plans())
def test_a_plan_decodes_to_the_plan_the_master_encoded(drawn: tuple[CallPlan, IndexSegment]) -> None:
    """CallPlan.decode(encode()) gives back every field, explicit indices read from the segment."""
    plan, segment = drawn
    args = np.zeros(2048, np.int64)
    Words(args).put(*plan.encode())
    assert_same_plan(CallPlan.decode(args, segment.lookup), plan)


def test_a_plan_with_another_batch_or_slices_encodes_them_not_the_cached_words() -> None:
    """with_batch and with_sliced drop the cached words: the worker decodes the new rows."""
    ref = InputRef(4, 1, 2, 0, (30, 2))
    plan = CallPlan(0, 1, Batch(5, 0, 5), [0], [ref], [], [Batch(5, 0, 5)])
    plan.encode()
    moved = plan.with_batch(Batch(5, 20, 25)).with_sliced([Batch(5, 7, 12)])
    decoded = CallPlan.decode(np.array(moved.encode(), np.int64), IndexSegment(0).lookup)
    assert (decoded.batch.start, decoded.sliced[0].start) == (20, 7)
    assert plan.shape_key() == moved.shape_key()


def test_a_plan_too_large_for_the_args_is_refused_with_the_count() -> None:
    """Words.put, and so PlanSlots.publish, refuse to write past the control words."""
    plan = CallPlan(0, 1, Batch(3, 0, 3), list(range(40)), [], [])
    with pytest.raises(ValueError, match="command needs more than 16 control words"):
        PlanSlots(2).publish(plan.encode(), np.zeros(16, np.int64), np.zeros(16, np.int64))
    with pytest.raises(ValueError, match="more than 3 control words"):
        Words(np.zeros(3, np.int64)).put(1, 2).put_list([3])


@settings(max_examples=30)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(1, 3))
def test_the_plan_table_hands_the_worker_every_plan_decoding_only_new_ones(order: list[int], n_slots: int) -> None:
    """PlanSlots and PlanMemo agree on every plan; only a plan not among the n most recently used
    is written again, and a repeated one is the worker's kept object."""
    pool = [CallPlan(fid, 1, Batch(fid + 1, 0, fid + 1), [fid], [], []) for fid in range(5)]
    slots, memo = PlanSlots(n_slots), PlanMemo(n_slots)
    header, args = np.zeros(16, np.int64), np.zeros(64, np.int64)
    recent: list[int] = []                    # the table's plans, least recently used first
    kept: dict[int, CallPlan] = {}
    for i in order:
        written = slots.publish(pool[i].encode(), header, args)
        got = memo.plan(header, args, IndexSegment(0).lookup)
        assert_same_plan(got, pool[i])
        assert written == (i not in recent)
        if not written:
            assert got is kept[i]
        recent = [j for j in recent if j != i][-(n_slots - 1):] + [i] if n_slots > 1 else [i]
        kept[i] = got
        assert 0 <= header[ControlBlock.PLAN_SLOT] < n_slots


def test_shape_key_and_arguments_text_say_what_traces_alike_and_what_every_node_compares() -> None:
    """Rows' placement and data ids leave the shape key alone; a local plan's text leaves rows out."""
    a = CallPlan(0, 1, Batch(8, 0, 8), [0], [InputRef(4, 0, 1, 0, (30, 2))], [])
    b = CallPlan(0, 1, Batch(8, 10, 18), [0], [InputRef(5, 0, 1, 0, (50, 2))], [])
    c = CallPlan(0, 1, Batch(9, 0, 9), [0], [InputRef(4, 0, 1, 0, (30, 2))], [])
    assert a.shape_key() == b.shape_key() != c.shape_key()
    assert InputRef(4, 0, 1, 0, (7, 30, 2), 1).row_free_shape() == (7, 2)
    local = CallPlan(0, 2, Batch(8, 0, 8), [1], [InputRef(4, 0, 1, 0, (30, 2))], [], local=True)
    assert local.arguments_text() == "num_slices 2, outputs [1]"
    picked = CallPlan(0, 1, Batch(2, indices=np.array([3, 1])), [0], [InputRef(4, 0, 1, 0, (30, 2))], [])
    other = picked.with_batch(Batch(2, indices=np.array([1, 3])))
    assert picked.arguments_text().startswith("2 indices (digest ")
    assert picked.arguments_text() != other.arguments_text()
    assert local.ranks(5, 8, 1, 4) == (1, 4) and a.ranks(5, 8, 1, 4) == (5, 8)


def test_result_record_holds_scalar_outputs_that_fit_a_ranks_record() -> None:
    """Scalar outputs travel as one record in their dtypes; an array or over 256 bytes does not."""
    spec = types.SimpleNamespace(outputs=[(pt.dscalar(), "avg"), (pt.iscalar(), "sum"), (pt.vector(), "gather")])
    assert result_record(spec, CallPlan(0, 1, Batch(1, 0, 1), [0, 1], [], [])) == \
        np.dtype([("o0", "float64"), ("o1", "int32")])
    assert result_record(spec, CallPlan(0, 1, Batch(1, 0, 1), [0, 2], [], [])) is None
    assert result_record(spec, CallPlan(0, 1, Batch(1, 0, 1), [], [], [])) is None
    wide = types.SimpleNamespace(outputs=[(pt.dscalar(), "avg")] * 33)          # 264 bytes
    assert result_record(wide, CallPlan(0, 1, Batch(1, 0, 1), list(range(32)), [], [])) is not None
    assert result_record(wide, CallPlan(0, 1, Batch(1, 0, 1), list(range(33)), [], [])) is None


@given(st.lists(st.integers(-2**63, 2**63 - 1)), st.lists(st.lists(WORD, max_size=5), max_size=5))
def test_words_read_back_what_was_put(singles: list[int], lists: list[list[int]]) -> None:
    """Words.put and put_list read back in order through get and get_list."""
    args = np.zeros(len(singles) + sum(len(v) + 1 for v in lists), np.int64)
    writer = Words(args).put(*singles)
    for values in lists:
        writer.put_list(values)
    reader = Words(args)
    assert [reader.get() for _ in singles] == singles
    assert [reader.get_list() for _ in lists] == lists


def test_the_control_blocks_names_are_its_enums_and_the_step_tail_has_room() -> None:
    """Header and status names are the enums' values; opcode names read back; a step's tail fits."""
    assert ControlBlock.PLAN_SLOT == Header.PLAN_SLOT and type(ControlBlock.PLAN_SLOT) is int
    assert ControlBlock.ROWS == Field.ROWS and ControlBlock.FUSED == Header.FUSED
    assert [op_name(op) for op in (Op.CALL, Op.STEP, 99)] == ["call", "step", "99"]
    assert 0 < STEP_COLLECTIVE_AT < ARGS
    assert (kind_name(Kind.ALL_REDUCE), kind_name(Kind.READ_DATA), kind_name(0)) == \
        ("all_reduce", "read_data", "collective")
    assert [int(k) for k in Keep] == [0, 1, 2]


def test_collective_buffers_group_by_dtype_with_each_variable_aligned() -> None:
    """dtype_groups keeps first-seen order; group_bytes is the largest group, 64 bytes per variable."""
    vars_ = [pytensor.shared(np.zeros(2, t)) for t in ("float32", "int64", "float32")]
    assert [list(g) for g in dtype_groups(vars_)] == [[0, 2], [1]]
    assert group_bytes(vars_, [3, 2, 5]) == max(3 * 4 + 64 + 5 * 4 + 64, 2 * 8 + 64)
    assert group_bytes(vars_, [0, 100, 0]) == 100 * 8 + 64
    assert shapes_of([np.zeros((2, 3)), np.float64(1.0), [1, 2]]) == [(2, 3), (), (2,)]


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_split_gives_contiguous_near_equal_chunks_covering_every_row(total: int, parts: int) -> None:
    """split/chunk cover [0, total) in order, sizes differing by at most one, wherever they start."""
    bounds = split(total, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert chunk(100, 100 + total, parts, parts - 1) == (100 + bounds[-1][0], 100 + total)


@given(st.one_of(st.integers(0, 10**9), st.tuples(st.none() | SMALL, st.none() | SMALL),
                 st.lists(st.integers(0, 2**62), max_size=20)))
def test_batch_from_spec_keeps_the_rows_the_user_named(spec: int | tuple | list) -> None:
    """An int counts rows from 0, a slice (open: to ``length``) is a range, a list its indices;
    an empty batch's bounds are (0, -1)."""
    length = 500
    if isinstance(spec, int):
        rows: range | list = range(spec)
    elif isinstance(spec, tuple):
        rows = range(spec[0] or 0, length if spec[1] is None else spec[1])
        spec = slice(*spec)
        if rows.stop < rows.start:
            return
    else:
        rows = spec
    batch = batch_from_spec(spec, length)
    bounds = (0, -1) if not len(rows) else (rows[0], rows[-1]) if isinstance(rows, range) else (min(rows), max(rows))
    assert (batch.is_range, batch.total, batch.lowest(), batch.highest()) == \
        (not isinstance(spec, list), len(rows), *bounds)


@pytest.mark.parametrize("spec, error, message", [
    (True, TypeError, "not a bool"),
    (-1, ValueError, "an int batch is a row count and must be >= 0"),
    (slice(0, 10, 2), ValueError, r"has a step; use explicit indices \(e.g. np.arange"),
    (slice(-3, None), ValueError, "has a negative bound"),
    (slice(5, 2), ValueError, "has stop < start"),
    ([1.0, 2.0], TypeError, "must be a 1-D list or array of ints, got float64"),
    ([[1, 2]], TypeError, r"with shape \(1, 2\)"),
    ([3, -1], IndexError, "batch index -1 is negative"),
    (np.array([2**63], np.uint64), IndexError, "batch index 9223372036854775808 is out of range"),
    ("0:5", TypeError, "got str"),
])
def test_a_malformed_batch_is_refused_saying_why(spec: object, error: type, message: str) -> None:
    """batch_from_spec refuses what names no rows, naming the fix."""
    with pytest.raises(error, match=message):
        batch_from_spec(spec, 10)


@given(st.integers(1, 8), st.integers(1, 8))
def test_topology_numbers_every_device_of_every_node_once(n_nodes: int, n_local: int) -> None:
    """Global ranks run node after node; node_of/local_of invert global_rank; to_dict round-trips."""
    seen = []
    for node in range(n_nodes):
        t = Topology(n_nodes, node, n_local, "10.0.0.1:7777" if n_nodes > 1 else None)
        assert Topology(**t.to_dict()) == t and t.several_nodes == (n_nodes > 1)
        ranks = [t.global_rank(local) for local in range(n_local)]
        assert ranks == list(t.ranks_of(node)) and ranks[0] == t.offset
        assert all(t.node_of(r) == node and t.local_of(r) == i for i, r in enumerate(ranks))
        seen += ranks
    assert seen == list(range(n_nodes * n_local)) == list(range(t.n_devices))


def test_function_spec_defaults_and_digest() -> None:
    """Axes default to the Data's own / 0, the user's mode wins, and the digest follows options."""
    x, w = pt.vector("x"), pytensor.shared(np.ones(3), name="w")
    spec = FunctionSpec(0, "f", [x], [], [(x * w, "avg")], [(w, w * 2, None)], [], [])
    assert spec.input_axis(0) is None and spec.gather_axis(0) == 0
    assert spec.pytensor_kwargs() == {"mode": JAX_MODE, "on_unused_input": "ignore"} and spec.kwargs == {}
    assert FunctionSpec(0, "f", [], [], [], [], [], [], kwargs={"mode": "FAST_RUN"}).pytensor_kwargs()["mode"] == \
        "FAST_RUN"
    assert set(spec.shared_variables()) == {w} and spec.all_inputs == [x]
    bare = [FunctionSpec(0, "f", [], [], [], [], [], [], kwargs=k) for k in ({}, {}, {"allow_input_downcast": True})]
    assert bare[0].digest() == bare[1].digest() != bare[2].digest()


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_steps_per_epoch_takes_every_row(n_rows: int, batch_size: int) -> None:
    """A last, short step takes the rows left: ceil(n / B) steps."""
    assert steps_per_epoch(n_rows, batch_size) == math.ceil(n_rows / batch_size)


def test_epoch_order_is_the_same_permutation_on_every_rank() -> None:
    """The order is a function of (rows, epoch, seed): a permutation, new each epoch."""
    first, again = epoch_order(50, 3, 7), epoch_order(50, 3, 7)
    np.testing.assert_array_equal(first, again)
    assert sorted(first.tolist()) == list(range(50)) and first.dtype == np.int64
    assert not np.array_equal(first, epoch_order(50, 4, 7))
    np.testing.assert_array_equal(epoch_order(4, 9, 9, shuffle=False), [0, 1, 2, 3])


def test_what_nodes_compare_of_a_function_tells_apart_every_part_of_its_graphs():
    """A function's compared text differs when any part of what it computes differs: a constant in
    the middle of a large one (printed abbreviated), the variable a givens replaces, a shared
    variable of the same name and shape, the variables it slices; and not between two builds of
    the same graph."""
    x = pt.vector("x")
    a, b, c = (pytensor.shared(np.zeros(3), name=name) for name in "abc")
    w, w_twin = pytensor.shared(np.ones(3), name="w"), pytensor.shared(np.ones(3), name="w")
    table = np.arange(1000.0)
    uids = {a: 0, b: 1, c: 2, w: 3, w_twin: 4}

    def text(constant=table, replaced=a, weights=w, sliced=()):
        spec = FunctionSpec(0, "f", [x], [], [(((x + a + 2 * b) * weights).sum() + pt.constant(constant).sum(),
                                               "sum")], [], [(replaced, c)], list(sliced))
        return spec.compared_text(uids.__getitem__)

    changed = table.copy()
    changed[500] = -1.0
    assert text() == text()
    others = [text(constant=changed), text(replaced=b), text(weights=w_twin), text(sliced=[c])]
    assert len({text(), *others}) == 5


def test_what_nodes_compare_reaches_inner_graphs_and_split_axes():
    """A large constant inside an OpFromGraph (printed abbreviated there too) and the axis a
    scattered input is split along are compared."""
    from pytensor.compile.builders import OpFromGraph
    x = pt.matrix("x")

    def text(middle=0.0, axes=(0,)):
        table = np.arange(1000.0)
        table[500] = middle
        inner_x = pt.matrix("inner_x")
        op = OpFromGraph([inner_x], [inner_x.sum() + pt.constant(table).sum()])
        spec = FunctionSpec(0, "f", [x], [], [(op(x), "sum")], [], [], [], input_axes=list(axes))
        return spec.compared_text(id)

    assert text() == text()
    assert len({text(), text(middle=-1.0), text(axes=(1,))}) == 3
