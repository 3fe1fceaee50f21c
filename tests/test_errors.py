"""Every misuse raises a clear exception before any process works, and the runtime stays usable."""

import os
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import RaiseIfNegative, close

import synkhronos as synk

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fx(synk2, rng):
    x, b = pt.matrix("x"), pt.vector("b")
    f = synk.function([x], [(x.sum(0), "sum")], bcast_inputs=[b], name="fx")
    X, B = rng.normal(size=(6, 3)), rng.normal(size=3)
    return f, synk.data(X), synk.data(B), X


def _sum_ok(f, xd, bd, X):
    close(f(xd, bd)[0], X.sum(0))


CALL_MISUSE = [
    ("wrong dtype", lambda f, xd, bd: f(synk.data(np.zeros((6, 3), "float32")), bd), TypeError, "dtype"),
    ("wrong ndim", lambda f, xd, bd: f(synk.data(np.zeros(6)), bd), TypeError, "ndim"),
    ("too many args", lambda f, xd, bd: f(xd, bd, bd), TypeError, "takes 2 inputs"),
    ("missing arg", lambda f, xd, bd: f(xd), TypeError, "missing"),
    ("unknown name", lambda f, xd, bd: f(xd, bd, nope=bd), TypeError, "no input named 'nope'"),
    ("given twice", lambda f, xd, bd: f(xd, bd, b=bd), TypeError, "twice"),
    ("int batch too big", lambda f, xd, bd: f(xd, bd, batch=7), IndexError, "6"),
    ("index out of range", lambda f, xd, bd: f(xd, bd, batch=[0, 9, 1]), IndexError, "9"),
    ("negative index", lambda f, xd, bd: f(xd, bd, batch=[0, -1]), IndexError, "-1"),
    ("slice past end", lambda f, xd, bd: f(xd, bd, batch=slice(2, 10)), IndexError, "out of range"),
    ("slice step", lambda f, xd, bd: f(xd, bd, batch=slice(0, 6, 2)), ValueError, "step"),
    ("float indices", lambda f, xd, bd: f(xd, bd, batch=[0.5, 1.0]), TypeError, "ints"),
    ("uint64 index past int64", lambda f, xd, bd: f(xd, bd, batch=np.array([0, 2**64 - 1], np.uint64)),
     IndexError, "18446744073709551615 is out of range"),
    ("negative int batch", lambda f, xd, bd: f(xd, bd, batch=-2), ValueError, ">= 0"),
    ("empty batch", lambda f, xd, bd: f(xd, bd, batch=[]), ValueError, "no rows"),
    ("num_slices 0", lambda f, xd, bd: f(xd, bd, num_slices=0), ValueError, "num_slices"),
    ("num_slices float", lambda f, xd, bd: f(xd, bd, num_slices=1.5), TypeError, "num_slices"),
    ("batch_s without sliceables", lambda f, xd, bd: f(xd, bd, batch_s=slice(0, 2)), TypeError, "sliceable"),
    ("bad output_subset", lambda f, xd, bd: f(xd, bd, output_subset=[3]), ValueError, "output_subset"),
    ("unsafe numpy cast", lambda f, xd, bd: f(np.zeros((6, 3), "complex128"), bd), TypeError,
     r"\.astype\('float64'\)\) or build the function with synk.function\(\.\.\., allow_input_downcast=True\)"),
    ("Data of another dtype", lambda f, xd, bd: f(synk.data(np.zeros((6, 3), "float32")), bd), TypeError,
     r"synk.data\(value, var=x, force_cast=True\)"),
    ("unequal lengths", None, ValueError, "different lengths"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CALL_MISUSE, ids=[c[0] for c in CALL_MISUSE])
def test_call_misuse(fx, case, synk2):
    f, xd, bd, X = fx
    _, call, exc, match = case
    if call is None:  # two scattered inputs of different lengths, no batch
        x, y = pt.matrix("x2"), pt.vector("y2")
        g = synk.function([x, y], (x.sum() + y.sum(), "sum"))
        with pytest.raises(exc, match=match):
            g(np.zeros((6, 2)), np.zeros(5))
    else:
        with pytest.raises(exc, match=match):
            call(f, xd, bd)
    _sum_ok(f, xd, bd, X)


def _images_given(w):
    images = pt.tensor4("images")
    return synk.function([], images.sum(), givens=[(images, w)], sliceable_shareds=[w])


BUILD_MISUSE = [
    ("bad output mode", lambda x, w: synk.function([x], [(x.sum(), "median")]), ValueError, "median"),
    ("int avg", lambda x, w: synk.function([x], [(x.shape[0], "avg")]), TypeError, "integer"),
    ("gather 0-d", lambda x, w: synk.function([x], [(x.sum(), "gather")]), TypeError, "0-d"),
    ("bad update mode", lambda x, w: synk.function([x], updates=[(w, w + 1, "gather")]), ValueError, "update mode"),
    ("update not shared", lambda x, w: synk.function([x], updates=[(x, x + 1)]), TypeError, "shared"),
    ("shared as input", lambda x, w: synk.function([w], x.sum()), TypeError, "symbolic input"),
    ("unused sliceable", lambda x, w: synk.function([x], x.sum(), sliceable_shareds=[
        pytensor.shared(np.zeros(2))]), ValueError, "not used"),
    ("sliceable not shared", lambda x, w: synk.function([x], (x.sum(), "sum"), sliceable_shareds=[np.zeros(2)]),
     TypeError, "sliceable_shareds must be shared variables"),
    ("duplicate input", lambda x, w: synk.function([x], x.sum(), bcast_inputs=[x]), ValueError, "more than once"),
    ("bad output", lambda x, w: synk.function([x], ["loss"]), TypeError, "output"),
    ("C backend mode", lambda x, w: synk.function([x], x.sum(), mode="FAST_RUN"), ValueError,
     "does not compile for JAX"),
    ("numba mode", lambda x, w: synk.function([x], x.sum(), mode="NUMBA"), ValueError, "JAX"),
    ("unknown mode", lambda x, w: synk.function([x], x.sum(), mode="NOPE"), ValueError, "NOPE"),
    ("sliceable of another type", lambda x, w: _images_given(w), TypeError,
     r"givens replaces images \(dtype float64, ndim 4\) with sliceable shared wm .*make wm of that"),
]


@pytest.mark.parametrize("case", BUILD_MISUSE, ids=[c[0] for c in BUILD_MISUSE])
def test_build_misuse(fx, case):
    f, xd, bd, X = fx
    _, build, exc, match = case
    x, w = pt.matrix("xm"), pytensor.shared(np.zeros(3), name="wm")
    with pytest.raises(exc, match=match):
        build(x, w)
    _sum_ok(f, xd, bd, X)


def test_allow_input_downcast_casts_numpy_arguments_as_pytensor_does(synk2):
    """scikit-learn's int64 labels into an ivector input."""
    x, y = pt.matrix("x"), pt.ivector("y")
    f = synk.function([x, y], ((x.sum(1) * y).sum(), "sum"), allow_input_downcast=True)
    close(f(np.ones((4, 3)), np.arange(4)), 18.0)
    close(f.as_pytensor(np.ones((4, 3)), np.arange(4)), 18.0)


def test_updates_with_fewer_rows_than_devices(fx, synk2):
    f, xd, bd, X = fx
    w = pytensor.shared(np.zeros(3), name="w_few")
    x = pt.matrix("x")
    g = synk.function([x], (x.sum(), "sum"), updates=[(w, w + x.sum(0))], local_updates=True)
    with pytest.raises(ValueError, match="at least one row per device"):
        g(X, batch=1)
    # without updates, a device with no rows simply contributes nothing
    h = synk.function([x], [(x.sum(0), "sum"), (x.mean(0), "avg"), (x.sum(0), None)])
    out = h(X, batch=[4])
    for got in out:
        close(got, X[4])
    _sum_ok(f, xd, bd, X)


def test_worker_exception_reaches_master_with_traceback(fx, synk2):
    f, xd, bd, X = fx
    x = pt.matrix("x")
    g = synk.function([x], (RaiseIfNegative()(x).sum(), "sum"))
    data = np.ones((6, 2))
    data[5, 1] = -1.0                        # only rank 1's rows hold a negative value
    with pytest.raises(synk.WorkerError) as info:
        g(data)
    err = info.value
    assert err.rank == 1 and err.how == "raised"
    assert "RaiseIfNegative saw a negative value" in str(err)
    assert "Traceback" in err.worker_traceback
    close(g(np.ones((6, 2))), 12.0)
    _sum_ok(f, xd, bd, X)


def test_worker_side_failure_to_map_data(fx, synk2):
    f, xd, bd, X = fx
    d = synk.data(np.ones((4, 3)))
    os.unlink("/dev/shm/" + d.segment_name())   # the master keeps its mapping; workers cannot map it
    with pytest.raises(synk.WorkerError, match="rank 1 raised FileNotFoundError"):
        f(d, bd)
    _sum_ok(f, xd, bd, X)


def test_error_in_every_rank_is_raised_once(fx, synk2):
    f, xd, bd, X = fx
    x, b = pt.matrix("x"), pt.vector("b")
    g = synk.function([x], (x @ b, "gather"), bcast_inputs=[b])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(synk.WorkerError) as info:
            g(np.ones((4, 3)), np.ones(5))           # shapes do not align in any rank
    # one exception, the master's own (rank 0 fails first); the worker's same error is not
    # raised again, neither now as a warning nor at the next call
    assert info.value.rank == synk2.master_rank and info.value.how == "raised"
    assert isinstance(info.value, TypeError) and "dot_general" in str(info.value)
    assert not [w for w in caught if "rank" in str(w.message)]
    close(g(np.ones((4, 3)), np.ones(3)), 3.0)
    _sum_ok(f, xd, bd, X)


@pytest.mark.parametrize("rows, failing_rank", [(5, 1), (3, 0)])
def test_an_error_has_one_type_whichever_rank_hits_it(fx, synk2, rows, failing_rank):
    """A reshape that fails only on the rank whose share has the wrong size (2 rows fit, 1 or 3 not)."""
    f, xd, bd, X = fx
    x = pt.matrix("x")
    g = synk.function([x], (pt.reshape(x, (2, 3)).sum(), "sum"), name="reshaped")
    with pytest.raises(synk.WorkerError, match=f"rank {failing_rank} raised TypeError") as info:
        g(np.ones((rows, 3)))
    err = info.value
    assert err.rank == failing_rank and err.how == "raised" and isinstance(err, TypeError)
    assert "reshape" in err.worker_traceback
    close(g(np.ones((4, 3))), 12.0)
    _sum_ok(f, xd, bd, X)


def test_warnings_of_workers_reach_the_master_once_through_its_filters(synk2):
    """A warning every rank raises shows once, from the master's warnings, and obeys its filters."""
    import warnings

    from helpers import WarnRows
    x = pt.matrix("x")
    f = synk.function([x], (WarnRows()(x).sum(), "sum"), name="warner")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        close(f(np.ones((5, 2))), 10.0)                          # rows 2 + 3
        close(f(np.ones((5, 2))), 10.0)
    messages = sorted(str(w.message) for w in seen if "WarnRows" in str(w.message))
    assert messages == ["WarnRows saw 2 rows", "WarnRows saw 3 rows"]     # each once, rank 1's too
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="WarnRows saw 4 rows")
        with pytest.raises(UserWarning, match="WarnRows saw 4 rows"):
            f(np.ones((7, 2)))                   # rows 3 + 4: rank 1's warning is an error here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        close(f(np.ones((4, 2))), 8.0)


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_an_error_while_computing_keeps_every_variable(synk2, failing_rank):
    from helpers import check_an_error_keeps_every_variable
    check_an_error_keeps_every_variable(2, failing_rank)


@pytest.mark.parametrize("rows, failing_rank", [(5, 1), (3, 0)])
def test_a_donating_call_failing_on_one_rank_keeps_every_rank_as_it_was(synk2, rows, failing_rank):
    """The graph calls no host code and its 2.9 MB update is donated; it fails when traced for one
    rank's rows only, while the other rank computes and stores its update: that rank puts it back."""
    w = pytensor.shared(np.ones((600, 600)), name="w_donated")
    x = pt.matrix("x")
    s = pt.reshape(x, (2, 3)).sum()
    g = synk.function([x], (s, "sum"), updates=[(w, w + s)], local_updates=True, name="donating")
    close(g(np.ones((4, 3))), 12.0)
    before = [synk.get_value(r, w) for r in range(2)]
    for _ in range(2):
        with pytest.raises(synk.WorkerError, match=f"rank {failing_rank} raised .*[Rr]eshape"):
            g(np.ones((rows, 3)))
        for r in range(2):
            np.testing.assert_array_equal(synk.get_value(r, w), before[r])
    close(g(np.ones((4, 3))), 12.0)
    for r in range(2):
        close(synk.get_value(r, w), before[r] + 6.0)


def test_an_error_a_host_callback_raises_reads_as_the_callbacks_own(synk2):
    """XLA reports an exception raised in a host callback as its own error holding the callback's
    traceback; the WorkerError is the callback's exception, type and message, from the first call
    on, whichever rank raised it."""
    x = pt.matrix("x")
    for failing_rank in (1, 0):
        g = synk.function([x], (RaiseIfNegative()(x).sum(), "sum"), name=f"raises_first_{failing_rank}")
        data = np.ones((4, 2))
        data[2 * failing_rank, 0] = -1.0
        for _ in range(2):              # the first call (which also builds the graph) and a later one
            with pytest.raises(synk.WorkerError) as info:
                g(data)
            err = info.value
            assert isinstance(err, ValueError) and err.exc_type == "ValueError", repr(err)
            assert err.rank == failing_rank and err.message == "RaiseIfNegative saw a negative value"
            assert len(str(err).splitlines()) <= 4, str(err)
        close(g(np.ones((4, 2))), 8.0)


def test_a_shared_variable_given_another_shape_on_one_rank_makes_calls_careful_again(synk2):
    """Calls of one shape have run everywhere (their 2.4 MB update donates); then one rank's weight
    takes another shape, and that rank's next call fails: the other rank puts its update back."""
    m = pytensor.shared(np.full(300_000, 2.0), name="m_reshaped_elsewhere")
    w = pytensor.shared(np.ones((3, 2)), name="w_reshaped_elsewhere")
    x = pt.matrix("x")
    f = synk.function([x], ((x @ w).sum(), "sum"), updates=[(m, m + 1.0)], local_updates=True)
    for _ in range(2):
        close(f(np.ones((4, 3))), 24.0)
    synk.set_value(1, w, np.ones((5, 2)))
    before = [synk.get_value(r, m) for r in range(2)]
    with pytest.raises(synk.WorkerError) as info:
        f(np.ones((4, 3)))
    assert info.value.rank == 1
    for r in range(2):
        np.testing.assert_array_equal(synk.get_value(r, m), before[r])
    synk.set_value(1, w, np.ones((3, 2)))
    close(f(np.ones((4, 3))), 24.0)
    for r in range(2):
        close(synk.get_value(r, m), before[r] + 1.0)


def _regression(prefix, rng):
    """The Theano script's regression MLP: inputs, targets, its parameters and its squared errors."""
    x, y = pt.matrix(f"{prefix}_x"), pt.matrix(f"{prefix}_y")
    W = pytensor.shared(rng.normal(size=(4, 3)) * 0.3, name=f"{prefix}_W")
    b = pytensor.shared(np.zeros(3), name=f"{prefix}_b")
    return x, y, [W, b], (pt.tanh(x.dot(W) + b) - y) ** 2


@pytest.mark.slow
def test_a_loss_summed_over_the_rows_is_refused_when_its_step_is_built_and_its_mean_trains_as_one_process(synk2):
    """``cost = mlp.cost / (2 * batch_size)`` (a sum of squares): each device's loss over its rows
    would be a fraction of the batch's, and the step, weighing devices by rows as for a mean, would
    train n_devices times too slowly. Every step builder refuses it, naming the fix; the fix (the
    rows' count in place of the constant) trains as one process on an uneven batch."""
    from synkhronos.extensions import train, updates
    rng = np.random.default_rng(3)
    x, y, params, errors = _regression("summed", rng)
    batch_size = pytensor.shared(np.float64(7.0), name="batch_size")
    lr = pt.scalar("summed_lr")
    summed = {"sum / (2 * batch_size)": errors.sum() / (2 * 7), "sum": errors.sum(),
              "sum * lr, over a shared size": lr * errors.sum() / batch_size,
              "sum of per-row sums, plus a penalty": errors.sum(axis=1).sum() / 7 + 0.01 * (params[0] ** 2).sum()}
    X_sh = pytensor.shared(np.zeros((14, 4)), name="summed_X")
    Y_sh = pytensor.shared(np.zeros((14, 3)), name="summed_Y")
    i = pt.iscalar("summed_i")
    for loss in summed.values():
        builds = [lambda: train.make_train_function(loss, params, x, y, updates.sgd, 0.1),
                  lambda: train.make_train_function(loss, params, x, y, updates.sgd, 0.1,
                                                    givens={x: X_sh[i * 7:(i + 1) * 7], y: Y_sh[i * 7:(i + 1) * 7]}),
                  lambda: train.make_device_train_function(loss, params, x, y, X_sh, Y_sh, updates.sgd, 0.1)]
        for build in builds:
            with pytest.raises(ValueError, match=r"the loss is a sum over the rows .*x\.shape\[0\]"):
                build()
    # means however written are not refused: a target read for its name alone (0 * y.sum()) counts
    # nothing; a mean written inside the sum, or weighed by normalized weights; a time-major mask
    # (its rows along axis 1, undeclared: a Data's split_axis says it at the call)
    weights, mask = pt.vector("summed_weights"), pt.matrix("summed_mask")
    per_row = errors.sum(axis=1)
    for mean, targets in ((errors.mean() + 0 * y.sum(), y), ((per_row / x.shape[0]).sum(), y),
                          ((per_row * (weights / weights.sum())).sum(), [y, weights]),
                          ((mask * per_row[None, :]).mean(axis=1).sum(), [y, mask])):
        train.make_train_function(mean, params, x, targets, updates.sgd, 0.1)
    X, Y = rng.normal(size=(7, 4)), rng.normal(size=(7, 3))
    mean = errors.sum() / (2 * x.shape[0])
    x1, y1, params1, errors1 = _regression("summed_one", np.random.default_rng(3))
    step = train.make_train_function(mean, params, x, y, updates.sgd, 0.1)
    single = train.make_single_process_train_function(errors1.sum() / (2 * x1.shape[0]), params1, x1, y1,
                                                      updates.sgd, 0.1)
    synk.distribute()
    for _ in range(3):
        close(step(synk.data(X), synk.data(Y)), single(X, Y))
    for p, p1 in zip(params, params1):
        for rank in (0, 1):
            close(synk.get_value(rank, p), p1.get_value())


def test_a_summed_output_adding_a_term_of_no_rows_is_said_when_built(synk2):
    """A summed loss plus a penalty on the weights, reduced with 'sum': every device adds the
    penalty, so the call counts it once per device. Said when built, naming it; a sum of row terms,
    a product with a weight, an output or a function without rows are not."""
    from synkhronos.errors import SynkWarning
    x, y = pt.matrix("penalised_x"), pt.vector("penalised_y")
    w = pytensor.shared(np.array([1.5, 2.0, -1.0]), name="w_penalised")
    X, Y = np.arange(15.0).reshape(5, 3), np.arange(5.0)
    loss = ((x @ w - y) ** 2).sum()
    with pytest.warns(SynkWarning, match=r"reduced with 'sum' and adds .*reads none of the call's rows.*once "
                                         r"per device and slice"):
        penalised = synk.function([x, y], (loss + 0.1 * (w ** 2).sum(), "sum"), name="penalised")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine = synk.function([x, y], [(loss + x.sum(), "sum"), (loss * w.sum(), "sum"), (w.sum(), "sum")],
                             name="row_terms")
        rowless = synk.function([], ((w ** 2).sum(), "sum"), name="rowless")
    synk.distribute()
    whole = ((X @ w.get_value() - Y) ** 2).sum()
    close(fine(X, Y), [whole + X.sum(), whole * w.get_value().sum(), 2 * w.get_value().sum()])
    penalty = 0.1 * (w.get_value() ** 2).sum()
    close(penalised(X, Y), whole + 2 * penalty)              # what the warning said: once per device
    close(rowless(), 2 * (w.get_value() ** 2).sum())


def test_an_output_summed_over_the_rows_and_averaged_by_default_is_said_when_built(synk2):
    """An output averaged by default that sums over the rows returns the devices' average of their
    own sums: said when the function is built (naming 'sum' and the rows' count). An explicit mode,
    a mean and a per-row sum are not."""
    from synkhronos.errors import SynkWarning
    x = pt.matrix("averaged_x")
    X = np.arange(15.0).reshape(5, 3)                      # 3 and 2 rows on the two devices
    with pytest.warns(SynkWarning, match=r"output .* is a sum over the rows .*'avg', the default.*'sum'"):
        averaged = synk.function([x], x.sum() / 10, name="averaged_sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summed = synk.function([x], (x.sum() / 10, "sum"), name="summed_sum")
        means = synk.function([x], [x.mean(), x.sum() / x.shape[0], (x.sum(axis=1), "gather"),
                                    ((x ** 2).sum(axis=0) / x.shape[0]).sum()], name="means")
    synk.distribute()
    close(summed(X), X.sum() / 10)
    assert not np.isclose(averaged(X), X.sum() / 10)        # what the warning said
    close(means(X)[0], X.mean())
    close(means(X)[1], X.sum() / 5)
