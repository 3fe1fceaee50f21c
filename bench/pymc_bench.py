"""PyMC's NUTS on a 200k-row logistic regression: 2 devices against PyMC alone on the same cores.

Every variant runs in a fresh process, in turn, once per round (the model of
``demos/pymc_logreg.py``, the same seed):

- PyMC alone, one chain, as ``pm.sample(cores=1)`` runs it (its BLAS on one thread);
- PyMC alone, one chain, its BLAS on every core (``pm.sample(cores=1, blas_cores=<all>)``);
- PyMC's own parallelism on the same cores: one chain per core (``chains=cores=<all>``);
- synkhronos, 2 devices: ``pm.sample(step=synkhronos.extensions.pymc.NUTS(), cores=1)``.

The goal compares synkhronos with the faster of the two single-chain PyMC runs of each round.

    python -m bench.pymc_bench [--quick]     # measure and write the section into RESULTS.md
"""

import argparse
import os
import sys

import numpy as np

from bench.common import (
    emit,
    figure,
    numbers_best,
    numbers_median,
    per_round_ratios,
    spread,
    variant_rounds,
    write_section,
)

ROWS, FEATURES = 200_000, 10
VARIANTS = ("pymc", "pymc_blas", "pymc_chains", "synk")
TITLE = "## 10. PyMC: NUTS on a 200k-row logistic regression"


def run_variant(variant, draws, tune):
    """One variant in this process; emits {eval_ms, draws_per_s, steps_per_s, chains}."""
    from demos.pymc_logreg import make_model, sample, time_per_call, typical_point
    model = make_model(ROWS, FEATURES)
    cores = os.cpu_count()
    if variant == "synk":
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        try:
            density = synk_pymc.logp_dlogp_function(model)
            point = typical_point(model)
            eval_s = time_per_call(lambda: density(point), calls=30)
            with model:
                step = synk_pymc.NUTS()
            _, nuts = sample(model, step, draws, tune)
        finally:
            synk.close()
        return dict(nuts, eval_ms=1e3 * eval_s, chains=1)
    import pymc as pm
    from threadpoolctl import threadpool_limits
    combined = model.logp_dlogp_function(ravel_inputs=True)
    q = np.concatenate([np.ravel(v) for v in typical_point(model).values()])
    chains = cores if variant == "pymc_chains" else 1
    blas = cores if variant == "pymc_blas" else 1         # pm.sample's default: cores // chains
    with threadpool_limits(blas):
        eval_s = time_per_call(lambda: combined._pytensor_function(q), calls=30)
    with model:
        step = pm.NUTS()
    _, nuts = sample(model, step, draws, tune, chains=chains, cores=chains, blas_cores=blas * chains)
    return dict(nuts, eval_ms=1e3 * eval_s, chains=chains)


def measure(rounds=3, quick=False):
    """Every variant once per round, in turn; per variant the median, and per-round ratios to PyMC alone."""
    draws = tune = 50 if quick else 100
    runs = variant_rounds("bench.pymc_bench", VARIANTS, rounds, ["--draws", str(draws), "--tune", str(tune)],
                          1800)
    out = dict(rounds=rounds, draws=draws, tune=tune, cores=os.cpu_count(), runs=runs, pymc=_version("pymc"))
    for key in ("draws_per_s", "steps_per_s", "eval_ms"):
        out[key] = {v: numbers_median([r.get(key) for r in runs[v]]) for v in VARIANTS}
    alone = [numbers_best([a.get("draws_per_s"), b.get("draws_per_s")], max)
             for a, b in zip(runs["pymc"], runs["pymc_blas"])]
    out["ratios"] = {v: per_round_ratios([r.get("draws_per_s") for r in runs[v]], alone) for v in VARIANTS}
    return out


def _version(package):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def section(r):
    """Section 10 of RESULTS.md."""
    d, s, e = r["draws_per_s"], r["steps_per_s"], r["eval_ms"]
    ratio = numbers_median(r["ratios"]["synk"])
    chains = numbers_median(r["ratios"]["pymc_chains"])
    met = "met" if ratio is not None and ratio >= 1.5 else "not met"
    errors = sorted({str(x.get("error"))[:80] for runs in r["runs"].values() for x in runs if "error" in x})
    return [TITLE, "",
            f"{ROWS:,} rows, an intercept and {FEATURES} slopes (`demos/pymc_logreg.py`); {r['tune']} tuning "
            f"and {r['draws']} draws per chain, every one counted. One logp + gradient is timed at a point "
            "of the posterior's scale: PyMC's compiled function branches on the values (at the initial "
            "point, all zeros, it runs about twice as fast).", "",
            "| variant | NUTS draws/s | leapfrog steps/s | one logp + gradient (ms) | draws/s over PyMC alone "
            "(the faster single chain) | spread over rounds | goal ≥ 1.5× |",
            "|---|---|---|---|---|---|---|",
            f"| PyMC alone, 1 chain (`pm.sample(cores=1)`: BLAS on 1 thread) | {figure(d['pymc'])} | "
            f"{figure(s['pymc'])} | {figure(e['pymc'], '{:.1f}')} | {figure(numbers_median(r['ratios']['pymc']))}× | "
            f"{spread(r['ratios']['pymc'], unit='×')} | — |",
            f"| PyMC alone, 1 chain, BLAS on {r['cores']} cores | {figure(d['pymc_blas'])} | "
            f"{figure(s['pymc_blas'])} | {figure(e['pymc_blas'], '{:.1f}')} | "
            f"{figure(numbers_median(r['ratios']['pymc_blas']))}× | {spread(r['ratios']['pymc_blas'], unit='×')} | — |",
            f"| PyMC, {r['cores']} chains on {r['cores']} cores (all chains' draws) | {figure(d['pymc_chains'])} | "
            f"{figure(s['pymc_chains'])} | {figure(e['pymc_chains'], '{:.1f}')} | {figure(chains)}× | "
            f"{spread(r['ratios']['pymc_chains'], unit='×')} | — |",
            f"| synkhronos, 2 devices, 1 chain | {figure(d['synk'])} | {figure(s['synk'])} | "
            f"{figure(e['synk'], '{:.1f}')} | {figure(ratio)}× | {spread(r['ratios']['synk'], unit='×')} | "
            f"{met} |", "",
            f"{r['rounds']} rounds, each variant a fresh process in turn; draws per second over the sampling "
            "alone (`sampling_time`; compiling excluded), tuning draws included. PyMC alone's value and "
            "gradient is its own combined function (`model.logp_dlogp_function`); synkhronos's is "
            "`logp_dlogp_function` (each device its half of the rows, the priors once on the master). "
            f"PyMC {r.get('pymc', '?')}; also run by itself: `python -m bench.pymc_bench`." + _per_step(r), ""] + (
        [f"Errors: {'; '.join(errors)}", ""] if errors else [])


def _per_step(r):
    """A leapfrog step's time inside the sampler beside the function's time called in a loop."""
    s, e = r["steps_per_s"], r["eval_ms"]
    if not all(isinstance(x, float) for x in (s["pymc"], e["pymc"], s["synk"], e["synk"])):
        return ""
    return (f" A leapfrog step inside the sampler took {1e3 / s['pymc']:.1f} ms for PyMC alone (its function "
            f"called in a loop: {e['pymc']:.1f} ms) and {1e3 / s['synk']:.1f} ms for synkhronos "
            f"({e['synk']:.1f} ms): draws/s compare what a user's sampling gets, the evaluation column "
            "the functions alone.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--tune", type=int, default=100)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.variant:
        emit(run_variant(args.variant, args.draws, args.tune))
        return
    lines = section(measure(1 if args.quick else args.rounds, args.quick))
    write_section(TITLE, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
