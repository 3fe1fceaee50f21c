"""PyMC on every device: a model's log-density with its likelihood split over the devices by rows.

A PyMC model's log-density over a large dataset is a sum over the rows of its
observed data, plus the priors. :func:`logp_dlogp_function` computes it and its
gradient with each device taking its share of the rows of every observed
variable (and of the covariates and indices their likelihood reads); the
priors, the Jacobian terms of transformed variables and the potentials that
read no rows are counted once. :func:`sample` is ``pm.sample`` with PyMC's
NUTS on that function (the same arguments, ``target_accept`` included, and the
same ``InferenceData``); :class:`NUTS` is that step, for ``pm.sample(step=...,
cores=1)`` beside other steps; and :func:`find_MAP` is ``pm.find_MAP`` on it.
A model whose likelihood does not split by rows is refused with :class:`UnsplittableModel`, naming the variable and why.

Needs the optional extra: ``pip install "synkhronos[pymc]"``.

Examples
--------
>>> import pymc as pm
>>> from synkhronos.extensions import pymc as synk_pymc
>>> with pm.Model() as model:
...     mu = pm.Normal("mu", 0, 1)
...     obs = pm.Normal("obs", mu, 1, observed=np.arange(8.0))
>>> f = synk_pymc.logp_dlogp_function(model)       # the 8 rows split over the devices
>>> logp, dlogp = f({"mu": np.array(1.0)})
>>> bool(np.isclose(logp, model.compile_logp()({"mu": np.array(1.0)})))
True
>>> dlogp                                          # (28 - 8 * 1) from the rows, -1 from the prior
array([19.])
>>> synk_pymc.find_MAP(model=model)["mu"]          # 28 / 9
array(3.11111111)
>>> with model:
...     idata = pm.sample(draws=20, tune=20, chains=1, cores=1, step=synk_pymc.NUTS(),
...                       random_seed=1, progressbar=False, compute_convergence_checks=False)
>>> idata.posterior["mu"].shape
(1, 20)
"""

from __future__ import annotations

try:
    import pymc  # noqa: F401
except ImportError as err:       # the extra is not installed
    raise ImportError("synkhronos.extensions.pymc needs PyMC: pip install 'synkhronos[pymc]'") from err

from .density import LogpDlogp, logp_dlogp_function
from .sampling import sample
from .steps import NUTS, find_MAP
from .terms import UnsplittableModel

__all__ = ["logp_dlogp_function", "NUTS", "find_MAP", "sample", "LogpDlogp", "UnsplittableModel"]
