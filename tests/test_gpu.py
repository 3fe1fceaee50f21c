"""The GPU tier (``make test-gpu``): synkhronos on one GPU, when JAX finds one.

The other tiers pin the CPU (``tests/conftest.py``): they test the CPU path and simulate devices with
processes. This one runs only with ``SYNK_TEST_GPU=1`` (what ``make test-gpu`` sets), on the GPU
JAX finds; without one, every test here is skipped, saying why. Several GPUs between processes (NCCL)
cannot run on a machine with one: see docs/design.md, "What only several GPUs run".
"""

import os
import subprocess
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import source_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu():
    """(True, the GPU's kind) if JAX finds a GPU, else (False, why); asked in a process of its own."""
    if not os.environ.get("SYNK_TEST_GPU"):
        return False, "the GPU tier runs with SYNK_TEST_GPU=1 (make test-gpu); the other tiers pin the CPU"
    code = "import jax; print(jax.devices('gpu')[0].device_kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no GPU"])[-1]
        return False, f"JAX finds no GPU here ({last[:160]})"
    return True, out.stdout.strip().splitlines()[-1]


FOUND, KIND = _gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not FOUND, reason=f"no GPU: {KIND}")]


# The tests in processes of their own come first: while the module's runtime is up, this process
# holds most of the GPU's memory (JAX preallocates it), and a demo beside it could not make its
# cuBLAS handles.


def _demo(*args, timeout=400):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "demos", args[0]), *args[1:]], capture_output=True,
                         text=True, timeout=timeout, env=source_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out


@pytest.mark.parametrize("args", [["--variant", "cpu"], ["--variant", "device"], ["--loop", "device"],
                                  ["--model", "cnn", "--loop", "device", "--epochs", "5"]],
                         ids=["host-data", "device-data", "train.run", "cnn-train.run"])
def test_the_digits_demo_on_one_gpu_reaches_95_percent_quietly(args):
    out = _demo("mnist.py", "--devices", "1", *args)
    accuracy = float(out.stdout.split("test accuracy")[1].split()[0])
    assert accuracy >= (0.9 if "cnn" in args else 0.95), out.stdout[-800:]
    noise = [line for line in out.stderr.splitlines()
             if "Warning" in line or "grpc" in line.lower() or "coordination_service" in line]
    assert not noise, out.stderr[-4000:]


def test_the_resnet_demo_runs_on_one_gpu():
    _demo("resnet_synthetic.py", "--devices", "1", "--epochs", "1", "--train-size", "256")


def test_a_steady_step_moves_nothing_implicitly_and_launches_few_programs():
    """The per-step counts of bench.gpu (eager ops, transfers) on the GPU itself."""
    code = ("import json; from bench.gpu import launch_counts; "
            "print(json.dumps(launch_counts(((784, 256, 10)), 512, 1.0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400,
                         env=source_env())
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    for way, launched in counts.items():
        assert isinstance(launched, dict), (way, launched)        # a transfer guard error is a str


@pytest.fixture(scope="module")
def one_gpu():
    import synkhronos as synk
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(1, platform="gpu")
    yield
    synk.close()


def test_the_readme_example_equals_numpy(one_gpu):
    import synkhronos as synk
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(5), name="w_readme")
    loss = ((x @ w - y) ** 2).mean()
    f_grad = synk.function([x, y], [(loss, "avg"), (pytensor.grad(loss, w), "avg")])
    dw = pt.vector("dw")
    f_upd = synk.function([], bcast_inputs=[dw], updates=[(w, w - 0.1 * dw)])
    rng = np.random.default_rng(0)
    X, Y = rng.random((1001, 5)), rng.random(1001)
    x_dat, y_dat = synk.data(X), synk.data(Y)
    W = np.zeros(5)
    for _ in range(20):
        idx = rng.permutation(1001)[:256]
        loss_val, grad = f_grad(x_dat, y_dat, batch=idx)
        err = X[idx] @ W - Y[idx]
        np.testing.assert_allclose(loss_val, (err ** 2).mean(), rtol=1e-9)
        np.testing.assert_allclose(grad, 2 * X[idx].T @ err / 256, rtol=1e-9, atol=1e-12)
        f_upd(grad)
        W = W - 0.1 * grad
    np.testing.assert_allclose(w.get_value(), W, rtol=1e-9)
    np.testing.assert_allclose(f_grad(x_dat, y_dat, num_slices=4)[0], f_grad.as_pytensor(X, Y)[0], rtol=1e-9)


@pytest.mark.parametrize("num_slices", [1, 3])
def test_every_output_mode_with_slices(one_gpu, num_slices):
    import synkhronos as synk
    x = pt.matrix("x")
    outputs = [(x.sum(), "sum"), (x.mean(), "avg"), (x.max(), "max"), (x.min(), "min"),
               (x.sum(axis=1), "gather"), (x[0].sum(), None)]
    f = synk.function([x], outputs)
    X = np.random.default_rng(1).normal(size=(11, 3))
    got = f(X, num_slices=num_slices)
    want = [X.sum(), X.mean(), X.max(), X.min(), X.sum(axis=1), X[0].sum()]
    for g, w in zip(got[:5], want[:5]):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    assert np.isfinite(got[5])           # the master's own (its first slice's first row)


def test_collectives_on_one_device(one_gpu):
    import synkhronos as synk
    v = pytensor.shared(np.arange(6.0), name="v_collect")
    synk.function([], [(v.sum(), "sum")])
    synk.distribute()
    for op in ("sum", "avg", "max", "min"):
        synk.all_reduce(v, op=op)
        np.testing.assert_allclose(v.get_value(), np.arange(6.0))
    synk.broadcast(v)
    np.testing.assert_allclose(synk.gather(v), [np.arange(6.0)])
    v.set_value(np.ones(6))
    np.testing.assert_allclose(synk.get_value(0, v), np.ones(6))


def test_a_checkpoint_round_trip(one_gpu, tmp_path):
    import synkhronos as synk
    W = pytensor.shared(np.random.default_rng(2).normal(size=(4, 3)), name="W_ckpt")
    synk.function([], [(W.sum(), "sum")])
    path = str(tmp_path / "ckpt.safetensors")
    synk.checkpoint.save(path, [W], step=7)
    saved = W.get_value().copy()
    W.set_value(np.zeros((4, 3)))
    assert synk.checkpoint.restore(path, [W])["step"] == 7
    np.testing.assert_array_equal(W.get_value(), saved)
    np.testing.assert_array_equal(synk.get_value(0, W), saved)


def test_as_pytensor_after_training(one_gpu):
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(3), name="w_after")
    loss = ((x @ w - y) ** 2).mean()
    step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
    X = np.random.default_rng(3).normal(size=(64, 3))
    Y = X @ np.array([1.0, -2.0, 0.5])
    for _ in range(50):
        step(X, Y)
    f = synk.function([x, y], (loss, "avg"))
    np.testing.assert_allclose(f(X, Y), f.as_pytensor(X, Y), rtol=1e-9)
    assert float(f(X, Y)) < 1e-3
