"""synkhronos.extensions.pymc: a PyMC model's log-density with the likelihood split over the devices.

Every value is compared with PyMC's own compiled functions (``compile_logp``/``compile_dlogp``),
sampler and ``pm.find_MAP`` on the same model. Skipped without the ``pymc`` extra.
"""

import functools
import warnings

import numpy as np
import pytensor
import pytest
from conftest import synk_segments, worker_children
from helpers import DEVICE_COUNTS, source_env

pm = pytest.importorskip("pymc")
az = pytest.importorskip("arviz")

import synkhronos as synk  # noqa: E402
from synkhronos.extensions import pymc as spm  # noqa: E402
from synkhronos.extensions.pymc.steps import MAP_FTOL  # noqa: E402
from synkhronos.runtime import session  # noqa: E402

pytestmark = pytest.mark.timeout(300)

N_ROWS = 103          # splits unevenly over 2 and 3 devices


def logistic_regression(n=N_ROWS, seed=0):
    """Covariates and labels as numpy constants in the graph, an intercept and three slopes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(x @ [1.0, -0.5, 0.25] + 0.3)))).astype("int64")
    with pm.Model() as model:
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=a + x @ b, observed=y)
    return model


def hierarchical(n=N_ROWS, seed=1):
    """Group intercepts read through an index array, with pm.Data and dims (a dim of the rows)."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 4, size=n)
    y = rng.normal(size=n) + 0.5 * groups
    with pm.Model(coords={"obs": np.arange(n), "group": np.arange(4)}) as model:
        g = pm.Data("g", groups, dims="obs")
        mu = pm.Normal("mu", 0, 2)
        tau = pm.HalfNormal("tau", 1)
        offset = pm.Normal("offset", 0, 1, dims="group")
        sigma = pm.Exponential("sigma", 1)
        pm.Normal("y", mu + tau * offset[g], sigma, observed=y, dims="obs")
    return model


def bounded(n=N_ROWS, seed=2):
    """Transformed variables (interval, log) with Jacobian terms, and a potential that reads no rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.3 + 0.6 * x + rng.normal(size=n) * 0.5
    with pm.Model() as model:
        p = pm.Beta("p", 2, 2)
        lo = pm.Uniform("lo", -1, 1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Potential("shrink", -(p - 0.5) ** 2)
        pm.Normal("y", lo + p * x, sigma, observed=y)
    return model


def centred(n=N_ROWS, seed=4):
    """A covariate centred on the mean of all its rows (a pm.Data): computed once, on all rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) + 3.0
    y = 0.7 * (x - x.mean()) + rng.normal(size=n)
    with pm.Model() as model:
        xd = pm.Data("x", x)
        beta = pm.Normal("beta", 0, 1)
        pm.Normal("y", beta * (xd - xd.mean()), 1.0, observed=y)
    return model


def autoregressive(n=N_ROWS, seed=5):
    """A hand-written AR(1): each row's mean reads the row before it (a lagged copy of the data)."""
    import pytensor.tensor as pt
    rng = np.random.default_rng(seed)
    z = np.zeros(n)
    for t in range(1, n):
        z[t] = 0.6 * z[t - 1] + rng.normal()
    with pm.Model() as model:
        rho = pm.Normal("rho", 0, 1)
        sigma = pm.HalfNormal("sigma", 1)
        zd = pm.Data("z_data", z)
        pm.Normal("z", rho * pt.concatenate([[0.0], zd[:-1]]), sigma, observed=z)
    return model


def group_table(n=N_ROWS, seed=6):
    """A pm.Data table of one value per group, read through a group index, with as many groups as
    observations (its length is the row count by coincidence: not rows)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=n)
    g = rng.integers(0, n, size=n)
    y = 1.5 * table[g] + rng.normal(size=n)
    with pm.Model() as model:
        t = pm.Data("table", table)
        gd = pm.Data("g", g)
        beta = pm.Normal("beta", 0, 1)
        pm.Normal("y", beta * t[gd], 1.0, observed=y)
    return model


def mixture(n=N_ROWS, seed=7):
    """pm.NormalMixture (PyMC writes its log-density with an OpFromGraph and a concatenation along
    the components' axis: neither mixes rows)."""
    rng = np.random.default_rng(seed)
    y = np.where(rng.uniform(size=n) < 0.4, -1.0, 1.5) + 0.5 * rng.normal(size=n)
    with pm.Model() as model:
        w = pm.Dirichlet("w", np.ones(2))
        mu = pm.Normal("mu", [-1.0, 1.0], 1.0, shape=2)
        pm.NormalMixture("y", w=w, mu=mu, sigma=0.5, observed=y)
    return model


def softmax_regression(n=N_ROWS, seed=8):
    """Multinomial logistic regression: a softmax over the categories of each row, and the row's
    category read at the row's own position."""
    import pytensor.tensor as pt
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    y = rng.integers(0, 3, size=n)
    with pm.Model() as model:
        B = pm.Normal("B", 0, 1, shape=(2, 3))
        pm.Categorical("y", p=pt.special.softmax(X @ B, axis=-1), observed=y)
    return model


def group_covariate(n=N_ROWS, seed=9):
    """A group-level covariate built from parameters and a pm.Data table of one value per group,
    with as many groups as rows, read at each row's group: a table, broadcast whole."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=n)
    g = rng.integers(0, n, size=n)
    y = 0.5 + 1.2 * u[g] + rng.normal(size=n)
    with pm.Model() as model:
        ud, gd = pm.Data("u", u), pm.Data("g", g)
        g0, g1 = pm.Normal("g0"), pm.Normal("g1")
        a = g0 + g1 * ud
        pm.Normal("y", a[gd], 1.0, observed=y)
    return model


def covariate_scales(n=N_ROWS, seed=10):
    """A regression on as many covariates as rows, each covariate's coefficient scaled by a pm.Data
    value of its own (a vector as long as the rows by coincidence: contracted with the covariates,
    and summed on its own, never read by row)."""
    import pytensor.tensor as pt
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, n)) / np.sqrt(n)
    y = X @ rng.normal(size=n) + rng.normal(size=n)
    with pm.Model() as model:
        scale = pm.Data("scale", rng.uniform(0.5, 2.0, size=n))
        b = pm.Normal("b", 0, 1, shape=n)
        pm.Normal("y", X @ (b * scale) + 0.1 * pt.sum(scale * b), 1.0, observed=y)
    return model


MODELS = {"logistic": logistic_regression, "hierarchical": hierarchical, "bounded": bounded,
          "centred": centred, "autoregressive": autoregressive, "group_table": group_table,
          "mixture": mixture, "softmax": softmax_regression, "group_covariate": group_covariate,
          "covariate_scales": covariate_scales}


def random_points(model, k=3, seed=3):
    rng = np.random.default_rng(seed)
    start = model.initial_point()
    return [{name: value + 0.3 * rng.normal(size=np.shape(value)) for name, value in start.items()}
            for _ in range(k)]


@functools.cache
def pymc_reference(name):
    """A model of MODELS and PyMC's own compiled logp and dlogp of it (compiled once for every test)."""
    model = MODELS[name]()
    return model, model.compile_logp(), model.compile_dlogp()


def assert_equals_pymc(f, name):
    model, logp, dlogp = pymc_reference(name)
    for point in random_points(model):
        value, grad = f(point)
        np.testing.assert_allclose(value, logp(point), rtol=1e-9, atol=0)
        np.testing.assert_allclose(grad, dlogp(point), rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def devices(request):
    if session.active() is not None:
        synk.close()
    synk.fork(request.param)
    yield request.param
    synk.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_logp_and_dlogp_equal_pymc_on_every_device_count(devices, name):
    model, _, _ = pymc_reference(name)
    f = spm.logp_dlogp_function(model, where="devices")
    assert_equals_pymc(f, name)
    # the likelihood really is split: each device's share of the rows is its own
    assert f.fn.spec.inputs and len(f.fn.spec.bcast_inputs) >= 1


@pytest.mark.slow
def test_without_jacobian_equals_pymc(synk2):
    model, _, _ = pymc_reference("bounded")
    f = spm.logp_dlogp_function(model, jacobian=False, where="devices")
    logp = model.compile_logp(jacobian=False)
    dlogp = model.compile_dlogp(jacobian=False)
    for point in random_points(model):
        value, grad = f(point)
        np.testing.assert_allclose(value, logp(point), rtol=1e-9)
        np.testing.assert_allclose(grad, dlogp(point), rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_as_many_covariates_as_rows_split_by_the_rows_and_equal_pymc(synk2):
    """Which arrays hold rows is not decided by their length: a per-covariate pm.Data vector as long
    as the rows, contracted with the covariates, goes whole to every device."""
    f = spm.logp_dlogp_function(pymc_reference("covariate_scales")[0], where="devices")
    assert_equals_pymc(f, "covariate_scales")
    assert [str(v) for v in f.fn.spec.inputs] == ["rows_0", "y"]     # the covariates' rows and y's


def test_outside_the_support_is_minus_infinity_as_in_pymc(synk2):
    with pm.Model() as scale:
        s = pm.Normal("s", 1, 1)
        pm.Normal("y", 0, s, observed=np.ones(6))      # s < 0 is outside the likelihood's support
    g = spm.logp_dlogp_function(scale, where="devices")
    assert g({"s": np.array(-1.0)})[0] == scale.compile_logp()({"s": np.array(-1.0)}) == -np.inf


def posterior_summary(idata, names):
    """Per scalar: mean, sd, and their Monte Carlo standard errors (from ArviZ's bulk ESS)."""
    out = {}
    for name in names:
        draws = idata.posterior[name].values          # (chain, draw, ...)
        ess = np.atleast_1d(az.ess(idata, var_names=[name])[name].values)
        flat = draws.reshape(-1, *draws.shape[2:])
        mean, sd = np.atleast_1d(flat.mean(0)), np.atleast_1d(flat.std(0))
        out[name] = (mean, sd, sd / np.sqrt(ess), sd / np.sqrt(2 * ess))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nuts_posterior_agrees_with_pymc_nuts_within_monte_carlo_error(synk2):
    model = logistic_regression(n=300)
    kwargs = dict(draws=400, tune=300, chains=2, cores=1, progressbar=False, compute_convergence_checks=False)
    with model:
        ours = pm.sample(step=spm.NUTS(where="devices"), random_seed=11, **kwargs)
        theirs = pm.sample(step=pm.NUTS(), random_seed=12, **kwargs)
    assert type(ours) is type(theirs) and set(ours.posterior.data_vars) == set(theirs.posterior.data_vars)
    a, b = posterior_summary(ours, ["a", "b"]), posterior_summary(theirs, ["a", "b"])
    for name in ["a", "b"]:
        mean1, sd1, se_mean1, se_sd1 = a[name]
        mean2, sd2, se_mean2, se_sd2 = b[name]
        assert np.all(np.abs(mean1 - mean2) <= 4 * np.hypot(se_mean1, se_mean2)), (name, mean1, mean2)
        assert np.all(np.abs(sd1 - sd2) <= 4 * np.hypot(se_sd1, se_sd2)), (name, sd1, sd2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sample_takes_what_pm_sample_takes_and_agrees_with_it(synk2):
    """The pymc-examples line, pm.sample(..., target_accept=0.95), with pm.sample swapped for ours."""
    model = hierarchical(n=60)
    kwargs = dict(draws=300, tune=300, chains=2, progressbar=False, compute_convergence_checks=False,
                  target_accept=0.95)
    with model:
        ours = spm.sample(random_seed=21, **kwargs, where="devices")
        theirs = pm.sample(random_seed=22, cores=1, **kwargs)
    assert type(ours) is type(theirs) and set(ours.posterior.data_vars) == set(theirs.posterior.data_vars)
    assert ours.posterior["mu"].shape == (2, 300)
    # the step took target_accept: after tuning, the mean acceptance is near it, not near 0.8
    assert float(ours.sample_stats["acceptance_rate"].mean()) > 0.9
    a, b = posterior_summary(ours, ["mu", "sigma"]), posterior_summary(theirs, ["mu", "sigma"])
    for name in ["mu", "sigma"]:
        mean1, sd1, se_mean1, se_sd1 = a[name]
        mean2, sd2, se_mean2, se_sd2 = b[name]
        assert np.all(np.abs(mean1 - mean2) <= 4 * np.hypot(se_mean1, se_mean2)), (name, mean1, mean2)
    # chains start apart, jittered as pm.sample starts its own NUTS
    with model:
        tuned = spm.sample(draws=1, tune=0, chains=2, random_seed=3, progressbar=False,
                           compute_convergence_checks=False, discard_tuned_samples=False, where="devices")
    assert not np.allclose(tuned.posterior["mu"].values[0], tuned.posterior["mu"].values[1])


@pytest.mark.slow
def test_sample_refuses_what_it_cannot_serve_and_says_cores_once(synk2):
    model = hierarchical(n=20)
    with model:
        with pytest.raises(ValueError, match="leave nuts_sampler out"):
            spm.sample(10, nuts_sampler="numpyro", where="devices")
        with pytest.raises(ValueError, match="'auto'.*pm.sample for the others"):
            spm.sample(10, init="advi+adapt_diag", where="devices")
        with pytest.raises(ValueError, match="pass them to that step"):
            spm.sample(10, step=spm.NUTS(where="devices"), target_accept=0.9, where="devices")
        with pytest.warns(synk.SynkWarning, match="cores=4: the devices of synkhronos are driven"):
            idata = spm.sample(5, tune=5, chains=1, cores=4, random_seed=2, progressbar=False,
                               compute_convergence_checks=False, nuts={"max_treedepth": 4}, where="devices")
    assert idata.posterior["mu"].shape == (1, 5)


@pytest.mark.slow
def test_nuts_beside_another_step_method(synk2):
    """NUTS on some variables, Metropolis on the rest: the values outside the gradient follow the chain."""
    model = hierarchical(n=40)
    with model:
        step = spm.NUTS(vars=[model["mu"], model["offset"], model["sigma"]], where="devices")
        point = model.initial_point()
        point["tau_log__"] = np.array(0.4)
        step._logp_dlogp_func._extra_vars_shared["tau_log__"].set_value(point["tau_log__"])
        q = np.concatenate([np.ravel(point[v.name]) for v in step.density.grad_vars])
        value, grad = step._logp_dlogp_func._pytensor_function(q)
        np.testing.assert_allclose(value, model.compile_logp()(point), rtol=1e-9)
        idata = pm.sample(draws=20, tune=20, chains=1, cores=1, step=[step, pm.Metropolis([model["tau"]])],
                          random_seed=5, progressbar=False, compute_convergence_checks=False)
    assert idata.posterior["tau"].shape == (1, 20)


@pytest.mark.slow
def test_chains_in_processes_of_their_own_are_refused_and_the_runtime_stays_usable(synk2):
    """pm.sample(cores=2): a forked chain process refuses to compute (the devices are driven from
    this process); where PyMC pickles the step instead, it falls back to sampling in this process."""
    model, _, _ = pymc_reference("logistic")
    f = spm.logp_dlogp_function(model, where="devices")
    kwargs = dict(draws=5, tune=5, chains=2, cores=2, random_seed=1, progressbar=False,
                  compute_convergence_checks=False)
    with model, pytest.raises(Exception, match="pass cores=1 to pm.sample"):
        pm.sample(step=spm.NUTS(where="devices"), mp_ctx="fork", **kwargs)
    assert_equals_pymc(f, "logistic")
    with model:
        idata = pm.sample(step=spm.NUTS(where="devices"), mp_ctx="forkserver", **kwargs)
    assert idata.posterior["b"].shape == (2, 5, 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["logistic", "bounded"])
def test_find_map_equals_pymc_find_map(synk2, name):
    model, _, _ = pymc_reference(name)
    ours = spm.find_MAP(model=model, where="devices")
    with pytest.warns(FutureWarning):       # as ours stops (see MAP_FTOL), and as PyMC's own does
        theirs = pm.find_MAP(model=model, progressbar=False, ftol=MAP_FTOL)
        default = pm.find_MAP(model=model, progressbar=False)
    assert set(ours) == set(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(ours[key], default[key], rtol=1e-4, atol=1e-6)
    idata = spm.find_MAP(model=model, return_inferencedata=True, where="devices")
    reference = pm.find_MAP(model=model, return_inferencedata=True, jitter=False, progressbar=False)
    assert set(idata.children) == set(reference.children)
    # pm.find_MAP's signature: the method first, the model by keyword
    by_position = spm.find_MAP("BFGS", model=model, use_grad=True, jitter=None, where="devices")
    for key in theirs:
        np.testing.assert_allclose(by_position[key], theirs[key], rtol=1e-3, atol=1e-6)   # BFGS, not L-BFGS-B


@pytest.mark.slow
def test_a_likelihood_too_small_to_gain_is_computed_here_and_said_once(synk2, monkeypatch):
    """where="auto" times PyMC's own function and the devices' at the initial point and keeps the
    faster: 40 rows gain nothing from a call through the runtime."""
    from synkhronos.extensions.pymc import density
    monkeypatch.setattr(density, "_SAID_HERE", set())        # said once per process: this test's
    model, _, _ = pymc_reference("hierarchical")
    with pytest.warns(synk.SynkWarning, match=r"ms in this process as PyMC compiles it and .* ms on the "
                                              r"devices: too small to gain.*where='devices'"):
        f = spm.logp_dlogp_function(model)
    assert f.here is not None
    assert_equals_pymc(f, "hierarchical")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # said once
        g = spm.logp_dlogp_function(model, where="here")
    assert g.here is not None and spm.logp_dlogp_function(model, where="devices").here is None
    with pytest.raises(ValueError, match="where='gpu' is not one of"):
        spm.logp_dlogp_function(model, where="gpu")
    # a NUTS step on it samples as on the devices, values outside the gradient included
    with model:
        step = spm.NUTS(vars=[model["mu"], model["offset"], model["sigma"]], where="here")
        idata = pm.sample(draws=10, tune=10, chains=1, cores=1, step=[step, pm.Metropolis([model["tau"]])],
                          random_seed=5, progressbar=False, compute_convergence_checks=False)
    assert idata.posterior["tau"].shape == (1, 10)


@pytest.mark.slow
def test_a_likelihood_the_devices_cannot_compute_is_computed_here_under_auto(synk2, monkeypatch):
    """A censored Student-t: PyTensor's JAX backend has no conversion of its CDF's gradient (a
    ScalarLoop), so the devices cannot run it. where="auto" computes it here, as PyMC does, and
    says why; where="devices" raises the devices' error, and the runtime goes on."""
    from synkhronos.extensions.pymc import density
    # (another model computed here because it was faster: this reason is said all the same)
    monkeypatch.setattr(density, "_SAID_HERE", {"faster here"})
    y = np.clip(np.random.default_rng(8).standard_t(4, 60), -1.5, 1.5)
    with pm.Model() as model:
        mu, nu, s = pm.Normal("mu"), pm.Gamma("nu", 2, 0.1), pm.HalfNormal("s")
        pm.Censored("y", pm.StudentT.dist(nu=nu, mu=mu, sigma=s), lower=-1.5, upper=1.5, observed=y)
    with pytest.warns(synk.SynkWarning, match=r"the devices cannot compute it \(NotImplementedError: .*"
                                              r"ScalarLoop\): it is computed in this process as PyMC"):
        f = spm.logp_dlogp_function(model)
    assert f.here is not None
    point = model.initial_point()                          # the initial point, and another
    pymc_logp, pymc_dlogp = model.compile_logp(), model.compile_dlogp()
    for at in (point, {k: v + 0.3 for k, v in point.items()}):
        logp, dlogp = f(at)
        np.testing.assert_allclose(logp, pymc_logp(at), rtol=1e-12)
        np.testing.assert_allclose(dlogp, pymc_dlogp(at), rtol=1e-10)
    with pytest.raises(synk.WorkerError, match="NotImplementedError"):
        spm.logp_dlogp_function(model, where="devices")(point)
    assert session.active() is not None


def radon_like(times, seed=0):
    """The radon varying-intercept model of pymc-examples on data of its shape (919 rows, 85
    counties, a floor covariate), repeated ``times`` times."""
    rng = np.random.default_rng(seed)
    county = np.sort(rng.integers(0, 85, size=919))
    floor = (rng.random(919) < 0.17).astype(float)
    y = rng.normal(1.5, 0.3, 85)[county] - 0.7 * floor + rng.normal(0, 0.75, 919)
    county, floor, y = np.tile(county, times), np.tile(floor, times), np.tile(y, times)
    with pm.Model(coords={"county": np.arange(85)}) as model:
        floor_idx, county_idx = pm.Data("floor_idx", floor), pm.Data("county_idx", county)
        mu_a, sigma_a = pm.Normal("mu_a", 0.0, 10.0), pm.Exponential("sigma_a", 1)
        alpha = pm.Normal("alpha", mu_a, sigma_a, dims="county")
        beta, sigma = pm.Normal("beta", 0.0, 10.0), pm.Exponential("sigma", 1.0)
        pm.Normal("y", alpha[county_idx] + beta * floor_idx, sigma=sigma, observed=y)
    return model


@pytest.mark.slow
def test_find_map_reaches_the_maximum_over_many_rows(synk2):
    """L-BFGS-B's default ftol is relative to |logp|: over 184k rows pm.find_MAP stops short, along
    the hierarchical scale the data barely pin down; ours reaches the maximum."""
    model = radon_like(200)
    names = ["mu_a", "sigma_a_log__", "alpha", "beta", "sigma_log__"]
    logp = model.compile_logp(jacobian=False)
    with pytest.warns(FutureWarning):
        short = pm.find_MAP(model=model, progressbar=False)
        best = pm.find_MAP(model=model, progressbar=False, ftol=1e-15, gtol=1e-9, maxiter=20000)
    ours = spm.find_MAP(model=model, where="devices")
    at = {name: {k: p[k] for k in names} for name, p in (("short", short), ("best", best), ("ours", ours))}
    assert logp(at["ours"]) >= logp(at["best"]) - 1e-4
    assert logp(at["ours"]) >= logp(at["short"]) - 1e-6
    for k in names:
        np.testing.assert_allclose(ours[k], best[k], atol=1e-3)


def test_find_map_refuses_what_it_cannot_do_over_the_devices(synk2):
    model, _, _ = pymc_reference("logistic")
    for options, match in [(dict(compute_hessian=True), "computes no Hessian .*compute_hessian=True"),
                           (dict(use_hess=True), "computes no Hessian"),
                           (dict(use_grad=False), "use_grad=False"),
                           (dict(backend="numba"), "leave backend out"),
                           (dict(compile_kwargs={}), "leave compile_kwargs out")]:
        with pytest.raises(ValueError, match=match):
            spm.find_MAP(model=model, **options, where="devices")
    with pytest.raises(TypeError, match="give the model as model="):
        spm.find_MAP(model, where="devices")


def test_a_model_that_does_not_split_is_computed_here_unless_the_devices_are_asked_for(synk2, monkeypatch):
    """Two observed variables of 40 and 7 rows: PyMC runs it, so where='auto' and 'here' do too (said
    once, with the reason); where='devices' refuses it, naming 'here'."""
    from synkhronos.extensions.pymc import density
    monkeypatch.setattr(density, "_SAID_HERE", set())
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        pm.Normal("y", a, 1, observed=np.arange(40.0))
        pm.Normal("y2", a, 3, observed=np.arange(7.0))
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    with pytest.raises(spm.UnsplittableModel, match="different row counts.*where='here'"):
        spm.logp_dlogp_function(model, where="devices")
    with pytest.warns(synk.SynkWarning, match="does not split over the devices .*different row counts") as said:
        auto = spm.logp_dlogp_function(model)
    assert {w.filename for w in said if issubclass(w.category, synk.SynkWarning)} == {__file__}   # the user's line
    for f in (auto, spm.logp_dlogp_function(model, where="here")):
        for point in ({"a": np.array(0.5)}, {"a": np.array(-2.0)}):
            value, grad = f(point)
            np.testing.assert_allclose(value, logp(point), rtol=1e-12)
            np.testing.assert_allclose(grad, dlogp(point), rtol=1e-12)
    with model:
        idata = spm.sample(20, tune=20, chains=1, random_seed=3, progressbar=False,
                           compute_convergence_checks=False)
    assert idata.posterior["a"].shape == (1, 20)


def _refused(build, match):
    with pm.Model() as model:
        build()
    with pytest.raises(spm.UnsplittableModel, match=match):
        spm.logp_dlogp_function(model, where="devices")


@pytest.mark.slow
def test_models_that_do_not_split_by_rows_are_refused_naming_the_variable(synk2):
    rng = np.random.default_rng(0)
    y = rng.normal(size=20)

    def potential_over_rows():
        mu = pm.Normal("mu")
        pm.Potential("all_rows", -((y - mu) ** 2).sum())
        pm.Normal("obs", mu, 1, observed=y)
    _refused(potential_over_rows, "potential 'all_rows' reads the observed rows")

    def no_row_axis():
        mu = pm.Normal("mu")
        pm.MvNormal("joint", mu * np.ones(20), np.eye(20), observed=y)
    _refused(no_row_axis, "observed variable 'joint' has no row axis")

    def scalar_observation():
        mu = pm.Normal("mu")
        pm.Normal("one", mu, 1, observed=1.5)
    _refused(scalar_observation, "observed variable 'one' has no row axis")

    def data_in_a_prior():
        data = pm.Data("shared_y", y)
        mu = pm.Normal("mu", data.mean(), 1)
        pm.Normal("obs", mu, 1, observed=data)
    _refused(data_in_a_prior, "'mu' reads the values of shared_y")

    def parameter_mixing_rows():
        import pytensor.tensor as pt
        data = pm.Data("x", y)
        mu = pm.Normal("mu")
        pm.Normal("running", pt.cumsum(mu * data), 1, observed=y)
    _refused(parameter_mixing_rows, "log-likelihood of 'running' reads the rows of x through a cumulative")

    def mean_of_parameter_times_rows():
        data = pm.Data("x", y)
        mu = pm.Normal("mu")
        pm.Normal("centered", mu * data - (mu * data).mean(), 1, observed=y)
    _refused(mean_of_parameter_times_rows, "'centered' reads the rows of x through a reduction")

    def rows_also_read_through_a_parameter_index():
        import pytensor.tensor as pt
        data = pm.Data("x", y)
        mu = pm.Normal("mu")
        k = pm.Categorical("k", np.ones(20) / 20)
        # x as rows (mu * x) and as a table read at k: split, a device's table would lack rows
        pm.Normal("picked", mu * data + data[pt.arange(20) * 0 + k], 1, observed=y)
    _refused(rows_also_read_through_a_parameter_index, "'picked'")

    def one_parameter_per_row():
        z = pm.Normal("z", shape=20)
        pm.Normal("obs", z, 1, observed=y)
    _refused(one_parameter_per_row, "free variable 'z' has one value per row")

    def no_observed():
        pm.Normal("mu")
    _refused(no_observed, "no observed variables")

    def missing_values():             # PyMC imputes them: a free variable per missing row
        mu = pm.Normal("mu")
        pm.Normal("gaps", mu, 1, observed=np.where(np.arange(20) % 7 == 3, np.nan, y))
    with pytest.warns(Warning):      # PyMC's ImputationWarning
        _refused(missing_values, r"'gaps' has missing values .* imputes as a free variable 'gaps_unobserved'")
    # refused before anything ran: the runtime still computes
    assert_equals_pymc(spm.logp_dlogp_function(pymc_reference("bounded")[0], where="devices"), "bounded")


def test_as_many_groups_as_rows_names_the_pm_data_index_and_that_index_splits(synk2):
    """Five groups over five rows, read through a numpy index (the rugby notebook's style): the
    refusal says the count may be a coincidence and names pm.Data for the index, and the model
    with the index as pm.Data splits and equals PyMC's."""
    y = np.random.default_rng(3).normal(size=5)
    groups = np.array([4, 3, 2, 1, 0])
    with pm.Model() as by_numpy:
        a = pm.Normal("a", 0, 1, shape=5)
        pm.Normal("y", a[groups], 1, observed=y)
    with pytest.raises(spm.UnsplittableModel, match="5 groups over 5 rows is a coincidence, give the "
                                                    "group index as pm.Data"):
        spm.logp_dlogp_function(by_numpy, where="devices")
    with pm.Model() as by_data:
        index = pm.Data("groups", groups)
        a = pm.Normal("a", 0, 1, shape=5)
        pm.Normal("y", a[index], 1, observed=y)
    f = spm.logp_dlogp_function(by_data, where="devices")
    point = {"a": np.linspace(-1, 1, 5)}
    np.testing.assert_allclose(f(point)[0], by_data.compile_logp()(point), rtol=1e-12)
    np.testing.assert_allclose(f(point)[1], by_data.compile_dlogp()(point), rtol=1e-12)


@pytest.mark.slow
def test_a_density_copied_before_pm_set_data_is_refused_and_one_built_after_equals_pymc(synk2):
    """The devices hold a copy of the model's data (its rows, and what reads data alone, computed
    once); ``pm.set_data``, or a ``set_value`` of a plain shared variable (PyMC3's way), gives the
    model others. The old copy is refused at its next evaluation, naming the variable, and a
    density built again equals PyMC's own on the new data."""
    rng = np.random.default_rng(5)
    covariate = pytensor.shared(rng.normal(size=30), name="plain_rows")
    prior_scale = pytensor.shared(np.array(2.0), name="plain_prior_scale")
    with pm.Model() as model:
        x = pm.Data("x_rows", rng.normal(size=30))
        scale = pm.Data("scale_table", np.array([1.0, 2.0]))       # not rows: read whole
        b = pm.Normal("b")
        c = pm.Normal("c", 0.0, prior_scale)
        pm.Normal("y", b * x + c * covariate, scale[0], observed=rng.normal(size=30), shape=x.shape)
    point = {"b": np.array(0.3), "c": np.array(-0.7)}
    shared = {"plain_rows": covariate, "plain_prior_scale": prior_scale}

    def set_data(name: str, value: np.ndarray) -> None:
        if name in shared:
            shared[name].set_value(value)
        else:
            pm.set_data({name: value}, model=model)
    # (a prior's scale is read by the devices' function itself, a shared variable of the runtime:
    # a set_value reaches every device, and the density follows it)
    followed = synk.function([], (prior_scale * 1.0, None))
    for name, value, how in (("scale_table", np.array([3.0, 2.0]), "pm.set_data"),
                             ("x_rows", rng.normal(size=30), "pm.set_data"),
                             ("plain_rows", rng.normal(size=30), "set_value"),
                             ("plain_prior_scale", np.array(0.5), None)):
        f = spm.logp_dlogp_function(model, where="devices")
        np.testing.assert_allclose(f(point)[0], model.compile_logp()(point), rtol=1e-12)
        # the same data given again, or a function of the runtime reading the variable: no change
        variable = shared[name] if name in shared else model[name]
        set_data(name, np.array(variable.get_value()))
        synk.function([], (variable.sum(), None))()
        np.testing.assert_allclose(f(point)[0], model.compile_logp()(point), rtol=1e-12)
        set_data(name, value)
        if how is None:
            np.testing.assert_allclose(followed(), 0.5)
            np.testing.assert_allclose(f(point)[0], model.compile_logp()(point), rtol=1e-12)
            np.testing.assert_allclose(f(point)[1], model.compile_dlogp()(point), rtol=1e-12)
            continue
        with pytest.raises(RuntimeError, match=f"{how} changed '{name}' .* build it again"):
            f(point)
        again = spm.logp_dlogp_function(model, where="devices")
        np.testing.assert_allclose(again(point)[0], model.compile_logp()(point), rtol=1e-12)
        np.testing.assert_allclose(again(point)[1], model.compile_dlogp()(point), rtol=1e-12)


@pytest.mark.slow
def test_nothing_left_behind(synk2):
    model, _, _ = pymc_reference("bounded")
    f = spm.logp_dlogp_function(model, where="devices")
    f(model.initial_point())
    workers = worker_children()
    del f
    synk.close()
    assert not [n for n in synk_segments() if n.startswith(synk2.prefix)]
    assert not set(workers) & set(worker_children())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ported_radon_model_samples_the_posterior_pymc_samples():
    """pymc-examples' varying-intercept model with pm.sample swapped for synk_pymc.sample."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "demos", "pymc_radon.py"), "--draws", "300",
                          "--tune", "300"], capture_output=True, text=True, timeout=500,
                         env=source_env())
    assert out.returncode == 0, out.stdout + out.stderr
    means = [line.split()[-2:] for line in out.stdout.splitlines() if line.startswith("posterior mean of")]
    assert len(means) == 4
    for alone, ours in means:
        assert abs(float(alone) - float(ours)) < 0.05, out.stdout
