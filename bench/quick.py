"""The headline ratios in a few minutes: ``make bench-quick`` (``python -m bench.quick``).

Before and after a change to a hot path (a call, a collective, a step, a
save), run this and compare: it measures, side by side in one run, what
``make bench`` measures at length in its sections 1, 3, 6, 7, 11 and 13, and
prints each ratio beside its goal. It is a benchmark, not a test: nothing
fails when a goal is missed. ``make bench`` writes the full tables.
"""

import os
import sys
import time

import numpy as np

from bench.common import cpu_model, python, run_json, spread

#: what each headline compares, and its goal
GOALS = {
    "tiny call": ("synkhronos / direct compiled call", "≤ 2×"),
    "empty call": ("synkhronos / direct compiled call", "≤ 2×"),
    "tiny call, 1 device (the floor)": ("the master's own path, no peer / direct call", "≤ 2×"),
    "MLP training, batch 1024, vs one process": ("samples/s, 2 devices / 1 process", "≥ 0.9×"),
    "MLP training, batch 1024, vs JAX shard_map": ("samples/s, 2 devices / 2 host devices", "≥ 1×"),
    "train.run vs master-driven loop": ("steps/s, digits MLP, batch 128", "≥ 3×"),
    "checkpoint save vs numpy.savez": ("time", "≤ 1.3×"),
    "small model step vs plain PyTensor": ("time, SdA finetuning, batch 20", "≤ 3×"),
}


def _met(goal, ratio):
    if ratio is None or not np.isfinite(ratio):
        return "n/a"
    bound = float(goal.split()[1].rstrip("×"))
    return "met" if (ratio <= bound if goal.startswith("≤") else ratio >= bound) else "not met"


def in_one_runtime():
    """Sections 1, 3 (synkhronos's side), 6 and 7 in one 2-device runtime."""
    import synkhronos as synk
    from bench import checkpoint_bench, loops, synk_bench
    out = {}
    synk.fork(2)
    try:
        rows = synk_bench.call_overhead(rounds=20, calls=40)
        out["tiny call"] = [r for r in rows[0]["ratios"]]
        out["empty call"] = [r for r in rows[1]["ratios"]]
        out["synk_samples"] = [synk_bench.training([1024], 8)["1024"] for _ in range(3)]
        out["train.run vs master-driven loop"] = _loop_ratios(synk, loops, rounds=2)
    finally:
        synk.close()
    saving = checkpoint_bench.measure(3)
    out["checkpoint save vs numpy.savez"] = saving["ratios"]
    return out


def _loop_ratios(synk, loops, rounds):
    """Per round, ``train.run``'s steps/s over the master-driven loop's on the digits MLP."""
    d = loops._digits()
    step, _, _, _, _ = loops._trainer(loops.DIGITS_SIZES, 0.05)
    x_d, y_d = synk.data(d["x_train"]), synk.data(d["y_train"])
    batch = loops.DIGITS_BATCH
    loops._device_loop(step, x_d, y_d, batch, 50), loops._master_loop(step, x_d, y_d, batch, 50)
    ratios = []
    for _ in range(rounds):
        device = 600 / loops._device_loop(step, x_d, y_d, batch, 600)
        master = 300 / loops._master_loop(step, x_d, y_d, batch, 300)
        ratios.append(device / master)
    return ratios


def baselines():
    """Section 3's baselines, each in a process of its own: one process, and JAX's shard_map."""
    single = [run_json([python(), "-m", "bench.single_jax", "1024", "8"]).get("1024") for _ in range(3)]
    shard = [run_json([python(), "-m", "bench.jax_shardmap", "1024", "8"],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}).get("1024")
             for _ in range(3)]
    return single, shard


def small_model():
    """Section 11 in two rounds: the master-driven step over the faster plain PyTensor step."""
    from bench import small_model as sm
    r = sm.measure(rounds=2, seconds=1.5)
    return r["ratios"]["synk"]


def call_floor():
    """Section 13's tiny call on one device, in two rounds: the master's path without a peer."""
    from bench import call_floor as cf
    return [row[2] for row in cf.measure(rounds=2, inner=6)["tiny"][1]]


def _ratios(numerators, denominators):
    return [a / b for a, b in zip(numerators, denominators) if isinstance(a, float) and isinstance(b, float)]


def main():
    start = time.perf_counter()
    single, shard = baselines()
    results = in_one_runtime()
    samples = results.pop("synk_samples")
    results["MLP training, batch 1024, vs one process"] = _ratios(samples, single)
    results["MLP training, batch 1024, vs JAX shard_map"] = _ratios(samples, shard)
    results["small model step vs plain PyTensor"] = small_model()
    results["tiny call, 1 device (the floor)"] = call_floor()
    print(f"bench-quick on {cpu_model()}, {os.cpu_count()} cores ({time.perf_counter() - start:.0f} s)\n")
    print("| headline | measures | ratio (median) | spread | goal | |")
    print("|---|---|---|---|---|---|")
    for name, (what, goal) in GOALS.items():
        values = [v for v in results.get(name, []) if v is not None and np.isfinite(v)]
        ratio = float(np.median(values)) if values else None
        shown = "n/a" if ratio is None else f"{ratio:.2f}×"
        print(f"| {name} | {what} | {shown} | {spread(values, unit='×')} | {goal} | {_met(goal, ratio)} |")
    print("\nmake bench measures each at length and writes bench/RESULTS.md.")


if __name__ == "__main__":
    sys.exit(main())
