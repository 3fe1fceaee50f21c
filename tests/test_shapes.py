"""Shapes: rows are free, graphs that need static shapes get them per device, declarations hold."""

import json
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import RaiseIfNegative, close, reference

import synkhronos as synk

pytestmark = pytest.mark.timeout(180)


def test_a_static_row_count_is_refused_with_the_way_to_declare_it(synk2):
    """A graph built for 8 rows may hold 8 anywhere; each device computes a share, so it is refused."""
    x = pt.tensor("x", shape=(8, 3), dtype="float64")
    n_functions = len(synk2.registry.specs)
    with pytest.raises(TypeError, match=r"static row count, shape \(8, 3\).*shape=\(None, 3\)"):
        synk.function([x], ((x ** 2).sum(axis=1).mean(), "avg"))
    labels = pt.tensor("labels", shape=(8,), dtype="int64")
    with pytest.raises(TypeError, match=r"shape=\(None,\)"):
        synk.function([labels], (labels.sum(), "sum"))
    assert len(synk2.registry.specs) == n_functions
    free = pt.tensor("x", shape=(None, 3), dtype="float64")
    f = synk.function([free], [((free ** 2).sum(axis=1).mean(), "avg"),
                               (pt.cast(free.shape[0], "float64"), "sum")])
    X = np.arange(24.0).reshape(8, 3)
    for got, want in zip(f(X), reference(f, X)):
        close(got, want)


def cnn_classifier(rng):
    """A pytensor-ml CNN with a cross-entropy loss, on free rows (JAX needs concrete shapes for it)."""
    from pytensor_ml.layers import Conv2D, Linear, MaxPool2D
    from pytensor_ml.loss import CrossEntropy, supervised_loss
    x = pt.tensor("images", shape=(None, 6, 6, 1), dtype="float64")     # channels last
    conv = Conv2D("shape_conv", in_channels=1, out_channels=2, kernel_size=3, padding="same")
    head = Linear("shape_head", n_in=2 * 3 * 3, n_out=3)
    logits = head(MaxPool2D("shape_pool", kernel_size=2)(conv(x)).reshape((-1, 18)))
    loss, y = supervised_loss(logits, CrossEntropy(expect_logits=True))
    params = [v for v in pytensor.graph.graph_inputs([loss]) if isinstance(v, pytensor.compile.SharedVariable)]
    for p in params:
        p.set_value(rng.normal(size=p.get_value().shape) * 0.5)
    return x, y, loss, logits, params


@pytest.mark.slow
@pytest.mark.parametrize("num_slices", [1, 2])
def test_a_graph_that_needs_static_shapes_is_compiled_per_shape_and_exact(synk2, rng, num_slices):
    x, y, loss, logits, _ = cnn_classifier(rng)
    f = synk.function([x, y], [(loss, "avg"), (logits, "gather")])
    X, Y = rng.normal(size=(7, 6, 6, 1)), rng.integers(0, 3, size=7)    # rows 3 + 4
    for got, want in zip(f(X, Y, num_slices=num_slices), reference(f, X, Y)):
        close(got, want)
    X2, Y2 = rng.normal(size=(5, 6, 6, 1)), rng.integers(0, 3, size=5)  # other shapes: compiled too
    for got, want in zip(f(X2, Y2), reference(f, X2, Y2)):
        close(got, want)
    assert f.compiled.by_rows          # found at the new shapes: the graph on free rows cannot trace


@pytest.mark.slow
def test_a_graph_is_built_for_its_first_calls_shapes_on_every_rank_and_nothing_else(synk2, rng, tmp_path):
    """A graph that builds on free rows but only traces on concrete ones (a ResNet's gradient) is built
    once per rank, for the rows of its first call there: no rank builds it on free rows for nothing."""
    from demos.resnet_synthetic import build
    make_graph, params = build(4, 2, 4)
    x, y, loss, _ = make_graph(None)
    grad = pytensor.grad(loss, params[0])          # a ResNet's gradient traces on concrete shapes only
    path = tmp_path / "trace.json"
    with synk.timeline(path):
        f = synk.function([x, y], [(loss, "avg"), (grad, "avg")])
        X, Y = rng.normal(size=(5, 4, 4, 3)), rng.integers(0, 2, size=5)      # rows 2 + 3
        got = f(X, Y)
    for got, want in zip(got, reference(f, X, Y)):
        close(got, want)
    with open(path) as fh:
        builds = [e for e in json.load(fh)["traceEvents"]
                  if e.get("cat") == "compile" and e["name"] == f"build {f.name}"]
    assert sorted(e["args"]["shapes"] for e in builds if e["pid"] == 1) == ["((3, 4, 4, 3), (3,))"]
    assert sorted(e["args"]["shapes"] for e in builds if e["pid"] == 0) == ["((2, 4, 4, 3), (2,))"]


def test_a_graph_that_traces_on_free_rows_is_built_so_at_its_second_row_count(synk2, rng, tmp_path):
    """The first rows of a call get a graph of their own; new rows try the graph on free rows, which
    then serves every later row count without another build."""
    x, w = pt.matrix("x"), pt.matrix("w")
    f = synk.function([x], [((x @ w).sum(), "sum"), (pt.tanh(x @ w), "gather")], bcast_inputs=[w],
                      name="free_rows")
    W = rng.normal(size=(3, 2))
    path = tmp_path / "trace.json"
    calls = [rng.normal(size=(rows, 3)) for rows in (6, 9, 13, 6)]
    with synk.timeline(path):
        results = [f(X, W) for X in calls]
    for X, result in zip(calls, results):
        for got, want in zip(result, reference(f, X, W)):
            close(got, want)
    assert f.compiled.by_rows is False
    with open(path) as fh:
        builds = [(e["pid"], e["args"]["shapes"]) for e in json.load(fh)["traceEvents"]
                  if e.get("cat") == "compile" and e["name"] == "build free_rows"]
    for rank in (0, 1):       # 6 rows: 3 each (and w, a broadcast array, at its shape); 9 rows: the
        # graph on free rows, for 9 and 13 rows alike
        assert [shapes for pid, shapes in builds if pid == rank] == ["((3, 3), (3, 2))", "any rows"], builds


@pytest.mark.slow
def test_training_a_cnn_on_an_uneven_split_takes_the_full_batch_step(synk2, rng):
    from synkhronos.extensions import train, updates
    x, y, loss, _, params = cnn_classifier(rng)
    step = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    X, Y = rng.normal(size=(9, 6, 6, 1)), rng.integers(0, 3, size=9)
    start = [p.get_value() for p in params]
    x9 = pt.tensor("images", shape=(9, 6, 6, 1), dtype="float64")       # the reference, static
    from synkhronos.rank.graphs import rebuild_on
    loss9, = rebuild_on([loss], {x: x9})
    want_loss, *grads = pytensor.function([x9, y], [loss9, *pytensor.grad(loss9, params)],
                                          mode="JAX")(X, Y)
    close(step(synk.data(X), synk.data(Y)), want_loss)
    for rank in (0, 1):
        for p, p0, g in zip(params, start, grads):
            close(synk.get_value(rank, p), p0 - 0.1 * g, rtol=1e-8, atol=1e-12)


def test_declared_non_row_axes_are_checked(synk2, rng):
    x = pt.tensor("x", shape=(None, 1), dtype="float64")
    b = pt.tensor("b", shape=(3,), dtype="float64")
    f = synk.function([x], (x.sum() + b.sum(), "sum"), bcast_inputs=[b])
    with pytest.raises(TypeError, match=r"'x' is declared with shape \(None, 1\).*\(4, 3\)"):
        f(np.ones((4, 3)), np.ones(3))
    with pytest.raises(TypeError, match=r"'x' is declared with shape \(None, 1\)"):
        f(synk.data(np.ones((4, 3))), np.ones(3))
    with pytest.raises(TypeError, match=r"'b' is declared with shape \(3,\).*\(4,\)"):
        f(np.ones((4, 1)), np.ones(4))
    close(f(np.ones((4, 1)), np.ones(3)), 4.0 + 2 * 3.0)           # each device adds b.sum()


def test_collectives_respect_a_declared_shape(synk2, rng):
    fixed = pytensor.shared(np.zeros((4, 3)), shape=(4, 3), name="fixed_shape")
    x = pt.matrix("x")
    synk.function([x], (x.sum() + fixed.sum(), "sum"))
    with pytest.raises(ValueError, match=r"scatter would give .* shape \(2, 3\).*\(4, 3\).*None"):
        synk.scatter(fixed, rng.normal(size=(4, 3)))
    with pytest.raises(ValueError, match=r"all_gather would give .* shape \(8, 3\)"):
        synk.all_gather(fixed)
    with pytest.raises(ValueError, match=r"set_value\(1, ...\) would give"):
        synk.set_value(1, fixed, np.zeros((2, 3)))
    synk.broadcast(fixed, np.ones((4, 3)))                           # what fits still works
    close(synk.get_value(1, fixed), np.ones((4, 3)))


def _rows_hint_of(f, *args):
    """The hint of the WorkerError that ``f(*args)`` raises."""
    with pytest.raises(synk.WorkerError) as info:
        f(*args)
    return info.value.hint


ROWS_HINT = "each device gets 10 of the call's 20 rows: write -1 or x.shape[0]"
W16 = np.linspace(-1.0, 1.0, 48).reshape(16, 3)

#: a batch size written into the graph, in every place one is written: name, output of x with batch size n
BATCH_WRITTEN = [
    ("flatten", lambda x, n: x.reshape((n, 1, 4, 4)).flatten(2) @ W16),          # fails in SpecifyShape
    ("reshape", lambda x, n: x.reshape((n, 1, 4, 4)).sum(axis=(2, 3))),
    ("reshape then product", lambda x, n: x.reshape((n, -1)) @ W16),           # fails in the product
    ("reshape beside a shape", lambda x, n: x.reshape((n, x.shape[1])) @ W16),
    ("specify_shape", lambda x, n: pt.specify_shape(x, (n, 16)) @ W16),
    ("zeros", lambda x, n: pt.zeros((n, 16)) + x),
    ("broadcast_to", lambda x, n: pt.broadcast_to(x.sum(1, keepdims=True), (n, 16)) @ W16),
]


@pytest.mark.parametrize("name, make", BATCH_WRITTEN, ids=[c[0] for c in BATCH_WRITTEN])
def test_a_batch_size_written_into_the_graph_gets_the_hint_of_the_rows_each_device_gets(synk2, name, make):
    x = pt.matrix("x")
    X = np.linspace(0.0, 1.0, 320).reshape(20, 16)
    f = synk.function([x], (make(x, 20).sum(), "sum"), name=f"batch_in_{name}")
    hint = _rows_hint_of(f, X)
    assert hint is not None and ROWS_HINT in hint, hint
    fixed = synk.function([x], (make(x, x.shape[0]).sum(), "sum"), name=f"rows_in_{name}")
    close(fixed(X), reference(fixed, X))        # what the hint says to write computes what PyTensor does


def test_an_error_that_has_nothing_to_do_with_rows_gets_no_rows_hint(synk2):
    """The graph holds 20, the call's row count, as a shape (a bias of 20 units, a weight reshaped to
    20 values), but the error is a host callback's, or a product of mismatched columns."""
    x, b = pt.matrix("x"), pt.vector("b")
    X = np.linspace(-1.0, 1.0, 320).reshape(20, 16)
    bias = pt.zeros(20)
    raising = synk.function([x], ((RaiseIfNegative()(x) @ W16).sum() + bias.sum(), "sum"),
                            name="raises_in_a_callback")
    hint = _rows_hint_of(raising, X)
    assert hint is None or "rows" not in hint, hint
    weight = pytensor.shared(np.ones((4, 5)), name="weight_of_20")
    mismatched = synk.function([x], ((x @ b).sum() + weight.reshape((20,)).sum(), "sum"),
                               bcast_inputs=[b], name="mismatched_columns")
    hint = _rows_hint_of(mismatched, X, np.ones(5))
    assert hint is None or "rows" not in hint, hint
    close(mismatched(X, np.ones(16)), X.sum() + 2 * 20.0)         # each device adds the weight's sum
    W2 = pytensor.shared(np.ones((5, 2)), name="W_5_2")
    sliced = synk.function([x], ((x @ W2).sum(0) + pt.zeros(20)[:2], "sum"), name="zeros_sliced")
    hint = _rows_hint_of(sliced, np.ones((20, 7)))                 # 7 columns against 5: no rows at all
    assert hint is None or "rows" not in hint, hint


def _first_half_sum(name, **kwargs):
    """A function whose graph JAX traces only with concrete shapes (a slice with symbolic bounds):
    each device builds it per argument shape."""
    x = pt.matrix("x")
    return synk.function([x], (x[:, :x.shape[1] // 2].sum(), "sum"), name=name, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_function_meeting_many_shapes_compiles_each_once_and_says_so(synk2):
    """Twenty sequence lengths in shuffled order, three epochs (the LSTM tutorial's minibatches,
    each padded to its own longest sequence): each length is built once per device, the results
    equal PyTensor's, and one SynkWarning names the cost and the cure."""
    f = _first_half_sum("lengths")
    lengths, rng = list(range(5, 25)), np.random.default_rng(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            rng.shuffle(lengths)
            for n in lengths:
                X = rng.normal(size=(6, n))
                close(f(X), X[:, :n // 2].sum())
    assert f.compiled.by_rows
    built = f.compiled._row_variant.cache_info()
    assert built.misses == len(lengths) and built.hits == 2 * len(lengths), built
    many = [w for w in seen if issubclass(w.category, synk.SynkWarning)
            and "different argument shapes" in str(w.message)]
    assert len(many) == 1, [str(w.message) for w in seen]
    assert "bucket" in str(many[0].message) and "shapes_kept" in str(many[0].message)


def test_shapes_kept_bounds_the_graphs_a_device_keeps(synk2):
    f = _first_half_sum("few_kept", shapes_kept=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (4, 5, 6, 4):
            X = np.ones((4, n))
            close(f(X), 4 * (n // 2))
    built = f.compiled._row_variant.cache_info()
    assert built.maxsize == 2 and built.currsize == 2 and built.misses == 4, built
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="shapes_kept must be a whole number"):
            _first_half_sum("bad_kept", shapes_kept=bad)
