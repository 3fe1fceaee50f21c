"""Device-driven training loops (train.run) and the sync rules, against single-process PyTensor."""

import json
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL, child_pids, synk_segments
from helpers import (
    SLOW_RANK,
    AnnouncingAllReduce,
    AnnouncingDownpour,
    FailingAllReduce,
    FailingDownpour,
    ListCenter,
    SlowAllReduce,
    SlowDownpour,
    SlowEASGD,
    SlowRateLimited,
    ToyAverage,
    close,
    digits_step,
    run_script,
    wait_for_marker,
)
from test_extensions import mlp

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session
from synkhronos.wire.batch import chunk

pytestmark = pytest.mark.timeout(300)

N_ROWS, BATCH = 203, 21           # 10 and 11 rows per device, and a last step of 14 rows


def digits_like(rng, n=N_ROWS):
    return rng.normal(size=(n, 6)), rng.integers(0, 3, size=n)


def global_batches(n_rows, batch, epochs, seed=0):
    """The global batches run(..., epochs=epochs, seed=seed) takes, in order."""
    per_epoch = train.steps_per_epoch(n_rows, batch)
    for epoch in range(epochs):
        order = train.epoch_order(n_rows, epoch, seed)
        for i in range(per_epoch):
            yield order[i * batch:(i + 1) * batch]


def values_on(rank, params):
    return [np.asarray(v) for v in synk.get_value(rank, params)]


def reset(params, init, step=None):
    """Parameters back to ``init`` on every device; with ``step``, its optimizer state to zeros."""
    for p, v in zip(params, init):
        p.set_value(v)
    everything = list(params)
    if step is not None:
        state = [s for s in step.functions[1].get_shared() if all(s is not p for p in params)]
        for s in state:
            s.set_value(np.zeros_like(s.get_value()))
        everything += state
    synk.broadcast(everything)


@pytest.fixture(scope="module")
def model(request):
    """A small pytensor-ml MLP with a master-driven momentum step, on a running runtime."""
    if session.active() is None:
        synk.fork(N_PARALLEL)
    X, y, loss, params, init = mlp(seed=3)
    step = train.make_train_function(loss, params, X, y, updates.momentum, learning_rate=0.1)
    synk.distribute()
    return step, params, init


# ------------------------------------------------------------------------------------------------
# The same parameters as the master-driven loop and as one process
# ------------------------------------------------------------------------------------------------

def test_allreduce_equals_master_loop_and_one_process(synk2, rng):
    x_np, y_np = digits_like(rng)
    X, y, loss, params, init = mlp(seed=5)
    step = train.make_train_function(loss, params, X, y, updates.momentum, learning_rate=0.1)
    synk.distribute()
    x_d, y_d = synk.data(x_np), synk.data(y_np)
    history = train.run(step, x_d, y_d, BATCH, epochs=2, sync=sync.AllReduce(), check_every=7)
    device_loop = [values_on(r, params) for r in range(N_PARALLEL)]
    assert history["step"] == [7, 14, 20] and history[-1].epoch == 2.0

    reset(params, init, step)
    for batch in global_batches(N_ROWS, BATCH, 2):
        step(x_d, y_d, batch=batch)
    master_loop = values_on(0, params)

    Xr, yr, loss_r, params_r, _ = mlp(seed=5)
    one = train.make_single_process_train_function(loss_r, params_r, Xr, yr, updates.momentum,
                                                    learning_rate=0.1)
    for batch in global_batches(N_ROWS, BATCH, 2):
        one(x_np[batch], y_np[batch])
    for rank in range(N_PARALLEL):
        for a, b, c in zip(device_loop[rank], master_loop, [p.get_value() for p in params_r]):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(a, c, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_allreduce_on_the_jax_runtime_collective(rng):
    """The collective GPUs use, on CPU: the same parameters as the master-driven loop."""
    synk.close()
    synk.fork(N_PARALLEL, collectives="jax")
    try:
        x_np, y_np = digits_like(rng)
        X, y, loss, params, init = mlp(seed=6)
        step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
        synk.distribute()
        train.run(step, x_np, y_np, BATCH, steps=12)
        device_loop = [values_on(r, params) for r in range(N_PARALLEL)]
        reset(params, init, step)
        for batch in list(global_batches(N_ROWS, BATCH, 2))[:12]:
            step(x_np, y_np, batch=batch)
        for rank in range(N_PARALLEL):
            for a, b in zip(device_loop[rank], values_on(0, params)):
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    finally:
        synk.close()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_every_rank_runs_the_same_blocks_whatever_it_compiled_besides():
    """A gradient that reads no rows builds one graph for any rows, which the master's check of
    its first share has built already: the master must still take the loop's first step apart as
    its workers do (a block on one rank and a step on another never meet in their collectives)."""
    synk.close()
    synk.fork(N_PARALLEL, collectives="jax")
    try:
        x = pt.matrix("x")
        w = pytensor.shared(np.zeros(5), name="w_rowless")
        step = train.make_train_function(x.sum(axis=1).mean() + w.sum(), [w], x, None, updates.sgd,
                                         learning_rate=0.1)
        train.run(step, synk.data(np.ones((64, 2))), batch_size=8, epochs=1, shuffle=False)
        v = pytensor.shared(np.zeros(5))
        alone = pytensor.function([], [], updates=[(v, v - 0.1 * pytensor.grad(v.sum(), v))])
        for _ in range(8):
            alone()
        for rank in range(N_PARALLEL):
            np.testing.assert_allclose(synk.get_value(rank, w), v.get_value(), rtol=1e-12)
    finally:
        synk.close()


@pytest.mark.slow
def test_a_thread_of_the_script_changes_nothing_under_the_jax_collectives(rng):
    """While another thread of the script runs, the master's values stay host faces (that thread
    may read them): the loop's block programs take them as device arrays, and train as one
    process does."""
    synk.close()
    synk.fork(N_PARALLEL, collectives="jax")
    ended = threading.Event()
    try:
        x_np, y_np = digits_like(rng)
        X, y, loss, params, _ = mlp(seed=6)
        step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
        synk.distribute()
        threading.Thread(target=ended.wait, daemon=True).start()
        train.run(step, x_np, y_np, 20, steps=24)        # blocks of 10 rows per device, and steps
        Xr, yr, loss_r, params_r, _ = mlp(seed=6)
        one = train.make_single_process_train_function(loss_r, params_r, Xr, yr, updates.sgd,
                                                        learning_rate=0.1)
        for batch in list(global_batches(N_ROWS, 20, 3))[:24]:
            one(x_np[batch], y_np[batch])
        for rank in range(N_PARALLEL):
            for a, b in zip(values_on(rank, params), [p.get_value() for p in params_r]):
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    finally:
        ended.set()
        synk.close()


@pytest.mark.slow
def assert_rules_agree(rng, seed, first, second, rtol, atol, **schedule):
    """The digits-like MLP trained with SGD from one start under ``first``, then under ``second``:
    every rank ends with what the first left on rank 0. Returns that, and the start."""
    x_np, y_np = digits_like(rng)
    X, y, loss, params, init = mlp(seed=seed)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.2)
    synk.distribute()
    train.run(step, x_np, y_np, BATCH, sync=first, **schedule)
    want = values_on(0, params)
    reset(params, init, step)
    train.run(step, x_np, y_np, BATCH, sync=second, **schedule)
    for rank in range(N_PARALLEL):
        for a, b in zip(values_on(rank, params), want):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return want, init


@pytest.mark.slow
def test_average_every_step_with_sgd_is_allreduce(synk2, rng):
    assert_rules_agree(rng, 7, sync.AllReduce(), sync.Average(every=1), 1e-9, 1e-12, epochs=2)


@pytest.mark.slow
def test_a_rule_written_against_the_rule_loop_contract_alone_runs_as_the_built_in_one(synk2, rng):
    """ToyAverage (tests/helpers.py) uses only synkhronos.seams.loop.RuleLoop; it computes what
    Average does, rows unevenly split included."""
    built_in, init = assert_rules_agree(rng, 7, sync.Average(every=3), ToyAverage(every=3), 1e-12, 1e-14,
                                        epochs=2)
    assert not np.allclose(built_in[0], init[0])          # it trained


def test_center_transports_meet_the_center_client_contract():
    """Node 0's shared-memory center, the remote one and a toy written against the contract alone;
    the toy answers a rule's merge as the contract says."""
    from synkhronos.runtime.centers.server import RemoteCenter
    from synkhronos.runtime.centers.shared import Center
    from synkhronos.seams.loop import CenterClient
    assert issubclass(Center, CenterClient) and issubclass(RemoteCenter, CenterClient)
    toy = ListCenter([np.zeros(2)], merge=sync.Downpour().merge)
    assert isinstance(toy, CenterClient)
    assert [toy.claim(2), toy.claim(2), toy.claim(2)] == [0, 1, None]
    pulled, = toy.exchange([np.array([1.0, 2.0])])
    np.testing.assert_array_equal(pulled, [1.0, 2.0])
    np.testing.assert_array_equal(toy.values()[0], [1.0, 2.0])


@pytest.mark.parametrize("answer,taken", [
    (lambda block: block.astype(np.int64), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),      # another dtype: cast back
    (lambda block: block.astype(np.float32), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
    (lambda block: block.T.copy(), None),                                 # another shape: refused
    (lambda block: 1.0, None),
    (lambda block: None, None),
])
def test_a_merge_answering_another_shape_or_dtype_is_named_or_cast(answer, taken):
    """Node 0's shared-memory center (what its center server uses for the other nodes) takes back
    from a rule's merge an array of the block's shape and dtype, or raises naming the merge."""
    import uuid

    from synkhronos.runtime.centers.shared import Center

    def merge(block, pushed):
        block += pushed
        return answer(block)
    center = Center(f"synk_test_center_{uuid.uuid4().hex[:8]}", [(2, 3)], [np.float64],
                    initial=[np.zeros((2, 3))], merge=merge)
    try:
        push = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        if taken is None:
            with pytest.raises(ValueError, match=r"the rule's merge .*merge answered .* for a center "
                                                 r"block of shape \(2, 3\) and dtype float64"):
                center.exchange([push])
        else:
            pulled, = center.exchange([push])
            assert pulled.dtype == np.float64 and pulled.shape == (2, 3)
            np.testing.assert_array_equal(pulled.ravel(), taken)
    finally:
        center.close()


def local_reference(seed, x_np, y_np, rank, steps, lr):
    """Rank ``rank``'s own SGD steps on its rows of each global step, in one process."""
    X, y, loss, params, _ = mlp(seed)
    one = train.make_single_process_train_function(loss, params, X, y, updates.sgd, learning_rate=lr)
    for batch in list(global_batches(N_ROWS, BATCH, 2))[:steps]:
        a, b = chunk(0, len(batch), N_PARALLEL, rank)
        one(x_np[batch[a:b]], y_np[batch[a:b]])
    return [p.get_value() for p in params]


@pytest.mark.slow
def test_easgd_with_no_pull_leaves_the_devices_independent(synk2, rng):
    x_np, y_np = digits_like(rng)
    X, y, loss, params, init = mlp(seed=8)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.2)
    synk.distribute()
    seen = {}

    def capture(history):
        seen.update({r: values_on(r, params) for r in range(N_PARALLEL)})
        seen["center"] = history.center_values()
    train.run(step, x_np, y_np, BATCH, steps=9, sync=sync.EASGD(alpha=0.0, every=2), on_check=capture)
    for rank in range(N_PARALLEL):
        for a, b in zip(seen[rank], local_reference(8, x_np, y_np, rank, 9, 0.2)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert not np.allclose(seen[0][0], seen[1][0])
    for c, v in zip(seen["center"], init):              # the center never moved ...
        np.testing.assert_allclose(c, v, rtol=1e-12)
    for rank in range(N_PARALLEL):                      # ... and every device ends on it
        for a, v in zip(values_on(rank, params), init):
            np.testing.assert_allclose(a, v, rtol=1e-12)


def test_one_easgd_exchange_matches_the_formula(synk2, rng):
    """With a zero learning rate only the exchange moves anything: d = a(x - c), x -= d, c += sum d."""
    x_np, y_np = digits_like(rng)
    X, y, loss, params, init = mlp(seed=9)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.0)
    synk.distribute()
    local = {r: [v + r * rng.normal(size=v.shape) for v in init] for r in range(N_PARALLEL)}
    for r in range(N_PARALLEL):
        synk.set_value(r, params, local[r])
    seen = {}

    def capture(history):
        seen.update({r: values_on(r, params) for r in range(N_PARALLEL)})
        seen["center"] = history.center_values()
    alpha = 0.3
    train.run(step, x_np, y_np, BATCH, steps=2, sync=sync.EASGD(alpha=alpha, every=2), on_check=capture)
    center0 = local[0]                                   # the center starts at the master's values
    pulls = {r: [alpha * (x - c) for x, c in zip(local[r], center0)] for r in range(N_PARALLEL)}
    for r in range(N_PARALLEL):
        for got, x, d in zip(seen[r], local[r], pulls[r]):
            np.testing.assert_allclose(got, x - d, rtol=1e-12, atol=1e-14)
    for i, (got, c) in enumerate(zip(seen["center"], center0)):
        np.testing.assert_allclose(got, c + sum(pulls[r][i] for r in range(N_PARALLEL)),
                                   rtol=1e-12, atol=1e-14)
    for r in range(N_PARALLEL):                          # run() ends with every device on the center
        for got, c in zip(values_on(r, params), seen["center"]):
            np.testing.assert_allclose(got, c, rtol=1e-12)


def diloco_reference(seed, x_np, y_np, n, steps, lr, rule, batches):
    """DiLoCo in one process: each round, every device's own SGD steps on its rows of each global step
    from the round's start, then the outer step on the row-weighted mean of the devices' parameters."""
    X, y, loss, params, _ = mlp(seed)
    one = train.make_single_process_train_function(loss, params, X, y, updates.sgd, learning_rate=lr)
    theta = [np.array(p.get_value()) for p in params]
    velocity = [np.zeros_like(t) for t in theta]
    batches = list(batches)[:steps]
    for start in range(0, steps, rule.every):
        rounds = batches[start:start + rule.every]
        total = sum(len(b) for b in rounds)
        mean = [np.zeros_like(t) for t in theta]
        for rank in range(n):
            for p, t in zip(params, theta):
                p.set_value(t.copy())
            rows = 0
            for batch in rounds:
                a, b = chunk(0, len(batch), n, rank)
                one(x_np[batch[a:b]], y_np[batch[a:b]])
                rows += b - a
            for m, p in zip(mean, params):
                m += np.asarray(p.get_value()) * (rows / total)     # (a JAX array would not add in place)
        for t, v, m in zip(theta, velocity, mean):
            delta = t - m
            v[...] = rule.outer_momentum * v + delta
            t -= rule.outer_lr * (delta + rule.outer_momentum * v if rule.nesterov else v)
    return theta


def check_diloco(n, rng, steps=9):
    """A DiLoCo run (rounds of 4 steps, the last round one step) equals :func:`diloco_reference`."""
    x_np, y_np = digits_like(rng)
    X, y, loss, params, _ = mlp(seed=12)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.2)
    synk.distribute()
    for rule in [sync.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9),
                 sync.DiLoCo(every=4, outer_lr=1.3, outer_momentum=0.5, nesterov=False)]:
        reset(params, mlp(seed=12)[4], step)
        history = train.run(step, x_np, y_np, BATCH, steps=steps, sync=rule)
        assert history[-1].step == steps
        want = diloco_reference(12, x_np, y_np, n, steps, 0.2, rule, global_batches(N_ROWS, BATCH, 2))
        for rank in range(n):
            for got, w in zip(values_on(rank, params), want):
                np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_diloco_takes_its_outer_nesterov_steps_exactly(synk2, rng):
    check_diloco(N_PARALLEL, rng)


def test_a_resumed_diloco_run_continues_exactly_from_inside_a_round(synk2, rng, tmp_path):
    x_np, y_np = digits_like(rng)
    X, y, loss, params, init = mlp(seed=14)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.2)
    synk.distribute()
    rule = sync.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9)
    train.run(step, x_np, y_np, BATCH, steps=12, sync=rule)
    whole = [values_on(r, params) for r in range(N_PARALLEL)]
    reset(params, init, step)
    # checkpoints at steps 3 and 6, inside rounds: the devices' own values, the outer ones, the momentum
    train.run(step, x_np, y_np, BATCH, steps=6, sync=rule, checkpoint_dir=tmp_path, checkpoint_every=3)
    reset(params, [np.zeros_like(v) for v in init], step)
    train.run(step, x_np, y_np, BATCH, steps=12, sync=rule, checkpoint_dir=tmp_path, checkpoint_every=3,
              resume=True)
    for rank in range(N_PARALLEL):
        for a, b in zip(values_on(rank, params), whole[rank]):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_diloco_with_unit_outer_rate_and_no_momentum_is_average(synk2, rng):
    assert_rules_agree(rng, 13, sync.Average(every=4), sync.DiLoCo(every=4, outer_lr=1.0, outer_momentum=0.0),
                       1e-9, 1e-12, steps=8)


# ------------------------------------------------------------------------------------------------
# Every rule trains the digits MLP
# ------------------------------------------------------------------------------------------------

# (rule, epochs): the asynchronous rules get more epochs
ACCURACY_RULES = [
    (sync.AllReduce(), 30),
    (sync.Average(every=4), 30),
    (sync.DiLoCo(every=8), 30),
    (sync.EASGD(alpha=0.5, every=4), 30),
    (sync.EASGD(alpha=0.5, every=4, asynchronous=True), 40),
    (sync.Downpour(every=2), 40),
    (sync.RateLimited(every_n_batches=2, alpha=0.5, beta=0.5, max_rate=0.5), 40),
]


def digits_model(spec, rule, learning_rate):
    """:func:`helpers.digits_step`, forking first if no runtime runs."""
    if session.active() is None:
        synk.fork(N_PARALLEL)
    return digits_step(spec, rule, learning_rate)


@pytest.fixture(scope="module")
def digits():
    data, step, params, (x, y, loss, accuracy) = digits_model("custom_mlp:1,128", updates.momentum, 0.05)
    evaluate = synk.function([x, y], [(loss, "avg"), (accuracy, "avg")], name="evaluate_digits")
    synk.distribute()
    init = [p.get_value() for p in params]
    stores = {k: synk.data(data[k]) for k in ("x_train", "y_train", "x_test", "y_test")}
    return step, evaluate, params, init, stores


@pytest.mark.slow
@pytest.mark.parametrize("rule,epochs", ACCURACY_RULES, ids=[repr(r) for r, _ in ACCURACY_RULES])
def test_every_rule_trains_the_digits_mlp(digits, rule, epochs):
    step, evaluate, params, init, d = digits
    reset(params, init, step)
    history = train.run(step, d["x_train"], d["y_train"], 128, epochs=epochs, sync=rule, seed=1)
    loss, accuracy = evaluate(d["x_test"], d["y_test"])
    ref_loss, ref_accuracy = evaluate.as_pytensor(d["x_test"].data, d["y_test"].data)
    close(accuracy, ref_accuracy)
    assert accuracy >= 0.95, f"{rule}: test accuracy {accuracy:.3f} after {epochs} epochs"
    assert history[-1].epoch == epochs and history[-1].loss < history[0].loss
    for rank in range(1, N_PARALLEL):                    # every device holds the final parameters
        for a, b in zip(values_on(rank, params), values_on(0, params)):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------
# A straggler
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide():
    """A model whose step computes long enough for a sleep to double it."""
    data, step, _, _ = digits_model("custom_mlp:2,512", updates.sgd, 0.01)
    synk.distribute()
    return step, synk.data(data["x_train"]), synk.data(data["y_train"])


#: rows per global step: enough compute per step that one exchange with the center stays a small part
STRAGGLER_BATCH = 512


def samples_per_s(wide, rule, steps=120):
    step, x_d, y_d = wide
    history = train.run(step, x_d, y_d, STRAGGLER_BATCH, steps=steps, sync=rule, check_every=steps // 2)
    return history[-1]          # the second half: compiled, warm


@pytest.mark.serial
@pytest.mark.slow
def test_asynchronous_rules_outpace_allreduce_with_a_straggler(wide):
    # compiled before anything is timed: every rank meets every row count, also those only an
    # asynchronous rule's claims give it (the last, smaller step's parts)
    train.run(wide[0], wide[1], wide[2], STRAGGLER_BATCH, epochs=1)
    for _ in range(3):
        train.run(wide[0], wide[1], wide[2], STRAGGLER_BATCH, epochs=2, sync=sync.Downpour())
    rules = {"downpour": lambda: SlowDownpour(every=1),
             "easgd": lambda: SlowEASGD(alpha=0.5, every=2, asynchronous=True),
             "ratelimited": lambda: SlowRateLimited(every_n_batches=1)}
    best = {}                # a shared machine: each rule's best of up to five interleaved rounds
    for _ in range(5):
        for name, make in [("allreduce", SlowAllReduce)] + list(rules.items()):
            check = samples_per_s(wide, make())
            best[name] = max(best.get(name, 0.0), check.samples_per_s)
            if name != "allreduce":          # the fast device trained on more of the rows
                fast, slow = (check.rows_per_device[r] for r in (1 - SLOW_RANK, SLOW_RANK))
                assert fast > 1.2 * slow, (name, check.rows_per_device)
        ratios = {name: best[name] / best["allreduce"] for name in rules}
        if min(ratios.values()) >= 1.3:
            break
    print("samples/s over AllReduce's with a straggler:", ratios)
    assert min(ratios.values()) >= 1.3, ratios


@pytest.mark.slow
def test_rate_limited_keeps_its_sync_fraction(wide):
    # what syncing every step costs on this machine, then a cap well below it: the rule must skip
    free = samples_per_s(wide, SlowRateLimited(every_n_batches=1, max_rate=1.0), steps=100)
    assert free.skipped == 0 and free.sync_fraction > 0, free
    cap = free.sync_fraction / 3
    check = samples_per_s(wide, SlowRateLimited(every_n_batches=1, max_rate=cap), steps=200)
    assert check.sync_fraction <= cap + 0.05, (cap, check)
    assert check.syncs > 0 and check.skipped > 0, (cap, check)


# ------------------------------------------------------------------------------------------------
# Faults, misuse, the History
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("announcing", [AnnouncingAllReduce, AnnouncingDownpour])
def test_a_device_dying_mid_run_ends_it(tmp_path, rng, announcing):
    if session.active() is None:
        synk.fork(N_PARALLEL)
    assert_a_dying_device_ends_the_run(tmp_path, rng, announcing)


@pytest.mark.slow
def test_a_device_dying_mid_run_is_named_under_the_jax_collectives(tmp_path, rng):
    """The master's own collective fails as its peer dies (Gloo: "connection closed by peer"): the
    error names the peer's death, the cause, not the master's failed all-reduce."""
    synk.close()
    synk.fork(N_PARALLEL, collectives="jax")
    try:
        assert_a_dying_device_ends_the_run(tmp_path, rng, AnnouncingAllReduce)
    finally:
        synk.close()


def assert_a_dying_device_ends_the_run(tmp_path, rng, announcing):
    """Worker 1 SIGKILLed inside ``train.run``: the error names its death, promptly, and nothing of
    the runtime is left."""
    rt = session.current()
    x_np, y_np = digits_like(rng, 4000)
    X, y, loss, params, _ = mlp(seed=11)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.01)
    synk.distribute()
    victim, prefix, pids = rt.worker_pids[1], rt.prefix, list(rt.worker_pids.values())

    killed = []

    def kill():
        wait_for_marker(tmp_path, victim)
        time.sleep(0.3)
        killed.append(time.time())
        os.kill(victim, signal.SIGKILL)
    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(synk.WorkerError) as info:
        train.run(step, x_np, y_np, 20, epochs=10_000, sync=announcing(directory=str(tmp_path)))
    assert killed and time.time() - killed[0] < 10
    assert info.value.rank == 1 and info.value.how == "died"
    assert session.active() is None
    deadline = time.time() + 10
    while time.time() < deadline and ({p for p, _ in child_pids()} & set(pids)
                                      or any(n.startswith(prefix) for n in synk_segments())):
        time.sleep(0.1)
    assert not {p for p, _ in child_pids()} & set(pids)
    assert not [n for n in synk_segments() if n.startswith(prefix)]


@pytest.mark.slow
@pytest.mark.parametrize("failing", [FailingAllReduce, FailingDownpour])
def test_a_device_raising_mid_run_ends_it_with_its_error(rng, failing):
    """Peers may be waiting for it mid-step: the runtime is shut down, the error names the rank."""
    if session.active() is None:
        synk.fork(N_PARALLEL)
    rt = session.current()
    prefix = rt.prefix
    x_np, y_np = digits_like(rng, 400)
    X, y, loss, params, _ = mlp(seed=13)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.01)
    synk.distribute()
    start = time.time()
    with pytest.raises(synk.WorkerError, match="rank 1 gives up") as info:
        train.run(step, x_np, y_np, 20, epochs=50, sync=failing())
    assert time.time() - start < 10
    assert info.value.rank == 1 and isinstance(info.value, ValueError)
    assert session.active() is None
    deadline = time.time() + 10
    while any(n.startswith(prefix) for n in synk_segments()) and time.time() < deadline:
        time.sleep(0.1)
    assert not [n for n in synk_segments() if n.startswith(prefix)]


class _LooseRule(sync.AllReduce):
    """A rule keeping a setting outside its dataclass fields (a misuse)."""

    def __init__(self, every):
        self.every = every


class _OldStyleRule(sync.AllReduce):
    """A rule with the hook signature of before RuleState (a misuse)."""

    def after_update(self, loop, rows, batch_rows):
        return False


@dataclass(frozen=True)
class _NoMergeRule(sync.Rule):
    """An asynchronous rule that never says how a push meets the center (a misuse)."""

    asynchronous = True


def _rule_of_a_module_made_at_run_time():
    """A rule whose class lives in a module built in this process (no import spec): the workers
    could not import it (a misuse)."""
    import sys
    import types
    module = types.ModuleType("synk_test_rules_made_here")
    exec("from dataclasses import dataclass\nfrom synkhronos.extensions import sync\n"
         "@dataclass(frozen=True)\nclass Made(sync.Average):\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    return module.Made()


MISUSE = [
    (dict(batch_size=1), ValueError, "batch_size must be"),
    (dict(batch_size=N_ROWS + 1), ValueError, "batch_size must be"),
    (dict(batch_size=202), ValueError, "last step of every epoch would have 1 rows"),
    (dict(steps=None, epochs=None), ValueError, "exactly one of steps="),
    (dict(steps=3, epochs=1), ValueError, "exactly one of steps="),
    (dict(steps=0), ValueError, "steps must be a positive"),
    (dict(sync="easgd"), TypeError, "sync must be a rule"),
    (dict(sync=_OldStyleRule()), TypeError, r"_OldStyleRule.after_update takes \(loop, rows, batch_rows\), "
                                            r"but every rank calls after_update\(self, state, loop"),
    (dict(sync=_LooseRule(2)), TypeError, r"_LooseRule keeps \['every'\] outside its settings.*frozen"),
    (dict(sync=_rule_of_a_module_made_at_run_time()), TypeError,
     r"module 'synk_test_rules_made_here', made while this process ran.*register_pickle_by_value"),
    (dict(sync=_NoMergeRule()), TypeError, r"_NoMergeRule is asynchronous but declares no merge\(center, "
                                           r"pushed\).*derive from sync.Downpour"),
    (dict(check_every=0), ValueError, "check_every must be"),
    (dict(on_check=3), TypeError, "on_check must be a callable"),
    (dict(seed=2, order=train.DataOrder(seed=2)), TypeError, r"got seed and order=: give a setting either"),
    (dict(checks=dict(every=2)), TypeError, r"checks= takes a Checks, got \{'every': 2\}"),
    (dict(check_evry=2), TypeError, r"unexpected keyword arguments \['check_evry'\]"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,error,message", MISUSE, ids=[str(m[0]) for m in MISUSE])
def test_misuse_is_refused_and_the_runtime_stays_usable(model, rng, kwargs, error, message):
    step, params, init = model
    x_np, y_np = digits_like(rng)
    arguments = dict(batch_size=BATCH, steps=3)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        train.run(step, x_np, y_np, **arguments)
    history = train.run(step, x_np, y_np, BATCH, steps=2)
    assert history[-1].step == 2


def test_wrong_functions_and_data_are_refused(model, rng):
    step, params, init = model
    x_np, y_np = digits_like(rng)
    with pytest.raises(TypeError, match="make_train_function returns"):
        train.run(lambda *a: None, x_np, y_np, BATCH, steps=1)
    with pytest.raises(ValueError, match=r"X has 203 rows, but \[\(.target., 202\)\]"):
        train.run(step, x_np, y_np[:-1], BATCH, steps=1)
    with pytest.raises(TypeError, match="expects dtype"):
        train.run(step, synk.data(x_np.astype("float32")), y_np, BATCH, steps=1)


@pytest.mark.parametrize("make,message", [
    (lambda: sync.EASGD(alpha=1.5), "alpha must be in"),
    (lambda: sync.Average(every=0), "every must be a positive"),
    (lambda: sync.DiLoCo(every=4, outer_lr=0), "outer_lr must be a positive"),
    (lambda: sync.DiLoCo(every=4, outer_momentum=1), "outer_momentum must be below 1"),
    (lambda: sync.DiLoCo(every=4, outer_momentum=-0.1), "outer_momentum must be in"),
    (lambda: sync.Downpour(every=2.5), "every must be a positive"),
    (lambda: sync.RateLimited(max_rate=0), "max_rate must be in"),
    (lambda: sync.EASGD(asynchronous="False"), "asynchronous must be True or False, got 'False'"),
    (lambda: sync.Average(state="no"), "state must be True or False"),
    (lambda: sync.EASGD(alpha=True), "alpha must be a number, got True"),
    (lambda: train.DataOrder(shuffle="False"), "shuffle must be True or False"),
    (lambda: train.Checkpointing("somewhere", 5, resume="no"), "resume must be True or False"),
    (lambda: train.Checkpointing(__file__, 5), "is a file; give a directory"),
])
def test_rule_settings_are_checked(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("directory", [None, 123, ""])
def test_a_checkpoint_directory_that_is_no_path_is_refused_when_the_group_is_made(directory):
    with pytest.raises(TypeError, match="checkpoint_dir must be a directory's path"):
        train.Checkpointing(directory, 5)


def test_a_nan_setting_equals_itself_in_a_checkpoints_record():
    from dataclasses import dataclass

    from synkhronos.seams.rule import rule_difference, rule_record

    @dataclass(frozen=True)
    class Tolerant(sync.Rule):
        k: float = float("nan")
    assert rule_difference(json.loads(json.dumps(rule_record(Tolerant()))), Tolerant()) is None


@pytest.mark.slow
def test_a_rule_defined_in_the_script_itself_runs():
    """The user guide's own rule, a class of ``__main__``, reaches the workers (cloudpickled) and
    averages every other step: the parameters equal those under Average(every=2)."""
    out = run_script("""
        from dataclasses import dataclass
        import numpy as np, pytensor, pytensor.tensor as pt, synkhronos as synk
        from synkhronos.extensions import sync, train, updates

        @dataclass(frozen=True)
        class EveryOther(sync.Rule):
            def after_update(self, state, loop, rows, batch_rows):
                state.steps += 1
                if state.steps % 2:
                    return False
                loop.set_values(loop.params, loop.all_reduce(loop.params, loop.param_values(), "avg"))
                return True

        synk.fork(2)
        x, y = pt.matrix("x"), pt.vector("y")
        w = pytensor.shared(np.zeros(5), name="w")
        step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.1)
        synk.distribute()
        X = np.random.default_rng(0).random((64, 5)); Y = X.sum(1)
        ends = []
        for rule in (EveryOther(), sync.Average(every=2)):
            w.set_value(np.zeros(5)); synk.broadcast([w])
            train.run(step, X, Y, 16, steps=8, sync=rule, shuffle=False)
            ends.append(w.get_value())
        print("DIFF", float(np.abs(ends[0] - ends[1]).max()), float(np.abs(ends[0]).max()))
        synk.close()
    """, timeout=180)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("DIFF")]
    assert line, out.stdout + out.stderr
    diff, size = map(float, line[0].split()[1:])
    assert diff < 1e-12 and size > 0.1, line


@pytest.mark.parametrize("rule", [sync.AllReduce(), sync.Average(every=3, state=True), sync.DiLoCo(every=5),
                                  sync.EASGD(0.3, every=2, asynchronous=True), sync.Downpour(every=2),
                                  sync.RateLimited(every_n_batches=3, max_rate=0.5)], ids=repr)
def test_rules_are_settings_only_frozen_comparable_and_recorded(rule):
    """A rule holds no run state: it cannot change, equals a rule of the same settings, and its
    record (what a checkpoint keeps) names its type and settings and tells other settings apart."""
    from dataclasses import FrozenInstanceError, fields, replace

    from synkhronos.seams.rule import rule_difference, rule_record
    with pytest.raises(FrozenInstanceError):
        rule.every = 7
    twin = pickle.loads(pickle.dumps(rule))
    assert twin == rule and hash(twin) == hash(rule) and repr(twin) == repr(rule)
    record = json.loads(json.dumps(rule_record(rule)))
    assert record["type"] == type(rule).__name__ and rule_difference(record, twin) is None
    for f in fields(rule):
        value = getattr(rule, f.name)
        other = (not value) if isinstance(value, bool) else value / 2 if isinstance(value, float) else value + 1
        changed = replace(rule, **{f.name: other})
        assert changed != rule
        assert rule_difference(record, changed) == (f"{type(rule).__name__}.{f.name} is {value!r} in "
                                                   f"the checkpoint, {other!r} here")


@pytest.mark.slow
def test_the_grouped_options_run_as_their_keywords_do(model, rng, tmp_path):
    """order=, checks= and checkpointing= are the keywords' settings, grouped: the same run."""
    step, params, init = model
    x_np, y_np = digits_like(rng)
    runs = {}
    for form, options in [
            ("keywords", dict(seed=5, shuffle=True, check_every=2, checkpoint_dir=tmp_path / "a",
                              checkpoint_every=2)),
            ("groups", dict(order=train.DataOrder(shuffle=True, seed=5), checks=train.Checks(every=2),
                            checkpointing=train.Checkpointing(tmp_path / "b", every=2)))]:
        reset(params, init, step)
        history = train.run(step, x_np, y_np, BATCH, steps=4, **options)
        runs[form] = [c.step for c in history], [p.get_value() for p in params]
    assert runs["keywords"][0] == runs["groups"][0] == [2, 4]
    for a, b in zip(runs["keywords"][1], runs["groups"][1]):
        np.testing.assert_array_equal(a, b)
    assert (tmp_path / "a" / "checkpoint.safetensors").exists()
    assert (tmp_path / "b" / "checkpoint.safetensors").exists()


def test_on_check_stops_the_run_and_the_history_plots(model, rng, tmp_path):
    step, params, init = model
    x_np, y_np = digits_like(rng)
    reset(params, init, step)
    history = train.run(step, x_np, y_np, BATCH, epochs=5, check_every=3,
                        on_check=lambda h: len(h) == 2)
    assert [c.step for c in history] == [3, 6]
    assert sum(history[0].rows_per_device) == 3 * BATCH
    assert 0 <= history[-1].sync_fraction <= 1 and history[-1].samples_per_s > 0
    history.plot(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    with pytest.raises(RuntimeError, match="run has ended"):
        history.center_values()


def test_input_that_cannot_run_is_refused_before_the_loop_and_the_runtime_stays(model, rng):
    step, params, init = model
    x_np, y_np = digits_like(rng)
    with pytest.raises(ValueError, match="seed must be a whole number >= 0"):
        train.run(step, x_np, y_np, BATCH, steps=2, seed=-1)
    with pytest.raises(TypeError, match="declared with shape"):   # a declared width: checked as in a call
        train.run(step, x_np[:, :5], y_np, BATCH, steps=2)
    x, y = pt.matrix("x_free"), pt.vector("y_free")               # a width only the graph knows
    w = pytensor.shared(np.zeros(6), name="w_free")
    free = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd,
                                     learning_rate=0.1)
    with pytest.raises(ValueError, match=r"cannot run on the data given \(x_free \(203, 5\)"):
        train.run(free, x_np[:, :5], y_np * 1.0, BATCH, steps=2)     # one feature short of w
    assert session.active() is not None
    train.run(free, x_np, y_np * 1.0, BATCH, steps=2)
    reset(params, init, step)
    train.run(step, x_np, y_np, BATCH, steps=2)


@pytest.mark.slow
def test_average_with_state_keeps_adams_step_count_whole_on_every_device(synk2, rng):
    """Average(state=True) averages Adam's int64 step count weighted by uneven rows (2 and 1 of 3):
    the count stays the number of steps on every device (a weighted sum of equal counts is the
    count give or take a rounding error, which a cast to int64 would truncate)."""
    x_np, y_np = digits_like(rng)
    X, y, loss, params, _ = mlp(seed=3)
    step = train.make_train_function(loss, params, X, y, updates.adam, learning_rate=0.01)
    synk.distribute()
    train.run(step, x_np, y_np, 3, steps=7, sync=sync.Average(every=1, state=True))
    counts = [v for v in step.optimizer_state if np.dtype(v.type.dtype).kind in "iu"]
    assert counts, step.optimizer_state
    for v in counts:
        assert [int(synk.get_value(rank, v)) for rank in range(N_PARALLEL)] == [7] * N_PARALLEL
