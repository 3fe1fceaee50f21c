"""Time-major inputs (the Theano tutorials' ``lstm.py``: (time, samples)) split along a declared axis.

A scan over time with a mask, on 1, 2 and 3 devices, against the single-process PyTensor function
on the same samples: every ``batch=`` form, ``num_slices``, row-weighted averages, gathers along the
split axis and along axis 0, updates accumulated over slices, ``synk.data(..., split_axis=1)``, and
the misuse errors (raised before any worker runs, the runtime usable after).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import DEVICE_COUNTS, close, reference

import synkhronos as synk
from synkhronos.runtime import session
from synkhronos.wire.batch import chunk

pytestmark = pytest.mark.timeout(600)

T, N = 6, 11                        # time steps, samples


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def runtime(request):
    if session.active() is not None:
        synk.close()
    synk.fork(request.param)
    yield session.current()
    synk.close()


def rnn(tag, w0=0.5):
    """A masked recurrence over time, as lstm.py's: x and mask are (time, samples), y (samples,)."""
    x, mask, y = pt.matrix("x"), pt.matrix("mask"), pt.vector("y")
    w = pytensor.shared(np.array(w0), name=f"w_{tag}")

    def step(m, x_t, h):
        return m * pt.tanh(w * h + x_t) + (1 - m) * h
    h = pytensor.scan(step, sequences=[mask, x], outputs_info=pt.zeros_like(x[0]), return_updates=False)
    last = h[-1]
    loss = ((last - y) ** 2).mean()
    return x, mask, y, w, h, last, loss


def sequences(rng, t=T, n=N):
    x = rng.normal(size=(t, n))
    lengths = rng.integers(1, t + 1, size=n)
    mask = (np.arange(t)[:, None] < lengths[None, :]).astype(x.dtype)
    return x, mask, rng.normal(size=n)


def selected(batch, n=N):
    if batch is None:
        return np.arange(n)
    if isinstance(batch, int):
        return np.arange(batch)
    return np.arange(n)[batch] if isinstance(batch, slice) else np.asarray(batch)


BATCHES = [None, 9, slice(2, 10), np.array([7, 0, 3, 10, 5, 4, 1, 8])]


@pytest.mark.slow
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("batch", BATCHES, ids=["all", "int", "slice", "indices"])
def test_time_major_calls_equal_pytensor(runtime, rng, batch, num_slices):
    x, mask, y, w, h, last, loss = rnn("calls")
    f = synk.function([x, mask, y], [(loss, "avg"), ((h * mask).sum(), "sum"), (h, "gather"),
                                     (last, "gather")],
                      split_axes={x: 1, mask: 1, h: 1}, name="time_major")
    X, M, Y = sequences(rng)
    rows = selected(batch)
    want = reference(f, X[:, rows], M[:, rows], Y[rows])
    got = f(synk.data(X), synk.data(M), synk.data(Y), batch=batch, num_slices=num_slices)
    for g, r in zip(got, want):
        close(g, r)
    assert got[2].shape == (T, len(rows)) and got[3].shape == (len(rows),)
    # the plain PyTensor function on the same samples
    plain = pytensor.function([x, mask, y], [loss, h])
    for g, r in zip(got[:3:2], plain(X[:, rows], M[:, rows], Y[rows])):
        close(g, r)
    if runtime.n_parallel > 1 and batch is None:
        # an average of the devices' means, unweighted, would be off by far more than the tolerance
        shares = [rows[slice(*chunk(0, len(rows), runtime.n_parallel, r))] for r in range(runtime.n_parallel)]
        means = [reference(f, X[:, s], M[:, s], Y[s])[0] for s in shares]
        assert abs(np.mean(means) - got[0]) > 1e-6


@pytest.mark.slow
def test_numpy_arguments_and_a_data_declaring_its_axis(runtime, rng):
    x, mask, y, w, h, last, loss = rnn("data")
    declared = synk.function([x, mask, y], [(loss, "avg"), (last, "gather")], split_axes={x: 1, mask: 1})
    X, M, Y = sequences(rng)
    want = reference(declared, X, M, Y)
    for g, r in zip(declared(X, M, Y, batch=[4, 2, 9, 0]), reference(declared, X[:, [4, 2, 9, 0]],
                                                                     M[:, [4, 2, 9, 0]], Y[[4, 2, 9, 0]])):
        close(g, r)
    # the function declares nothing: the Data say which axis carries their rows
    f = synk.function([x, mask, y], [(loss, "avg"), (last, "gather")], name="data_axes")
    x_dat, m_dat = synk.data(X, split_axis=1), synk.data(M, split_axis=1)
    assert x_dat.split_axis == 1 and synk.data(Y).split_axis is None
    for g, r in zip(f(x_dat, m_dat, synk.data(Y)), want):
        close(g, r)
    for g, r in zip(f(x_dat, m_dat, synk.data(Y), batch=slice(3, 11), num_slices=3),
                    reference(f, X[:, 3:], M[:, 3:], Y[3:])):
        close(g, r)
    # agreeing declarations on both sides are fine
    for g, r in zip(declared(x_dat, m_dat, synk.data(Y)), want):
        close(g, r)


@pytest.mark.slow
def test_updates_accumulate_over_slices_along_the_split_axis(runtime, rng):
    x, mask, y, w, h, last, loss = rnn("updates")
    grad = pytensor.function([x, mask, y], pytensor.grad(loss, w))
    f = synk.function([x, mask, y], (loss, "avg"), updates=[(w, w - 0.1 * pytensor.grad(loss, w), "avg")],
                      split_axes={x: 1, mask: 1}, local_updates=True)
    X, M, Y = sequences(rng)
    idx = np.array([10, 1, 6, 2, 9, 3, 0, 7, 5])
    n = runtime.n_parallel
    shares = [idx[slice(*chunk(0, len(idx), n, r))] for r in range(n)]
    # the slices' updates averaged by their rows: the step on the mean gradient of the device's rows
    want = [0.5 - 0.1 * grad(X[:, mine], M[:, mine], Y[mine]) for mine in shares]
    f(synk.data(X), synk.data(M), synk.data(Y), batch=idx, num_slices=3)
    for r in range(n):
        close(synk.get_value(r, w), want[r])


@pytest.mark.slow
def test_misuse_is_refused_before_any_worker_runs(runtime, rng):
    if runtime.n_parallel != 2:
        pytest.skip("the checks are the master's: one device count is enough")
    x, mask, y, w, h, last, loss = rnn("misuse")
    X, M, Y = sequences(rng)
    with pytest.raises(ValueError, match=r"split axis 2 .*'x'.* 2 dimensions"):
        synk.function([x, mask, y], loss, split_axes={x: 2, mask: 1})
    with pytest.raises(ValueError, match="bcast_inputs"):
        synk.function([x, mask], loss, bcast_inputs=[y], split_axes={x: 1, mask: 1, y: 0})
    with pytest.raises(ValueError, match="neither a scattered input nor an output"):
        synk.function([x, mask, y], loss, split_axes={x: 1, mask: 1, pt.matrix("z"): 1})
    with pytest.raises(ValueError, match="'gather'"):
        synk.function([x, mask, y], [(h.sum(0), "sum")], split_axes={x: 1, mask: 1, h: 1})
    with pytest.raises(TypeError, match="split_axes must be a dict"):
        synk.function([x, mask, y], loss, split_axes=[(x, 1)])
    with pytest.raises(TypeError, match="static"):
        xs = pt.tensor("xs", shape=(None, N))
        synk.function([xs], xs.sum(), split_axes={xs: 1})
    with pytest.raises(ValueError, match="split_axis 2 is out of range"):
        synk.data(X, split_axis=2)
    f = synk.function([x, mask, y], [(loss, "avg"), (last, "gather")], split_axes={x: 1, mask: 1})
    # lengths along the split axes differ
    with pytest.raises(ValueError, match=r"x: 11 along axis 1.*y: 10 along axis 0"):
        f(X, M, Y[:10])
    # a Data declaring another axis than the function
    with pytest.raises(ValueError, match="split_axis=0.*split_axes"):
        f(synk.data(X, split_axis=0), M, Y)
    # undeclared: the rows are axis 0, and the message says how to declare another
    g = synk.function([x, mask, y], [(loss, "avg")], name="undeclared")
    with pytest.raises(ValueError, match=r"axis 0.*split_axes=\{x: 1"):
        g(X, M, Y)
    # equal time and batch lengths: the scan would run over the rows each device got
    Xs, Ms, Ys = sequences(rng, t=N, n=N)
    with pytest.raises(ValueError, match=r"scan.*axis 0 of scattered inputs 'x' and 'mask'.*"
                                         r"split_axes=\{x: 1, mask: 1\}"):
        g(Xs, Ms, Ys)
    with pytest.raises(ValueError, match="split_axes"):
        g(synk.data(Xs), synk.data(Ms), synk.data(Ys), batch=4)
    # declared axis 0: the user means to cut the sequences, each device scanning its own time steps
    cut = synk.function([x, mask], (h[-1], "gather"), split_axes={x: 0, mask: 0}, name="cut")
    close(cut(Xs, Ms), np.concatenate([cut.as_pytensor(Xs[a:b], Ms[a:b]) for a, b in [(0, 5), (5, 11)]]))
    # a 'gather' output that keeps the split axis second, undeclared: its shares do not join along
    # axis 0, and the message names split_axes (on the workers too, when they join slices)
    keeps = synk.function([x, mask], (x * 2, "gather"), split_axes={x: 1, mask: 1}, name="keeps")
    with pytest.raises(ValueError, match=r"do not join along axis 0.*split_axes=\{x: 1, output: 1\}"):
        keeps(X, M)
    with pytest.raises(ValueError, match=r"do not join along axis 0.*split_axes"):
        keeps(X, M, num_slices=3)
    # the runtime is usable after every refusal
    for got, want in zip(f(X, M, Y), reference(f, X, M, Y)):
        close(got, want)
    for got, want in zip(g(synk.data(X, split_axis=1), synk.data(M, split_axis=1), Y), reference(g, X, M, Y)):
        close(got, want)


@pytest.mark.slow
def test_training_helpers_count_the_step_rows_on_axis_0_of_x(runtime, rng):
    """make_train_function weighs each device's gradient by x's rows along axis 0: a time-major mask
    beside a batch-major x trains as one process; a time-major x, and train.run on a time-major
    Data, are refused before any worker runs."""
    if runtime.n_parallel != 2:
        pytest.skip("the checks are the master's: one device count is enough")
    from synkhronos.extensions import train, updates

    def model():
        x, mask, y = pt.matrix("x"), pt.matrix("mask"), pt.vector("y")       # x: (samples, 3)
        w = pytensor.shared(np.array([0.3, -0.2, 0.1]), name="w_train")
        return x, mask, y, w, (((x @ w) * mask.mean(0) - y) ** 2).mean()
    x, mask, y, w, loss = model()
    step = train.make_train_function(loss, [w], [x, mask], y, updates.sgd, learning_rate=0.1)
    x1, mask1, y1, w1, loss1 = model()
    single = train.make_single_process_train_function(loss1, [w1], [x1, mask1], y1, updates.sgd,
                                                      learning_rate=0.1)
    X, M, Y = rng.normal(size=(N, 3)), sequences(rng)[1], rng.normal(size=N)
    x_dat, m_dat, y_dat = synk.data(X), synk.data(M, split_axis=1), synk.data(Y)
    for idx in [np.array([3, 9, 0, 4, 7]), np.arange(N)]:
        close(step(x_dat, m_dat, y_dat, batch=idx), single(X[idx], M[:, idx], Y[idx]))
        close(w.get_value(), w1.get_value())
    with pytest.raises(ValueError, match="split_axis=1, but train_grad splits x along axis 0"):
        step(synk.data(X.T.copy(), split_axis=1), m_dat, y_dat)
    with pytest.raises(ValueError, match=r"train.run.*axis 0.*mask \(axis 1\)"):
        train.run(step, [x_dat, m_dat], y_dat, 4, steps=2)
    close(step(x_dat, m_dat, y_dat, batch=[1, 2]), single(X[[1, 2]], M[:, [1, 2]], Y[[1, 2]]))


@pytest.mark.slow
def test_a_scan_over_an_embedding_of_the_rows_is_refused_and_the_bcast_route_runs(runtime):
    """DeepLearningTutorials' rnnslu: a sentence's word indices, read through an embedding and
    reshaped, then scanned with a carried state. Split, each device would restart the recurrence
    halfway: refused, naming split_axes and bcast_inputs; given whole, it equals pytensor.function."""
    rng = np.random.default_rng(0)
    emb = pytensor.shared(rng.normal(size=(20, 4)), name="emb_slu")
    wx = pytensor.shared(rng.normal(size=(4, 5)), name="wx_slu")
    wh = pytensor.shared(rng.normal(size=(5, 5)) * 0.5, name="wh_slu")
    w = pytensor.shared(rng.normal(size=(5, 7)), name="w_slu")
    idxs = pt.ivector("idxs")
    x = emb[idxs].reshape((idxs.shape[0], 4))
    h = pytensor.scan(lambda x_t, h: pt.tanh(x_t @ wx + h @ wh), sequences=[x], outputs_info=pt.zeros(5),
                      return_updates=False)
    y_pred = pt.argmax(h @ w, axis=1)
    sentence = np.array([3, 5, 1, 1, 7, 9, 2, 2], dtype="int32")
    want = pytensor.function([idxs], y_pred)(sentence)
    split = synk.function([idxs], (y_pred, "gather"), name="classify")
    if runtime.n_parallel > 1:
        with pytest.raises(ValueError, match=r"scan runs over axis 0 of scattered input 'idxs'.*bcast_input"):
            split(sentence)
    whole = synk.function([], (y_pred, None), bcast_inputs=[idxs], name="classify_whole")
    np.testing.assert_array_equal(whole(sentence), want)


@pytest.mark.slow
def test_a_training_step_on_time_major_inputs_trains_as_one_process(runtime, rng):
    """make_train_function(..., split_axes={x: 1, mask: 1}): each device takes whole sequences of
    its own samples and weighs its gradient by them (11 samples as 6/5 and 3/4/4, 7 as 3/4 and
    2/2/3); train.run, which gives out rows along axis 0, refuses the step."""
    from synkhronos.extensions import train, updates
    x, mask, y, w, _, _, loss = rnn("tm_step")
    step = train.make_train_function(loss, [w], [x, mask], y, updates.sgd, learning_rate=0.3,
                                     split_axes={x: 1, mask: 1})
    x1, mask1, y1, w1, _, _, loss1 = rnn("tm_single")
    single = train.make_single_process_train_function(loss1, [w1], [x1, mask1], y1, updates.sgd,
                                                      learning_rate=0.3, mode="FAST_RUN")
    X, M, Y = sequences(rng)
    x_dat, m_dat = synk.data(X, split_axis=1), synk.data(M, split_axis=1)
    for idx in [np.arange(N), np.array([3, 9, 0, 4, 7, 1, 10])]:
        close(step(x_dat, m_dat, synk.data(Y), batch=idx), single(X[:, idx], M[:, idx], Y[idx]))
        close(w.get_value(), w1.get_value())
    close(step(X[:, :7], M[:, :7], Y[:7]), single(X[:, :7], M[:, :7], Y[:7]))      # numpy, as they are
    close(w.get_value(), w1.get_value())
    with pytest.raises(TypeError, match="takes its rows otherwise .*split_axes="):
        train.run(step, [x_dat, m_dat], synk.data(Y), 4, steps=2)
    with pytest.raises(ValueError, match="split_axes gives x .ndim 2. the axis 2"):
        train.make_train_function(loss, [w], [x, mask], y, updates.sgd, learning_rate=0.3,
                                  split_axes={x: 2})
