"""Checkpoint cost: ``synk.checkpoint.save`` of the benchmark MLP's training state against
``numpy.savez`` of the same arrays. Runs in the bench process with a 2-device runtime of its own."""

import os
import tempfile
import time

import numpy as np

from bench.common import spread
from bench.mlp import SIZES, pytensor_graph


def measure(rounds=7):
    """Seconds the training is blocked per save, synkhronos and numpy side by side (medians)."""
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    synk.fork(2)
    try:
        x, y, loss, params = pytensor_graph(SIZES)
        step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.01)
        synk.distribute()
        variables = step.state_variables
        n_values = sum(np.size(v.get_value(borrow=True)) for v in variables)
        synk_times, numpy_times = [], []
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as directory:
            path = os.path.join(directory, "ckpt.safetensors")
            for _ in range(rounds + 1):          # the first round warms both up
                start = time.perf_counter()
                synk.checkpoint.save(path, variables, step=1)
                synk_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                arrays = {f"v{i}": np.asarray(v.get_value()) for i, v in enumerate(variables)}
                with open(os.path.join(directory, "plain.npz"), "wb") as fh:
                    np.savez(fh, **arrays)
                    fh.flush()
                    os.fsync(fh.fileno())
                numpy_times.append(time.perf_counter() - start)
        synk_times, numpy_times = synk_times[1:], numpy_times[1:]
        return dict(values=n_values, bytes=n_values * 4, rounds=rounds, synk=float(np.median(synk_times)),
                    numpy=float(np.median(numpy_times)),
                    ratio=float(np.median(np.array(synk_times) / np.array(numpy_times))),
                    ratios=list(np.array(synk_times) / np.array(numpy_times)))
    finally:
        synk.close()


def section(r):
    """Section 7 of RESULTS.md."""
    return ["## 7. Checkpoints: saving the benchmark MLP's training state", "",
            f"Parameters and momentum of the MLP {'-'.join(map(str, SIZES))}: {r['values'] / 1e6:.1f} M "
            f"float32 values ({r['bytes'] / 2**20:.0f} MB), 2 devices.", "",
            "| `synk.checkpoint.save` (ms) | `numpy.savez` of the master's arrays, fsynced (ms) | ratio | "
            "spread over rounds |",
            "|---|---|---|---|",
            f"| {1000 * r['synk']:.0f} | {1000 * r['numpy']:.0f} | {r['ratio']:.2f}× | "
            f"{spread(r.get('ratios', []), unit='×')} |", "",
            f"{r['rounds']} alternating rounds after a warm-up round; both block training for the whole "
            "save (synkhronos's reads every device's values, writes safetensors beside the old file, "
            "fsyncs and renames).", ""]
