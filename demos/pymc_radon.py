"""pymc-examples' multilevel radon model (varying intercepts), ported: pm.sample -> synk_pymc.sample.

The model is the gallery's "varying intercept" model of ``multilevel_modeling``
as written there: county intercepts drawn from a common Normal, one slope for
the floor a house was measured on. Its data are of the radon survey's shape
(919 houses, 85 counties of uneven sizes, 17% measured on the first floor),
drawn here since the survey is not bundled; ``--times N`` repeats them, for a
likelihood over N times the rows. The port changes one line:
``pm.sample(tune=2000, init="adapt_diag", random_seed=32)`` becomes
``synk_pymc.sample(...)`` with the same arguments. PyMC alone runs first in
this process, then the devices; the table compares the posteriors and the
draws per second. (The model's maximum lies down the funnel where
``sigma_a`` shrinks, so the gallery runs no ``find_MAP`` on it, and neither
does this port.)

Examples
--------
    python demos/pymc_radon.py --devices 2
    python demos/pymc_radon.py --times 200 --draws 200 --tune 200
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COUNTIES, HOUSES = 85, 919


def radon_data(times=1, seed=0):
    """(county index, floor, log radon) of the survey's shape, repeated ``times`` times."""
    rng = np.random.default_rng(seed)
    county = np.sort(rng.integers(0, COUNTIES, size=HOUSES))
    floor = (rng.random(HOUSES) < 0.17).astype(float)
    log_radon = rng.normal(1.5, 0.3, COUNTIES)[county] - 0.7 * floor + rng.normal(0, 0.75, HOUSES)
    return np.tile(county, times), np.tile(floor, times), np.tile(log_radon, times)


def make_model(times=1, seed=0):
    """The gallery's varying-intercept model, as its notebook writes it."""
    import pymc as pm
    county, floor, log_radon = radon_data(times, seed)
    coords = {"Level": ["Basement", "Floor"], "obs_id": np.arange(floor.size), "County": np.arange(COUNTIES)}
    with pm.Model(coords=coords) as varying_intercept:
        floor_idx = pm.Data("floor_idx", floor, dims="obs_id")
        county_idx = pm.Data("county_idx", county, dims="obs_id")
        # Hyperpriors:
        a = pm.Normal("a", mu=0.0, sigma=10.0)
        sigma_a = pm.Exponential("sigma_a", 1.0)
        # Varying intercepts:
        a_county = pm.Normal("a_county", mu=a, sigma=sigma_a, dims="County")
        # Common slope:
        b = pm.Normal("b", mu=0.0, sigma=10.0)
        # Expected value per county:
        theta = a_county[county_idx] + b * floor_idx
        # Model error:
        sigma = pm.Exponential("sigma", 1.0)
        pm.Normal("y", theta, sigma=sigma, observed=log_radon, dims="obs_id")
    return varying_intercept


def fit(sample, model, draws, tune):
    """NUTS by ``sample`` (PyMC's or synkhronos's): the InferenceData and draws per second."""
    with model:
        idata = sample(draws=draws, tune=tune, init="adapt_diag", random_seed=32, chains=2,
                       progressbar=False, compute_convergence_checks=False)
    return dict(idata=idata, draws_per_s=2 * draws / float(idata.posterior.attrs["sampling_time"]))


def report(alone, ours, devices, out=print):
    out(f"{'':28s} {'PyMC alone':>12s} {f'{devices} devices':>12s}")
    out(f"{'NUTS draws per second':28s} {alone['draws_per_s']:12.1f} {ours['draws_per_s']:12.1f}")
    for name in ("a", "b", "sigma_a", "sigma"):
        a, o = (r["idata"].posterior[name] for r in (alone, ours))
        out(f"{'posterior mean of ' + name:28s} {float(a.mean()):12.3f} {float(o.mean()):12.3f}")
    divergent = [int(r["idata"].sample_stats["diverging"].sum()) for r in (alone, ours)]
    out(f"{'divergences':28s} {divergent[0]:12d} {divergent[1]:12d}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--times", type=int, default=1)
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--tune", type=int, default=500)
    args = p.parse_args(argv)
    import pymc as pm
    model = make_model(args.times)
    print(f"varying intercepts: {HOUSES * args.times:,} houses, {COUNTIES} counties; PyMC alone first")
    alone = fit(pm.sample, model, args.draws, args.tune)
    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    synk.fork(args.devices)
    try:
        ours = fit(synk_pymc.sample, model, args.draws, args.tune)
    finally:
        synk.close()
    report(alone, ours, args.devices)


if __name__ == "__main__":
    sys.exit(main())
