"""0-d inputs among a function's inputs reach every device whole, and the training step takes
scalar hyperparameters (the Theano tutorials' learning rate and corruption level). Every result
is compared with ``pytensor.function`` on the same values, on 1, 2 and 3 devices."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import DEVICE_COUNTS, close
from test_programs import forked

import synkhronos as synk
from synkhronos.extensions import train, updates

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def device_count(request):
    return request.param


@pytest.fixture
def devices(device_count):
    yield forked(device_count)


@pytest.mark.slow
def test_an_update_function_of_a_scalar_input_equals_pytensor_function(devices):
    lr = pt.scalar("lr")
    w = pytensor.shared(np.arange(3.0), name="w_scalar_step")
    g = pytensor.shared(np.array([1.0, -2.0, 0.5]), name="g_scalar_step")
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # nothing here is computed from rows
        step = synk.function([lr], [], updates=[(w, w - lr * g)])
    synk.distribute()
    step(0.5)
    step(lr=0.25)
    expected = np.arange(3.0) - 0.75 * np.array([1.0, -2.0, 0.5])
    for rank in range(devices.n_parallel):
        close(synk.get_value(rank, w), expected, rtol=1e-15)


@pytest.mark.slow
def test_scalar_inputs_keep_their_place_among_scattered_inputs(devices, rng):
    x, scale, y = pt.matrix("x"), pt.scalar("scale"), pt.vector("y")
    w = pytensor.shared(rng.normal(size=3), name="w_scale")
    loss = ((x.dot(w) * scale - y) ** 2).mean()
    outputs = [(loss, "avg"), (x * scale, "gather"), (scale * y.sum(), "sum")]
    f = synk.function([x, scale, y], outputs)
    reference = pytensor.function([x, scale, y], [o for o, _ in outputs])
    synk.distribute()
    X, Y = rng.normal(size=(11, 3)), rng.normal(size=11)
    expected = reference(X, 0.5, Y)
    for got in (f(X, 0.5, Y), f(x=X, scale=0.5, y=Y), f(X, 0.5, y=Y), f.as_pytensor(X, 0.5, Y)):
        for ours, theirs in zip(got, expected):
            close(ours, theirs, rtol=1e-12)
    x_dat, y_dat = synk.data(X), synk.data(Y)
    rows = np.array([1, 4, 5, 9, 10])
    for ours, theirs in zip(f(x_dat, 2.0, y_dat, batch=rows), reference(X[rows], 2.0, Y[rows])):
        close(ours, theirs, rtol=1e-12)
    with pytest.raises(TypeError, match=r"missing inputs \['scale'\]"):
        f(x_dat, y=y_dat)
    for ours, theirs in zip(f(X, 0.5, Y), expected):           # still usable
        close(ours, theirs, rtol=1e-12)


@pytest.mark.slow
def test_a_scalar_input_beside_time_major_inputs(devices, rng):
    x, scale, mask = pt.matrix("x"), pt.scalar("scale"), pt.matrix("mask")      # (time, samples)
    outputs = [((x * mask * scale).sum(axis=0), "gather"), ((x * scale).sum(), "sum")]
    f = synk.function([x, scale, mask], outputs, split_axes={x: 1, mask: 1})
    reference = pytensor.function([x, scale, mask], [o for o, _ in outputs])
    synk.distribute()
    X, M = rng.normal(size=(5, 7)), (rng.uniform(size=(5, 7)) < 0.7).astype(float)
    for got in (f(X, 0.5, M), f(x=X, scale=0.5, mask=M), f.as_pytensor(X, 0.5, M)):
        for ours, theirs in zip(got, reference(X, 0.5, M)):
            close(ours, theirs, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# The training step with scalar hyperparameters (the SdA tutorial's pretraining)
# ------------------------------------------------------------------------------------------------

def denoising_autoencoder(X, batch_size, seed=3):
    """The tutorials' dA, fed through givens and an index, with symbolic corruption and rate.

    The corruption scales the input here (a mask drawn from a generator would differ per device)
    so that every step can be compared exactly.
    """
    rng = np.random.default_rng(seed)
    train_set_x = pytensor.shared(X, name="train_set_x_dA")
    index, corruption, lr = pt.lscalar("index"), pt.scalar("corruption"), pt.scalar("lr")
    x = pt.matrix("x_dA")
    W = pytensor.shared(rng.normal(scale=0.3, size=(X.shape[1], 4)), name="W_dA")
    b = pytensor.shared(np.zeros(4), name="b_dA")
    b_prime = pytensor.shared(np.zeros(X.shape[1]), name="b_prime_dA")
    tilde_x = x * (1 - corruption)
    z = pt.sigmoid(pt.sigmoid(tilde_x.dot(W) + b).dot(W.T) + b_prime)
    cost = pt.mean(-pt.sum(x * pt.log(z) + (1 - x) * pt.log(1 - z), axis=1))
    window = slice(index * batch_size, (index + 1) * batch_size)
    return dict(index=index, corruption=corruption, lr=lr, x=x, params=[W, b, b_prime], cost=cost,
                givens={x: train_set_x[window]})


@pytest.mark.slow
def test_the_sda_pretraining_step_takes_corruption_and_learning_rate(devices, rng):
    X = rng.uniform(0.05, 0.95, size=(50, 6))
    m = denoising_autoencoder(X, 15)                 # the last of 4 batches has 5 rows
    step = train.make_train_function(m["cost"], m["params"], m["x"], None, updates.sgd,
                                     learning_rate=m["lr"], givens=m["givens"])
    r = denoising_autoencoder(X, 15)
    grads = pytensor.grad(r["cost"], r["params"])
    single = pytensor.function([r["index"], r["corruption"], r["lr"]], r["cost"], givens=r["givens"],
                               updates=[(p, p - r["lr"] * g) for p, g in zip(r["params"], grads)])
    assert [v.name for v in step.inputs] == ["index", "corruption", "lr"]
    synk.distribute()
    for i, (level, rate) in enumerate([(0.1, 0.1), (0.3, 0.05), (0.0, 0.2), (0.2, 0.1)]):
        args = (i, level, rate) if i % 2 else (i,)
        named = {} if i % 2 else dict(corruption=level, lr=rate)      # as the tutorial calls it
        close(step(*args, **named), single(i, level, rate), rtol=1e-12)
    for ours, theirs in zip(m["params"], r["params"]):
        for rank in range(devices.n_parallel):
            close(synk.get_value(rank, ours), theirs.get_value(), rtol=1e-10, atol=1e-13)


@pytest.mark.slow
def test_the_data_step_takes_a_scalar_learning_rate(synk2, rng):
    x, y, lr = pt.matrix("x"), pt.vector("y"), pt.scalar("lr")
    w = pytensor.shared(np.zeros(3), name="w_lr")
    loss = ((x.dot(w) - y) ** 2).mean()
    step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=lr)
    w1 = pytensor.shared(np.zeros(3), name="w_lr1")
    loss1 = ((x.dot(w1) - y) ** 2).mean()
    single = pytensor.function([x, y, lr], loss1, updates=[(w1, w1 - lr * pytensor.grad(loss1, w1))])
    X, Y = rng.normal(size=(20, 3)), rng.normal(size=20)
    x_dat, y_dat = synk.data(X), synk.data(Y)
    assert step.scalars == [lr]
    for i, rate in enumerate([0.1, 0.05, 0.2]):
        rows = np.arange(i, 20, 2)
        close(step(x_dat, y_dat, rate, batch=rows) if i % 2 else step(x_dat, y_dat, lr=rate, batch=rows),
              single(X[rows], Y[rows], rate), rtol=1e-12)
    close(w.get_value(), w1.get_value(), rtol=1e-12)
    with pytest.raises(TypeError, match=r"scalar inputs \['lr'\].*pytensor.shared"):
        train.run(step, x_dat, y_dat, 10, steps=1)


def test_a_step_reading_an_input_that_is_neither_data_nor_scalar_is_refused(synk2):
    x, y, offset = pt.matrix("x"), pt.vector("y"), pt.vector("offset")
    w = pytensor.shared(np.zeros(3), name="w_offset")
    loss = ((x.dot(w + offset) - y) ** 2).mean()
    with pytest.raises(TypeError, match=r"offset.*1-d.*x or y.*pytensor.shared"):
        train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
