"""A steady training step is one compiled program, a device loop one per block: results unchanged.

These tests run the accelerator's code on the CPU: ``SYNK_HOST_FACES=0`` keeps
every value a device array, as on a GPU. They count the programs a steady step
launches (JAX's profiler) with ``jax.transfer_guard("disallow")`` on, so any
implicit host-device transfer raises, and they compare every result with one
process (``make_single_process_train_function``) or with the master-driven loop.
"""

import jax
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import RaiseIfNegative, run_script

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session
from synkhronos.tracing.launches import count_launches

pytestmark = pytest.mark.timeout(240)

#: the name PyTensor's JAX linker gives every function's jitted graph
PYTENSOR_GRAPH = "jax_funcified_fgraph"


@pytest.fixture
def device_arrays(monkeypatch):
    """A runtime started with ``SYNK_HOST_FACES=0``: ``fork_with(n, collectives)``."""
    monkeypatch.setenv("SYNK_HOST_FACES", "0")

    def fork_with(n, collectives="shm"):
        if session.active() is not None:
            synk.close()
        synk.fork(n, collectives=collectives)
    yield fork_with
    synk.close()


def _model(seed=0, width=6):
    """A small tanh MLP with momentum, its step on host data and on device data, and the data."""
    rng = np.random.default_rng(seed)
    x, y = pt.matrix("x"), pt.vector("y")
    w1 = pytensor.shared(rng.normal(size=(5, width)) * 0.5, name="w1")
    w2 = pytensor.shared(rng.normal(size=width) * 0.5, name="w2")
    loss = ((pt.tanh(x @ w1) @ w2 - y) ** 2).mean()
    step = train.make_train_function(loss, [w1, w2], x, y, updates.momentum, learning_rate=0.05)
    x_sh = pytensor.shared(np.zeros((1, 5)), name="x_sh")
    y_sh = pytensor.shared(np.zeros(1), name="y_sh")
    device_step = train.make_device_train_function(loss, [w1, w2], x, y, x_sh, y_sh, updates.momentum,
                                                   learning_rate=0.05)
    X, Y = rng.random((960, 5)), rng.random(960)
    return dict(step=step, device_step=device_step, params=[w1, w2], x_sh=x_sh, y_sh=y_sh, X=X, Y=Y,
                loss=loss, x=x, y=y)


def _launched(fn):
    with count_launches() as launches, jax.transfer_guard("disallow"):
        out = fn()
    return dict(launches), out


SLOW = pytest.mark.slow

#: (devices, collectives, what one steady step launches on the master)
STEADY = [(1, "shm", {"synk_step": 1}), (2, "jax", {"synk_step": 1}),
          # the shared-memory collective reduces in host memory, between the two programs
          pytest.param(2, "shm", {PYTENSOR_GRAPH: 2}, marks=SLOW)]


@pytest.mark.parametrize("n, collectives, expected", [STEADY[0], pytest.param(*STEADY[1], marks=SLOW), STEADY[2]])
def test_a_steady_master_loop_step_launches_one_program(device_arrays, n, collectives, expected):
    device_arrays(n, collectives)
    m = _model()
    x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
    batches = [np.random.default_rng(i).permutation(960)[:240] for i in range(4)]
    for idx in batches[:3]:
        m["step"](x_dat, y_dat, batch=idx)
    launches, loss = _launched(lambda: m["step"](x_dat, y_dat, batch=batches[3]))
    assert launches == expected
    assert isinstance(m["params"][0].get_value(borrow=True), jax.Array)    # no host faces
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("n, collectives, expected", STEADY)
def test_a_steady_step_on_device_data_launches_one_program(device_arrays, n, collectives, expected):
    device_arrays(n, collectives)
    m = _model()
    synk.scatter([m["x_sh"], m["y_sh"]], [m["X"], m["Y"]])
    per = 960 // n
    batches = [[np.random.default_rng(10 * i + r).permutation(per)[:40] for r in range(n)]
               for i in range(4)]
    for batch_s in batches[:3]:
        m["device_step"](batch_s=batch_s)
    launches, _ = _launched(lambda: m["device_step"](batch_s=batches[3]))
    # unfused, the device rows are gathered by one program of their own per variable
    assert launches == (expected if PYTENSOR_GRAPH not in expected else
                        {PYTENSOR_GRAPH: 2, "synk_take": 2})


@pytest.mark.parametrize("n, collectives, expected", [(1, "shm", {"synk_steps": 1}),
                                                      pytest.param(2, "jax", {"synk_steps": 1}, marks=SLOW),
                                                      pytest.param(2, "shm", {PYTENSOR_GRAPH: 16},
                                                                   marks=SLOW)])
def test_a_device_loop_block_is_one_program(device_arrays, n, collectives, expected):
    device_arrays(n, collectives)
    m = _model()
    x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
    train.run(m["step"], x_dat, y_dat, 96, steps=15, check_every=15)       # its programs built
    launches, _ = _launched(lambda: train.run(m["step"], x_dat, y_dat, 96, steps=8, check_every=8))
    assert launches == expected


def _single_process_steps(m, batches, scalars=()):
    """The parameters and losses of one process stepping on ``batches`` of (X, Y)."""
    for p, v in zip(m["params"], m["start"]):
        p.set_value(v.copy())
    # (PyTensor's C backend: a JAX-mode function would make a backend, and the next fork() refuses)
    reference = train.make_single_process_train_function(m["loss"], m["params"], m["x"], m["y"],
                                                         updates.momentum, learning_rate=0.05,
                                                         mode="FAST_COMPILE")
    losses = [float(reference(m["X"][idx], m["Y"][idx])) for idx in batches]
    return [p.get_value() for p in m["params"]], losses


def _equal_to_one_process(m, batches, losses):
    """The runtime's parameters and ``losses`` equal one process's on ``batches`` (the runtime is
    closed first: the reference runs in this process)."""
    got = [np.asarray(p.get_value()) for p in m["params"]]
    synk.close()
    want, want_losses = _single_process_steps(m, batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("n, collectives", [(1, "shm"), pytest.param(2, "jax", marks=SLOW),
                                            pytest.param(3, "jax", marks=SLOW),
                                            pytest.param(3, "shm", marks=SLOW)])
def test_fused_steps_equal_one_process(device_arrays, n, collectives):
    """Even batches (fused on every rank) and an uneven one (three programs) in one run."""
    device_arrays(n, collectives)
    m = _model(seed=n)
    m["start"] = [p.get_value().copy() for p in m["params"]]
    x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
    rng = np.random.default_rng(5)
    sizes = [240] * 6 + [241] + [240] * 3
    batches = [rng.permutation(960)[:k] for k in sizes]
    losses = [float(m["step"](x_dat, y_dat, batch=idx)) for idx in batches]
    _equal_to_one_process(m, batches, losses)


@pytest.mark.parametrize("n, collectives", [(1, "shm"), pytest.param(2, "jax", marks=SLOW),
                                            pytest.param(3, "jax", marks=SLOW)])
def test_fused_steps_on_device_data_equal_one_process(device_arrays, n, collectives):
    device_arrays(n, collectives)
    m = _model(seed=10 + n)
    m["start"] = [p.get_value().copy() for p in m["params"]]
    synk.scatter([m["x_sh"], m["y_sh"]], [m["X"], m["Y"]])
    per = 960 // n
    rng = np.random.default_rng(7)
    per_rank = [[rng.permutation(per)[:60] for _ in range(n)] for _ in range(8)]
    losses = [float(m["device_step"](batch_s=b)) for b in per_rank]
    batches = [np.concatenate([r * per + b for r, b in enumerate(bs)]) for bs in per_rank]
    _equal_to_one_process(m, batches, losses)


@pytest.mark.parametrize("n, collectives", [pytest.param(1, "shm", marks=SLOW), pytest.param(2, "jax", marks=SLOW),
                                            pytest.param(3, "jax", marks=SLOW)])
def test_run_in_blocks_equals_the_master_loop(device_arrays, n, collectives):
    """AllReduce in blocks of steps (each epoch's last, shorter step apart) against the master
    loop over the same orders, from the same start."""
    device_arrays(n, collectives)
    m = _model(seed=20 + n)
    state = m["params"] + m["step"].optimizer_state
    start = [np.asarray(v.get_value()).copy() for v in state]
    x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
    history = train.run(m["step"], x_dat, y_dat, 150, epochs=3, check_every=5)
    in_blocks = [np.asarray(p.get_value()) for p in m["params"]]
    synk.broadcast(state, start)
    losses = []
    for epoch in range(3):
        order = train.epoch_order(960, epoch, 0)
        losses += [float(m["step"](x_dat, y_dat, batch=order[i * 150:(i + 1) * 150]))
                   for i in range(train.steps_per_epoch(960, 150))]
    for got, want in zip(in_blocks, [np.asarray(p.get_value()) for p in m["params"]]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert history[0].loss == pytest.approx(np.mean(losses[:5]), rel=1e-9)


@SLOW
@pytest.mark.parametrize("rule", [sync.Average(every=3), sync.DiLoCo(every=3), sync.EASGD(every=3)])
def test_rules_in_blocks_equal_rules_step_by_step(device_arrays, rule):
    """The same run on the JAX runtime (blocks up to each sync point) and on shared memory
    (step by step): the same parameters."""
    results = []
    for collectives in ("jax", "shm"):
        device_arrays(2, collectives)
        m = _model(seed=3)
        x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
        train.run(m["step"], x_dat, y_dat, 96, steps=17, sync=rule, check_every=17)
        results.append([np.asarray(p.get_value()) for p in m["params"]])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


# ------------------------------------------------------------------------------------------------
# Found by the attack pass on the fused path
# ------------------------------------------------------------------------------------------------

_INTERRUPTED = """
    import os, subprocess, sys, numpy as np, pytensor, pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    n, collectives, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    synk.fork(n, collectives=collectives)
    rng = np.random.default_rng(0)
    x, y = pt.matrix("x"), pt.vector("y")
    w1 = pytensor.shared(rng.normal(size=(50, 3000)) * 0.05, name="w1")     # > 1 MiB: donated
    w2 = pytensor.shared(rng.normal(size=3000) * 0.05, name="w2")
    loss = ((pt.tanh(x @ w1) @ w2 - y) ** 2).mean()
    step = train.make_train_function(loss, [w1, w2], x, y, updates.momentum, learning_rate=0.002)
    X, Y = rng.random((1200, 50)), rng.random(1200)
    xd, yd = synk.data(X), synk.data(Y)
    for _ in range(3):
        step(xd, yd, batch=rng.permutation(1200)[:240])
    subprocess.Popen(["sh", "-c", f"sleep 2; kill -INT {os.getpid()}"])      # the user's Ctrl-C
    try:
        if what == "steps":
            while True:
                step(xd, yd, batch=rng.permutation(1200)[:240])
        train.run(step, xd, yd, 240, epochs=100000)
    except KeyboardInterrupt:
        print("interrupted")
    print("readable", w1.get_value().shape, bool(np.isfinite(w2.get_value()).all()))
    synk.close()
    print("forks again", synk.fork(n, collectives=collectives))
    synk.close()
"""


@SLOW
@pytest.mark.parametrize("n, collectives, what", [(1, "shm", "steps"), (1, "shm", "run"),
                                                  (2, "jax", "run"), (2, "jax", "steps")])
def test_ctrl_c_in_fused_steps_keeps_every_value(n, collectives, what):
    """A Ctrl-C that lands between a donating program's dispatch and its results' store is held
    until they are stored: every variable stays readable, and the process can fork again."""
    out = run_script(_INTERRUPTED, args=(str(n), collectives, what), timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "interrupted" in out.stdout and "readable (50, 3000) True" in out.stdout
    assert f"forks again {n}" in out.stdout


@SLOW
@pytest.mark.parametrize("n, collectives", [(1, "shm"), (2, "jax")])
def test_a_block_that_raises_keeps_every_value(device_arrays, n, collectives):
    """A host callback that raises inside train.run (which takes such steps one at a time, never in
    blocks): the runtime ends as for any failed loop, and the values are still readable (a step
    that runs host code donates nothing)."""
    device_arrays(n, collectives)
    rng = np.random.default_rng(0)
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(rng.normal(size=(5, 3000)) * 0.05, name="w_raises")
    loss = ((RaiseIfNegative()(x) @ w).sum(1) - y).mean() ** 2
    step = train.make_train_function(loss, [w], x, y, updates.momentum, learning_rate=0.01)
    X, Y = rng.random((960, 5)), rng.random(960)
    X[700, 0] = -1.0
    with pytest.raises(synk.WorkerError, match="negative"):
        train.run(step, synk.data(X), synk.data(Y), 96, epochs=3, shuffle=False)
    assert np.asarray(w.get_value()).shape == (5, 3000)
    synk.close()
    synk.fork(n, collectives=collectives)


@pytest.mark.slow
def test_a_shape_set_by_the_users_own_function_is_asked_again(device_arrays):
    """A sliceable shared shrunk by the user's own JAX-mode function: batch_s past its new end is
    refused (the kept shapes were forgotten), not read from its last row."""
    device_arrays(2, "jax")
    m = _model()
    synk.scatter([m["x_sh"], m["y_sh"]], [m["X"], m["Y"]])
    for i in range(3):
        m["device_step"](batch_s=[np.random.default_rng(i).permutation(480)[:40] for _ in range(2)])
    shrink = pytensor.function([], [], updates=[(m["x_sh"], m["x_sh"][:100]),
                                                (m["y_sh"], m["y_sh"][:100])], mode="JAX")
    shrink()                                    # the master's copy: 100 rows
    with pytest.raises(IndexError, match="out of range"):
        m["device_step"](batch_s=[np.full(40, 399), np.arange(40)])


@SLOW
def test_a_rule_overriding_after_update_below_steps_to_sync_is_asked_every_step(device_arrays):
    """A subclass of Average that clips the parameters after every step inherits Average's
    steps_to_sync, which cannot know that: in blocks it trains as step by step."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ClippedAverage(sync.Average):
        def after_update(self, state, loop, rows, batch_rows):
            loop.set_values(loop.params, [np.clip(v, -0.3, 0.3) for v in loop.param_values()])
            return super().after_update(state, loop, rows, batch_rows)
    results = []
    for collectives in ("jax", "shm"):
        device_arrays(2, collectives)
        m = _model(seed=4)
        train.run(m["step"], synk.data(m["X"]), synk.data(m["Y"]), 96, steps=12,
                  sync=ClippedAverage(every=3), check_every=12)
        results.append([np.asarray(p.get_value()) for p in m["params"]])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def _wide_model(seed=0, features=1200):
    """Linear regression whose step's rows are megabytes (what goes up from pinned buffers)."""
    rng = np.random.default_rng(seed)
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(rng.normal(size=features) * 0.01, name="w")
    loss = ((x @ w - y) ** 2).mean()
    step = train.make_train_function(loss, [w], x, y, updates.momentum, learning_rate=0.05)
    return dict(step=step, params=[w], loss=loss, x=x, y=y, X=rng.random((960, features)),
                Y=rng.random(960), start=[w.get_value().copy()])


@pytest.mark.parametrize("n, collectives", [(1, "shm"), pytest.param(2, "jax", marks=SLOW)])
def test_large_rows_go_up_from_pinned_buffers_and_equal_one_process(device_arrays, n, collectives):
    """Steps whose rows (2.3 MB a rank) are gathered into pinned buffers, reused while earlier
    steps may still be in flight (no loss is read until the end), equal one process."""
    from synkhronos.platform.pinned import pinned_buffers
    device_arrays(n, collectives)
    m = _wide_model(seed=n)
    x_dat, y_dat = synk.data(m["X"]), synk.data(m["Y"])
    rng = np.random.default_rng(9)
    batches = [rng.permutation(960)[:240 * n] for _ in range(12)]
    losses = [m["step"](x_dat, y_dat, batch=idx) for idx in batches]
    assert pinned_buffers() is not None and pinned_buffers().kept_bytes > 0
    _equal_to_one_process(m, batches, [float(v) for v in losses])


def test_a_pinned_buffer_is_written_again_only_when_free(device_arrays):
    """A buffer held by its face, or whose transfer is in flight, is never handed out again; what
    was sent keeps its values when the buffer is rewritten."""
    from synkhronos.platform.pinned import SLOTS_PER_SHAPE, PinnedBuffers
    device_arrays(1)            # (the JAX backend of the runtime; one of this test's own would stay)
    buffers = PinnedBuffers(jax.devices()[0])
    held = buffers.empty((512, 1024), "float32")
    held[:] = 1.0
    sent = buffers.send(held)
    again = buffers.empty((512, 1024), "float32")
    assert again.ctypes.data != held.ctypes.data            # the first face is still held
    del held, again
    reused = buffers.empty((512, 1024), "float32")
    reused[:] = 2.0
    assert float(sent.sum()) == 512 * 1024                   # the first transfer kept its values
    faces = [reused] + [buffers.empty((512, 1024), "float32") for _ in range(SLOTS_PER_SHAPE)]
    assert faces[-1] is None                                 # all held: the caller goes the usual way
    assert buffers.empty((16, 16), "float32") is None        # too small to pay off
    assert buffers.send(np.zeros((512, 1024), "float32")) is None


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=SLOW)])
def test_a_value_the_scripts_own_jax_function_leaves_reaches_every_device(device_arrays, n):
    """Where values stay device arrays (a GPU), the user's own functions compile with mode="JAX"
    and leave new JAX arrays in the variables they update (a learning-rate decay): a change of the
    one script, every device's at the next call, as a ``set_value`` is; synkhronos's own results
    (a step's update) stay as they are."""
    device_arrays(n)
    m = _model()
    lr = pytensor.shared(np.float64(0.5), name="lr_jax")
    f = synk.function([m["x"]], ((m["x"].sum(1) * lr).sum(), "sum"))
    decay = pytensor.function([], [], updates=[(lr, lr * 0.5)], mode="JAX")
    X = m["X"][:8]
    for step in range(3):
        m["step"](m["X"][:32], m["Y"][:32])             # a step's update: every device's already
        decay()
        assert float(f(X)) == pytest.approx(X.sum() * 0.5 ** (step + 2), rel=1e-12)
        assert [float(v) for v in synk.gather(lr)] == [0.5 ** (step + 2)] * n
        gathered = synk.gather(m["params"][0])
        np.testing.assert_array_equal(gathered[0], gathered[-1])


@pytest.mark.slow
def test_per_device_values_stay_per_device_over_calls_made_while_a_thread_runs(device_arrays):
    """While another thread runs, the values are numpy faces (a reader may hold them); after, device
    arrays again. Neither change is the script's: each device keeps its own updates."""
    import threading
    device_arrays(2)
    w = pytensor.shared(np.zeros(3), name="w_thread_per_device")
    x = pt.dvector("x")
    f = synk.function([x], x.sum(), updates=[(w, w + x.sum())], local_updates=True)
    X = synk.data(np.arange(4.0))        # rows 0, 1 on device 0 and 2, 3 on device 1: 1 and 5 a call

    def per_device():
        return [float(synk.get_value(rank, w)[0]) for rank in (0, 1)]
    f(X)
    done = threading.Event()
    waiting = threading.Thread(target=done.wait)
    waiting.start()
    f(X)
    done.set()
    waiting.join()
    f(X)
    assert per_device() == [3.0, 15.0]
    caller = threading.Thread(target=lambda: f(X))
    caller.start()
    caller.join()
    f(X)
    assert per_device() == [5.0, 25.0]
