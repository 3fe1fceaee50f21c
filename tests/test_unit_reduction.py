"""Unit tests of the output and update modes (synkhronos.comm.reduction) against numpy.

Slices of one rank accumulate through :class:`Accumulator`; ranks' results combine through
:func:`reduce_ranks` and :func:`reduce_outputs`. Row counts are deliberately unequal so that a
wrong weighting of ``"avg"`` shows.
"""

from collections.abc import Callable

import numpy as np
import pytensor.tensor as pt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from synkhronos.comm.reduction import (
    GATHER,
    OUTPUT_MODES,
    UPDATE_MODES,
    Accumulator,
    Reduce,
    check_output_mode,
    check_update_mode,
    owned,
    reduce_outputs,
    reduce_ranks,
)

ROWS = [1, 4, 2]                                   # rows each slice (or rank) computed
ELEMENTWISE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sum": lambda a: a.sum(0), "prod": lambda a: a.prod(0), "min": lambda a: a.min(0), "max": lambda a: a.max(0),
    "avg": lambda a: np.average(a, axis=0, weights=ROWS)}


def parts(dtype: str = "float64") -> list[np.ndarray]:
    """Three ranks' (or slices') values of one (2, 3) output."""
    return [np.arange(6, dtype=dtype).reshape(2, 3) * (k + 1) - 2 * k for k in range(3)]


def test_the_modes_are_strings_travelling_as_codes() -> None:
    """Reduce members equal their names and round-trip through their codes."""
    assert Reduce.AVG == "avg" and Reduce("max") is Reduce.MAX
    assert [Reduce.of_code(m.code) for m in Reduce] == list(Reduce)
    assert set(OUTPUT_MODES) == {"avg", "sum", "prod", "min", "max", GATHER, None}
    assert set(UPDATE_MODES) == set(OUTPUT_MODES) - {GATHER}


def test_an_unknown_reduction_is_refused_listing_the_known_ones() -> None:
    """Reduce.named refuses 'mean', naming the argument and every mode it may be."""
    with pytest.raises(ValueError, match=r"op must be one of \['avg', 'sum', 'prod', 'min', 'max'\], got 'mean'"):
        Reduce.named("mean")
    with pytest.raises(ValueError, match="^reduce must be one of"):
        Reduce.named("average", what="reduce")


@pytest.mark.parametrize("mode", ["mean", "concat", "AVG", ""])
def test_an_unknown_output_or_update_mode_is_refused(mode: str) -> None:
    """check_output_mode and check_update_mode refuse a mode outside their lists, naming it."""
    var = pt.vector("loss")
    with pytest.raises(ValueError, match=f"output mode {mode!r} for loss is not one of"):
        check_output_mode(var, mode)
    with pytest.raises(ValueError, match=f"update mode {mode!r} for loss is not one of"):
        check_update_mode(var, mode)
    with pytest.raises(ValueError, match="not one of"):
        check_update_mode(var, GATHER)                            # gather is an output's only


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool"])
def test_avg_of_an_integer_output_is_refused_naming_the_modes_that_fit(dtype: str) -> None:
    """An integer or bool output cannot be averaged exactly: the error names gather, None, sum."""
    with pytest.raises(TypeError, match=r"which 'avg' cannot average exactly: give it as .*'gather'.*None.*'sum'"):
        check_output_mode(pt.vector("n", dtype=dtype), "avg")
    assert check_output_mode(pt.vector("n", dtype=dtype), "sum") == "sum"


def test_gather_of_a_scalar_output_is_refused() -> None:
    """'gather' concatenates along axis 0: a 0-d output is told to gain a dimension."""
    with pytest.raises(TypeError, match="is 0-d; 'gather' concatenates along axis 0"):
        check_output_mode(pt.dscalar("loss"), GATHER)
    assert check_output_mode(pt.dscalar("loss"), "avg") == "avg" and check_output_mode(pt.dscalar(), None) is None


@pytest.mark.parametrize("mode", sorted(ELEMENTWISE))
def test_a_ranks_slices_accumulate_as_numpy_reduces_them(mode: str) -> None:
    """Accumulator over slices of rows (1, 4, 2): sum/prod/min/max elementwise, avg row-weighted."""
    acc = Accumulator(mode, np)
    for value, rows in zip(parts(), ROWS):
        acc.add(value, rows)
    np.testing.assert_allclose(acc.result(), ELEMENTWISE[mode](np.stack(parts())))
    assert acc.rows == sum(ROWS)


def test_avg_over_slices_is_the_mean_over_the_whole_batch() -> None:
    """Slice means weighted by rows equal the mean of every row, not the mean of the means."""
    rows = np.arange(10.0) ** 2
    acc = Accumulator("avg", np)
    for a, b in [(0, 1), (1, 7), (7, 10)]:
        acc.add(rows[a:b].mean(), b - a)
    assert acc.result() == pytest.approx(rows.mean())
    assert acc.result() != pytest.approx(np.mean([rows[:1].mean(), rows[1:7].mean(), rows[7:].mean()]))


def test_gather_and_none_over_slices() -> None:
    """'gather' concatenates the slices in order (along its axis); None keeps the last slice's value."""
    gathered, along_1, last = Accumulator(GATHER, np), Accumulator(GATHER, np, axis=1), Accumulator(None, np)
    for value, rows in zip(parts(), ROWS):
        gathered.add(value, rows)
        along_1.add(value, rows)
        last.add(value, rows)
    np.testing.assert_array_equal(gathered.result(), np.concatenate(parts()))
    np.testing.assert_array_equal(along_1.result(), np.concatenate(parts(), axis=1))
    np.testing.assert_array_equal(last.result(), parts()[-1])
    one = Accumulator(GATHER, np)
    one.add(parts()[0], 2)
    np.testing.assert_array_equal(one.result(), parts()[0])


@pytest.mark.parametrize("mode", sorted(ELEMENTWISE))
def test_ranks_arrays_reduce_as_numpy_reduces_them(mode: str) -> None:
    """reduce_ranks over three ranks' arrays: elementwise modes, avg weighted by each rank's rows."""
    np.testing.assert_allclose(reduce_ranks(mode, parts(), ROWS), ELEMENTWISE[mode](np.stack(parts())))


@pytest.mark.parametrize("mode", sorted(ELEMENTWISE))
def test_ranks_scalars_reduce_in_one_call_as_their_arrays_do(mode: str) -> None:
    """A scalar output's 1-D array over ranks reduces to what the list of the same scalars does."""
    scalars = np.array([3.0, -1.5, 8.0])
    want = ELEMENTWISE[mode](scalars)
    assert reduce_ranks(mode, scalars, ROWS) == pytest.approx(want)
    assert reduce_ranks(mode, list(scalars), ROWS) == pytest.approx(want)


def test_avg_over_ranks_weights_by_rows_not_by_rank() -> None:
    """Rank means (2, 4) over 1 and 3 rows average to 3.5, not 3."""
    assert reduce_ranks("avg", [np.array([2.0]), np.array([4.0])], [1, 3]) == pytest.approx([3.5])
    assert reduce_ranks("avg", np.array([2.0, 4.0]), [1, 3]) == pytest.approx(3.5)


@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(0, 4)),
                  elements=st.floats(-1e6, 1e6, allow_subnormal=False)),
       st.lists(st.integers(1, 1000), min_size=5, max_size=5))
def test_avg_over_ranks_is_numpys_weighted_average(values: np.ndarray, rows: list[int]) -> None:
    """For any ranks' values and positive row counts, avg is np.average weighted by rows."""
    rows = rows[:len(values)]
    want = np.average(values, axis=0, weights=rows)
    np.testing.assert_allclose(reduce_ranks("avg", list(values), rows), want, rtol=1e-12, atol=1e-6)
    if values.shape[1]:
        np.testing.assert_allclose(reduce_ranks("avg", values[:, 0], rows), want[0], rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_avg_keeps_a_narrow_float_dtype(dtype: str) -> None:
    """A float32 or float16 output averaged over ranks stays of its dtype."""
    out = reduce_ranks("avg", parts(dtype), ROWS)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, ELEMENTWISE["avg"](np.stack(parts())), rtol=1e-3)


def test_gather_over_ranks_concatenates_unequal_shares_in_rank_order() -> None:
    """Ranks of 1, 4 and 2 rows gather into 7 rows in rank order, along the declared axis."""
    shares = [np.full((n, 2), k) for k, n in enumerate(ROWS)]
    np.testing.assert_array_equal(reduce_ranks(GATHER, shares, ROWS), np.concatenate(shares))
    np.testing.assert_array_equal(reduce_ranks(GATHER, [s.T for s in shares], ROWS, axis=1),
                                  np.concatenate(shares).T)
    with pytest.raises(ValueError, match=r"do not join along axis 0.*split_axes"):
        reduce_ranks(GATHER, [s.T for s in shares], ROWS)


@pytest.mark.parametrize("mode", ["sum", "avg", "max"])
def test_parts_of_other_shapes_are_refused_not_broadcast(mode: str) -> None:
    """(3, 1) and (3, 2) parts would broadcast into a wrong number: the error names 'gather'."""
    with pytest.raises(ValueError, match=r"the shapes \[\(3, 1\), \(3, 2\)\].*needs mode 'gather'"):
        reduce_ranks(mode, [np.ones((3, 1)), np.ones((3, 2))], [3, 3])


def test_reduce_outputs_leaves_out_ranks_without_rows_and_reweights_the_rest() -> None:
    """A rank with 0 rows returns nothing and weighs nothing; avg uses the others' rows only."""
    rows = [2, 0, 6]
    columns = [[np.array([1.0, 10.0]), None, np.array([3.0, 20.0])],      # avg
               [np.array([1, 2]), None, np.array([5, 7])],                 # sum of int32
               np.array([4.0, np.nan, -2.0]),                              # a scalar's record: min
               [np.ones((2, 1)), None, np.zeros((6, 1))]]                  # gather
    reductions = [("avg", "float64", 0), ("sum", "int32", 0), ("min", "float32", 0), (GATHER, "float64", 0)]
    avg, total, low, rows_out = reduce_outputs(columns, [0, 1, 2, 3], rows, 0, reductions)
    np.testing.assert_allclose(avg, [(2 * 1 + 6 * 3) / 8, (2 * 10 + 6 * 20) / 8])
    np.testing.assert_array_equal(total, [6, 9])
    assert total.dtype == np.int32 and low == -2.0 and low.dtype == np.float32
    np.testing.assert_array_equal(rows_out, [[1], [1], [0], [0], [0], [0], [0], [0]])


def test_reduce_outputs_mode_none_takes_the_masters_result_or_the_first_computing_ranks() -> None:
    """None: the master's own value; if the master computed no rows, the lowest rank that did."""
    column = [np.array([0.0]), np.array([1.0]), np.array([2.0])]
    reductions = [(None, "float64", 0)]
    assert reduce_outputs([column], [0], [1, 1, 1], 1, reductions)[0] == [1.0]
    assert reduce_outputs([[None, None, column[2]]], [0], [0, 0, 5], 0, reductions)[0] == [2.0]
    assert reduce_outputs([[None, column[1], column[2]]], [0], [0, 3, 5], 0, reductions)[0] == [1.0]
    assert reduce_outputs([], [], [1, 1], 0, reductions) == []


def test_reduce_outputs_selects_by_subset_and_returns_the_declared_dtype() -> None:
    """Each selected output reduces by its own mode and comes back in its declared dtype."""
    reductions = [("sum", "float64", 0), ("max", "float32", 0), ("prod", "int64", 0)]
    columns = [np.array([3, 5], np.int32), [np.array([1.5, 2.0]), np.array([2.5, 1.0])]]
    prod, peak = reduce_outputs(columns, [2, 1], [4, 4], 0, reductions)
    assert prod == 15 and prod.dtype == np.int64
    np.testing.assert_array_equal(peak, [2.5, 2.0])
    assert peak.dtype == np.float32


def test_the_caller_owns_what_it_is_given() -> None:
    """owned copies a read-only view (a device array's host face) into a writeable array of its own."""
    view = np.arange(4.0)
    view.flags.writeable = False
    out = owned(view, "float32")
    assert out.flags.writeable and out.flags.owndata and out.dtype == np.float32
    out[0] = 9.0
    assert view[0] == 0.0
    borrowed = reduce_outputs([[view[1:], view[:3]]], [0], [1, 1], 0, [(None, "float64", 0)])[0]
    assert borrowed.flags.writeable and borrowed.flags.owndata
    np.testing.assert_array_equal(borrowed, [1.0, 2.0, 3.0])
