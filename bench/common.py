"""Timing helpers shared by the benchmarks."""

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def median_time(fn, repeat=200, warmup=20):
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def interleaved_medians(fns, rounds, calls):
    """Median wall time (s) of each of ``fns``, timed in alternating blocks of ``calls`` calls.

    Also returns, for two functions, the median over rounds of the ratio of
    their block medians: a slow patch of a shared machine then moves both
    sides of each ratio alike.
    """
    times = [[] for _ in fns]
    ratios = []
    for fn in fns:
        for _ in range(20):
            fn()
    for _ in range(rounds):
        block = []
        for fn, out in zip(fns, times):
            mine = []
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                mine.append(time.perf_counter() - t)
            out.extend(mine)
            block.append(np.median(mine))
        if len(fns) == 2:
            ratios.append(block[0] / block[1])
    medians = [float(np.median(t)) for t in times]
    return medians + ([float(np.median(ratios))] if ratios else [])


@contextlib.contextmanager
def busy_peer(seconds=120):
    """A second process calling the tiny benchmark function in a loop while the block runs."""
    proc = subprocess.Popen([python(), "-m", "bench.busy_call", str(seconds)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bench.busy_call did not start")
        yield
    finally:
        proc.kill()
        proc.wait()


def run_json(cmd, env=None, timeout=900):
    """Run a helper script that prints one JSON line last; return the parsed dict (or an error)."""
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except (subprocess.TimeoutExpired, FileNotFoundError) as e:
        return {"error": str(e)}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1])


def emit(result):
    print(json.dumps(result), flush=True)


def python():
    return sys.executable


def _copy_in_step(nbytes, repeat, barrier, out):
    src = np.ones(nbytes // 4, "float32")
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        barrier.wait()
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    out.put(float(np.median(times)))


def concurrent_copy_time(nbytes, processes=2, repeat=5):
    """Median time of a numpy copy of ``nbytes`` while ``processes`` processes each copy at once.

    Every rank of a host-memory collective moves bytes at the same time as its
    peers, so this, not one process's copy, is the bandwidth each of them gets.
    Runs in a fresh interpreter (no JAX threads to fork).
    """
    out = run_json([python(), "-m", "bench.common", str(nbytes), str(processes), str(repeat)])
    return out["seconds"]


def _concurrent_copy_main(nbytes, processes, repeat):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_copy_in_step, args=(nbytes, repeat, barrier, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    emit({"seconds": float(np.mean(times))})


if __name__ == "__main__":
    _concurrent_copy_main(*map(int, sys.argv[1:4]))
