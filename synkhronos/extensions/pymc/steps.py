"""PyMC's NUTS and MAP on the data-parallel log-density of :mod:`.density`.

:class:`NUTS` is PyMC's own sampler given that function in place of the one it
compiles; :func:`find_MAP` runs the optimizer ``pm.find_MAP`` runs on it and
returns what ``pm.find_MAP`` returns.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, NoReturn

import numpy as np
import pymc as pm
from pymc.blocking import DictToArrayBijection, RaveledVars
from pymc.initial_point import make_initial_point_fns_per_chain
from pymc.model import modelcontext
from pymc.util import get_random_generator, get_value_vars_from_user_vars
from pymc.vartypes import discrete_types

from .density import LogpDlogp, logp_dlogp_function

__all__ = ["NUTS", "find_MAP"]

#: why a sampler's chains cannot run in processes of their own
_ONE_PROCESS = ("the devices of synkhronos are driven from this process, so chains run one after "
                "another here, each on every device: pass cores=1 to pm.sample")


class _SamplerFunction:
    """The face of PyMC's ``ValueGradFunction`` that its samplers call: a raveled vector in,
    ``(logp, dlogp)`` out; the values outside the gradient through ``_extra_vars_shared``."""

    _raveled_inputs = True
    trust_input = True

    def __init__(self, density: LogpDlogp) -> None:
        self._density = density
        self.dtype = density.dtype
        self._pid = os.getpid()
        self._extra_vars_shared = {v.name: _ExtraValue(density, v.name) for v in density.extra_vars}

    def _pytensor_function(self, q: np.ndarray) -> tuple[float, np.ndarray]:
        if os.getpid() != self._pid:
            raise RuntimeError(f"a synkhronos NUTS step was called in a process PyMC started: {_ONE_PROCESS}")
        return self._density.raveled(q)


class _ExtraValue:
    """Takes ``set_value`` as the shared variable of a value outside the gradient would."""

    def __init__(self, density: LogpDlogp, name: str) -> None:
        self._density, self._name = density, name

    def set_value(self, value: Any, borrow: bool = False) -> None:
        self._density.set_extra_values({self._name: value})

    def get_value(self, borrow: bool = False) -> np.ndarray:
        return self._density.extra_value(self._name)


class NUTS(pm.NUTS):
    """PyMC's No-U-Turn sampler on the model's log-density with the likelihood split over the devices.

    Takes what ``pm.NUTS`` takes, the model first. Give it to
    ``pm.sample(step=..., cores=1)``: the chains run one after another in this
    process, each on every device, and ``pm.sample`` returns PyMC's own
    ``InferenceData``.

    Parameters
    ----------
    model : pymc.Model, optional
        The model (default: the one of the enclosing ``with`` block).
    vars : list, optional
        The variables to sample (default: every continuous one); others may be
        sampled by other step methods beside it.
    density : LogpDlogp, optional
        The model's density over those variables, if already built
        (:func:`~.density.logp_dlogp_function`).
    where : {"auto", "devices", "here"}
        Where the density is computed (see :func:`~.density.logp_dlogp_function`).
    **kwargs
        As ``pm.NUTS`` (``target_accept``, ``max_treedepth``, ...).
    """

    def __init__(self, model: Any = None, *, vars: Any = None, density: LogpDlogp | None = None,
                 where: str = "auto", **kwargs: Any) -> None:
        model = modelcontext(model)
        grad_vars = (model.continuous_value_vars if vars is None
                     else get_value_vars_from_user_vars(vars, model))
        if density is not None and list(density.grad_vars) != list(grad_vars):
            raise ValueError("the density given is not over the variables this step samples")
        self.density = density if density is not None else \
            logp_dlogp_function(model, grad_vars=grad_vars, where=where)
        super().__init__(vars=vars, model=model, logp_dlogp_func=_SamplerFunction(self.density), **kwargs)

    def __reduce__(self) -> NoReturn:
        raise pickle.PicklingError(f"a synkhronos NUTS step is not pickled: {_ONE_PROCESS}")


#: L-BFGS-B's ``ftol`` unless one is given. scipy's (2.2e-9) is relative to ``|logp|``, which grows
#: with the rows: over 200k rows it stops up to 1e-3 short in logp, and further in the parameters the
#: data barely pin down (a hierarchical scale), wherever the float rounding of the gradient led the
#: search. This one stops within rounding of the maximum at any data size.
MAP_FTOL = 1e-12


def find_MAP(method: str = "L-BFGS-B", *, vars: Any = None, use_grad: bool | None = None,
             use_hess: bool | None = None, use_hessp: bool | None = None, initvals: dict | None = None,
             jitter: bool | None = None, jitter_max_retries: int = 10, random_seed: Any = None,
             progressbar: Any = False, compute_hessian: bool = False, return_inferencedata: bool = False,
             idata_kwargs: dict | None = None, model: Any = None, backend: str | None = None,
             compile_kwargs: dict | None = None, where: str = "auto", **optimizer_kwargs: Any) -> Any:
    """The maximum a posteriori point, as ``pm.find_MAP`` finds it, on every device.

    Takes ``pm.find_MAP``'s arguments. The optimizer is the one
    ``pm.find_MAP`` drives (``better_optimize.minimize`` over scipy's methods),
    on ``-logp`` without the Jacobian terms and its gradient, both from
    :func:`~.density.logp_dlogp_function`.

    Parameters
    ----------
    method : str
        A gradient-based ``scipy.optimize.minimize`` method (default ``"L-BFGS-B"``).
    vars : list, optional
        Continuous variables to optimize (default: all); the others keep their initial values.
    use_grad : bool, optional
        True or None: the optimizer follows the gradient (False is refused).
    use_hess, use_hessp, compute_hessian : optional
        Refused when set: no Hessian is computed over the devices; ``pm.find_MAP(...,
        compute_hessian=True, initvals=<the point found>)`` gives one at the point.
    initvals, jitter, jitter_max_retries, random_seed, progressbar : optional
        As ``pm.find_MAP`` (``jitter=None`` is False).
    return_inferencedata : bool
        As ``pm.find_MAP``: an ``InferenceData`` if True, else a dict of every
        unobserved variable's value (transformed ones included unless
        ``idata_kwargs={"include_transformed": False}``).
    idata_kwargs : dict, optional
    model : pymc.Model, optional
    backend, compile_kwargs : optional
        Refused when set: the density is compiled for the devices (JAX on each).
    where : {"auto", "devices", "here"}
        Where the density is computed (see :func:`~.density.logp_dlogp_function`).
    **optimizer_kwargs
        Passed to the optimizer (``maxiter``, ``tol``, ...). L-BFGS-B gets
        ``ftol=MAP_FTOL`` unless ``ftol`` or ``tol`` is given: scipy's own is
        relative to ``|logp|``, and over many rows it stops short of the
        maximum (``pm.find_MAP`` does too).
    """
    _refuse_unsupported_map_options(use_grad=use_grad, use_hess=use_hess, use_hessp=use_hessp,
                                    compute_hessian=compute_hessian, backend=backend,
                                    compile_kwargs=compile_kwargs, method=method)
    jitter = bool(jitter)
    from better_optimize import minimize
    model = modelcontext(model)
    grad_vars = _map_vars(model, vars)
    rng = get_random_generator(random_seed)
    jittered = {model.values_to_rvs[v] for v in grad_vars} if jitter else set()
    [initial] = make_initial_point_fns_per_chain(model=model, overrides=initvals, jitter_rvs=jittered, chains=1)
    start = initial(int(rng.integers(2**30)))
    density = logp_dlogp_function(model, grad_vars=grad_vars, jacobian=False, where=where)
    density.set_extra_values(start)

    def loss(x: np.ndarray) -> tuple[float, np.ndarray]:
        logp, dlogp = density.raveled(np.asarray(x, dtype=density.dtype))
        return -logp, -dlogp

    def ravel(point: dict[str, np.ndarray]) -> RaveledVars:
        return DictToArrayBijection.map({v.name: point[v.name] for v in grad_vars})

    for _ in range(jitter_max_retries if jitter else 0):
        if np.isfinite(loss(ravel(start).data)[0]):
            break
        start = initial(int(rng.integers(2**30)))
    x0 = ravel(start)
    if method.upper() == "L-BFGS-B" and not {"ftol", "tol", "options"} & set(optimizer_kwargs):
        optimizer_kwargs["ftol"] = MAP_FTOL
    result = minimize(f=loss, x0=x0.data, method=method, progressbar=progressbar, **optimizer_kwargs)
    return _as_pymc_returns(model, start, result, x0, method, return_inferencedata, idata_kwargs or {})


def _refuse_unsupported_map_options(use_grad: bool | None, use_hess: bool | None, use_hessp: bool | None,
                                    compute_hessian: bool, backend: str | None, compile_kwargs: dict | None,
                                    method: object) -> None:
    """Refuse, naming the way, what ``pm.find_MAP`` takes that this one cannot do over the devices."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a scipy.optimize.minimize method name, got {method!r}; give "
                        f"the model as model=")
    if use_grad is False:
        raise ValueError("find_MAP here follows the gradient (use_grad=False is not supported); use "
                         "pm.find_MAP for a gradient-free method")
    asked = [name for name, value in (("use_hess", use_hess), ("use_hessp", use_hessp),
                                      ("compute_hessian", compute_hessian)) if value]
    if asked:
        raise ValueError(f"find_MAP here computes no Hessian ({', '.join(asked)}); for one at the point "
                         f"found, call pm.find_MAP(compute_hessian=True, initvals=<that point>)")
    given = [name for name, value in (("backend", backend), ("compile_kwargs", compile_kwargs))
             if value is not None]
    if given:
        raise ValueError(f"find_MAP here compiles the density for the devices itself; leave "
                         f"{', '.join(given)} out")


def _map_vars(model: Any, vars: Any) -> list:
    """The value variables to optimize, in the model's order; discrete ones are refused."""
    selected = set(model.continuous_value_vars if vars is None else get_value_vars_from_user_vars(vars, model))
    grad_vars = [v for v in model.value_vars if v in selected]
    discrete = [v.name for v in grad_vars if v.dtype in discrete_types]
    if discrete:
        raise ValueError(f"find_MAP here follows gradients and cannot optimize the discrete variables "
                         f"{discrete}; leave them out of vars= or use pm.find_MAP")
    if not grad_vars:
        raise ValueError("the model has no unobserved continuous variables to optimize")
    return grad_vars


def _as_pymc_returns(model: Any, start: dict[str, np.ndarray], result: Any, x0: RaveledVars, method: str,
                     return_inferencedata: bool, idata_kwargs: dict) -> Any:
    """What ``pm.find_MAP`` returns for ``result``, built by PyMC's own code."""
    from pymc.tuning.starting import _map_to_inference_data, _MAPFit
    x_star = RaveledVars(np.asarray(result.x), x0.point_map_info)
    point = DictToArrayBijection.rmap(x_star, start)
    unobserved = model.unobserved_value_vars
    fn = model.compile_fn(unobserved, inputs=model.value_vars, point_fn=False, on_unused_input="ignore",
                          mode="FAST_COMPILE")
    values = dict(zip([var.name for var in unobserved], fn(**point)))
    fit = _MAPFit(model, point, values, fn, result, x_star, None, method)
    if return_inferencedata:
        return _map_to_inference_data(fit, idata_kwargs)
    return fit.as_point(idata_kwargs.get("include_transformed", True))
