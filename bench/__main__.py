"""Run every benchmark side by side and write bench/RESULTS.md and bench/results.png.

    python -m bench [--quick]

PyTorch DDP runs in its own virtualenv (.venv-torch, made with a Python 3.11 and
torch==2.13.0 if available); if it cannot be made, its column says why.
"""

import argparse
import os
import platform
import subprocess

import numpy as np

from bench import report
from bench.common import HERE, ROOT, cpu_model, python, run_json

TORCH_VENV = os.path.join(ROOT, ".venv-torch")


def torch_python():
    """Path of a Python with torch, creating .venv-torch if needed; None if impossible."""
    exe = os.path.join(TORCH_VENV, "bin", "python")
    if os.path.exists(exe) and subprocess.run([exe, "-c", "import torch"], capture_output=True).returncode == 0:
        return exe
    for base in ("python3.11", "python3"):
        try:
            subprocess.run([base, "-m", "venv", "--clear", TORCH_VENV], check=True, capture_output=True)
            subprocess.run([exe, "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"], check=True,
                           capture_output=True, timeout=1800)
            return exe
        except Exception:
            continue
    return None


def machine():
    import jax
    import pytensor
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.machine()}, Python "
            f"{platform.python_version()}, numpy {np.__version__}, jax {jax.__version__}, pytensor "
            f"{pytensor.__version__}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps and no 400 MB case")
    args = p.parse_args(argv)
    steps = 5 if args.quick else 20
    batches = [1024, 4096]
    sizes = [4 << 10, 1 << 20, 40 << 20] + ([] if args.quick else [400 << 20])

    import synkhronos as synk
    from bench import synk_bench
    n = synk.fork(2)
    overhead = synk_bench.call_overhead()
    from bench import timeline_bench
    recording = timeline_bench.overhead()
    allreduce = synk_bench.all_reduce(sizes, n)
    gathering = synk_bench.gathering(200_000, 4096, n)
    synk.close()
    synk_train = training_rounds(1 if args.quick else 3, batches, steps)
    from bench import loops
    loop_results = loops.measure(1 if args.quick else 3, torch_python(), args.quick)
    from bench import checkpoint_bench
    saving = checkpoint_bench.measure(3 if args.quick else 7)
    from bench import nodes_bench
    nodes = nodes_bench.measure(batches, steps, 3 if args.quick else 7)
    from bench import compile_time
    compile_times = compile_time.measure(1 if args.quick else 3, python())
    from bench import pymc_bench
    nuts = pymc_bench.measure(1 if args.quick else 3, args.quick)
    from bench import small_model
    small = small_model.measure(1 if args.quick else 3, 1.5 if args.quick else 3.0)
    from bench import elastic_bench
    elastic = elastic_bench.measure(1 if args.quick else 3)
    from bench import call_floor
    floor = call_floor.measure(1 if args.quick else 3)
    from bench import gpu
    on_gpu = gpu.measure(1.0 if args.quick else 2.0)          # skipped, saying why, without a GPU

    report.write(machine(), overhead, allreduce, batches, synk_train, gathering, compile_times,
                 loops.section(loop_results) + checkpoint_bench.section(saving)
                 + timeline_bench.section(recording) + nodes_bench.section(nodes) + pymc_bench.section(nuts)
                 + small_model.section(small) + elastic_bench.section(elastic)
                 + call_floor.section(floor) + gpu.section(on_gpu))
    report.plot(allreduce, batches, synk_train)
    loops.plot(loop_results)
    nodes_bench.plot_accuracy(nodes, os.path.join(HERE, "nodes_accuracy.png"))
    print(open(os.path.join(HERE, "RESULTS.md")).read())


def training_rounds(rounds, batches, steps):
    """Every training variant once per round, in turn (a shared machine's slow minutes then hit
    all of them); per variant and batch the median over rounds, and the median per-round ratio."""
    import synkhronos as synk
    from bench import synk_bench
    blist = ",".join(map(str, batches))
    tp = torch_python()
    runs = {name: [] for name in ("single", "bound", "shared", "torch", "shard", "core_jax", "core_synk",
                                  "core_torch")}
    per_device = ",".join(str(b // 2) for b in batches)
    for _ in range(rounds):
        # per-core speed of each framework's compiled step: one process bound to one core
        runs["core_jax"].append(run_json([python(), "-m", "bench.single_jax", per_device, str(steps),
                                          "--one-core"]))
        runs["core_synk"].append(run_json([python(), "-m", "bench.single_jax", per_device, str(steps),
                                           "--one-core", "--synk-mode"]))
        runs["core_torch"].append(run_json([tp, os.path.join(HERE, "torch_single.py"), per_device,
                                            str(steps)]) if tp else {"error": "no torch virtualenv"})
        # baselines that must not share this process (thread pools, device count) run apart
        runs["single"].append(run_json([python(), "-m", "bench.single_jax", blist, str(steps)]))
        runs["shard"].append(run_json([python(), "-m", "bench.jax_shardmap", blist, str(steps)],
                                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
        runs["torch"].append(run_json([tp, os.path.join(HERE, "torch_ddp.py"), blist, str(steps)]) if tp
                             else {"error": "no torch virtualenv (needs a Python 3.11 and torch==2.13.0)"})
        for name, threads in (("bound", None), ("shared", os.cpu_count())):
            synk.fork(2, threads_per_device=threads)
            try:
                runs[name].append(synk_bench.training(batches, steps))
            finally:
                synk.close()
    result = {name: _medians(per_round, batches) for name, per_round in runs.items()
              if not name.startswith("core")}
    halves = [b // 2 for b in batches]
    result["core"] = {"batches": halves, "jax": _medians(runs["core_jax"], halves),
                      "synk": _medians(runs["core_synk"], halves),
                      "torch": _medians(runs["core_torch"], halves),
                      "ratio": {str(h): _median_ratio(runs["core_jax"], runs["core_torch"], str(h))
                                for h in halves},
                      "synk_ratio": {str(h): _median_ratio(runs["core_synk"], runs["core_torch"], str(h))
                                     for h in halves}}
    result["torch_version"] = next((r["torch"] for r in runs["torch"] if "torch" in r), None)
    from synkhronos.compile import rewrites
    result["products"] = dict(rewrites.products_measured, rewrite=rewrites.use_cpu_rewrite()) \
        if rewrites.products_measured else {}
    result["rounds"] = rounds
    result["per_round"] = {name: runs[name] for name in ("bound", "shared", "torch", "shard", "single")}
    result["ratios"] = {str(b): {f"{x}/{y}": _median_ratio(runs[x], runs[y], str(b))
                                 for x, y in (("bound", "torch"), ("shared", "torch"),
                                              ("bound", "shard"), ("shared", "shard"),
                                              ("bound", "single"), ("shared", "single"))}
                        for b in batches}
    return result


def _medians(per_round, batches):
    out = {}
    for b in map(str, batches):
        values = [r[b] for r in per_round if isinstance(r.get(b), float)]
        out[b] = float(np.median(values)) if values else None
    errors = [r["error"] for r in per_round if "error" in r]
    if errors:
        out["error"] = errors[0]
    return out


def _median_ratio(xs, ys, key):
    ratios = [x[key] / y[key] for x, y in zip(xs, ys)
              if isinstance(x.get(key), float) and isinstance(y.get(key), float)]
    return float(np.median(ratios)) if ratios else None


if __name__ == "__main__":
    main()
