"""Run every benchmark side by side and write bench/RESULTS.md and bench/results.png.

    python -m bench [--quick]

PyTorch DDP runs in its own virtualenv (.venv-torch, made with a Python 3.11 and
torch==2.13.0 if available); if it cannot be made, its column says why.
"""

import argparse
import os
import platform
import subprocess
import time

import numpy as np

from bench.common import HERE, ROOT, python, run_json

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


def cpu_model():
    """The CPU's model name (from /proc/cpuinfo), or the architecture."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    compile_times = {s: run_json([python(), "-m", "bench.compile_time", s]) for s in ("pytensor", "synk")}

    write_results(machine(), overhead, allreduce, batches, synk_train, gathering, compile_times,
                  loops.section(loop_results) + checkpoint_bench.section(saving)
                  + timeline_bench.section(recording) + nodes_bench.section(nodes))
    plot(allreduce, batches, synk_train)
    loops.plot(loop_results)
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


def _near_far(r):
    """", all-reduce X ms (busbw / copy Y%) in far rounds against Z ms (W%) in the others."""
    parts = [f"{name} rounds {r[name + '_ms']:.1f} ms (busbw / copy {r[name + '_bus_vs_copy']:.0%})"
             for name in ("far", "near") if r.get(name + "_ms") is not None]
    return (": all-reduce in " + ", in ".join(parts) if parts else "") + "."


def _fmt_ratio(r):
    return "n/a" if r is None else f"{r:.2f}"


def _fmt(d, key):
    v = d.get(key)
    return f"{v:,.0f}" if isinstance(v, float) else ("n/a: " + str(d.get("error", "?"))[:60])


def _copy_scaling(allreduce):
    """How many times one process's bytes two processes copying at once move (section 2's copies)."""
    big = [r for r in allreduce if r["bytes"] >= 40 << 20]
    if not big:
        return "section 2 timed no copy of 40 MB or more in this run"
    parts = [f"{r['bytes'] >> 20} MB: {2 * r['copy_ms'] / r['concurrent_copy_ms']:.2f}×" for r in big]
    return ("two processes copying at once move only " + ", ".join(parts) +
            " the bytes of one (section 2)")


def compile_section(times):
    """Section 5 of RESULTS.md: the first steps of the ResNet demo's training step."""
    L = ["## 5. Compile time: the ResNet demo's training step (pytensor-ml ResNet blocks, Adam)", "",
         "| | first step, compiling (s) | second step (s) | third step (s) |", "|---|---|---|---|"]
    names = {"pytensor": "plain PyTensor `mode=\"JAX\"`, 1 process, 32 rows",
             "synk": "synkhronos, 2 devices, 16 rows each"}
    for key in ("pytensor", "synk"):
        r = times.get(key, {})
        if "steps_s" in r:
            a, b, c = r["steps_s"]
            L.append(f"| {names[key]} | {a:.2f} | {b:.3f} | {c:.3f} |")
        else:
            L.append(f"| {names[key]} | {r.get('error', 'failed')} | | |")
    ok = all("steps_s" in times.get(k, {}) for k in names)
    if ok:
        ratio = times["synk"]["steps_s"][0] / times["pytensor"]["steps_s"][0]
        L.append(f"\nThe first step: synkhronos {ratio:.2f}× plain PyTensor's (every device compiles its own "
                 "graph at the same time; the gradient, the update and the all-reduce are separate "
                 "programs). Each function compiles once: the second step runs at steady speed. "
                 "PyTensor's time includes `pytensor.function`; synkhronos compiles in `synk.function`, "
                 "`distribute()` and the first call, all counted.")
    return L + [""]


def write_results(mach, overhead, allreduce, batches, synk_train, gathering, compile_times,
                  loop_section):
    single, torch, shard = synk_train["single"], synk_train["torch"], synk_train["shard"]
    L = ["# Benchmark results", "", f"Generated by `make bench` on {time.strftime('%Y-%m-%d %H:%M')}.",
         f"Machine: {mach}.", "Ratios come from one run; absolute times on a shared machine are noisy.", "",
         "## 1. Call overhead (2 devices vs the same compiled function called directly)", "",
         "| case | synkhronos (µs) | direct (µs) | ratio | goal ≤ 3× | direct while a 2nd process "
         "runs it too (µs) |", "|---|---|---|---|---|---|"]
    for r in overhead:
        busy = f"{r['direct_busy_us']:.0f}" if "direct_busy_us" in r else "—"
        L.append(f"| {r['case']} | {r['synk_us']:.0f} | {r['direct_us']:.0f} | {r['ratio']:.2f}× | "
                 f"{'met' if r['ratio'] <= 3 else 'not met'} | {busy} |")
    L += ["", "Timed in alternating blocks of 50 calls: times are medians over all calls, the ratio is "
          "the median over rounds of the two blocks' ratio. A synkhronos call "
          "has every device compute its share at once; the last column is the direct call while "
          "another process makes the same call: where it exceeds the direct call, the cores share "
          "execution resources and that part of the ratio is the machine's, not the runtime's."]
    L += ["", "## 2. All-reduce, float32, 2 processes (nccl-tests definitions: busbw = algbw × 2(n−1)/n)", "",
          "| size | all_reduce (ms) | algbw (GB/s) | busbw (GB/s) | numpy copy (ms) | copy (GB/s) | "
          "busbw / copy | goal ≥ 50% (40 MB, 400 MB) | 2 processes copying at once (ms, the slower) | "
          "all_reduce / that |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in allreduce:
        size = f"{r['bytes'] / 2**20:.0f} MB" if r["bytes"] >= 2**20 else f"{r['bytes'] // 1024} KB"
        goal = ("met" if r["bus_vs_copy"] >= 0.5 else "not met") if r["bytes"] >= 40 << 20 else "—"
        L.append(f"| {size} | {r['allreduce_ms']:.2f} | {r['algbw_GBs']:.2f} | {r['busbw_GBs']:.2f} | "
                 f"{r['copy_ms']:.2f} | {r['copy_GBs']:.2f} | {r['bus_vs_copy']:.0%} | {goal} | "
                 f"{r['concurrent_copy_ms']:.2f} | {r['ar_in_concurrent_copies']:.2f}× |")
    L += ["", "Timed all-reduces, fastest–slowest (result regions written; −1 = private result; how many "
          "took the published path rather than the rings): " +
          "; ".join(f"{r['bytes'] / 2**20:.0f} MB {r['allreduce_min_ms']:.1f}–{r['allreduce_max_ms']:.1f} ms "
                    f"(regions {r['regions']}; published {r['published']} of {r['timed_calls']})"
                    for r in allreduce if r["bytes"] >= 40 << 20) + "."]
    L += ["", "Where the cores were, round by round: 1 MB chunks handed from one core's process to the "
          "other's (`bench.common.core_handover`, bare numpy) run at ~12 GB/s on this machine while "
          "the hypervisor keeps the two vCPUs on cores that share a cache and at ~4.5 GB/s when it "
          "does not (a C cache-line ping-pong: ~100 vs ~480 ns), for stretches of 0.4–15 s. Rounds "
          "whose hand-over ran under half the fastest round's are counted *far*:", ""]
    L += [f"- {r['bytes'] / 2**20:.0f} MB: hand-over {r['handover_GBs']:.1f} GB/s median "
          f"({r['handover_min_GBs']:.1f}–{r['handover_max_GBs']:.1f}); {r['far_rounds']} of {r['rounds']} "
          f"rounds far" + _near_far(r) for r in allreduce if "handover_GBs" in r]
    L += ["", "The all-reduce and the copy are timed in alternating rounds (after 5 warm-up calls each, 9 "
          "from 8 MB on, which also cover the first touch of the shared result regions and the "
          "path chooser's first measurements): times are medians, "
          "busbw / copy is the median of the per-round ratios.",
          "", "The shared-memory all-reduce (the default on CPU) is a reduce-scatter in which each rank "
          "copies the parts of its buffer its peers reduce into shared memory and reduces its own part "
          "into a shared result region every device adopts without a copy. From 8 MB on, those copies "
          "can stream through small per-pair rings (1 MB chunks) and be reduced while still in the "
          "cache, so per rank the memory bus carries its buffer once and its part of the result once; "
          "that needs the cores close, so the master picks rings or publishing for each large "
          "all-reduce from the times it measured (`synkhronos/comm/paths.py`). Both "
          "ranks do this at once, so the fair yardstick for large buffers is a copy made *while the "
          "other process copies too* (second-to-last column). Small buffers are dominated by the "
          "command round trip (~0.5 ms: prepare, the go-ahead, two barriers)."]
    L += ["", "## 3. Training throughput, MLP 784-1024-1024-10, SGD momentum (samples/s)", "",
          "| global batch | (a) single process | (b) synkhronos, 2 devices | (b′) the same, XLA pools on all cores | "
          "(c) PyTorch DDP Gloo, 2 procs | (d) JAX shard_map, 2 host devices | b / c, b′ / c (goal ≥ 1) | "
          "b / d, b′ / d (goal ≥ 1) | b / a, b′ / a (goal ≥ 0.9) |",
          "|---|---|---|---|---|---|---|---|---|"]
    bound, shared, ratios = synk_train["bound"], synk_train["shared"], synk_train["ratios"]

    def ratio(key, b):
        return _fmt_ratio(ratios[str(b)][key])
    for b in batches:
        k = str(b)
        L.append(f"| {b} | {_fmt(single, k)} | {_fmt(bound, k)} | {_fmt(shared, k)} | {_fmt(torch, k)} | "
                 f"{_fmt(shard, k)} | {ratio('bound/torch', b)}, {ratio('shared/torch', b)} | "
                 f"{ratio('bound/shard', b)}, {ratio('shared/shard', b)} | "
                 f"{ratio('bound/single', b)}, {ratio('shared/single', b)} |")
    core = synk_train["core"]
    L += ["", "Parallel efficiency: 2-device samples/s over twice the samples/s of one process on one "
          "core with the per-device batch (plain PyTensor, the table below):", "",
          "| global batch | synkhronos (b) | PyTorch DDP (c, over PyTorch on 1 core) | JAX shard_map (d) | "
          "goal ≥ 0.95 |", "|---|---|---|---|---|"]
    for b in batches:
        k, h = str(b), str(b // 2)

        def efficiency(result, per_core):
            value, one = (result or {}).get(k), (per_core or {}).get(h)
            return value / (2 * one) if value and one else float("nan")
        e_synk = efficiency(bound, core["jax"])
        L.append(f"| {b} | {e_synk:.2f} | {efficiency(torch, core['torch']):.2f} | "
                 f"{efficiency(shard, core['jax']):.2f} | {'met' if e_synk >= 0.95 else 'not met'} |")
    L += ["", f"Each figure is the median of {synk_train['rounds']} rounds in which every variant ran once, "
          "in turn; each ratio is the median of the per-round ratios. (b) is the default: each "
          "process's XLA CPU pool has `cores // n_parallel` threads bound to its own cores "
          "(`threads_per_device`). (b′) is `fork(threads_per_device=<all cores>)`: every pool spreads "
          "over every core, so a process that waits (its all-reduce, Python) leaves its cores to the "
          "other's threads. Which is faster depends on the step; both are reported. (d) runs one "
          "process with JAX's default thread pool over its 2 host devices."]
    products = synk_train.get("products") or {}
    if products:
        chosen = "numpy's BLAS (the CPU rewrite)" if products["rewrite"] else "XLA's own (no rewrite)"
        L += ["", f"Products: synkhronos ran {chosen}. At start-up the master timed "
              f"`x @ w` + `x.T @ d` ({' x '.join(map(str, products['shape']))}, float32, its share of "
              f"the cores): XLA {1000 * products['xla_s']:.1f} ms, numpy's BLAS "
              f"{1000 * products['blas_s']:.1f} ms, and every rank compiles with the faster "
              "(`synkhronos.compile.rewrites.use_cpu_rewrite`)."]
    L += ["", "Where the compute goes: the same step in one process bound to one core (the per-device "
          "batch), PyTensor's JAX code (plain, and with the CPU rewrite forced on: "
          "`synkhronos/rewrites.py`) against PyTorch's:", "",
          "| rows | PyTensor (JAX), 1 core (samples/s) | + synkhronos CPU rewrite, 1 core | "
          "PyTorch, 1 core (samples/s) | JAX / PyTorch | with rewrite / PyTorch |",
          "|---|---|---|---|---|---|"]
    for h in core["batches"]:
        r, rs = core["ratio"][str(h)], core["synk_ratio"][str(h)]
        L.append(f"| {h} | {_fmt(core['jax'], str(h))} | {_fmt(core['synk'], str(h))} | "
                 f"{_fmt(core['torch'], str(h))} | {_fmt_ratio(r)} | {_fmt_ratio(rs)} |")
    if synk_train.get("torch_version"):
        L.append(f"\nPyTorch {synk_train['torch_version']} (CPU build) in its own virtualenv, "
                 "`torch.set_num_threads(1)` per process.")
    g = gathering
    L += ["", "## 4. Gathering rows of a 200k × 784 float32 Data with shuffled batch indices", "",
          "| batch | every device gathers its rows (ms) | master gathers all alone (ms) | speed-up | goal ≥ 1.6× "
          "| result checked |",
          "|---|---|---|---|---|---|",
          f"| {g['batch']} | {g['workers_ms']:.2f} | {g['master_alone_ms']:.2f} | {g['speedup']:.2f}× | "
          f"{'met' if g['speedup'] >= 1.6 else 'not met'} | {g['correct']} |", "",
          "Both are whole calls of the same function (`x[:, 0].sum()`); the master-alone "
          "path first gathers every row into a shared Data with the gatherer each device uses "
          "(`synkhronos.rank.rows.gather_rows`, blocks of rows whose first elements are touched first), "
          "then calls on that Data's range of rows.", "",
          "For reference, timed in the same rounds (medians; the speed-up is the median of per-round ratios):", "",
          "| bare process gathers all (ms) | 2 bare processes gather half each at once (ms) "
          "| the bare split's speed-up | the call on a range of rows (ms) "
          "| the call on the same indices into a 1-column Data (ms) |",
          "|---|---|---|---|---|",
          f"| {g['bare_alone_ms']:.2f} | {g['bare_split_ms']:.2f} | {g['bare_speedup']:.2f}× | "
          f"{g['range_call_ms']:.2f} | {g['index_call_ms']:.2f} |", "",
          "The bare columns gather the same rows from shared memory with the same gatherer into a "
          "buffer of their own in two processes of their own, no synkhronos call "
          "(`bench.common.bare_gathering`): what splitting the gathering itself gains here. Rows "
          "are 3 KB apart in 4 KB pages of shared memory, so every row costs a TLB miss, and both "
          "processes share the memory system; how much two gatherings at once slow each other down "
          f"moves over tens of seconds on this machine (for comparison, {_copy_scaling(allreduce)}). "
          "The last two columns are what a call costs besides its gathering: on a range of rows "
          "(every device takes its rows as a view: validation, the command, the function, the "
          "reduction; the master-alone column pays this one too) and on explicit indices (the same "
          "validation and publishing of the indices as the synkhronos column, next to nothing to "
          "gather).", ""]
    L += compile_section(compile_times) + ["![plot](results.png)", ""] + loop_section
    with open(os.path.join(HERE, "RESULTS.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")


def plot(allreduce, batches, synk_train):
    single, torch, shard = synk_train["single"], synk_train["torch"], synk_train["shard"]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = [r["bytes"] for r in allreduce]
    a.plot(sizes, [r["busbw_GBs"] for r in allreduce], "o-", label="synk.all_reduce busbw")
    a.plot(sizes, [r["copy_GBs"] for r in allreduce], "s--", label="numpy copy")
    a.set_xscale("log"), a.set_xlabel("bytes"), a.set_ylabel("GB/s"), a.legend(), a.set_title("all-reduce")
    names = ["single", "synkhronos", "synkhronos, pools on all cores", "torch DDP", "JAX shard_map"]
    width = 0.16
    for i, res in enumerate([single, synk_train["bound"], synk_train["shared"], torch, shard]):
        vals = [res.get(str(bb)) or 0 for bb in batches]
        b.bar(np.arange(len(batches)) + i * width, vals, width, label=names[i])
    b.set_xticks(np.arange(len(batches)) + 2 * width, [str(bb) for bb in batches])
    b.set_xlabel("global batch"), b.set_ylabel("samples/s"), b.legend(fontsize=8), b.set_title("MLP training")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "results.png"), dpi=100)


if __name__ == "__main__":
    main()
