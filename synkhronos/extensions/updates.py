r"""Optimizers whose gradients travel as one flat vector.

Every rule returns ``(grad_updates, param_updates, grad_shared)``:

- ``grad_updates`` writes the local raw gradient of every parameter into ONE
  flat shared vector ``grad_shared`` (use it in the gradient function);
- after ``synk.all_reduce(grad_shared, op="avg")`` (one collective, whatever
  the number of parameters), ``param_updates`` applies the optimizer to every
  parameter from the unflattened slices of ``grad_shared`` (use it in a
  separate update function, which runs identically on every device).

The loss is a mean over the call's rows (as :func:`~synkhronos.extensions.train.make_train_function`'s):
where a batch splits unevenly over the devices, the average weighs each device's
gradient by its rows (see :func:`synkhronos.all_reduce`), so the step is the
one-process step on the whole batch.

The optimizer maths is :mod:`pytensor_ml.optim`'s: its rules accept
precomputed gradients, and :func:`from_optim` wraps any of them (including
``chain(...)`` with clipping or schedules) into this three-part form. The named
rules below keep Lasagne's signatures and defaults.

Examples
--------
>>> x, y = pt.matrix("x"), pt.vector("y")
>>> w = pytensor.shared(np.zeros(3), name="w")
>>> loss = ((x.dot(w) - y) ** 2).mean()
>>> grad_updates, param_updates, grad_shared = adam(loss, [w])
>>> f_grad = synk.function([x, y], loss, updates=grad_updates)
>>> f_upd = synk.function([], updates=param_updates)
>>> f_grad(np.ones((4, 3)), np.ones(4))
array(1.)
>>> synk.all_reduce(grad_shared, op="avg")
>>> outputs = f_upd()
>>> w.get_value()          # Adam's first step: the learning rate along the gradient's sign
array([0.001, 0.001, 0.001])
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.basic import Variable
from pytensor_ml import optim
from pytensor_ml.pytensorf import collect_clock_updates

from .statistics import carried_statistics


class FlatStep(NamedTuple):
    """What every rule returns, in this order (it unpacks as a 3-tuple)."""

    #: updates writing the gradient (and batch statistics) into the flat vector
    grad_updates: list
    #: updates applying the rule to the parameters from the all-reduced vector
    param_updates: list
    #: the flat vector to all-reduce between the two (a list of vectors for ``sgd_nonflat``)
    grad_shared: Any

__all__ = ["parameter_groups", "plain_parameters", "GROUP_SETTINGS",
           "flatten_vars", "unflatten_vars", "vars_flat_size", "flat_unflat_grads", "nonflat_grads",
           "from_optim", "sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta",
           "adam", "adamax", "apply_momentum", "apply_nesterov_momentum", "sgd_nonflat"]


def flatten_vars(variables: Sequence[Any]) -> Any:
    """Concatenate the raveled ``variables`` into one symbolic vector.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> flatten_vars([pt.matrix("a"), pt.vector("b")]).ndim
    1
    """
    return pt.concatenate([pt.flatten(v) for v in variables])


def _shape_of(var: Any) -> tuple[int, ...]:
    if hasattr(var, "get_value"):
        return np.shape(var.get_value(borrow=True))
    return tuple(var.type.shape)


def unflatten_vars(flat: Any, like: Sequence[Any]) -> list:
    """Slice the flat vector ``flat`` into pieces shaped like the shared variables ``like``.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.zeros((2, 3))); b = pytensor.shared(np.zeros(3))
    >>> [p.eval().shape for p in unflatten_vars(pt.arange(9.0), [w, b])]
    [(2, 3), (3,)]
    """
    pieces, pos = [], 0
    for var in like:
        shape = _shape_of(var)
        size = math.prod(shape)
        pieces.append(flat[pos:pos + size].reshape(shape))
        pos += size
    return pieces


def vars_flat_size(variables: Sequence[Any]) -> int:
    """The number of items in all the shared ``variables`` together (the flat vector's length).

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> vars_flat_size([pytensor.shared(np.zeros((2, 3))), pytensor.shared(np.zeros(3))])
    9
    """
    return sum(math.prod(_shape_of(v)) for v in variables)


def flat_unflat_grads(loss: Any, params: Sequence[Any]) -> tuple[Any, Any, list]:
    """The gradients of ``loss`` as one flat vector, and a flat shared vector to hold them.

    Returns
    -------
    grad_shared_flat : SharedVariable
        A zero vector of length ``vars_flat_size(params)`` (the one to all-reduce).
    flat_grad : TensorVariable
        The gradients of every parameter, raveled and concatenated: update
        ``grad_shared_flat`` to it in the gradient function.
    unflat_grads : list of TensorVariable
        Slices of ``grad_shared_flat`` shaped like ``params``: the gradients for
        the parameter updates.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> w = pytensor.shared(np.ones(3)); x = pt.vector("x")
    >>> grad_shared, flat_grad, (g,) = flat_unflat_grads((w * x).sum(), [w])
    >>> grad_shared.get_value().shape, g.ndim
    ((3,), 1)
    """
    (grad_shared, flat), = _flat_gradient(loss, params)[0]
    return grad_shared, flat, unflatten_vars(grad_shared, list(params))


def _flat_gradient(loss: Any, params: Sequence[Any]) -> tuple[list[tuple[Any, Any]], Any, list]:
    """``([(grad_shared, flat gradient)], grad_shared, unflattened slices)``."""
    params = list(params)
    # pytensor-ml's gradient rewrites the loss first (e.g. for JAX-friendly indexing), exactly
    # as its own rules do, so our gradients are the ones its rules would compute.
    grads = optim.get_gradients(loss, params)
    dtype = np.result_type(*[p.type.dtype for p in params]).name
    flat = flatten_vars(grads).astype(dtype)
    grad_shared = _flat_vector(vars_flat_size(params), dtype, flat)
    return [(grad_shared, flat)], grad_shared, unflatten_vars(grad_shared, params)


def _flat_vector(size: int, dtype: str, flat: Any) -> Any:
    """The shared vector of ``size`` zeros that holds ``flat``, of its static length (known for
    0-d parameters alone: PyTensor takes no update of another broadcast pattern)."""
    grad_shared = pytensor.shared(np.zeros(size, dtype=dtype), name="grad_shared", shape=flat.type.shape)
    grad_shared.tag.synk_gradient = True     # scratch between steps: checkpoints leave it out
    return grad_shared


def _flat_step(loss: Any, params: Sequence[Any]) -> tuple[list[tuple[Any, Any]], Any, list, list[tuple[Any, Any]]]:
    """A step's flat vector: the gradients of ``params``, then the model's statistics.

    Returns ``(grad_updates, grad_shared, gradient slices, statistics' write-backs)``;
    see :mod:`synkhronos.extensions.statistics`.
    """
    grads = optim.get_gradients(loss, params)
    carried = carried_statistics(loss)
    dtype = np.result_type(*[p.type.dtype for p in params]).name
    n_grads = vars_flat_size(params)
    flat = flatten_vars(grads + [c.contribution for c in carried]).astype(dtype)
    grad_shared = _flat_vector(n_grads + sum(c.size for c in carried), dtype, flat)
    slices = unflatten_vars(grad_shared[n_grads:], [c.target for c in carried])
    reduced = {c.target: s.astype(c.target.type.dtype) for c, s in zip(carried, slices)}
    write_backs = [(c.target, c.written(reduced.__getitem__)) for c in carried]
    return [(grad_shared, flat)], grad_shared, unflatten_vars(grad_shared, params), write_backs


def nonflat_grads(loss: Any, params: Sequence[Any]) -> tuple[list, list]:
    """The gradients of ``loss``, with one shared variable per parameter to hold each.

    The pattern without flattening: every gradient then needs a collective of
    its own (see :func:`sgd_nonflat`). Prefer the flat rules.

    Returns
    -------
    grads_shared : list of SharedVariable
        Zeros shaped like ``params``.
    grads : list of TensorVariable
    """
    params = list(params)
    grads = optim.get_gradients(loss, params)
    grads_shared = [pytensor.shared(np.zeros(_shape_of(p), dtype=p.type.dtype),
                                    name=f"grad_{p.name or i}") for i, p in enumerate(params)]
    for g in grads_shared:
        g.tag.synk_gradient = True
    return grads_shared, grads


#: what a parameter group may set besides its ``"params"`` (see :func:`parameter_groups`)
GROUP_SETTINGS = ("lr_scale", "weight_decay")


def parameter_groups(params: Sequence[Any]) -> tuple[list, dict, dict]:
    """``(parameters, {parameter: learning-rate scale}, {parameter: weight decay})`` of ``params``.

    ``params`` lists shared variables, or groups of them as torch's optimizers
    take them: dicts with ``"params"`` (a list, or one variable) and any of ``"lr_scale"`` (the group's
    learning rate as a multiple of the rule's) and ``"weight_decay"`` (added
    to the gradient as ``weight_decay * parameter``, torch's L2 form), or both
    mixed. A parameter outside any group has a scale of 1 and no decay.

    Raises
    ------
    TypeError
        For a group without ``"params"``, a setting that is not one of
        :data:`GROUP_SETTINGS`, or a parameter listed twice.

    Examples
    --------
    >>> W, b = pytensor.shared(np.zeros((3, 2)), name="W"), pytensor.shared(np.zeros(2), name="b")
    >>> params, scale, decay = parameter_groups([{"params": [W], "weight_decay": 5e-4},
    ...                                          {"params": [b], "lr_scale": 2.0}])
    >>> [p.name for p in params], {p.name: v for p, v in scale.items()}, {p.name: v for p, v in decay.items()}
    (['W', 'b'], {'b': 2.0}, {'W': 0.0005})
    """
    flat: list = []
    scale: dict = {}
    decay: dict = {}
    for item in params:
        if not isinstance(item, dict):
            flat.append(item)
            continue
        if "params" not in item:
            raise TypeError(f"a parameter group is a dict with 'params' (a list of shared variables) and "
                            f"any of {list(GROUP_SETTINGS)}; got the keys {sorted(item)}")
        unknown = sorted(set(item) - {"params", *GROUP_SETTINGS})
        if unknown:
            hint = " (a group's own rate is lr_scale: its rate over the rule's)" if "lr" in unknown else ""
            raise TypeError(f"a parameter group takes {list(GROUP_SETTINGS)} besides 'params'; got "
                            f"{unknown}{hint}")
        group = [item["params"]] if isinstance(item["params"], Variable) else list(item["params"])
        flat += group
        for p in group:
            if float(item.get("lr_scale", 1.0)) != 1.0:
                scale[p] = float(item["lr_scale"])
            if float(item.get("weight_decay", 0.0)):
                decay[p] = float(item["weight_decay"])
    twice = [p.name or str(p) for i, p in enumerate(flat) if any(p is q for q in flat[:i])]
    if twice:
        raise TypeError(f"the parameters {twice} are listed twice: give each to one group")
    return flat, scale, decay


def plain_parameters(params: Sequence[Any]) -> list:
    """The shared variables of ``params``, its groups opened (see :func:`parameter_groups`)."""
    return parameter_groups(params)[0]


def from_optim(transform: Callable, loss: Any, params: Sequence[Any]) -> FlatStep:
    """Wrap a :mod:`pytensor_ml.optim` transform into ``(grad_updates, param_updates, grad_shared)``.

    The step is what pytensor-ml's ``optim.compile_train`` builds, split in two:
    the flat vector carries the gradients and the statistics that stateful
    layers write back (batch norm's running mean and variance, combined over
    the devices exactly: :mod:`synkhronos.extensions.statistics`);
    ``param_updates`` applies the rule, writes the combined statistics and
    advances every training clock that the loss or the rule reads
    (:func:`pytensor_ml.pytensorf.collect_clock_updates`) once per step.

    Parameters
    ----------
    transform : callable
        Any pytensor-ml optimizer transform, e.g. ``optim.adam(1e-3)`` or
        ``optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))``.
    loss : TensorVariable
    params : list of SharedVariable, or of parameter groups
        Groups as torch's optimizers take them, with their own learning-rate
        scale and weight decay (:func:`parameter_groups`): the decay joins the
        reduced gradient, and the scale multiplies the rule's step of each
        parameter (for every rule here, whose step is its rate times what it
        computes, that is the rule at the scaled rate).

    Raises
    ------
    ValueError
        If the rule leaves a parameter unwritten, or writes a statistic the model writes.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor_ml import optim
    >>> w = pytensor.shared(np.zeros(3), name="w"); x = pt.vector("x")
    >>> rule = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-3))
    >>> grad_updates, param_updates, grad_shared = from_optim(rule, ((w - x) ** 2).sum(), [w])
    >>> grad_shared.get_value().shape
    (3,)
    """
    params, scale, decay = parameter_groups(params)
    grad_updates, grad_shared, grads, write_backs = _flat_step(loss, params)
    grads = [g + decay[p] * p if p in decay else g for g, p in zip(grads, params)]
    rule_updates = transform([g.astype(p.type.dtype) for g, p in zip(grads, params)], params)
    _check_rule_writes(rule_updates, params, write_backs)
    for p, factor in scale.items():
        rule_updates[p] = p + factor * (rule_updates[p] - p)
    # A rule computing in floatX (e.g. float64 rates) must still store each variable's own dtype.
    param_updates = [(var, value if value.type.dtype == var.type.dtype else value.astype(var.type.dtype))
                     for var, value in rule_updates.items()] + write_backs
    written = dict(param_updates)
    clocks = collect_clock_updates([loss, *rule_updates.values()], already_written=written)
    return FlatStep(grad_updates, param_updates + list(clocks.items()), grad_shared)


def _check_rule_writes(rule_updates: Mapping[Any, Any], params: Sequence[Any],
                       write_backs: Sequence[tuple[Any, Any]]) -> None:
    """What pytensor-ml's ``compile_train`` checks: every parameter written, no statistic twice."""
    unwritten = [p.name or str(p) for p in params if p not in rule_updates]
    if unwritten:
        raise ValueError(f"No update reaches {unwritten}: the rule writes only some of the "
                         f"parameters it was given, so the rest would stay frozen silently; leave "
                         f"a parameter out of params to freeze it on purpose")
    twice = [s.name or str(s) for s, _ in write_backs if s in rule_updates]
    if twice:
        raise ValueError(f"The model writes {twice} from a stateful layer (batch-norm statistics) "
                         f"and the rule writes them too; leave them out of the rule's parameters")


def sgd(loss: Any, params: Sequence[Any], learning_rate: float) -> FlatStep:
    r"""Stochastic gradient descent: :math:`p \leftarrow p - \eta g`."""
    return from_optim(optim.sgd(learning_rate), loss, params)


def momentum(loss: Any, params: Sequence[Any], learning_rate: float, momentum: float = 0.9) -> FlatStep:
    r"""SGD with momentum: :math:`v \leftarrow \mu v + g,\ p \leftarrow p - \eta v` (pytensor-ml's form)."""
    return from_optim(optim.sgd(learning_rate, momentum=momentum), loss, params)


def nesterov_momentum(loss: Any, params: Sequence[Any], learning_rate: float,
                      momentum: float = 0.9) -> FlatStep:
    r"""SGD with Nesterov momentum: the gradient is taken after the momentum carry."""
    return from_optim(optim.sgd(learning_rate, momentum=momentum, nesterov=True), loss, params)


def adagrad(loss: Any, params: Sequence[Any], learning_rate: float = 1.0, epsilon: float = 1e-6) -> FlatStep:
    r"""Adagrad: :math:`a \leftarrow a + g^2,\ p \leftarrow p - \eta g / \sqrt{a + \epsilon}`."""
    return from_optim(optim.adagrad(learning_rate, epsilon=epsilon), loss, params)


def rmsprop(loss: Any, params: Sequence[Any], learning_rate: float = 1.0, rho: float = 0.9,
            epsilon: float = 1e-6) -> FlatStep:
    r"""RMSProp: :math:`a \leftarrow \rho a + (1-\rho) g^2,\ p \leftarrow p - \eta g / \sqrt{a + \epsilon}`."""
    return from_optim(optim.rmsprop(learning_rate, rho=rho, epsilon=epsilon), loss, params)


def adadelta(loss: Any, params: Sequence[Any], learning_rate: float = 1.0, rho: float = 0.95,
             epsilon: float = 1e-6) -> FlatStep:
    r"""Adadelta: step scaled by the ratio of running RMS of past steps and of gradients."""
    return from_optim(optim.adadelta(learning_rate, rho=rho, epsilon=epsilon), loss, params)


def adam(loss: Any, params: Sequence[Any], learning_rate: float = 0.001, beta1: float = 0.9,
         beta2: float = 0.999, epsilon: float = 1e-8) -> FlatStep:
    r"""Adam, with bias-corrected first and second moments and ONE step counter for all parameters.

    .. math:: m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
              p \leftarrow p - \eta \hat m / (\sqrt{\hat v} + \epsilon)
    """
    return from_optim(optim.adam(learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon), loss, params)


def adamax(loss: Any, params: Sequence[Any], learning_rate: float = 0.002, beta1: float = 0.9,
           beta2: float = 0.999, epsilon: float = 1e-8) -> FlatStep:
    r"""Adamax: Adam with an infinity-norm second moment :math:`u \leftarrow \max(\beta_2 u, |g|)`."""
    return from_optim(optim.adamax(learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon), loss, params)


def apply_momentum(param_updates: list, momentum: float = 0.9) -> list:
    """Add classical momentum to ``param_updates``, as Lasagne's ``apply_momentum``.

    For each ``(param, new_value)``: ``x = momentum * velocity + new_value``,
    ``velocity <- x - param``, ``param <- x``.

    Parameters
    ----------
    param_updates : list of (SharedVariable, TensorVariable)
        E.g. the second part of :func:`sgd`.
    momentum : float

    Returns
    -------
    list of (SharedVariable, TensorVariable)
        The updates with the velocities' (one new shared variable per parameter).
    """
    updates = []
    for param, new in param_updates:
        velocity = pytensor.shared(np.zeros(_shape_of(param), dtype=param.type.dtype))
        x = momentum * velocity + new
        updates += [(velocity, (x - param).astype(param.type.dtype)), (param, x.astype(param.type.dtype))]
    return updates


def apply_nesterov_momentum(param_updates: list, momentum: float = 0.9) -> list:
    """Add Nesterov momentum to ``param_updates``, as Lasagne's ``apply_nesterov_momentum``.

    For each ``(param, new_value)``: ``x = momentum * velocity + new_value - param``,
    ``velocity <- x``, ``param <- momentum * x + new_value``.
    """
    updates = []
    for param, new in param_updates:
        velocity = pytensor.shared(np.zeros(_shape_of(param), dtype=param.type.dtype))
        x = momentum * velocity + new - param
        updates += [(velocity, x.astype(param.type.dtype)),
                    (param, (momentum * x + new).astype(param.type.dtype))]
    return updates


def sgd_nonflat(loss: Any, params: Sequence[Any], learning_rate: float) -> FlatStep:
    """SGD with one gradient shared variable per parameter (no flattening), for comparison.

    Returns ``(grad_updates, param_updates, grads_shared)``; all-reduce the
    whole list ``grads_shared`` (one launch per dtype) before the update.
    """
    params, scale, decay = parameter_groups(params)
    if scale or decay:
        raise TypeError("sgd_nonflat takes no group settings: use updates.sgd, which applies them")
    grads_shared, grads = nonflat_grads(loss, params)
    grad_updates = [(g_s, g.astype(g_s.type.dtype)) for g_s, g in zip(grads_shared, grads)]
    param_updates = [(p, (p - learning_rate * g_s).astype(p.type.dtype))
                     for p, g_s in zip(params, grads_shared)]
    return FlatStep(grad_updates, param_updates, grads_shared)
