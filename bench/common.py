"""Timing helpers shared by the benchmarks."""

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
