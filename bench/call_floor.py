"""Where a call's time goes: section 1's calls on one device and on two, beside the direct call.

    python -m bench.call_floor [--rounds R]    # measure and write the section into RESULTS.md

A synkhronos call on one device is the master's own path with no peer: the
kept plan, the undo log, the fault watch, the same compiled program, the
reduction and the numpy faces handed back to user code. Two devices add
posting the command, the peer computing its share on the other core, waiting
for it and reading its record. Each is timed side by side with the direct
call of the same compiled program in the same runtime, so every ratio cancels
the machine's slow patches; the runtimes alternate over rounds.
"""

import numpy as np

from bench.common import block_ratios, interleaved_medians, section_main, spread

TITLE = "## 13. Where a call's time goes (the floor of section 1)"
DEVICES = (1, 2)


#: the tiny call again, in a runtime whose other functions hold this many shared variables
HELD_VARIABLES = 60
HELD = f"tiny, beside {HELD_VARIABLES} variables of other functions"


def _hold_variables(synk, n):
    """A function updating ``n`` shared variables of its own, called once (a model's parameters
    and optimizer state: what a call of another function must not pay for)."""
    import pytensor
    held = [pytensor.shared(np.zeros(4, "float32"), name=f"held_{i}") for i in range(n)]
    synk.function([], updates=[(v, v + 1) for v in held], name="hold_floor")()


def measure(rounds=3, inner=8, calls=50):
    """Per case and device count, every round's (synkhronos µs, direct µs, ratio)."""
    import synkhronos as synk
    from bench.synk_bench import call_cases
    out = {case: {n: [] for n in DEVICES} for case in ("tiny", "empty", HELD)}
    for _ in range(rounds):
        for n in DEVICES:
            synk.fork(n)
            try:
                cases = call_cases("_floor")
                cases[HELD] = cases["tiny"]
                for case, (through, direct) in cases.items():
                    if case == HELD:
                        _hold_variables(synk, HELD_VARIABLES)
                    blocks: list = []
                    t_synk, t_direct, _ = interleaved_medians([through, direct], inner, calls, blocks=blocks)
                    out[case][n].append((t_synk * 1e6, t_direct * 1e6, float(np.median(block_ratios(blocks)))))
            finally:
                synk.close()
    return out


def _median(rows, i):
    return float(np.median([r[i] for r in rows]))


def section(r):
    L = [TITLE, "",
         "| call | direct (µs) | 1 device: the master alone (µs) | its ratio | 2 devices (µs) | "
         "its ratio | the second device adds (µs) |", "|---|---|---|---|---|---|---|"]
    for case, by_n in r.items():
        one, two = by_n[1], by_n[2]
        direct = _median(one + two, 1)
        ratios = {n: [row[2] for row in by_n[n]] for n in DEVICES}
        L.append(f"| {case} | {direct:.0f} | {_median(one, 0):.0f} | {np.median(ratios[1]):.2f}× "
                 f"({spread(ratios[1], unit='×')}) | {_median(two, 0):.0f} | {np.median(ratios[2]):.2f}× "
                 f"({spread(ratios[2], unit='×')}) | {_median(two, 0) - _median(one, 0):.0f} |")
    return L + ["", f"Medians over {len(next(iter(r.values()))[1])} rounds (the spread of the per-round "
                "ratios in brackets), each round a 1-device and a 2-device runtime, each call timed in "
                "alternating blocks of 50 beside the direct call of the same program. The 1-device "
                "column is the floor of the master's own path, whatever the device count: the runtime "
                "lock, the kept plan, the undo log of the updates, the fault watch, the program itself, "
                "the reduction, and the numpy faces that user code reads (of the call's own variables: "
                f"the third row's runtime holds {HELD_VARIABLES} more). The last column is what a "
                "peer costs on top: the command posted, the peer's share computed at once on the other "
                "core, the wait for the slower of the two, its result record read.", ""]


if __name__ == "__main__":
    section_main(__doc__, TITLE, measure, section)
