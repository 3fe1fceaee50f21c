"""Baseline (a): the MLP step in one process, plain PyTensor (JAX backend), full batch, all cores.

    python -m bench.single_jax BATCHES STEPS [--one-core] [--synk-mode]

``--one-core`` binds the process to its first core before JAX starts (XLA then
makes a one-thread pool): the per-core speed of the step's compiled code.
``--synk-mode`` compiles with synkhronos's CPU rewrite on (PyTensor's JAX mode
plus :mod:`synkhronos.compile.rewrites`) instead of plain "JAX",
and allocates and limits numpy's BLAS as a synkhronos process does
(:func:`synkhronos.platform.cpu_tuning.keep_freed_memory_for_reuse`,
:func:`synkhronos.platform.cpu_blas.limit_blas_threads`).
"""

import os
import sys
import time

if "--one-core" in sys.argv:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])

import numpy as np
import pytensor
from pytensor_ml import optim

from bench.common import emit
from bench.mlp import LR, MOMENTUM, data, pytensor_graph


def main(batches, steps, mode="JAX"):
    x, y, loss, params = pytensor_graph()
    step = pytensor.function([x, y], loss, updates=optim.sgd(LR, momentum=MOMENTUM)(loss, params),
                             mode=mode)
    result = {}
    for b in batches:
        X, Y = data(b)
        for _ in range(3):
            step(X, Y)
        t = time.perf_counter()
        for _ in range(steps):
            out = step(X, Y)
        np.asarray(out)                      # JAX dispatch is asynchronous: wait for the last step
        result[str(b)] = b * steps / (time.perf_counter() - t)
    emit(result)


if __name__ == "__main__":
    if "--synk-mode" in sys.argv:
        from synkhronos.compile.rewrites import compile_mode, set_cpu_rewrite
        from synkhronos.platform.cpu_blas import limit_blas_threads
        from synkhronos.platform.cpu_tuning import keep_freed_memory_for_reuse
        keep_freed_memory_for_reuse()
        limit_blas_threads(len(os.sched_getaffinity(0)))
        set_cpu_rewrite(True)
        mode = compile_mode("cpu")
    else:
        mode = "JAX"
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]), mode)
