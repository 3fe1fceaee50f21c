"""Compile time of a ResNet training step: synkhronos (2 devices) against plain PyTensor (JAX mode).

    python -m bench.compile_time SYSTEM      (SYSTEM: synk or pytensor)

Prints one JSON line: the wall time of the first three steps (the first one compiles).
The model is demos/resnet_synthetic.py's (pytensor-ml ResNet blocks, Adam), 16 rows per device.
"""

import os
import sys
import time

import numpy as np

from bench.common import ROOT, emit

sys.path.insert(0, os.path.join(ROOT, "demos"))

PER_DEVICE = 16


def _steps(step, n=3):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def synk_steps():
    from resnet_synthetic import build, synthetic_images

    import synkhronos as synk
    from synkhronos.extensions import train, updates
    n = synk.fork(2)
    X, Y = synthetic_images(256, 8, 4, seed=0)
    make_graph, params = build(8, 4, 8)
    x, y, loss, _ = make_graph(None)
    xd, yd = synk.data(X), synk.data(Y)
    t = time.perf_counter()
    step = train.make_train_function(loss, params, x, y, updates.adam, learning_rate=3e-3)
    synk.distribute()
    synk.broadcast(params)
    build_time = time.perf_counter() - t
    batches = iter(np.arange(256).reshape(-1, PER_DEVICE * n))
    times = _steps(lambda: step(xd, yd, batch=next(batches)))
    times[0] += build_time                    # compiled in synk.function, distribute and the first call
    synk.close()
    return times


def pytensor_steps():
    import pytensor
    from resnet_synthetic import build, synthetic_images

    from synkhronos.extensions import updates
    X, Y = synthetic_images(256, 8, 4, seed=0)
    make_graph, params = build(8, 4, 8)
    rows = 2 * PER_DEVICE
    x, y, loss, _ = make_graph(rows)         # plain PyTensor's JAX mode needs the static batch
    grad_updates, param_updates, _ = updates.adam(loss, params, learning_rate=3e-3)
    t = time.perf_counter()
    f_grad = pytensor.function([x, y], loss, updates=grad_updates, mode="JAX")
    f_upd = pytensor.function([], [], updates=param_updates, mode="JAX")
    build_time = time.perf_counter() - t
    batches = iter(np.arange(256).reshape(-1, rows))

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
    system = sys.argv[1]
    times = synk_steps() if system == "synk" else pytensor_steps()
    emit({"system": system, "steps_s": times})
