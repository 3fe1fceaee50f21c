"""What recording a timeline costs: the tiny call of section 1 with ``synk.timeline`` on and off."""

import os
import tempfile
import time

import numpy as np

from bench.common import spread


def overhead(rounds=20, calls=200):
    """Median per-call microseconds off and on (alternating blocks), and the median per-round ratio.

    Runs in a forked runtime (the caller's).
    """
    import pytensor.tensor as pt

    import synkhronos as synk
    x = pt.vector("x", dtype="float32")
    tiny = synk.function([x], [((x * 2 + 1).sum(), "sum")], name="tiny_timeline")
    synk.distribute()
    x_dat = synk.data(np.arange(8, dtype="float32"))

    def block():
        start = time.perf_counter()
        for _ in range(calls):
            tiny(x_dat)
        return (time.perf_counter() - start) / calls
    block()
    off, on = [], []
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as directory:
        for _ in range(rounds):
            off.append(block())
            with synk.timeline(os.path.join(directory, "trace.json")):
                on.append(block())
    return dict(off_us=float(np.median(off)) * 1e6, on_us=float(np.median(on)) * 1e6,
                ratio=float(np.median(np.array(on) / np.array(off))), rounds=rounds, calls=calls,
                ratios=list(np.array(on) / np.array(off)))


def section(r):
    """Section 8 of RESULTS.md."""
    return ["## 8. Timeline: what recording costs", "",
            "| tiny call, timeline off (µs) | timeline on (µs) | on / off | spread over rounds | "
            "goal ≤ 1.10× |",
            "|---|---|---|---|---|",
            f"| {r['off_us']:.1f} | {r['on_us']:.1f} | {r['ratio']:.2f}× | {spread(r.get('ratios', []), unit='×')} | "
            f"{'met' if r['ratio'] <= 1.10 else 'not met'} |", "",
            f"The tiny function of section 1, blocks of {r['calls']} calls off and on alternating over "
            f"{r['rounds']} rounds (each 'on' block records into a fresh timeline, written outside the "
            "timed calls).", ""]
