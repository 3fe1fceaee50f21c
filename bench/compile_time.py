"""Start-up: the first training steps of a model, synkhronos (2 devices) against plain PyTensor (JAX mode).

    python -m bench.compile_time SYSTEM MODEL CACHE      (SYSTEM: synk or pytensor; MODEL: resnet or cnn)

Prints one JSON line: the wall time of the first three steps (the first one compiles, or loads
from the compile cache at CACHE, a directory: empty for a cold start, filled for a warm one).
``resnet`` is demos/resnet_synthetic.py's model (pytensor-ml ResNet blocks, Adam), ``cnn``
demos/mnist.py's (two convolutions, on the bundled digits); 16 rows per device.
"""

import os
import sys
import tempfile
import time

import numpy as np

from bench.common import ROOT, emit, run_json

sys.path.insert(0, os.path.join(ROOT, "demos"))

PER_DEVICE = 16
DEVICES = 2
MODELS = ("resnet", "cnn")


def measure(rounds, python):
    """Per model and round, each in a fresh process: plain PyTensor's first step into an empty JAX
    cache, synkhronos's into an empty compile cache (cold), then synkhronos's again (warm)."""
    runs = {m: {"pytensor": [], "cold": [], "warm": [], "later": []} for m in MODELS}

    def first_step(system, m, cache):
        result = run_json([python, "-m", "bench.compile_time", system, m, cache])
        return result["steps_s"] if "steps_s" in result else [float("nan")] * 3
    for _ in range(rounds):
        for m in MODELS:
            with tempfile.TemporaryDirectory() as plain, tempfile.TemporaryDirectory() as cache:
                runs[m]["pytensor"].append(first_step("pytensor", m, plain)[0])
                cold = first_step("synk", m, cache)
                runs[m]["cold"].append(cold[0])
                runs[m]["later"].append(cold[2])
                runs[m]["warm"].append(first_step("synk", m, cache)[0])
    return runs


def model(name):
    """(make_graph, params, X, Y): ``make_graph(rows)`` returns (x, y, loss, ...) for ``rows`` rows."""
    if name == "resnet":
        from resnet_synthetic import build, synthetic_images
        X, Y = synthetic_images(256, 8, 4, seed=0)
        make_graph, params = build(8, 4, 8)
        return make_graph, params, X, Y
    from mnist import build_model, load_data
    data = load_data()
    make_graph, params, _ = build_model("cnn", data["side"])
    return make_graph, params, data["x_train"][:256], data["y_train"][:256]


def _steps(step, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def synk_steps(name, cache):
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    n = synk.fork(DEVICES, compile_cache=cache)
    make_graph, params, X, Y = model(name)
    x, y, loss = make_graph(None)[:3]
    xd, yd = synk.data(X), synk.data(Y)
    t = time.perf_counter()
    step = train.make_train_function(loss, params, x, y, updates.adam, learning_rate=3e-3)
    synk.distribute()
    synk.broadcast(params)
    build_time = time.perf_counter() - t
    batches = iter(np.arange(len(X) - len(X) % (PER_DEVICE * n)).reshape(-1, PER_DEVICE * n))
    times = _steps(lambda: step(xd, yd, batch=next(batches)))
    times[0] += build_time                    # compiled in synk.function, distribute and the first call
    synk.close()
    return times


def pytensor_steps(name, cache):
    import pytensor

    from synkhronos.extensions import updates
    from synkhronos.platform.jax_init import use_compile_cache
    use_compile_cache(cache)                  # JAX's cache, set as synkhronos sets it in every process
    make_graph, params, X, Y = model(name)
    rows = DEVICES * PER_DEVICE
    x, y, loss = make_graph(rows)[:3]         # plain PyTensor's JAX mode needs the static batch
    t = time.perf_counter()                   # from the gradient on, as make_train_function does
    grad_updates, param_updates, _ = updates.adam(loss, params, learning_rate=3e-3)
    f_grad = pytensor.function([x, y], loss, updates=grad_updates, mode="JAX")
    f_upd = pytensor.function([], [], updates=param_updates, mode="JAX")
    build_time = time.perf_counter() - t
    batches = iter(np.arange(len(X) - len(X) % rows).reshape(-1, rows))

    def step():
        import jax
        idx = next(batches)
        f_grad(X[idx], Y[idx])
        f_upd()
        jax.block_until_ready([p.get_value(borrow=True) for p in params])   # JAX runs asynchronously
    times = _steps(step)
    times[0] += build_time                    # PyTensor compiles at pytensor.function and first call
    return times


if __name__ == "__main__":
    system, name, cache = sys.argv[1:4]
    times = synk_steps(name, cache) if system == "synk" else pytensor_steps(name, cache)
    emit({"system": system, "model": name, "steps_s": times})
