"""Flattened-gradient optimizers and the training helper against pytensor-ml on the full batch."""

import numpy as np
import pytensor
import pytest
from pytensor_ml import optim
from pytensor_ml.activations import ReLU
from pytensor_ml.layers import Input, Linear
from pytensor_ml.loss import CrossEntropy, supervised_loss
from pytensor_ml.pytensorf import collect_trainable_params

import synkhronos as synk
from synkhronos.extensions import train, updates
from helpers import close

pytestmark = pytest.mark.timeout(300)
STEPS = 4


def mlp(seed):
    X = Input("X", shape=(None, 6))
    h = ReLU()(Linear(f"fc1_{seed}", n_in=6, n_out=8)(X))
    logits = Linear(f"fc2_{seed}", n_in=8, n_out=3)(h)
    loss, y = supervised_loss(logits, CrossEntropy(expect_logits=True))
    params = collect_trainable_params(loss)
    rng = np.random.default_rng(seed)
    init = [rng.normal(scale=0.5, size=p.get_value().shape) for p in params]
    for p, v in zip(params, init):
        p.set_value(v)
    return X, y, loss, params, init


def data(rng, n=13):
    return rng.normal(size=(n, 6)), rng.integers(0, 3, size=n)


RULES = [
    ("sgd", updates.sgd, dict(learning_rate=0.1), lambda: optim.sgd(0.1)),
    ("momentum", updates.momentum, dict(learning_rate=0.1), lambda: optim.sgd(0.1, momentum=0.9)),
    ("nesterov", updates.nesterov_momentum, dict(learning_rate=0.1),
     lambda: optim.sgd(0.1, momentum=0.9, nesterov=True)),
    ("adagrad", updates.adagrad, dict(learning_rate=0.1), lambda: optim.adagrad(0.1, epsilon=1e-6)),
    ("rmsprop", updates.rmsprop, dict(learning_rate=0.01), lambda: optim.rmsprop(0.01, rho=0.9, epsilon=1e-6)),
    ("adadelta", updates.adadelta, dict(), lambda: optim.adadelta(1.0, rho=0.95, epsilon=1e-6)),
    ("adam", updates.adam, dict(learning_rate=0.01), lambda: optim.adam(0.01)),
    ("adamax", updates.adamax, dict(learning_rate=0.01), lambda: optim.adamax(0.01)),
]


def reference_params(seed, make_rule, X_np, Y_np, steps):
    """The pytensor-ml rule in one process on the full batch."""
    X, y, loss, params, _ = mlp(seed)
    step = pytensor.function([X, y], loss, updates=make_rule()(loss, params), mode="JAX")
    for _ in range(steps):
        step(X_np, Y_np)
    return [p.get_value() for p in params]


@pytest.mark.parametrize("name,rule,kwargs,make_rule", RULES, ids=[r[0] for r in RULES])
def test_rule_matches_pytensor_ml_on_the_full_batch(synk2, rng, name, rule, kwargs, make_rule):
    X, y, loss, params, _ = mlp(7)
    X_np, Y_np = data(rng, n=12)                     # 6 rows per device: all_reduce avg is exact
    grad_updates, param_updates, grad_shared = rule(loss, params, **kwargs)
    assert grad_shared.get_value().shape == (sum(p.get_value().size for p in params),)
    f_grad = synk.function([X, y], loss, updates=grad_updates)
    f_upd = synk.function([], updates=param_updates)
    x_dat, y_dat = synk.data(X_np), synk.data(Y_np)
    for _ in range(STEPS):
        f_grad(x_dat, y_dat)
        synk.all_reduce(grad_shared, op="avg")
        f_upd()
    want = reference_params(7, make_rule, X_np, Y_np, STEPS)
    for rank in range(2):
        for got, ref in zip(synk.get_value(rank, params), want):
            close(got, ref, rtol=1e-6, atol=1e-8)


def test_adam_with_many_parameters_has_one_step_counter(synk2):
    X, y, loss, params, _ = mlp(3)
    _, param_updates, _ = updates.adam(loss, params)
    targets = [s for s, _ in param_updates]
    assert len(targets) == len({id(s) for s in targets})
    counters = [s for s in targets if "step" in (s.name or "") or "count" in (s.name or "")]
    assert len(counters) == 1, [s.name for s in targets]


def test_from_optim_chain_with_clipping(synk2, rng):
    X, y, loss, params, _ = mlp(11)
    X_np, Y_np = data(rng, n=10)
    make = lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.5))   # noqa: E731
    grad_updates, param_updates, grad_shared = updates.from_optim(make(), loss, params)
    f_grad = synk.function([X, y], loss, updates=grad_updates)
    f_upd = synk.function([], updates=param_updates)
    for _ in range(3):
        f_grad(X_np, Y_np)
        synk.all_reduce(grad_shared)
        f_upd()
    for got, ref in zip(synk.get_value(1, params), reference_params(11, make, X_np, Y_np, 3)):
        close(got, ref, rtol=1e-6, atol=1e-8)


def test_make_train_function_is_exact_on_uneven_batches(synk2, rng):
    X, y, loss, params, _ = mlp(5)
    X_np, Y_np = data(rng, n=40)
    train_step = train.make_train_function(loss, params, X, y, updates.momentum, learning_rate=0.1)
    x_dat, y_dat = synk.data(X_np), synk.data(Y_np)
    batches = [rng.permutation(40)[:13] for _ in range(3)]    # 13 rows: 6 and 7 per device
    losses = [train_step(x_dat, y_dat, batch=b, num_slices=2) for b in batches]

    X2, y2, loss2, params2, _ = mlp(5)
    single = train.make_single_process_train_function(loss2, params2, X2, y2, updates.momentum,
                                                      learning_rate=0.1)
    ref_losses = [single(X_np[b], Y_np[b]) for b in batches]
    close(losses, ref_losses, rtol=1e-9)
    for got, ref in zip(synk.get_value(1, params), [p.get_value() for p in params2]):
        close(got, ref, rtol=1e-7, atol=1e-10)


def test_flatten_helpers():
    a = pytensor.shared(np.arange(6.0).reshape(2, 3))
    b = pytensor.shared(np.arange(2.0))
    flat = updates.flatten_vars([a, b])
    close(flat.eval(), np.r_[np.arange(6.0), np.arange(2.0)])
    back = updates.unflatten_vars(flat, [a, b])
    close(back[0].eval(), a.get_value())
    close(back[1].eval(), b.get_value())
