"""A PyMC logistic regression over 200,000 rows: MAP and NUTS on the devices, beside PyMC alone.

The model is plain PyMC. Its log-density's likelihood is split over the
devices by rows (``synkhronos.extensions.pymc``); the priors are counted once.
PyMC alone runs first, in this process before ``synk.fork()``; then the same
model runs on the devices: ``find_MAP`` and ``pm.sample(step=NUTS(), cores=1)``.
The table prints the time of one log-density and gradient, the MAP (compiling
included) and NUTS draws per second (sampling alone), and how far the two
agree.

Examples
--------
    python demos/pymc_logreg.py --devices 2
    python demos/pymc_logreg.py --rows 20000 --draws 100 --tune 100
"""

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_model(rows=200_000, features=10, seed=0):
    """A logistic regression on synthetic data: an intercept and ``features`` slopes."""
    import pymc as pm
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features))
    slopes = rng.normal(size=features) * 0.5
    y = (rng.uniform(size=rows) < 1 / (1 + np.exp(-(x @ slopes + 0.3)))).astype("int64")
    with pm.Model() as model:
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=features)
        pm.Bernoulli("y", logit_p=a + x @ b, observed=y)
    return model


def typical_point(model, seed=5):
    """A point where the posterior could be (slopes of the data's scale): the log-density's time is
    measured there, since PyMC's compiled function branches on the values (all zeros run faster)."""
    rng = np.random.default_rng(seed)
    return {name: 0.5 * rng.normal(size=np.shape(value)) for name, value in model.initial_point().items()}


def time_per_call(fn, calls=20):
    """Median seconds of ``fn()`` over ``calls`` calls, after one."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def sample(model, step, draws, tune, chains=1, cores=1, seed=1, **kwargs):
    """``pm.sample`` with ``step``; the InferenceData and draws per second (tuning draws included)."""
    import pymc as pm
    with model:
        idata = pm.sample(draws=draws, tune=tune, chains=chains, cores=cores, step=step, random_seed=seed,
                          progressbar=False, compute_convergence_checks=False, discard_tuned_samples=False,
                          **kwargs)
    seconds = float(idata.posterior.attrs["sampling_time"])
    steps = sum(int(idata[group]["n_steps"].sum()) for group in ("warmup_sample_stats", "sample_stats")
                if group in idata.children)
    return idata, dict(draws_per_s=chains * (draws + tune) / seconds, steps_per_s=steps / seconds,
                       seconds=seconds)


def pymc_alone(model, draws, tune):
    """PyMC by itself, one chain with its BLAS on every core: its value-and-gradient function,
    pm.find_MAP and its NUTS."""
    import pymc as pm
    from threadpoolctl import threadpool_limits
    point = typical_point(model)
    combined = model.logp_dlogp_function(ravel_inputs=True)
    q = np.concatenate([np.ravel(point[v.name]) for v in model.continuous_value_vars])
    with threadpool_limits(os.cpu_count()):
        out = dict(eval_s=time_per_call(lambda: combined._pytensor_function(q)))
    start = time.perf_counter()
    with warnings.catch_warnings():          # its note that a later release returns InferenceData
        warnings.simplefilter("ignore", FutureWarning)
        out["map"] = pm.find_MAP(model=model, progressbar=False, jitter=False)
    out["map_s"] = time.perf_counter() - start
    with model:
        step = pm.NUTS()
    out["idata"], out["nuts"] = sample(model, step, draws, tune, blas_cores=os.cpu_count())
    return out


def on_devices(model, draws, tune):
    """The same on every device of the forked runtime: logp and gradient, find_MAP, NUTS."""
    from synkhronos.extensions import pymc as synk_pymc
    point = typical_point(model)
    start = time.perf_counter()
    density = synk_pymc.logp_dlogp_function(model)
    density(point)
    out = dict(build_s=time.perf_counter() - start, eval_s=time_per_call(lambda: density(point)))
    start = time.perf_counter()
    out["map"] = synk_pymc.find_MAP(model=model)
    out["map_s"] = time.perf_counter() - start
    with model:
        step = synk_pymc.NUTS()
    out["idata"], out["nuts"] = sample(model, step, draws, tune)
    return out


def report(alone, ours, devices, out=print):
    mean = {name: r["idata"].posterior["b"].mean(("chain", "draw")).values for name, r in
            (("alone", alone), ("ours", ours))}
    rows = [("one logp + gradient (ms)", 1e3 * alone["eval_s"], 1e3 * ours["eval_s"]),
            ("find_MAP, compiling included (s)", alone["map_s"], ours["map_s"]),
            ("NUTS draws per second", alone["nuts"]["draws_per_s"], ours["nuts"]["draws_per_s"]),
            ("NUTS leapfrog steps per second", alone["nuts"]["steps_per_s"], ours["nuts"]["steps_per_s"])]
    out(f"{'':34s} {'PyMC alone':>12s} {f'{devices} devices':>12s} {'speed-up':>9s}")
    for label, a, b in rows:
        faster = a / b if "(" in label else b / a
        out(f"{label:34s} {a:12.2f} {b:12.2f} {faster:8.2f}x")
    gap = max(float(np.max(np.abs(ours["map"][k] - alone["map"][k]))) for k in alone["map"])
    out(f"MAP: largest difference from pm.find_MAP {gap:.1e}")
    out(f"posterior means of the slopes differ by at most {np.max(np.abs(mean['ours'] - mean['alone'])):.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--features", type=int, default=10)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--tune", type=int, default=200)
    args = p.parse_args(argv)
    model = make_model(args.rows, args.features)
    print(f"logistic regression: {args.rows:,} rows, {args.features} slopes; PyMC alone first")
    alone = pymc_alone(model, args.draws, args.tune)
    import synkhronos as synk
    synk.fork(args.devices)
    try:
        ours = on_devices(model, args.draws, args.tune)
    finally:
        synk.close()
    report(alone, ours, args.devices)


if __name__ == "__main__":
    main()
