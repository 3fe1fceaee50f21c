"""The training helper's options for programs written elsewhere: ``state_updates`` (a counter, the
RBM's persistent chain), ``consider_constant``, and the single-process step's ``mode=`` and
``givens=``. Every step is compared with one ``pytensor.function`` doing the same updates, on 1, 2
and 3 devices."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import DEVICE_COUNTS, close
from test_programs import forked, tutorial_model

import synkhronos as synk
from synkhronos.extensions import train, updates

pytestmark = pytest.mark.timeout(300)

#: rows of every step: uneven over 2 and 3 devices, and never the RBM's 7 chains
BATCHES = [8, 11, 10, 9]


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def device_count(request):
    return request.param


@pytest.fixture
def devices(device_count):
    yield forked(device_count)


def sgd_updates(loss, params, lr, consider_constant=None):
    grads = pytensor.grad(loss, params, consider_constant=consider_constant)
    return [(p, p - lr * g) for p, g in zip(params, grads)]


def regression(seed, name):
    """A linear regression with a step counter and a moving average of its weights."""
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.random.default_rng(seed).normal(size=4), name=f"w_{name}")
    count = pytensor.shared(np.array(0, dtype="int64"), name=f"count_{name}")
    average = pytensor.shared(np.zeros(4), name=f"average_{name}")
    loss = ((x.dot(w) - y) ** 2).mean()
    state = [(count, count + 1), (average, 0.9 * average + 0.1 * w)]      # w before the step
    return x, y, w, loss, state


def test_a_counter_of_rows_summed_over_slices_counts_each_row_once(devices, rng):
    """A state update ``seen + rows`` under "sum" counts the step's rows on each device whatever
    ``num_slices`` is; the weights equal a step in one slice."""
    X, Y = rng.normal(size=(40, 4)), rng.normal(size=40)
    made = []
    for tag in ("sliced", "whole"):
        x, y, w, loss, _ = regression(7, f"rows_{tag}")
        seen = pytensor.shared(np.array(0.0), name=f"seen_{tag}")
        made.append((train.make_train_function(loss, [w], x, y, updates.adam, learning_rate=0.05, state_updates=[
            (seen, seen + pt.cast(x.shape[0], "float64"), "sum")]), w, seen))
    x_dat, y_dat = synk.data(X), synk.data(Y)
    for num_slices in (1, 2, 3, 3, 2):
        batch = rng.permutation(40)[:7]
        for (step, _, _), slices in zip(made, (num_slices, 1)):
            step(x_dat, y_dat, batch=batch, num_slices=slices)
    (_, w, seen), (_, w_whole, seen_whole) = made
    n = synk.local_devices()
    for rank in range(n):
        close(synk.get_value(rank, w), synk.get_value(rank, w_whole), rtol=1e-12)
        assert synk.get_value(rank, seen) == synk.get_value(rank, seen_whole)
    assert sum(synk.get_value(rank, seen) for rank in range(n)) == 5 * 7


@pytest.mark.slow
def test_state_updates_are_applied_with_the_step_as_one_pytensor_function(devices, rng):
    X, Y = rng.normal(size=(40, 4)), rng.normal(size=40)
    x, y, w, loss, state = regression(5, "driven")
    step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1, state_updates=state)
    x1, y1, w1, loss1, state1 = regression(5, "plain")
    plain = pytensor.function([x1, y1], loss1, updates=sgd_updates(loss1, [w1], 0.1) + state1)
    x2, y2, w2, loss2, state2 = regression(5, "single")
    single = train.make_single_process_train_function(loss2, [w2], x2, y2, updates.sgd, learning_rate=0.1,
                                                       mode="FAST_RUN", state_updates=state2)
    assert step.extra_state == [v for v, _ in state]
    assert all(any(v is s for s in step.state_variables) for v, _ in state)
    x_dat, y_dat = synk.data(X), synk.data(Y)
    start = 0
    for i, rows in enumerate(BATCHES):
        batch = np.arange(start, start + rows)
        start += rows
        expected = plain(X[batch], Y[batch])
        close(step(x_dat, y_dat, batch=batch, num_slices=2 if i == 1 else 1), expected, rtol=1e-12)
        close(single(X[batch], Y[batch]), expected, rtol=1e-12)
    for ours, single_var, theirs in zip([w, *step.extra_state], [w2] + [v for v, _ in state2],
                                        [w1] + [v for v, _ in state1]):
        close(single_var.get_value(), theirs.get_value(), rtol=1e-12)
        for rank in range(devices.n_parallel):
            close(synk.get_value(rank, ours), theirs.get_value(), rtol=1e-12)
    assert int(synk.get_value(devices.n_parallel - 1, state[0][0])) == len(BATCHES)


def two_paths(seed, name):
    """A loss reaching ``W`` through ``h`` and directly: holding ``h`` constant leaves the second."""
    rng = np.random.default_rng(seed)
    x, y = pt.matrix("x"), pt.vector("y")
    W = pytensor.shared(rng.normal(scale=0.5, size=(4, 3)), name=f"W_{name}")
    v = pytensor.shared(rng.normal(size=3), name=f"v_{name}")
    h = pt.tanh(x.dot(W))
    loss = ((h.dot(v) + 0.5 * x.dot(W).sum(axis=1) - y) ** 2).mean()
    return x, y, [W, v], h, loss


@pytest.mark.slow
def test_consider_constant_changes_the_gradient_as_pytensor_grad_does(devices, rng):
    X, Y = rng.normal(size=(40, 4)), rng.normal(size=40)
    x, y, params, h, loss = two_paths(2, "held")
    step = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.1,
                                     consider_constant=[h])
    references = {}
    for held in (True, False):
        x1, y1, params1, h1, loss1 = two_paths(2, f"plain{held}")
        plain = pytensor.function([x1, y1], loss1,
                                  updates=sgd_updates(loss1, params1, 0.1, [h1] if held else None))
        references[held] = (plain, params1)
    x2, y2, params2, h2, loss2 = two_paths(2, "single")
    single = train.make_single_process_train_function(loss2, params2, x2, y2, updates.sgd, learning_rate=0.1,
                                                      consider_constant=[h2])
    x_dat, y_dat = synk.data(X), synk.data(Y)
    start = 0
    for rows in BATCHES:
        batch = np.arange(start, start + rows)
        start += rows
        expected = references[True][0](X[batch], Y[batch])
        references[False][0](X[batch], Y[batch])
        close(step(x_dat, y_dat, batch=batch), expected, rtol=1e-12)
        close(single(X[batch], Y[batch]), expected, rtol=1e-12)
    for ours, single_var, theirs, free in zip(params, params2, references[True][1], references[False][1]):
        close(single_var.get_value(), theirs.get_value(), rtol=1e-10)
        for rank in range(devices.n_parallel):
            close(synk.get_value(rank, ours), theirs.get_value(), rtol=1e-10, atol=1e-13)
    assert not np.allclose(params[0].get_value(), references[False][1][0].get_value(), rtol=1e-3)


def rbm(seed, name, n_chains=7, n_visible=6, n_hidden=4, k=2):
    """The RBM tutorial's persistent contrastive divergence, its chain in mean field (no draws)."""
    rng = np.random.default_rng(seed)
    x = pt.matrix("x")
    W = pytensor.shared(rng.normal(scale=0.3, size=(n_visible, n_hidden)), name=f"W_{name}")
    hbias = pytensor.shared(np.zeros(n_hidden), name=f"hbias_{name}")
    vbias = pytensor.shared(np.zeros(n_visible), name=f"vbias_{name}")
    persistent = pytensor.shared(np.full((n_chains, n_hidden), 0.5), name=f"persistent_{name}")

    def free_energy(v):
        return -v.dot(vbias) - pt.softplus(v.dot(W) + hbias).sum(axis=1)

    def gibbs_hvh(h):
        v_mean = pt.sigmoid(h.dot(W.T) + vbias)
        return pt.sigmoid(v_mean.dot(W) + hbias), v_mean

    (h_means, v_means) = pytensor.scan(gibbs_hvh, outputs_info=[persistent, None], n_steps=k,
                                       return_updates=False)
    chain_end = v_means[-1]
    cost = pt.mean(free_energy(x)) - pt.mean(free_energy(chain_end))
    return x, [W, hbias, vbias], persistent, chain_end, cost, h_means[-1]


@pytest.mark.slow
def test_the_rbm_tutorials_persistent_chain_and_constant_chain_end(devices, rng):
    X = (rng.uniform(size=(40, 6)) < 0.4).astype(float)
    x, params, persistent, chain_end, cost, next_chain = rbm(4, "driven")
    step = train.make_train_function(cost, params, x, None, updates.sgd, learning_rate=0.05,
                                     consider_constant=[chain_end], state_updates=[(persistent, next_chain)])
    x1, params1, persistent1, chain_end1, cost1, next_chain1 = rbm(4, "plain")
    plain = pytensor.function([x1], cost1, updates=sgd_updates(cost1, params1, 0.05, [chain_end1])
                              + [(persistent1, next_chain1)])
    x_dat = synk.data(X)
    start = 0
    for rows in BATCHES:
        batch = np.arange(start, start + rows)
        start += rows
        close(step(x_dat, batch=batch), plain(X[batch]), rtol=1e-12)
    for ours, theirs in zip(params + [persistent], params1 + [persistent1]):
        for rank in range(devices.n_parallel):
            close(synk.get_value(rank, ours), theirs.get_value(), rtol=1e-10, atol=1e-13)


def scan_model(name):
    """A recurrent net over (samples, time) scanned along time, as the LSTM tutorial's."""
    x, y = pt.matrix("x"), pt.vector("y")
    U = pytensor.shared(np.full((1, 4), 0.3), name=f"U_{name}")
    Wh = pytensor.shared(np.eye(4) * 0.5 + 0.1, name=f"Wh_{name}")
    v = pytensor.shared(np.linspace(-1, 1, 4), name=f"v_{name}")

    def recur(x_t, h):
        return pt.tanh(x_t[:, None].dot(U) + h.dot(Wh))

    hs = pytensor.scan(recur, sequences=[x.T], outputs_info=[pt.zeros((x.shape[0], 4))],
                       return_updates=False)
    loss = ((hs[-1].dot(v) - y) ** 2).mean()
    return x, y, [U, Wh, v], loss


@pytest.mark.slow
def test_the_single_process_step_takes_mode_for_a_scan_jax_cannot_compile(synk2, rng):
    x, y, params, loss = scan_model("driven")
    step = train.make_train_function(loss, params, x, y, updates.adadelta)
    x1, y1, params1, loss1 = scan_model("single")
    single = train.make_single_process_train_function(loss1, params1, x1, y1, updates.adadelta,
                                                      mode="FAST_RUN")
    for length in (5, 3, 7, 3):                       # every minibatch its own time length
        X, Y = rng.normal(size=(9, length)), rng.normal(size=9)
        close(step(X, Y), single(X, Y), rtol=1e-10)
    for ours, theirs in zip(params, params1):
        close(ours.get_value(), theirs.get_value(), rtol=1e-10, atol=1e-13)
    x2, y2, params2, loss2 = scan_model("jax")
    in_jax = train.make_single_process_train_function(loss2, params2, x2, y2, updates.adadelta)
    with pytest.raises(Exception):                    # the reason mode= exists
        in_jax(X, Y)


def test_the_single_process_step_takes_givens_and_scalars(rng):
    X, Y = rng.normal(size=(100, 5)), rng.integers(0, 3, size=100)
    m = tutorial_model(X, Y, 20)
    lr = pt.scalar("lr")
    single = train.make_single_process_train_function(m["cost"], [m["W"], m["b"]], m["x"], m["y"],
                                                      updates.sgd, learning_rate=lr, givens=m["givens"],
                                                      mode="FAST_RUN")
    r = tutorial_model(X, Y, 20)
    plain = pytensor.function([r["index"], lr], r["cost"], givens=r["givens"],
                              updates=sgd_updates(r["cost"], [r["W"], r["b"]], lr))
    for i in range(5):
        close(single(i, lr=0.1 * (i + 1)), plain(i, 0.1 * (i + 1)), rtol=1e-12)
    close(m["W"].get_value(), r["W"].get_value(), rtol=1e-12)


def test_misused_options_are_refused_before_any_worker_runs(synk2):
    x, y, w, loss, state = regression(1, "misuse")
    count = state[0][0]
    x1, y1, params, h, loss1 = two_paths(1, "misuse")
    cases = [
        (dict(state_updates=[(pt.vector("v"), w)]), TypeError, "not a shared variable"),
        (dict(state_updates=[(w, w * 2)]), ValueError, "the update rule writes too"),
        (dict(state_updates=[(count, count + 0.5)]), TypeError, r"float64.*int64.*astype\('int64'\)"),
        (dict(state_updates=[(count, count + 1), (count, count + 2)]), ValueError, "more than once"),
        (dict(state_updates=[(count, count + 1, "mean")]), ValueError, "update mode 'mean'"),
        (dict(consider_constant=h), TypeError, "must be a list of variables"),
        (dict(consider_constant=[h]), ValueError, "does not read"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1, **options)
    step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
    assert np.isfinite(float(step(np.ones((4, 4)), np.ones(4))))
