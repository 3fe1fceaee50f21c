"""PyMC's NUTS at three sizes, synkhronos beside PyMC alone: is it ever slower?

Three models, each sampled by PyMC alone and by synkhronos on 2 devices
(``synk_pymc.NUTS()``, which computes the density where it is faster: see
``logp_dlogp_function(where="auto")``), every variant a fresh process, in
turn, once per round:

- the gallery's radon varying-intercept model, 919 rows (``demos/pymc_radon.py``);
- the same over 200 times the rows (183,800);
- a logistic regression over 500,000 rows and 20 slopes (``demos/pymc_logreg.py``);
- the same beside two processes that only spin: a machine other jobs load, where waits that spin
  would take the cores the computation needs (``synkhronos.ipc.semaphores``).

PyMC alone is the faster of one chain with its BLAS on one thread and on
every core. Goals (draws/s over PyMC alone): ≥ 0.95× at ×1, ≥ 1.3× at ×200,
≥ 1.8× for the regression.

    python -m bench.pymc_sizes [--quick]     # measure and write the section into RESULTS.md
"""

import argparse
import os
import sys

from bench.common import emit, figure, numbers_best, numbers_median, per_round_ratios, spread, write_section

TITLE = "## 15. PyMC at three sizes: NUTS draws/s beside PyMC alone"
#: size -> (what it is, goal, draws = tune per chain, quick draws)
SIZES = {"radon_x1": ("radon varying intercepts, 919 rows", 0.95, 1000, 500),
         "radon_x200": ("radon varying intercepts, 183,800 rows", 1.3, 100, 50),
         "logistic_500k": ("logistic regression, 500,000 rows × 20 slopes", 1.8, 60, 30),
         "logistic_500k_busy": ("the same, two busy processes beside (a loaded machine)", None, 60, 30)}
#: processes that only spin, started beside a variant of a ``_busy`` size
BUSY = 2
VARIANTS = ("pymc", "pymc_blas", "synk")


def make_model(size):
    size = size.removesuffix("_busy")
    if size.startswith("radon"):
        from demos.pymc_radon import make_model as radon
        return radon(int(size.rsplit("x", 1)[1]))
    from demos.pymc_logreg import make_model as logistic
    return logistic(500_000, 20)


def run_variant(size, variant, draws):
    """One variant on one size in this process: {draws_per_s, where}; beside :data:`BUSY` processes
    that only spin for a ``_busy`` size."""
    import subprocess
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(BUSY if size.endswith("_busy") else 0)]
    try:
        return _sampled(size, variant, draws)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def _sampled(size, variant, draws):
    from demos.pymc_logreg import sample
    model = make_model(size)
    if variant == "synk":
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        try:
            with model:
                step = synk_pymc.NUTS()
            _, nuts = sample(model, step, draws, draws)
        finally:
            synk.close()
        return dict(nuts, where="here" if step.density.here is not None else "devices")
    import pymc as pm
    from threadpoolctl import threadpool_limits
    blas = os.cpu_count() if variant == "pymc_blas" else 1
    with threadpool_limits(blas), model:
        step = pm.NUTS()
        _, nuts = sample(model, step, draws, draws, blas_cores=blas)
    return dict(nuts, where="here")


def measure(rounds=3, quick=False):
    """Every size and variant once per round, in turn; per size the ratios to PyMC alone."""
    from bench.common import python, run_json
    out = dict(rounds=rounds, cores=os.cpu_count(), sizes={})
    runs = {(s, v): [] for s in SIZES for v in VARIANTS}
    for _ in range(rounds):
        for size, (_, _, draws, quick_draws) in SIZES.items():
            for v in VARIANTS:
                runs[(size, v)].append(run_json(
                    [python(), "-m", "bench.pymc_sizes", "--size", size, "--variant", v, "--draws",
                     str(quick_draws if quick else draws)], timeout=1800))
    for size in SIZES:
        alone = [numbers_best([a.get("draws_per_s"), b.get("draws_per_s")], max)
                 for a, b in zip(runs[(size, "pymc")], runs[(size, "pymc_blas")])]
        synk = [r.get("draws_per_s") for r in runs[(size, "synk")]]
        steps = {v: numbers_median([r.get("steps_per_s") for r in runs[(size, v)]]) for v in VARIANTS}
        out["sizes"][size] = dict(alone=numbers_median(alone), synk=numbers_median(synk), steps=steps,
                                  ratios=per_round_ratios(synk, alone),
                                  where=sorted({r.get("where", "?") for r in runs[(size, "synk")]}),
                                  errors=sorted({str(r["error"])[:80] for v in VARIANTS
                                                 for r in runs[(size, v)] if "error" in r}))
    return out


def section(r):
    lines = [TITLE, "",
             "| model | PyMC alone, draws/s | synkhronos, 2 devices, draws/s | leapfrog steps/s (PyMC alone, "
             "BLAS 1 / all; synkhronos) | where it computed | over PyMC alone | spread over rounds | goal |",
             "|---|---|---|---|---|---|---|---|"]
    for size, (what, goal, _, _) in SIZES.items():
        s = r["sizes"][size]
        ratio = numbers_median(s["ratios"])
        met = "—" if goal is None else \
            f"≥ {goal}×: " + ("met" if ratio is not None and ratio >= goal else "not met")
        st = s["steps"]
        lines.append(f"| {what} | {figure(s['alone'])} | {figure(s['synk'])} | {figure(st['pymc'], '{:.0f}')} / "
                     f"{figure(st['pymc_blas'], '{:.0f}')}; {figure(st['synk'], '{:.0f}')} | {', '.join(s['where'])} | "
                     f"{figure(ratio)}× | {spread(s['ratios'], unit='×')} | {met} |")
    errors = sorted({e for s in r["sizes"].values() for e in s["errors"]})
    lines += ["", f"{r['rounds']} rounds on {r['cores']} cores, each variant a fresh process in turn; one chain, "
              "tuning draws included, sampling time alone (`sampling_time`). PyMC alone is the faster of its BLAS "
              "on one thread and on every core; synkhronos is `synk_pymc.NUTS()` with `where='auto'` (the "
              "density where it was faster when built: in this process as PyMC compiles it, or split over the "
              "devices). Also run by itself: `python -m bench.pymc_sizes`.", ""]
    return lines + ([f"Errors: {'; '.join(errors)}", ""] if errors else [])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES))
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.variant:
        emit(run_variant(args.size, args.variant, args.draws))
        return
    lines = section(measure(1 if args.quick else args.rounds, args.quick))
    write_section(TITLE, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
