"""The original Synkhronos's names: accepted where they still mean something, else refused clearly."""


import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close

import synkhronos as synk
from synkhronos.extensions import train, updates

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def model(synk2, rng):
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(rng.normal(size=3), name="w_old")
    b = pytensor.shared(np.array([0.5]), name="b_old")
    loss = ((x @ w + b[0] - y) ** 2).mean()
    return x, y, [w, b], loss


def test_fork_options_of_the_original(synk2):
    with pytest.raises(TypeError, match="max_n_var=.*sizes its control block itself; remove it"):
        synk.fork(2, max_n_var=100)
    with pytest.raises(TypeError, match="max_dim="):
        synk.fork(2, max_dim=16)
    with pytest.warns(DeprecationWarning, match=r"use_gpu=False\) is fork\(platform='cpu'\)"):
        with pytest.raises(RuntimeError, match="already called"):     # the warning comes first
            synk.fork(2, use_gpu=False)


def test_nccl_argument_of_the_collectives(synk2):
    v = pytensor.shared(np.arange(4.0), name="v_nccl")
    synk.function([], (v.sum(), "sum"))
    for call in (lambda: synk.all_reduce(v, nccl=True), lambda: synk.broadcast(v, nccl=True),
                 lambda: synk.reduce(v, nccl=True), lambda: synk.gather(v, nccl=False)):
        with pytest.warns(DeprecationWarning, match="fork\\(collectives=...\\)"):
            call()
    with pytest.warns(DeprecationWarning):
        synk.all_gather(v, nccl=True)
    close(synk.get_value(1, v), np.tile(np.arange(4.0), 2))


def test_function_get_shared(model):
    x, y, params, loss = model
    f = synk.function([x, y], (loss, "avg"))
    assert set(f.get_shared()) == set(params)


def test_flat_unflat_grads_has_the_originals_meaning(model, rng):
    x, y, params, loss = model
    grad_shared, flat_grad, unflat = updates.flat_unflat_grads(loss, params)
    assert grad_shared.get_value().shape == (updates.vars_flat_size(params),) == (4,)
    assert flat_grad.ndim == 1 and [g.ndim for g in unflat] == [1, 1]
    X, Y = rng.normal(size=(6, 3)), rng.normal(size=6)
    f = synk.function([x, y], (loss, "avg"), updates=[(grad_shared, flat_grad)])
    f(X, Y)
    want = pytensor.function([x, y], updates.flatten_vars(pytensor.grad(loss, params)), mode="JAX")(X, Y)
    synk.all_reduce(grad_shared, op="avg")                      # rows split 3 + 3: the plain mean
    close(grad_shared.get_value(), want)
    close(np.concatenate(pytensor.function([], unflat, mode="JAX")()), want)


@pytest.mark.parametrize("apply", [updates.apply_momentum, updates.apply_nesterov_momentum])
def test_lasagnes_apply_momentum_rules(model, rng, apply):
    x, y, params, loss = model
    grad_updates, param_updates, grad_shared = updates.sgd(loss, params, 0.1)
    with_momentum = apply(param_updates, momentum=0.9)
    f_grad = synk.function([x, y], (loss, "avg"), updates=grad_updates)
    f_upd = synk.function([], updates=with_momentum)
    synk.distribute()
    X, Y = rng.normal(size=(6, 3)), rng.normal(size=6)
    w0 = [p.get_value() for p in params]
    velocity = [np.zeros_like(v) for v in w0]
    g_fn = pytensor.function([x, y], pytensor.grad(loss, params), mode="JAX")
    for _ in range(3):                                          # the rule, written out in numpy
        grads = g_fn(X, Y)
        f_grad(X, Y)
        synk.all_reduce(grad_shared, op="avg")
        f_upd()
        for i, (p, g) in enumerate(zip(params, grads)):
            new = w0[i] - 0.1 * g
            if apply is updates.apply_momentum:
                xv = 0.9 * velocity[i] + new
                velocity[i], w0[i] = xv - w0[i], xv
            else:
                xv = 0.9 * velocity[i] + new - w0[i]
                velocity[i], w0[i] = xv, 0.9 * xv + new
            close(p.get_value(), w0[i])
            close(synk.get_value(1, p), w0[i])


def test_sgd_nonflat_and_nonflat_grads(model, rng):
    x, y, params, loss = model
    grad_updates, param_updates, grads_shared = updates.sgd_nonflat(loss, params, 0.1)
    assert [g.get_value().shape for g in grads_shared] == [(3,), (1,)]
    f_grad = synk.function([x, y], (loss, "avg"), updates=grad_updates)
    f_upd = synk.function([], updates=param_updates)
    synk.distribute()
    X, Y = rng.normal(size=(6, 3)), rng.normal(size=6)
    start = [p.get_value() for p in params]
    grads = pytensor.function([x, y], pytensor.grad(loss, params), mode="JAX")(X, Y)
    f_grad(X, Y)
    synk.all_reduce(grads_shared, op="avg")
    f_upd()
    for p, p0, g in zip(params, start, grads):
        close(p.get_value(), p0 - 0.1 * g)


def test_make_train_function_theano_is_the_single_process_one(model, rng):
    x, y, params, loss = model
    with pytest.warns(DeprecationWarning, match="make_single_process_train_function"):
        step = train.make_train_function_theano(loss, params, x, y, updates.sgd, 0.1)
    X, Y = rng.normal(size=(6, 3)), rng.normal(size=6)
    want = float(pytensor.function([x, y], loss, mode="JAX")(X, Y))
    close(step(X, Y), want)
