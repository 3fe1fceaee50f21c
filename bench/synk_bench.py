"""The synkhronos side of every benchmark, run in the master after fork()."""

import itertools
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from bench.busy_call import tiny_direct
from bench.common import (
    bare_gathering,
    block_ratios,
    busy_peer,
    concurrent_copy_time,
    copy_pair,
    interleaved_medians,
    shuffled_batches,
)
from bench.mlp import LR, MOMENTUM, data, pytensor_graph
from synkhronos.comm.shm.collectives import PIPELINE_MIN_BYTES
from synkhronos.comm.shm.paths import PUBLISHED
from synkhronos.extensions import train, updates
from synkhronos.rank.rows import gather_rows


def call_cases(suffix=""):
    """Section 1's two calls in the runtime now forked, each through synkhronos and direct (the same
    program compiled for one process): ``{"tiny": (through, direct), "empty": (through, direct)}``."""
    x = pt.vector("x", dtype="float32")
    tiny = synk.function([x], [((x * 2 + 1).sum(), "sum")], name="tiny" + suffix)
    w = pytensor.shared(np.zeros(4, "float32"), name="w_empty" + suffix)
    empty = synk.function([], updates=[(w, w + 1)], name="empty" + suffix)
    synk.distribute()
    direct_tiny, X = tiny_direct()
    x_dat = synk.data(X)
    w2 = pytensor.shared(np.zeros(4, "float32"))
    direct_empty = pytensor.function([], [], updates=[(w2, w2 + 1)], mode="JAX")
    assert float(tiny(x_dat)[0]) == float(np.asarray(direct_tiny(X)))
    # the direct call returns a host value too, as a synkhronos call does
    return {"tiny": (lambda: tiny(x_dat), lambda: np.asarray(direct_tiny(X))),
            "empty": (lambda: empty(), lambda: direct_empty())}


def call_overhead(rounds=40, calls=50):
    """Median per-call time through synkhronos vs the same compiled function called directly.

    The two are timed in alternating blocks of ``calls`` calls, so a slow
    patch of a shared machine hits both alike; each figure is the median over
    all calls. A third column times the direct call while another process
    runs it at the same time (what every device of a synkhronos call does).
    """
    made = call_cases()
    cases = [("tiny function (8 rows, a few scalar ops)", *made["tiny"]),
             ("empty function (inputs=[], one update)", *made["empty"])]
    rows = []
    for name, synk_call, direct_call in cases:
        blocks = []
        t_synk, t_direct, ratio = interleaved_medians([synk_call, direct_call], rounds, calls, blocks=blocks)
        rows.append(dict(case=name, synk_us=t_synk * 1e6, direct_us=t_direct * 1e6, ratio=ratio,
                         ratios=block_ratios(blocks)))
    with busy_peer():
        t_busy, = interleaved_medians([cases[0][2]], rounds // 2, calls)
    rows[0]["direct_busy_us"] = t_busy * 1e6
    return rows


def all_reduce(sizes_bytes, n):
    """synk.all_reduce of float32 vectors beside a numpy copy of the same size."""
    return [_all_reduce_size(nbytes, n) for nbytes in sizes_bytes]


def _all_reduce_size(nbytes, n):
    count = nbytes // 4
    v = pytensor.shared(np.ones(count, "float32"), name=f"ar_{nbytes}")
    synk.function([], [(v[0], "sum")], name=f"holder_{nbytes}")
    synk.distribute()
    rounds, calls = (10, 10) if nbytes <= 1 << 20 else (10, 1) if nbytes <= 50 << 20 else (9, 1)
    src, dst = copy_pair(nbytes)
    # alternating rounds: a slow minute of the shared machine slows the copy as much as the
    # all-reduce (the ratio is the median of per-round ratios); the warm-up covers the first
    # touch of the shared result regions (the first three 400 MB all-reduces take 0.3-0.6 s)
    seen = []                                     # per all-reduce: (seconds, region, path)
    blocks = []

    def reduce_and_note():
        t = time.perf_counter()
        synk.all_reduce(v, op="sum")
        seen.append((time.perf_counter() - t, result_region(), reduce_path()))
    fns = [reduce_and_note, lambda: np.copyto(dst, src)]
    # the warm-up also covers the path chooser's first calls (each path measured twice; the
    # first published call touches the whole slot)
    warmup = 9 if nbytes >= PIPELINE_MIN_BYTES else 5
    t_ar, t_copy, *_, ratio = interleaved_medians(fns, rounds, calls, warmup=warmup, blocks=blocks)
    timed = seen[-rounds * calls:]
    # what each rank's memory traffic gets while its peer moves bytes too (shared memory bus)
    t_both = concurrent_copy_time(nbytes, n, repeat=max(5, rounds))
    algbw = nbytes / t_ar / 1e9
    busbw = algbw * 2 * (n - 1) / n
    row = dict(bytes=nbytes, allreduce_ms=t_ar * 1e3, algbw_GBs=algbw, busbw_GBs=busbw,
               copy_ms=t_copy * 1e3, copy_GBs=nbytes / t_copy / 1e9,
               bus_vs_copy=2 * (n - 1) / n / ratio,
               bus_vs_copy_rounds=[2 * (n - 1) / n / r for r in block_ratios(blocks)],
               concurrent_copy_ms=t_both * 1e3, ar_in_concurrent_copies=t_ar / t_both,
               # to tell a slow run's cause: the spread of the timed all-reduces, the result
               # regions they wrote (-1: a private result) and the paths they took
               allreduce_min_ms=min(t for t, _, _ in timed) * 1e3,
               allreduce_max_ms=max(t for t, _, _ in timed) * 1e3,
               regions=sorted({r for _, r, _ in timed}),
               published=sum(p == PUBLISHED for _, _, p in timed), timed_calls=len(timed))
    v.set_value(np.zeros(1, "float32"))
    synk.broadcast(v)                                  # free the big buffers everywhere
    return row


def result_region():
    """The shared result region the last all-reduce wrote (-1: a private result)."""
    from synkhronos.runtime import session
    return session.current().context.comm.chosen_region


def reduce_path():
    """The path (synkhronos.comm.shm.paths) the master chose for the last large all-reduce."""
    from synkhronos.runtime import session
    return session.current().context.comm.chosen_path


def training(batches, steps):
    """Samples/s of the MLP step: gradient, one flat all-reduce, update."""
    x, y, loss, params = pytensor_graph()
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=LR,
                                     momentum=MOMENTUM)
    synk.distribute()
    result = {}
    for b in batches:
        X, Y = data(b)
        x_dat, y_dat = synk.data(X), synk.data(Y)
        for _ in range(3):
            step(x_dat, y_dat)
        t = time.perf_counter()
        for _ in range(steps):
            step(x_dat, y_dat)
        result[str(b)] = b * steps / (time.perf_counter() - t)
    return result


def gathering(n_rows, batch, n, batches=16):
    """batch= with shuffled indices: every device gathers its rows vs the master gathering all.

    Every call takes the next of ``batches`` different shuffled index sets (as
    training does), so the rows come from memory, not from the cache.
    """
    x = pt.matrix("x", dtype="float32")
    f = synk.function([x], [(x[:, 0].sum(), "sum")], name="gather_rows")
    synk.distribute()
    X = np.random.default_rng(0).normal(size=(n_rows, 784)).astype("float32")
    x_dat = synk.data(X)
    index_sets = shuffled_batches(n_rows, batch, batches)
    staged = synk.data(X[index_sets[0]])               # the master-alone path stages into this
    # the same call on the same indices into a one-column Data: an index call's fixed cost
    narrow = synk.data(X[:, :1])
    workers_next, alone_next = itertools.cycle(index_sets), itertools.cycle(index_sets)
    narrow_next = itertools.cycle(index_sets)

    def every_device_gathers():
        f(x_dat, batch=next(workers_next))

    def master_alone():
        # the master gathers every row from the same shared Data with the gatherer every device
        # uses (synkhronos.rank.rows.gather_rows: faster than one np.take), then calls on the range
        gather_rows(x_dat.data, next(alone_next), staged.data)
        f(staged)
    bare = []                                          # (alone, split) seconds per probe
    rounds, calls = 10, 8
    with bare_gathering(n_rows, 784, batch, batches) as probe:
        # the bare gatherings run in the same rounds: how much two gatherings at once slow each
        # other down moves from minute to minute
        blocks = []
        t_workers, t_master, _, t_narrow, ratio = interleaved_medians(
            [every_device_gathers, master_alone, lambda: bare.append(probe()),
             lambda: f(narrow, batch=next(narrow_next))], rounds, calls, blocks=blocks)
    # what a call costs besides the gathering: the same call on a range of rows (nothing gathered)
    t_range, = interleaved_medians([lambda: f(x_dat, batch=batch)], rounds, calls)
    check = all(np.isclose(float(f(x_dat, batch=idx)[0]), float(X[idx, 0].sum()), rtol=1e-4)
                for idx in index_sets[:3])
    timed = np.array(bare[-rounds * calls:]).reshape(rounds, calls, 2)  # the timed rounds' probes
    alone, split = np.median(timed[:, :, 0]), np.median(timed[:, :, 1])
    bare_speedup = np.median(np.median(timed[:, :, 0], axis=1) / np.median(timed[:, :, 1], axis=1))
    return dict(rows=n_rows, batch=batch, workers_ms=t_workers * 1e3, master_alone_ms=t_master * 1e3,
                range_call_ms=t_range * 1e3, index_call_ms=t_narrow * 1e3,
                speedup=1 / ratio, speedups=block_ratios(blocks, 1, 0), correct=bool(check), bare_alone_ms=alone * 1e3,
                bare_split_ms=split * 1e3, bare_speedup=float(bare_speedup))
