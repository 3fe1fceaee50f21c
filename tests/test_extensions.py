"""Flattened-gradient optimizers and the training helper against pytensor-ml on the full batch."""

import gc
import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close
from pytensor_ml import optim
from pytensor_ml.activations import ReLU
from pytensor_ml.layers import Input, Linear
from pytensor_ml.loss import CrossEntropy, supervised_loss
from pytensor_ml.pytensorf import collect_trainable_params

import synkhronos as synk
from synkhronos.api.step import Step
from synkhronos.extensions import train, updates

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.parametrize("rule", [updates.sgd, updates.adam])
def test_a_model_of_one_0d_parameter_trains_as_one_process(synk2, rng, rule):
    """Its flat gradient is known to be 1 long: the vector holding it is too (PyTensor takes no
    update of another broadcast pattern)."""
    def model(name):
        x, y = pt.matrix("x"), pt.vector("y")
        w = pytensor.shared(np.array(0.5), name=name)
        return x, y, w, ((x.sum(axis=1) * w - y) ** 2).mean()
    X_np, Y_np = rng.normal(size=(13, 2)), rng.normal(size=13)
    x, y, w, loss = model("w_0d")
    step = train.make_train_function(loss, [w], x, y, rule, learning_rate=0.1)
    x1, y1, w1, loss1 = model("w_0d_single")
    single = train.make_single_process_train_function(loss1, [w1], x1, y1, rule, learning_rate=0.1)
    for b in [np.arange(13), np.arange(7)]:
        close(step(X_np[b], Y_np[b]), single(X_np[b], Y_np[b]), rtol=1e-12)
    close(w.get_value(), w1.get_value(), rtol=1e-12)


def test_flatten_helpers():
    a = pytensor.shared(np.arange(6.0).reshape(2, 3))
    b = pytensor.shared(np.arange(2.0))
    flat = updates.flatten_vars([a, b])
    close(flat.eval(), np.r_[np.arange(6.0), np.arange(2.0)])
    back = updates.unflatten_vars(flat, [a, b])
    close(back[0].eval(), a.get_value())
    close(back[1].eval(), b.get_value())


def _linear_model(seed, reshaped):
    """A linear least-squares model; ``reshaped``: its loss reshapes its rows to (2, 3), so it
    fails on a device whose share is not 2 rows."""
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.random.default_rng(seed).normal(size=3), name=f"w_linear_{reshaped}")
    rows = pt.reshape(x, (2, 3)) if reshaped else x
    return x, y, pt.mean((rows @ w - y) ** 2), [w]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the pools cannot be bound "
                    "to cores of their own, and steps stay three commands (State.fuses_steps)")
def test_a_step_is_one_command_on_every_device(synk2, rng, tmp_path):
    """The gradient call, the all-reduce and the update of a master-driven step: one command."""
    import json
    X, y, loss, params, _ = mlp(7)
    train_step = train.make_train_function(loss, params, X, y, updates.momentum, learning_rate=0.1)
    X_np, Y_np = data(rng, n=16)
    x_dat, y_dat = synk.data(X_np), synk.data(Y_np)
    # an earlier test's Data collected while recording would post a drop command: collect now,
    # and let a step before the recording post what the collection released
    gc.collect()
    gc.disable()
    try:
        train_step(x_dat, y_dat)
        with synk.timeline(tmp_path / "t.json"):
            for _ in range(3):
                train_step(x_dat, y_dat)
    finally:
        gc.enable()
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    commands = [e["name"] for e in events if e.get("cat") == "command" and e["pid"] == 1]
    assert commands == ["step"] * 3
    updates_run = [e for e in events if e.get("name") == "train_update" and e.get("ph") == "X"]
    assert sorted(e["pid"] for e in updates_run) == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("rows, failing_rank", [(5, 1), (3, 0)])
def test_a_step_whose_gradient_fails_on_one_rank_changes_nothing(synk2, rng, rows, failing_rank):
    """Every rank skips the all-reduce and the update; the error names the rank; the next step is exact."""
    x, y, loss, params = _linear_model(3, reshaped=True)
    train_step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.1)
    velocity = [s for s in train_step.state_variables if all(s is not p for p in params)]
    X_np, Y_np = rng.normal(size=(8, 3)), rng.normal(size=8)
    x_dat, y_dat = synk.data(X_np), synk.data(Y_np)
    train_step(x_dat, y_dat, batch=4)                  # 2 rows a device: a velocity to keep
    before = [synk.get_value(r, params + velocity) for r in range(2)]
    with pytest.raises(synk.WorkerError, match=f"rank {failing_rank} raised TypeError") as info:
        train_step(x_dat, y_dat, batch=rows)
    assert "reshape" in info.value.worker_traceback
    for r in range(2):
        for got, kept in zip(synk.get_value(r, params + velocity), before[r]):
            np.testing.assert_array_equal(got, kept)

    train_step(x_dat, y_dat, batch=4)
    x2, y2, loss2, params2 = _linear_model(3, reshaped=False)
    single = train.make_single_process_train_function(loss2, params2, x2, y2, updates.momentum,
                                                      learning_rate=0.1)
    for _ in range(2):                                 # the same two steps, the failed one left out
        single(X_np[:4], Y_np[:4])
    for r in range(2):
        close(synk.get_value(r, params)[0], params2[0].get_value(), rtol=1e-12)


def test_a_step_refuses_an_update_with_inputs(synk2):
    x = pt.vector("x")
    w = pytensor.shared(np.zeros(2), name="w_step_refuses")
    f = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1)], name="step_call")
    g = synk.function([x], updates=[(w, w * x.sum())], name="step_update_with_input")
    with pytest.raises(TypeError, match="step_update_with_input takes 1; give it none"):
        Step(f, w, g)


@pytest.mark.slow
def test_with_pools_over_every_core_a_step_is_three_commands_and_exact(rng, tmp_path):
    """``threads_per_device`` = every core: steps stay three commands (see State.fuses_steps),
    with the same parameters as one process."""
    import json

    from conftest import N_PARALLEL

    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(N_PARALLEL, threads_per_device=len(os.sched_getaffinity(0)))
    try:
        X, y, loss, params, _ = mlp(9)
        train_step = train.make_train_function(loss, params, X, y, updates.momentum,
                                               learning_rate=0.1)
        synk.distribute()
        X_np, Y_np = data(rng, n=30)
        x_dat, y_dat = synk.data(X_np), synk.data(Y_np)
        batches = [rng.permutation(30)[:11] for _ in range(3)]
        with synk.timeline(tmp_path / "t.json"):
            losses = [train_step(x_dat, y_dat, batch=b) for b in batches]
        events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
        commands = [e["name"] for e in events if e.get("cat") == "command" and e["pid"] == 1]
        assert commands == ["call", "collective", "call"] * 3

        X2, y2, loss2, params2, _ = mlp(9)
        single = train.make_single_process_train_function(loss2, params2, X2, y2, updates.momentum,
                                                          learning_rate=0.1)
        close(losses, [single(X_np[b], Y_np[b]) for b in batches], rtol=1e-9)
        for got, ref in zip(synk.get_value(1, params), [p.get_value() for p in params2]):
            close(got, ref, rtol=1e-7, atol=1e-10)
    finally:
        synk.close()
