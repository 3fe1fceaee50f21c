"""Timing helpers shared by the benchmarks."""

import argparse
import contextlib
import json
import mmap
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def interleaved_medians(fns, rounds, calls, warmup=20, blocks=None):
    """Median wall time (s) of each of ``fns``, timed in alternating blocks of ``calls`` calls.

    Also returns, for two or more functions, the median over rounds of the
    ratio of the first two's block medians: a slow patch of a shared machine
    then moves both sides of each ratio alike. Each function is first called
    ``warmup`` times. ``blocks``, a list, receives every round's block medians.
    """
    times = [[] for _ in fns]
    ratios = []
    for fn in fns:
        for _ in range(warmup):
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
        if len(fns) >= 2:
            ratios.append(block[0] / block[1])
        if blocks is not None:
            blocks.append(block)
    medians = [float(np.median(t)) for t in times]
    return medians + ([float(np.median(ratios))] if ratios else [])


def per_round_ratios(xs, ys):
    """The ratio of two variants in every round both measured (numbers; others skipped)."""
    return [x / y for x, y in zip(xs, ys) if isinstance(x, float) and isinstance(y, float) and y]


def spread(values, fmt="{:.2f}", unit=""):
    """``"lo–hi"`` of per-round figures (the spread the tables report), or ``"—"`` for fewer than two."""
    values = [v for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
    if len(values) < 2:
        return "—"
    return f"{fmt.format(min(values))}–{fmt.format(max(values))}{unit}"


def block_ratios(blocks, first=0, second=1):
    """Per-round ratios of two functions' block medians (the ``blocks`` of :func:`interleaved_medians`)."""
    return [float(b[first] / b[second]) for b in blocks]


@contextlib.contextmanager
def busy_peer(seconds=120):
    """A second process calling the tiny benchmark function in a loop while the block runs."""
    proc = subprocess.Popen([python(), "-m", "bench.busy_call", str(seconds)], stdout=subprocess.PIPE,
                            text=True, env=source_env())
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bench.busy_call did not start")
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _helper(kind, *args):
    """Yield ``ask()``: one answer line of the persistent helper ``python -m bench.common kind``.

    The helper prints "ready" once set up, then answers every line it reads;
    closing its stdin ends it (and the partner process it forked).
    """
    proc = subprocess.Popen([python(), "-m", "bench.common", kind, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=source_env())

    def ask():
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return proc.stdout.readline()
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bench.common {kind} did not start")
        yield ask
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def run_json(cmd, env=None, timeout=900):
    """Run a helper script that prints one JSON line last; return the parsed dict (or an error)."""
    full_env = source_env(**(env or {}))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except (subprocess.TimeoutExpired, FileNotFoundError) as e:
        return {"error": str(e)}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(lines[-1])


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


def write_section(title, lines):
    """Put ``lines`` into bench/RESULTS.md in place of the section headed ``title`` (or at the end)."""
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else ""
    block = "\n".join(lines) + "\n"
    pattern = re.compile(re.escape(title) + r".*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as fh:
        fh.write(text)


def section_main(doc, title, measure, section, argv=None):
    """A section module's command line (``--rounds R``): measure, write the section headed ``title``
    into bench/RESULTS.md, and print it."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    lines = section(measure(args.rounds))
    write_section(title, lines)
    print("\n".join(lines))


def emit(result):
    print(json.dumps(result), flush=True)


def python():
    return sys.executable


def source_env(**variables):
    """This process's environment with the project first on ``PYTHONPATH`` (what was there stays
    after it: a GPU image's wheels may be), plus ``variables``."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **variables)


def _in_lockstep(step, repeat, barrier, out):
    """Time ``step()`` ``repeat`` times, every process starting each round together."""
    step()
    times = []
    for _ in range(repeat):
        barrier.wait()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out.put(times)


def copy_pair(nbytes):
    """(source of ones, destination) float32 arrays of ``nbytes`` for timing a copy, page-aligned.

    glibc copies blocks this large (from some size between 64 and 400 MB on)
    with non-temporal stores, at twice the speed of the ordinary path here,
    unless source and destination lie a few bytes apart modulo the 4 KiB page:
    then 400 MB ran at 3.5-4.4 GB/s instead of 12.8-13.8 (measured). Where
    malloc puts two arrays decides which; page-aligned arrays measure the
    machine's copy, not the allocator's placement.
    """
    src, dst = (np.frombuffer(mmap.mmap(-1, nbytes), "float32") for _ in range(2))
    src[:] = 1
    return src, dst


def _copy_step(nbytes):
    src, dst = copy_pair(nbytes)
    return lambda: np.copyto(dst, src)


def shuffled_batches(rows, batch, count, seed=1):
    """``count`` different shuffled index sets of ``batch`` rows out of ``rows``."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(rows)[:batch] for _ in range(count)]


def _gather_step(segment, rows, cols, index_sets):
    import itertools
    from multiprocessing import shared_memory

    from synkhronos.rank.rows import (
        gather_rows,  # the gatherer every synkhronos device uses
    )
    shm = shared_memory.SharedMemory(name=segment)
    table = np.ndarray((rows, cols), np.float32, shm.buf)
    out = np.empty((len(index_sets[0]), cols), np.float32)
    sets = itertools.cycle(index_sets)
    return lambda shm=shm: gather_rows(table, next(sets), out)  # the default argument keeps shm mapped


def _run_in_lockstep(make_steps, repeat):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(len(make_steps)), ctx.Queue()
    procs = [ctx.Process(target=lambda make=make: _in_lockstep(make(), repeat, barrier, out))
             for make in make_steps]
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    # a round of a synchronous split lasts as long as its slowest process
    return float(np.median(np.max(times, axis=0)))


def concurrent_copy_time(nbytes, processes=2, repeat=5):
    """Median time of a round in which ``processes`` processes each copy ``nbytes`` at once.

    A round lasts until the slowest of them is done, as a collective does.

    Every rank of a host-memory collective moves bytes at the same time as its
    peers, so this, not one process's copy, is the bandwidth each of them gets.
    Runs in a fresh interpreter (no JAX threads to fork).
    """
    return run_json([python(), "-m", "bench.common", "copy", str(nbytes), str(processes),
                     str(repeat)])["seconds"]


@contextlib.contextmanager
def bare_gathering(rows, cols, batch, batches):
    """Yield ``probe()``: (seconds for one bare process gathering ``batch`` rows alone, seconds
    for two bare processes each gathering half of them at once), no synkhronos call involved.

    Two processes (a fresh interpreter and its fork) keep a ``rows`` x ``cols``
    float32 table in shared memory and gather with
    :func:`synkhronos.rank.rows.gather_rows`, as the synkhronos devices and the
    master-alone baseline do, cycling through ``batches`` index sets as
    :func:`shuffled_batches` makes them. A benchmark calls ``probe()`` between
    its own timings, so the two ratios come from the same minutes: two
    gatherings at once slow each other down by a factor that moves over tens
    of seconds on this machine (2048 rows each: 0.9-1.5 ms, measured).
    The split's time is the slower process's own gathering.
    """
    with _helper("gather", rows, cols, batch, batches) as ask:
        yield lambda: tuple(map(float, ask().split()))


def _serve_gathering(rows, cols, batch, batches):
    """The helper behind :func:`bare_gathering`: an alone and a split gathering per stdin line."""
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=rows * cols * 4)
    try:
        np.ndarray((rows, cols), np.float32, shm.buf)[:] = 1
        sets = shuffled_batches(rows, batch, batches)
        halves = [[np.array_split(idx, 2)[p] for idx in sets] for p in range(2)]
        go_r, go_w = os.pipe()
        took_r, took_w = os.pipe()
        if os.fork() == 0:                             # the partner: gathers its half on request
            os.close(go_w)
            step = _gather_step(shm.name, rows, cols, halves[1])
            step()
            while os.read(go_r, 1):                    # b"" once the helper is gone
                t = time.perf_counter()
                step()
                os.write(took_w, f"{time.perf_counter() - t:.9f}\n".encode())
            os._exit(0)
        os.close(go_r)
        alone_step = _gather_step(shm.name, rows, cols, sets)
        half_step = _gather_step(shm.name, rows, cols, halves[0])
        alone_step(), half_step()
        took = os.fdopen(took_r)
        print("ready", flush=True)
        for _ in sys.stdin:
            t = time.perf_counter()
            alone_step()
            alone = time.perf_counter() - t
            os.write(go_w, b"g")
            t = time.perf_counter()
            half_step()
            mine = time.perf_counter() - t
            print(alone, max(mine, float(took.readline())), flush=True)
        os.close(go_w)
        os.wait()
    finally:
        shm.close()
        shm.unlink()


def _main(kind, *args):
    if kind == "copy":
        nbytes, processes, repeat = map(int, args)
        emit({"seconds": _run_in_lockstep([lambda: _copy_step(nbytes)] * processes, repeat)})
        return
    if kind == "gather":
        _serve_gathering(*map(int, args))
        return
    raise ValueError(f"unknown helper {kind!r}")


if __name__ == "__main__":
    _main(*sys.argv[1:])


def variant_rounds(module, variants, rounds, args, timeout):
    """``rounds`` rounds of ``python -m module --variant V *args`` for every variant in turn (each a
    fresh process printing its JSON result): per variant, the list of results."""
    runs = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            runs[v].append(run_json([python(), "-m", module, "--variant", v, *args], timeout=timeout))
    return runs


def numbers_median(values):
    """The median of the numbers among ``values`` (a failed run gives None): None if none."""
    numbers = [v for v in values if isinstance(v, float)]
    return float(np.median(numbers)) if numbers else None


def numbers_best(values, best):
    """``best`` (min or max) of the numbers among ``values``: None if none."""
    numbers = [v for v in values if isinstance(v, float)]
    return best(numbers) if numbers else None



def figure(value, fmt="{:.2f}"):
    """``value`` formatted for a table ("n/a" for a run that gave none)."""
    return "n/a" if value is None else fmt.format(value)
