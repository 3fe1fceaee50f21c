"""Collectives, training and loops on 1 and 3 devices (the rest of the suite runs on 2).

Three processes on two cores are enough for correctness. Every result is compared with numpy
or with one process.
"""

import numpy as np
import pytensor
import pytest
from helpers import close
from test_extensions import mlp
from test_loops import check_diloco, global_batches

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[(1, "shm"), pytest.param((1, "jax"), marks=pytest.mark.slow),
                                        pytest.param((3, "shm"), marks=pytest.mark.slow), (3, "jax")],
                ids=lambda p: f"{p[0]}dev-{p[1]}")
def runtime(request):
    n, kind = request.param
    if session.active() is not None:
        synk.close()
    synk.fork(n, collectives=kind)
    yield session.current()
    synk.close()


@pytest.mark.slow
def test_every_collective_equals_numpy(runtime):
    n = runtime.n_parallel
    w = pytensor.shared(np.zeros((2, 3)), name="w_counts")
    v = pytensor.shared(np.zeros(4, dtype="float32"), name="v_counts")
    synk.function([], updates=[(w, w * 1.0), (v, v * 1.0)])
    synk.distribute()
    per_rank = [np.arange(6.0).reshape(2, 3) + 10 * r for r in range(n)]
    for r in range(n):
        synk.set_value(r, [w, v], [per_rank[r], np.full(4, r + 1, "float32")])
    for op, reduce in [("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min),
                       ("prod", np.prod)]:
        close(synk.reduce(w, op=op, in_place=False), reduce(per_rank, axis=0))
    close(synk.gather(w), np.stack(per_rank))
    synk.all_reduce([w, v], op="avg")
    for r in range(n):
        close(synk.get_value(r, w), np.mean(per_rank, axis=0))
        close(synk.get_value(r, v), np.full(4, (n + 1) / 2, "float32"))
    synk.reduce(w, op="sum")                          # into the master, in place
    close(w.get_value(), n * np.mean(per_rank, axis=0))
    synk.broadcast(w, np.ones((2, 3)))
    for r in range(n):
        close(synk.get_value(r, w), np.ones((2, 3)))
    whole = np.arange(15.0).reshape(5, 3)
    synk.scatter(w, whole)
    bounds = [(5 * r) // n for r in range(n + 1)]
    for r in range(n):
        close(synk.get_value(r, w), whole[bounds[r]:bounds[r + 1]])
    synk.all_gather(w)
    for r in range(n):
        close(synk.get_value(r, w), whole)


@pytest.mark.slow
def test_training_and_every_sync_rule(runtime, rng):
    if runtime.comm_kind == "jax":
        pytest.skip("the loop's collectives on the JAX runtime: test_loops")
    n = runtime.n_parallel
    x_np, y_np = rng.normal(size=(64, 6)), rng.integers(0, 3, size=64)
    batch = 15                                        # 5 steps an epoch, the last of 4 rows

    def model(seed=7):
        X, y, loss, params, _ = mlp(seed)
        return X, y, loss, params
    X, y, loss, params = model()
    driven = train.make_train_function(loss, params, X, y, updates.momentum, learning_rate=0.1)
    X1, y1, loss1, params1 = model()
    single = train.make_single_process_train_function(loss1, params1, X1, y1, updates.momentum,
                                                      learning_rate=0.1)
    looped = {}
    for rule in [sync.AllReduce(), sync.Average(every=2), sync.EASGD(0.5, every=2),
                 sync.EASGD(0.5, every=2, asynchronous=True), sync.Downpour(every=2),
                 sync.RateLimited(every_n_batches=2, max_rate=1.0)]:
        Xr, yr, lossr, paramsr = model()
        looped[repr(rule)] = (rule, train.make_train_function(
            lossr, paramsr, Xr, yr, updates.momentum, learning_rate=0.1), paramsr)
    synk.distribute()
    x_d, y_d = synk.data(x_np), synk.data(y_np)
    for rows in global_batches(64, batch, epochs=2):
        close(driven(x_d, y_d, batch=rows), single(x_np[rows], y_np[rows]), rtol=1e-10)
    for ours, theirs in zip(params, params1):
        close(ours.get_value(), theirs.get_value(), rtol=1e-10, atol=1e-12)
    for name, (rule, step, ps) in looped.items():
        history = train.run(step, x_d, y_d, batch, epochs=2, sync=rule)
        assert history[-1].step == 10 and sum(history[-1].rows_per_device) == 64, name
        finals = [[np.asarray(a) for a in synk.get_value(r, ps)] for r in range(n)]
        for r in range(1, n):                        # every device holds the same final parameters
            for a, b in zip(finals[r], finals[0]):
                close(a, b, rtol=0, atol=0)
        if name == "AllReduce()" or n == 1 and isinstance(rule, (sync.Average, sync.Downpour)):
            # synchronous SGD is the one-process run; on one device averaging and pushing too
            for a, b in zip(finals[0], params1):
                close(a, b.get_value(), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_diloco_takes_its_outer_steps_exactly(runtime, rng):
    if runtime.comm_kind == "jax":
        pytest.skip("the loop's collectives on the JAX runtime: test_loops")
    check_diloco(runtime.n_parallel, rng)


def test_an_error_while_computing_keeps_every_variable(runtime):
    from helpers import check_an_error_keeps_every_variable
    check_an_error_keeps_every_variable(runtime.n_parallel, runtime.n_parallel - 1)
