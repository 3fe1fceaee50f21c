"""``pm.sample`` as PyMC users write it, with NUTS on the data-parallel log-density.

:func:`sample` takes what ``pm.sample`` takes and returns what it returns. It
starts the chains as ``pm.sample`` does when it makes its own NUTS step
(``init="auto"``: each chain's start jittered, the mass matrix adapted from
their mean), with the step of :class:`~.steps.NUTS`; the chains then run one
after another in this process, each on every device.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import pymc as pm
from pymc.blocking import DictToArrayBijection
from pymc.model import modelcontext
from pymc.step_methods.hmc.quadpotential import QuadPotentialDiagAdapt
from pymc.util import get_random_generator

from ...errors import warn
from .density import LogpDlogp, logp_dlogp_function
from .steps import _ONE_PROCESS, NUTS

__all__ = ["sample", "INITS"]

#: the ways ``pm.sample`` starts its own NUTS that :func:`sample` starts alike ("auto" is the second)
INITS = ("adapt_diag", "jitter+adapt_diag")


def sample(draws: int = 1000, *, tune: int | None = None, chains: int | None = None, cores: int | None = None,
           random_seed: Any = None, step: Any = None, init: str = "auto", initvals: Any = None,
           jitter_max_retries: int = 10, nuts_sampler: str | None = None, model: Any = None,
           where: str = "auto", **kwargs: Any) -> Any:
    """``pm.sample`` with NUTS on the devices: the same arguments, the same ``InferenceData``.

    Parameters
    ----------
    draws, tune, chains, random_seed, initvals, jitter_max_retries, model
        As ``pm.sample``. ``chains`` defaults as there (2 to 4, by the cores
        the machine has), and they run one after another.
    cores : int, optional
        The chains run in this process whatever it is; a number above 1 is
        said once, and sampling goes on.
    step : optional
        A step of your own (a :class:`~.steps.NUTS`, with others beside it):
        then passed to ``pm.sample`` as it is, and ``init`` does not apply.
    init : str
        ``"auto"`` (``"jitter+adapt_diag"``) or ``"adapt_diag"``, started as
        ``pm.sample`` starts them; any other is refused, naming these.
    nuts_sampler : str, optional
        None or ``"pymc"``: the sampler is PyMC's NUTS.
    where : {"auto", "devices", "here"}
        Where the density is computed (see :func:`~.density.logp_dlogp_function`).
    **kwargs
        What else ``pm.sample`` takes (``progressbar``, ``idata_kwargs``,
        ``compute_convergence_checks``, ``var_names``...) goes to it; the
        rest, ``target_accept`` and ``nuts={...}`` included, to the NUTS step
        (``max_treedepth``, ``step_scale``...).

    Returns
    -------
    What ``pm.sample`` returns (an ``InferenceData`` by default).

    Examples
    --------
    >>> import pymc as pm
    >>> from synkhronos.extensions import pymc as synk_pymc
    >>> with pm.Model() as model:
    ...     mu = pm.Normal("mu", 0, 1)
    ...     obs = pm.Normal("obs", mu, 1, observed=np.arange(8.0))
    ...     idata = synk_pymc.sample(30, tune=30, target_accept=0.95, random_seed=1,
    ...                              progressbar=False, compute_convergence_checks=False)
    >>> idata.posterior["mu"].shape[1]
    30
    """
    model = modelcontext(model)
    if nuts_sampler not in (None, "pymc"):
        raise ValueError(f"nuts_sampler={nuts_sampler!r} samples with its own compiled model; the "
                         f"devices serve PyMC's own NUTS: leave nuts_sampler out (or 'pymc')")
    if cores not in (None, 1):
        warn(f"cores={cores}: {_ONE_PROCESS.split(': ')[0]}")
    if chains is None:
        chains = max(2, min(4, os.cpu_count() or 1))
    sample_kwargs, nuts_kwargs = _split_kwargs(kwargs)
    common = dict(draws=draws, tune=tune, chains=chains, cores=1, random_seed=random_seed, model=model,
                  jitter_max_retries=jitter_max_retries, **sample_kwargs)
    if step is not None:
        if nuts_kwargs:
            raise ValueError(f"{sorted(nuts_kwargs)} set the NUTS step sample() would make, and a step "
                             f"was given: pass them to that step (synk_pymc.NUTS(target_accept=...))")
        return pm.sample(step=step, initvals=initvals, **common)
    init = "jitter+adapt_diag" if init == "auto" else init
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one sample() starts NUTS with; use 'auto' "
                         f"('jitter+adapt_diag') or 'adapt_diag', or pm.sample for the others")
    if any(v not in model.continuous_value_vars for v in model.value_vars):
        # pm.sample too starts a compound step unjittered, with NUTS's own mass matrix
        return pm.sample(step=NUTS(model=model, where=where, **nuts_kwargs), initvals=initvals, **common)
    seeds = [int(rng.integers(2**30)) for rng in get_random_generator(random_seed).spawn(chains)]
    density = logp_dlogp_function(model, where=where)
    starts = _chain_starts(model, density, initvals, seeds, "jitter" in init, jitter_max_retries)
    mean = np.mean([DictToArrayBijection.map(p).data for p in starts], axis=0)
    potential = QuadPotentialDiagAdapt(len(mean), mean, np.ones_like(mean), 10, rng=seeds[0])
    nuts = NUTS(model=model, density=density, potential=potential, rng=seeds[0], **nuts_kwargs)
    return pm.sample(step=nuts, initvals=starts, **common)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what goes to ``pm.sample``, what goes to the NUTS step) of :func:`sample`'s other arguments."""
    takes = set(inspect.signature(pm.sample).parameters) - {"kwargs"}
    nuts_kwargs = dict(kwargs.get("nuts") or {})
    for name, value in kwargs.items():
        if name != "nuts" and name not in takes:
            if name in nuts_kwargs:
                raise ValueError(f"{name} was given twice: as an argument and in nuts=")
            nuts_kwargs[name] = value
    return {k: v for k, v in kwargs.items() if k in takes}, nuts_kwargs


def _chain_starts(model: Any, density: LogpDlogp, initvals: Any, seeds: list[int], jitter: bool,
                  retries: int) -> list[dict[str, np.ndarray]]:
    """Each chain's start as ``pm.sample``'s NUTS init finds it, checked on the devices' density."""
    from pymc.sampling.mcmc import _init_jitter

    def logp(point: dict[str, np.ndarray]) -> float:
        return density.raveled(DictToArrayBijection.map(
            {v.name: point[v.name] for v in density.grad_vars}).data)[0]
    return _init_jitter(model, initvals, seeds=seeds, jitter=jitter, jitter_max_retries=retries, logp_fn=logp)
