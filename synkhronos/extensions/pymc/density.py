"""A PyMC model's log-density and its gradient as one data-parallel function.

Each device computes the log-likelihood of its own rows and its gradient
(reduced with ``"sum"``); the priors, their Jacobian terms and the potentials
that read no rows are taken from the master alone (mode ``None``), so they are
counted once, exactly as PyMC counts them, whatever the device count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor
import pytensor.tensor as pt
import xxhash
from pymc.blocking import DictToArrayBijection
from pymc.logprob.utils import local_check_parameter_to_ninf_switch, local_remove_check_parameter
from pymc.model import modelcontext
from pymc.pytensorf import join_nonshared_inputs
from pytensor.graph.basic import Variable
from pytensor.graph.rewriting.basic import in2out
from pytensor.graph.rewriting.utils import rewrite_graph

from ...api.data import data
from ...api.function import function
from ...errors import Failure, WorkerError, warn
from .terms import SplitModel, UnsplittableModel, split_model

if TYPE_CHECKING:
    from pymc.model.core import ValueGradFunction

__all__ = ["LogpDlogp", "logp_dlogp_function", "WHERE"]


#: where a density may be computed (see :func:`logp_dlogp_function`)
WHERE = ("auto", "devices", "here")
#: evaluations timed per way when ``where="auto"`` chooses (the median counts)
TIMED_CALLS = 7
#: the reasons this process has given for a density computed here (each said once)
_SAID_HERE: set[str] = set()


def _say_once(reason: str, message: str) -> None:
    """Warn ``message`` once in this process per ``reason``, at the user's line."""
    if reason not in _SAID_HERE:
        _SAID_HERE.add(reason)
        warn(message)


def logp_dlogp_function(model: Any = None, grad_vars: list | None = None, jacobian: bool = True,
                        where: str = "auto") -> LogpDlogp:
    """The model's joint log-density and its gradient, the likelihood split over the devices.

    Parameters
    ----------
    model : pymc.Model, optional
        The model (default: the one of the enclosing ``with`` block).
    grad_vars : list of value variables, optional
        The variables of the gradient (default: ``model.continuous_value_vars``,
        as ``model.compile_dlogp()``).
    jacobian : bool
        Whether the log-density holds the Jacobian terms of the transformed
        variables (as ``model.logp(jacobian=...)``; ``pm.find_MAP`` leaves them out).
    where : {"auto", "devices", "here"}
        ``"devices"``: split over the runtime's devices (a model whose
        likelihood does not split is refused). ``"here"``: in this process,
        as PyMC compiles it. ``"auto"`` (default) times both at the model's
        initial point when built and keeps the faster, saying once when that
        is here: a likelihood too small to gain from the devices (each
        evaluation is one call through the runtime) then costs what it costs
        in PyMC alone; a model that does not split is computed here, said
        once with the reason. Either way computes the same density, to
        rounding: a seeded chain may differ between the two by that
        rounding, so pass ``where`` for draws equal bit for bit from run to run.

    Returns
    -------
    LogpDlogp
        ``f(point) -> (logp, dlogp)``: ``point`` a dict as ``model.initial_point()``
        gives, ``logp`` a float, ``dlogp`` in the order of ``grad_vars``.

    Raises
    ------
    UnsplittableModel
        For a model whose likelihood does not split by rows (see :mod:`.terms`).

    Notes
    -----
    The data are copied into shared memory (``synk.data``) when the function
    is built; after ``pm.set_data``, or a ``set_value`` of a shared variable
    the model reads, build it again (the old one refuses to compute).
    """
    if where not in WHERE:
        raise ValueError(f"where={where!r} is not one of {list(WHERE)}")
    model = modelcontext(model)
    grad_vars = list(model.continuous_value_vars if grad_vars is None else grad_vars)
    split, unsplittable = None, None
    if where != "here":
        try:
            split = split_model(model, jacobian)
        except UnsplittableModel as why:
            if where == "devices":
                raise UnsplittableModel(f"{why}; where='here' (or 'auto') computes it in this process, "
                                        f"as PyMC does") from None
            unsplittable = str(why)
    density = LogpDlogp(model, split, grad_vars)
    if split is None:
        density.compute_here(jacobian, why=unsplittable)
    elif where == "auto":
        density.compute_here_if_faster(jacobian)
    return density


class LogpDlogp:
    """``f(point) -> (logp, dlogp)`` on every device; made by :func:`logp_dlogp_function`.

    ``f.raveled(q)`` takes the gradient's variables raveled and joined in one
    vector (the order of ``grad_vars``), as PyMC's samplers hold them; the
    other value variables then keep the values of ``f.set_extra_values``.
    """

    def __init__(self, model: Any, split: SplitModel | None, grad_vars: list) -> None:
        self.model = model
        self.grad_vars = grad_vars
        self.extra_vars = [v for v in model.value_vars if v not in grad_vars]
        point = model.initial_point()
        self.dtype = np.result_type(*[point[v.name].dtype for v in grad_vars]) if grad_vars else np.float64
        q = DictToArrayBijection.map({v.name: point[v.name] for v in grad_vars})
        self._point_map_info = q.point_map_info
        #: PyMC's own function of the density in this process, when it computes here (else None)
        self.here: Any = None
        #: the function on the devices (None for a model that does not split: it computes here)
        self.fn: Any = None
        self._extras: list = []
        #: the model's shared data copied into the devices' function, and its value then
        self._data_held: list = []
        if split is None:
            return
        outputs, self._joined = self._graph(split, point, model.check_bounds)
        self.fn = function(split.row_inputs, list(zip(outputs, ["sum", "sum", None, None])),
                           bcast_inputs=[self._joined, *self.extra_vars],
                           name=f"pymc_logp_dlogp_{model.name or 'model'}", on_unused_input="ignore")
        self._rows = [data(value, var=var) for var, value in zip(split.row_inputs, split.row_values)]
        # (a data variable the function still read would be a shared variable of the runtime, which
        # a set_value reaches on every device; the others were copied, as rows or computed once)
        kept = set(self.fn.spec.shared_variables())
        self._data_held = [[v, v.get_value(borrow=True), _digest(v.get_value(borrow=True))]
                           for v in split.shared_data if v not in kept]
        self._q = data(q.data.astype(self._joined.type.dtype))
        self._extras = [data(np.asarray(point[v.name]), var=v) for v in self.extra_vars]

    def compute_here(self, jacobian: bool, why: str | None = None) -> None:
        """Compute in this process, as PyMC compiles the density; ``why`` (the reason the
        likelihood does not split over the devices) is said once."""
        self.here = self._pymc_function(jacobian)
        if why is not None:
            _say_once("unsplittable", f"the likelihood of {self.model.name or 'the model'} does not split over "
                      f"the devices ({why}): it is computed in this process as PyMC compiles it (said once; "
                      f"where='devices' refuses it)")

    def compute_here_if_faster(self, jacobian: bool) -> None:
        """Compute in this process, as PyMC compiles the density, if that is faster than the devices
        at the model's initial point; say so once."""
        here = self._pymc_function(jacobian)
        point = self.model.initial_point()
        q = DictToArrayBijection.map({v.name: point[v.name] for v in self.grad_vars}).data
        try:
            on_devices = _median_seconds(lambda: self.raveled(q))
        except WorkerError as error:
            if error.how is not Failure.RAISED or not error.exc_type.endswith("NotImplementedError"):
                raise
            # an op PyTensor's JAX backend does not implement (a distribution's CDF, say)
            self.here = here
            # (the op's name, not its inner graph)
            first = (error.message.splitlines() or [""])[0].split("{", 1)[0][:160]
            self._say_here("not implemented", f"the devices cannot compute it (NotImplementedError: "
                           f"{first}): it is computed in this process as PyMC compiles it (said once)")
            return
        in_process = _median_seconds(lambda: here._pytensor_function(q))
        if in_process >= on_devices:
            return
        self.here = here
        self._say_here("faster here", f"it takes {1e3 * in_process:.3g} ms in this process as PyMC compiles it and "
                       f"{1e3 * on_devices:.3g} ms on the devices: too small to gain, it is computed here "
                       f"(said once; where='devices' splits it anyway)")

    def _say_here(self, reason: str, why: str) -> None:
        """Say once in this process, per ``reason``, why a density splitting over the devices is
        computed here."""
        _say_once(reason, f"the log-density of {self.model.name or 'the model'}: {why}")

    def _pymc_function(self, jacobian: bool) -> ValueGradFunction:
        """PyMC's own value-and-gradient function of the density (raveled inputs, trusted)."""
        from pymc.model.core import ValueGradFunction
        model, point = self.model, self.model.initial_point()
        here = ValueGradFunction([model.logp(jacobian=jacobian)], self.grad_vars,
                                 {v: point[v.name] for v in self.extra_vars}, model=model,
                                 initial_point=point, ravel_inputs=True)
        here.trust_input = True
        return here

    def _graph(self, split: SplitModel, point: dict[str, np.ndarray], check_bounds: bool
               ) -> tuple[list[Variable], Variable]:
        """The four outputs (rows' logp and gradient, once-terms' logp and gradient) on a joined input."""
        outputs = []
        for terms in (split.row_terms, split.once_terms):
            total = pt.add(*[pt.sum(t) for t in terms]) if terms else pt.constant(0.0, dtype="float64")
            grads = pytensor.grad(total, self.grad_vars, disconnected_inputs="ignore") if self.grad_vars else []
            joined = pt.join(0, *[g.ravel() for g in grads]) if grads else pt.zeros(0)  # type: ignore[union-attr]
            outputs += [total, joined]
        outputs = [outputs[0], outputs[1], outputs[2], outputs[3]]
        outputs, joined_input = join_nonshared_inputs(point, outputs, self.grad_vars)
        rewrite = local_check_parameter_to_ninf_switch if check_bounds else local_remove_check_parameter
        outputs = rewrite_graph(outputs, custom_rewrite=in2out(rewrite), clone=False)  # type: ignore[assignment]
        return [pt.cast(o, "float64") for o in outputs], joined_input

    def set_extra_values(self, point: dict) -> None:
        """Values of the value variables outside the gradient (those other step methods sample)."""
        for d, var in zip(self._extras, self.extra_vars):
            if var.name in point:
                d[...] = point[var.name]
        if self.here is not None:
            self.here.set_extra_values({v.name: point[v.name] for v in self.extra_vars if v.name in point})

    def extra_value(self, name: str) -> np.ndarray:
        """The value the variable ``name`` (outside the gradient) holds."""
        if self.fn is None:
            return np.array(self.here.get_extra_values()[name])
        return np.array(self._extras[[v.name for v in self.extra_vars].index(name)].data)

    def raveled(self, q: np.ndarray) -> tuple[float, np.ndarray]:
        """``(logp, dlogp)`` at ``q``, the gradient's variables raveled and joined."""
        if self.here is not None:
            logp, dlogp = self.here._pytensor_function(q)
            return float(logp), np.asarray(dlogp).astype(self.dtype, copy=False)
        self._check_data_unchanged()
        self._q[:] = q
        lik, dlik, prior, dprior = self.fn(*self._rows, self._q, *self._extras)
        return float(lik + prior), (dlik + dprior).astype(self.dtype, copy=False)

    def _check_data_unchanged(self) -> None:
        """Refuse to compute on the devices' copy of the data once the model was given other data
        (``pm.set_data``, or ``set_value`` of a plain shared variable it reads): the copy would be
        stale without a word. A value that is another array (a ``set_value``, or synkhronos's own
        face of a data variable a function of the runtime reads) is compared by its bytes, once."""
        for held in self._data_held:
            var, value = held[0], held[0].get_value(borrow=True)
            if value is held[1]:
                continue
            if _digest(value) != held[2]:
                how = "pm.set_data" if var in getattr(self.model, "data_vars", []) else "set_value"
                raise RuntimeError(f"{how} changed {var.name or str(var)!r} of {self.model.name or 'the model'} "
                                   f"after this density was copied to the devices: build it again "
                                   f"(logp_dlogp_function, or a new NUTS step)")
            held[1] = value

    def __call__(self, point: dict) -> tuple[float, np.ndarray]:
        """``(logp, dlogp)`` at ``point`` (a dict as ``model.initial_point()`` gives)."""
        self.set_extra_values(point)
        q = DictToArrayBijection.map({v.name: np.asarray(point[v.name]) for v in self.grad_vars})
        return self.raveled(q.data)

    @property
    def point_map_info(self) -> tuple:
        """Names, shapes, sizes and dtypes of the raveled vector's pieces (PyMC's ``RaveledVars``)."""
        return self._point_map_info


def _digest(value: Any) -> tuple[tuple[int, ...], str, int]:
    """A data value's shape, dtype and checksum of its bytes."""
    array = np.ascontiguousarray(value)
    return array.shape, array.dtype.str, xxhash.xxh3_64_intdigest(array)


def _median_seconds(call: Callable[[], object], calls: int = TIMED_CALLS) -> float:
    """The median time of ``call()`` over ``calls`` calls, after one that compiles."""
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
