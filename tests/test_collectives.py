"""Collectives on shared variables, sliceable shareds and batch_s, checked against numpy."""

import contextlib
import itertools

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close

import synkhronos as synk
from synkhronos.comm.shm.paths import PIPELINED, PUBLISHED, Path, PathChooser
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(240)
_unique = itertools.count()


@pytest.fixture
def held(comm_kind, synk2, rng):
    """Three shared variables of two dtypes, with rank-specific values on 2 ranks."""
    a = pytensor.shared(np.zeros((3, 2)), name=f"c_a{next(_unique)}")  # names are looked up
    b = pytensor.shared(np.zeros(4, "float32"), name="c_b")
    c = pytensor.shared(np.zeros(5, "int64"), name="c_c")
    synk.function([], [(a.sum() + b.sum() + c.sum(), "sum")])
    values = [[rng.normal(size=(3, 2)), rng.normal(size=4).astype("float32"),
               rng.integers(-5, 5, size=5)] for _ in range(2)]
    for rank in range(2):
        synk.set_value(rank, [a, b, c], values[rank])
    return (a, b, c), values


@pytest.mark.slow
@pytest.mark.parametrize("op,combine", [("sum", np.add), ("max", np.maximum), ("min", np.minimum),
                                        ("prod", np.multiply)])
def test_all_reduce_several_vars_and_dtypes(held, op, combine):
    vars_, values = held
    synk.all_reduce(list(vars_), op=op)
    for rank in range(2):
        for var, v0, v1 in zip(vars_, *values):
            got = synk.get_value(rank, var)
            close(got, combine(v0, v1), rtol=1e-6)
            assert got.dtype == var.type.dtype


def test_all_reduce_avg_and_by_name(held):
    (a, b, c), values = held
    synk.all_reduce([a.name, b], op="avg")
    for rank in range(2):
        close(synk.get_value(rank, a), (values[0][0] + values[1][0]) / 2)
        close(synk.get_value(rank, b), (values[0][1] + values[1][1]) / 2, rtol=1e-6)
    with pytest.raises(TypeError, match="avg"):
        synk.all_reduce(c, op="avg")


def test_reduce_in_place_and_not(held):
    (a, b, c), values = held
    out = synk.reduce([a, c], op="sum", in_place=False)
    close(out[0], values[0][0] + values[1][0])
    close(out[1], values[0][2] + values[1][2])
    close(synk.get_value(0, a), values[0][0])          # untouched
    assert synk.reduce(a, op="max") is None
    close(synk.get_value(0, a), np.maximum(values[0][0], values[1][0]))
    close(synk.get_value(1, a), values[1][0])          # workers keep theirs


def test_broadcast_numpy_data_and_master_value(held, rng):
    (a, b, c), values = held
    synk.broadcast(a)
    close(synk.get_value(1, a), values[0][0])
    new = rng.normal(size=(7, 2))                      # a new shape travels too
    synk.broadcast(a, new)
    for rank in range(2):
        close(synk.get_value(rank, a), new)
    d = synk.data(np.arange(6, dtype="float32"))
    synk.broadcast([b], [d])
    for rank in range(2):
        close(synk.get_value(rank, b), np.arange(6))


def test_scatter_uneven_with_batch(held, rng):
    (a, b, c), _ = held
    full = rng.normal(size=(9, 2))
    synk.scatter(a, full)
    assert synk.get_lengths(a) == [4, 5]
    assert synk.get_shapes(a) == [(4, 2), (5, 2)]
    close(synk.get_value(0, a), full[:4])
    close(synk.get_value(1, a), full[4:])
    idx = [8, 1, 3, 0, 5]
    synk.scatter([a, c], [synk.data(full), np.arange(9)], batch=idx)
    close(synk.get_value(0, a), full[[8, 1]])
    close(synk.get_value(1, a), full[[3, 0, 5]])
    close(synk.get_value(1, c), [3, 0, 5])


def test_rows_scattered_by_index_stay_put_when_more_are_scattered(comm_kind, synk2, rng):
    """A device adopts the buffer its indexed rows were gathered into (no second copy); a later
    scatter must not reuse that buffer while the first variable holds it (>1 MB: pooled buffers)."""
    a = pytensor.shared(np.zeros((1, 600)), name=f"big_a{next(_unique)}")
    b = pytensor.shared(np.zeros((1, 600)), name=f"big_b{next(_unique)}")
    synk.function([], [(a.sum() + b.sum(), "sum")])
    full = synk.data(rng.normal(size=(700, 600)))
    idx1, idx2 = rng.permutation(700)[:600], rng.permutation(700)[:600]
    synk.scatter(a, full, batch=idx1)
    synk.scatter(b, full, batch=idx2)
    for rank, rows in enumerate((slice(0, 300), slice(300, 600))):
        close(synk.get_value(rank, a), full.data[idx1[rows]])
        close(synk.get_value(rank, b), full.data[idx2[rows]])


def test_gather_and_all_gather_unequal_lengths(held, rng):
    (a, b, c), values = held
    stacked = synk.gather([a, b], nd_up=1)
    close(stacked[0], np.stack([values[0][0], values[1][0]]))
    close(stacked[1], np.stack([values[0][1], values[1][1]]))
    synk.set_value(1, a, rng.normal(size=(5, 2)))
    parts = [synk.get_value(r, a) for r in range(2)]
    close(synk.gather(a, nd_up=0), np.concatenate(parts))
    with pytest.raises(ValueError, match="same shape on every rank"):
        synk.gather(a, nd_up=1)
    synk.all_gather([a, c])
    for rank in range(2):
        close(synk.get_value(rank, a), np.concatenate(parts))
        close(synk.get_value(rank, c), np.concatenate([values[0][2], values[1][2]]))


def test_the_tests_of_each_collectives_kind_run_on_a_runtime_of_that_kind(comm_kind, synk2):
    assert synk2.comm_kind == comm_kind and session.current() is synk2


def test_large_all_reduce_is_exact(comm_kind, synk2):
    big = pytensor.shared(np.zeros(3_000_000, "float32"), name="big")
    synk.function([], [(big.sum(), "sum")])
    ones = np.ones(3_000_000, "float32")
    synk.set_value(0, big, ones)
    synk.set_value(1, big, 2 * ones)
    synk.all_reduce(big, op="sum")
    assert np.all(synk.get_value(1, big) == 3.0) and np.all(synk.get_value(0, big) == 3.0)


def test_all_reduce_of_one_dtype_group_crossing_chunk_bounds(comm_kind, synk2, rng):
    """Several float32 variables travel as one flat buffer whose chunks split them unevenly."""
    shapes = [(7,), (1000,), (5, 3), (300_001,), ()]
    vars_ = [pytensor.shared(np.zeros(s, "float32"), name=f"g{next(_unique)}") for s in shapes]
    synk.function([], [(sum(v.sum() for v in vars_), "sum")])
    for op, combine in [("sum", np.add), ("max", np.maximum)]:
        values = [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(2)]
        for rank in range(2):
            synk.set_value(rank, vars_, values[rank])
        synk.all_reduce(vars_, op=op)
        for rank in range(2):
            for var, v0, v1 in zip(vars_, *values):
                got = synk.get_value(rank, var)
                assert got.shape == np.shape(v0)
                np.testing.assert_array_equal(got, combine(v0, v1))


@contextlib.contextmanager
def reduce_path(comm_kind, path):
    """Make the master's path chooser take ``path`` for every large all-reduce (shm only)."""
    if comm_kind != "shm":
        if path != PIPELINED:
            pytest.skip("the path choice belongs to the shared-memory collectives")
        yield                                   # the JAX runtime has one path
        return
    paths = session.current().context.comm.paths
    paths.fixed = path
    try:
        yield
    finally:
        paths.fixed = None


@pytest.mark.slow
@pytest.mark.parametrize("path", [PIPELINED, PUBLISHED], ids=lambda p: Path(p).name.lower())
@pytest.mark.parametrize("op,combine", [("sum", np.add), ("max", np.maximum), ("prod", np.multiply),
                                        ("avg", lambda a, b: (a + b) / a.dtype.type(2))])
def test_large_all_reduce_paths_with_shared_and_private_results(comm_kind, synk2, rng, op, combine,
                                                                path):
    """Over 8 MB the shared-memory all-reduce streams 1 MB chunks through per-pair rings, or
    publishes whole parts, whichever the master chose.

    One dtype group gets a shared result; two dtype groups get private results
    (a second gather phase). Sizes split the variables unevenly across chunks.
    """
    shapes = {"float32": [(1_200_003,), (3,), (700, 1501)], "float64": [(1_100_001,), ()]}
    vars_ = {dt: [pytensor.shared(np.zeros(s, dt), name=f"p{next(_unique)}") for s in ss]
             for dt, ss in shapes.items()}
    every = vars_["float32"] + vars_["float64"]
    synk.function([], [(sum(v.sum() for v in every), "sum")])
    with reduce_path(comm_kind, path):
        for group in (vars_["float32"], every):
            values = [[rng.normal(size=v.get_value().shape).astype(v.type.dtype) for v in group]
                      for _ in range(2)]
            for rank in range(2):
                synk.set_value(rank, group, values[rank])
            synk.all_reduce(group, op=op)
            if comm_kind == "shm":
                assert session.current().context.comm.chosen_path == path
            for rank in range(2):
                for var, v0, v1 in zip(group, *values):
                    np.testing.assert_array_equal(synk.get_value(rank, var), combine(v0, v1))


def test_both_paths_give_the_same_bits_and_the_master_times_them(comm_kind, synk2, rng):
    """Both paths add the same numbers in the same order; unforced, the master measures both."""
    if comm_kind != "shm":
        pytest.skip("the path choice belongs to the shared-memory collectives")
    big = pytensor.shared(np.zeros(2_500_003, "float32"), name=f"b{next(_unique)}")   # 10 MB
    synk.function([], [(big.sum(), "sum")])
    values = [rng.normal(size=2_500_003).astype("float32") for _ in range(2)]
    results = {}
    for path in (PIPELINED, PUBLISHED):
        with reduce_path(comm_kind, path):
            for rank in range(2):
                synk.set_value(rank, big, values[rank])
            synk.all_reduce(big, op="avg")
            results[path] = [synk.get_value(rank, big) for rank in range(2)]
    for got in results[PIPELINED] + results[PUBLISHED]:
        assert got.tobytes() == results[PIPELINED][0].tobytes()
    close(results[PUBLISHED][1], (values[0] + values[1]) / 2)
    paths = session.current().context.comm.paths
    size_class = paths.size_class(big.get_value().nbytes)
    for _ in range(10):             # calls that first touch new shared memory are not timed
        synk.all_reduce(big, op="sum")
    assert {(size_class, PIPELINED), (size_class, PUBLISHED)} <= set(paths.estimates)


def _run_chooser(paths, seconds_of, calls, nbytes=400 << 20):
    """Let ``paths`` pick ``calls`` times, each path taking ``seconds_of[path]``; the picks."""
    picks = []
    for _ in range(calls):
        path = paths.choose(nbytes)
        paths.record(nbytes, path, seconds_of[path])
        picks.append(path)
    return picks


def test_path_chooser_measures_both_then_takes_the_faster_and_explores():
    paths = PathChooser(explore_every=5)
    picks = _run_chooser(paths, {PIPELINED: 0.05, PUBLISHED: 0.08}, 4 + 20)
    assert picks[:4] == [PIPELINED, PIPELINED, PUBLISHED, PUBLISHED]     # first calls uncounted
    later = picks[4:]
    assert later.count(PUBLISHED) == 4 and all(later[i] == PUBLISHED for i in (4, 9, 14, 19))
    # another size class is measured on its own
    assert _run_chooser(paths, {PIPELINED: 0.5, PUBLISHED: 0.1}, 1, nbytes=40 << 20) == [PIPELINED]


def test_path_chooser_follows_a_change_of_the_faster_path():
    """The cores moving apart makes publishing faster; moving back, the rings again."""
    paths = PathChooser(explore_every=5)
    _run_chooser(paths, {PIPELINED: 0.05, PUBLISHED: 0.08}, 10)
    far = _run_chooser(paths, {PIPELINED: 0.11, PUBLISHED: 0.07}, 10)
    assert far[4:].count(PUBLISHED) == 5                 # switched within a few calls (1 explores)
    near = _run_chooser(paths, {PIPELINED: 0.05, PUBLISHED: 0.08}, 15)
    assert near[-5:].count(PIPELINED) >= 4               # noticed at an exploring call
    paths.fixed = PUBLISHED
    assert paths.choose(400 << 20) == PUBLISHED


def test_a_held_all_reduce_result_is_never_overwritten(comm_kind, synk2):
    """Results live in reused host buffers: one still referenced must not be reused."""
    big = pytensor.shared(np.zeros(600_000, "float32"), name=f"h{next(_unique)}")
    synk.function([], [(big.sum(), "sum")])
    synk.set_value(0, big, np.ones(600_000, "float32"))
    synk.set_value(1, big, np.ones(600_000, "float32"))
    synk.all_reduce(big, op="sum")
    kept = big.get_value(borrow=True)                 # the master's result, still referenced
    for step in range(3):
        synk.all_reduce(big, op="sum")
    np.testing.assert_array_equal(np.asarray(kept), 2.0)
    np.testing.assert_array_equal(synk.get_value(1, big), 16.0)


def test_results_stay_intact_when_more_are_held_than_there_are_shared_regions(comm_kind, synk2):
    from synkhronos.comm.shm.regions import MAX_REGIONS
    big = pytensor.shared(np.zeros(300_000, "float32"), name=f"k{next(_unique)}")   # 1.2 MB
    synk.function([], [(big.sum(), "sum")])
    kept = []
    for step in range(MAX_REGIONS + 3):
        for rank in range(2):
            synk.set_value(rank, big, np.full(300_000, step + rank, "float32"))
        synk.all_reduce(big, op="avg")
        kept.append(big.get_value(borrow=True))
    for step, value in enumerate(kept):
        np.testing.assert_array_equal(np.asarray(value), step + 0.5)
    np.testing.assert_array_equal(synk.get_value(1, big), MAX_REGIONS + 2.5)


COLLECTIVE_MISUSE = [
    ("unknown variable", lambda v: synk.all_reduce(pytensor.shared(np.zeros(2), name="stray")),
     ValueError, "not used by any synk.function"),
    ("unknown name", lambda v: synk.broadcast("no_such_var"), ValueError, "no shared variable named"),
    ("unknown op", lambda v: synk.all_reduce(v, op="median"), ValueError, "op must be one of"),
    ("bad rank", lambda v: synk.get_value(2, v), ValueError, "rank must be"),
    ("bad rank type", lambda v: synk.set_value("1", v, np.zeros((3, 2))), ValueError, "rank must be"),
    ("bad nd_up", lambda v: synk.gather(v, nd_up=2), ValueError, "nd_up"),
    ("values count", lambda v: synk.scatter([v], [np.zeros((2, 2)), np.zeros(2)]), ValueError, "2 values"),
    ("unsafe cast", lambda v: synk.broadcast(v, np.zeros((3, 2), "complex64")), TypeError, "cast"),
    ("wrong ndim", lambda v: synk.scatter(v, np.zeros(4)), TypeError, "ndim"),
    ("listed twice", lambda v: synk.all_reduce([v, v]), ValueError, "more than once"),
]


@pytest.mark.parametrize("case", COLLECTIVE_MISUSE, ids=[c[0] for c in COLLECTIVE_MISUSE])
def test_collective_misuse(held, case):
    (a, b, c), values = held
    _, call, exc, match = case
    with pytest.raises(exc, match=match):
        call(a)
    synk.all_reduce(a, op="sum")                       # still works, nothing was half-done
    close(synk.get_value(1, a), values[0][0] + values[1][0])


def test_unequal_shapes_all_reduce_is_refused_before_any_collective(held, rng):
    (a, b, c), _ = held
    synk.set_value(1, a, rng.normal(size=(4, 2)))
    with pytest.raises(ValueError, match=r"\[\(3, 2\), \(4, 2\)\]"):
        synk.all_reduce(a)
    with pytest.raises(ValueError, match="same shape on every rank"):
        synk.reduce([b, a], op="sum", in_place=False)
    assert synk.get_shapes(a) == [(3, 2), (4, 2)]       # nothing was half-done
    synk.set_value(1, a, rng.normal(size=(2, 3)))      # same size, other shape: still refused
    with pytest.raises(ValueError, match=r"\[\(3, 2\), \(2, 3\)\]"):
        synk.all_reduce(a)
    synk.all_reduce(b, op="max")


# ------------------------------------------------------------------------------------------------
# sliceable shareds and batch_s
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def sliced(comm_kind, synk2, rng):
    s = pytensor.shared(np.zeros((1, 3)), name="s_rows")
    t = pytensor.shared(np.zeros(1), name="t_rows")
    w = pt.vector("w")
    z = s @ w + t
    f = synk.function([], [(z.mean(), "avg"), (z, "gather"), (z.max(), "max")], bcast_inputs=[w],
                      sliceable_shareds=[s, t], name="sliced")
    X, T, W = rng.normal(size=(11, 3)), rng.normal(size=11), rng.normal(size=3)
    synk.scatter([s, t], [X, T])                      # rank 0: rows 0..4, rank 1: rows 5..10
    return f, (s, t), X, T, W


def reference_on_rows(f, shareds, values, *args):
    """as_pytensor with the master's sliceable shareds temporarily holding ``values``."""
    saved = [s.container.storage[0] for s in shareds]
    try:
        for s, v in zip(shareds, values):
            s.set_value(v)
        return f.as_pytensor(*args)
    finally:
        for s, v in zip(shareds, saved):
            s.container.storage[0] = v


BATCH_S = {
    "all rows": (None, [np.arange(5), np.arange(6)]),
    "one slice": (slice(1, 4), [np.arange(1, 4)] * 2),
    "one index list": ([4, 0, 2], [np.array([4, 0, 2])] * 2),
    "one int array": (np.array([3, 1]), [np.array([3, 1])] * 2),
    "per rank slices": ([slice(0, 2), slice(2, 6)], [np.arange(0, 2), np.arange(2, 6)]),
    "per rank lists": ([[4, 4, 1], np.array([5, 0])], [np.array([4, 4, 1]), np.array([5, 0])]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BATCH_S))
@pytest.mark.parametrize("num_slices", [1, 3])
def test_batch_s_forms(sliced, name, num_slices):
    f, shareds, X, T, W = sliced
    batch_s, local_rows = BATCH_S[name]
    starts = [0, 5]
    rows = np.concatenate([start + r for start, r in zip(starts, local_rows)])
    out = f(W, batch_s=batch_s, num_slices=num_slices)
    ref = reference_on_rows(f, shareds, [X[rows], T[rows]], W)
    for got, want in zip(out, ref):
        close(got, want)


def test_scatter_once_then_shuffled_batch_s_every_epoch(sliced, rng):
    f, shareds, X, T, W = sliced
    for epoch in range(3):
        perms = [rng.permutation(5)[:4], rng.permutation(6)[:4]]
        out = f(W, batch_s=perms, num_slices=2)
        rows = np.concatenate([perms[0], 5 + perms[1]])
        ref = reference_on_rows(f, shareds, [X[rows], T[rows]], W)
        for got, want in zip(out, ref):
            close(got, want)


def test_scattered_inputs_with_batch_s_and_givens(synk2, rng):
    s = pytensor.shared(np.zeros((1, 2)), name="s_giv")
    x = pt.matrix("x")
    feats = pt.matrix("feats")
    f = synk.function([x], [((x * feats).sum(), "sum")], givens=[(feats, s)],
                      sliceable_shareds=[s])
    S, Xv = rng.normal(size=(8, 2)), rng.normal(size=(6, 2))
    synk.scatter(s, S)                                # 4 rows each
    out = f(Xv, batch_s=[[0, 2, 3], [1, 0, 3]])        # 3 scattered rows per rank match 3 batch_s rows
    rows = np.array([0, 2, 3, 5, 4, 7])
    close(out[0], (Xv * S[rows]).sum())
    with pytest.raises(ValueError, match="must match"):
        f(Xv, batch_s=slice(0, 2))


def test_batch_s_errors(sliced, rng):
    f, shareds, X, T, W = sliced
    with pytest.raises(ValueError, match="3 entries but there are 2 devices"):
        f(W, batch_s=[slice(0, 1)] * 3)
    with pytest.raises(IndexError, match="out of range .* on rank 0"):
        f(W, batch_s=[slice(0, 6), slice(0, 6)])
    with pytest.raises(ValueError, match="step"):
        f(W, batch_s=slice(0, 4, 2))
    synk.set_value(1, shareds[1], np.zeros(3))
    with pytest.raises(ValueError, match="different lengths on rank 1"):
        f(W)
    x = pt.vector("x")
    g = synk.function([x], (x.sum(), "sum"))
    with pytest.raises(TypeError, match="no sliceable_shareds"):
        g(np.ones(4), batch_s=[0, 1])
    out = f(W, batch_s=[0, 1])                        # still usable
    close(out[1], np.concatenate([X[[0, 1]] @ W + T[[0, 1]], X[[5, 6]] @ W + synk.get_value(1, shareds[1])[[0, 1]]]))


def test_copy_large_copies_in_pieces_and_falls_back_for_strided_arrays(monkeypatch, rng):
    from synkhronos.platform import device_arrays
    monkeypatch.setattr(device_arrays, "COPY_PIECE_BYTES", 1000)          # many uneven pieces
    src = rng.normal(size=(301, 7)).astype("float32")
    for source in (src, src[::2], src[:, 3]):                       # contiguous, strided rows, a column
        dst = np.empty_like(source)
        device_arrays.copy_large(dst, source)
        np.testing.assert_array_equal(dst, source)


@pytest.mark.slow
def test_collectives_of_values_larger_than_a_copy_piece_are_exact(comm_kind, synk2, rng):
    """36 MB values: broadcast, all_gather and a private-result all-reduce copy them in pieces."""
    n = 9_000_001                                                   # 36 MB of float32
    big = pytensor.shared(np.zeros(n, "float32"), name=f"L{next(_unique)}")
    small = pytensor.shared(np.zeros(3, "float64"), name=f"l{next(_unique)}")
    synk.function([], [(big.sum() + small.sum(), "sum")])
    values = [rng.normal(size=n).astype("float32") for _ in range(2)]
    synk.broadcast(big, values[0])
    for rank in range(2):
        np.testing.assert_array_equal(synk.get_value(rank, big), values[0])
    for rank in range(2):
        synk.set_value(rank, [big, small], [values[rank], np.full(3, rank + 1.0)])
    synk.all_reduce([big, small], op="sum")                        # two dtype groups: private results
    for rank in range(2):
        np.testing.assert_array_equal(synk.get_value(rank, big), values[0] + values[1])
        np.testing.assert_array_equal(synk.get_value(rank, small), np.full(3, 3.0))
    part = pytensor.shared(np.zeros(5_000_000, "float32"), name=f"G{next(_unique)}")   # 20 MB
    synk.function([], [(part.sum(), "sum")])
    for rank in range(2):
        synk.set_value(rank, part, values[rank][:5_000_000])
    synk.all_gather(part)
    np.testing.assert_array_equal(synk.get_value(1, part),
                                  np.concatenate([v[:5_000_000] for v in values]))
