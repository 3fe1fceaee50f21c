r"""Optimizers whose gradients travel as one flat vector.

Every rule returns ``(grad_updates, param_updates, grad_shared)``:

- ``grad_updates`` writes the local raw gradient of every parameter into ONE
  flat shared vector ``grad_shared`` (use it in the gradient function);
- after ``synk.all_reduce(grad_shared, op="avg")`` (one collective, whatever
  the number of parameters), ``param_updates`` applies the optimizer to every
  parameter from the unflattened slices of ``grad_shared`` (use it in a
  separate update function, which runs identically on every device).

The optimizer maths is :mod:`pytensor_ml.optim`'s: its rules accept
precomputed gradients, and :func:`from_optim` wraps any of them (including
``chain(...)`` with clipping or schedules) into this three-part form. The named
rules below keep Lasagne's signatures and defaults.

Examples
--------
>>> grad_updates, param_updates, grad_shared = adam(loss, params)      # doctest: +SKIP
>>> f_grad = synk.function([x, y], loss, updates=grad_updates)          # doctest: +SKIP
>>> f_upd = synk.function([], updates=param_updates)                    # doctest: +SKIP
>>> f_grad(x_dat, y_dat, batch=idx); synk.all_reduce(grad_shared); f_upd()  # doctest: +SKIP
"""

import math

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor_ml import optim

__all__ = ["flatten_vars", "unflatten_vars", "flat_unflat_grads", "from_optim", "sgd", "momentum",
           "nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam", "adamax"]


def flatten_vars(variables):
    """Concatenate the raveled ``variables`` into one symbolic vector.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> flatten_vars([pt.matrix("a"), pt.vector("b")]).ndim
    1
    """
    return pt.concatenate([pt.flatten(v) for v in variables])


def _shape_of(var):
    if hasattr(var, "get_value"):
        return np.shape(var.get_value(borrow=True))
    return tuple(var.type.shape)


def unflatten_vars(flat, like):
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


def flat_unflat_grads(loss, params):
    """Gradients of ``loss`` as one flat shared vector.

    Returns
    -------
    grad_updates : list
        ``[(grad_shared, flat gradient)]`` for the gradient function.
    grad_shared : SharedVariable
        The flat vector, of length ``sum(p.size for p in params)``.
    grads : list of TensorVariable
        Its unflattened slices, shaped like ``params``.
    """
    params = list(params)
    # pytensor-ml's gradient rewrites the loss first (e.g. for JAX-friendly indexing), exactly
    # as its own rules do, so our gradients are the ones its rules would compute.
    grads = optim.get_gradients(loss, params)
    dtype = np.result_type(*[p.type.dtype for p in params]).name
    size = sum(math.prod(_shape_of(p)) for p in params)
    grad_shared = pytensor.shared(np.zeros(size, dtype=dtype), name="grad_shared")
    flat = flatten_vars(grads).astype(dtype)
    return [(grad_shared, flat)], grad_shared, unflatten_vars(grad_shared, params)


def from_optim(transform, loss, params):
    """Wrap a :mod:`pytensor_ml.optim` transform into ``(grad_updates, param_updates, grad_shared)``.

    Parameters
    ----------
    transform : callable
        Any pytensor-ml optimizer transform, e.g. ``optim.adam(1e-3)`` or
        ``optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))``.
    loss : TensorVariable
    params : list of SharedVariable

    Examples
    --------
    >>> from pytensor_ml import optim                                          # doctest: +SKIP
    >>> rule = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(1e-3))   # doctest: +SKIP
    >>> grad_updates, param_updates, grad_shared = from_optim(rule, loss, params)  # doctest: +SKIP
    """
    params = list(params)
    grad_updates, grad_shared, grads = flat_unflat_grads(loss, params)
    rule_updates = transform([g.astype(p.type.dtype) for g, p in zip(grads, params)], params)
    # A rule computing in floatX (e.g. float64 rates) must still store each variable's own dtype.
    param_updates = [(var, value if value.type.dtype == var.type.dtype else value.astype(var.type.dtype))
                     for var, value in rule_updates.items()]
    return grad_updates, param_updates, grad_shared


def sgd(loss, params, learning_rate):
    r"""Stochastic gradient descent: :math:`p \leftarrow p - \eta g`."""
    return from_optim(optim.sgd(learning_rate), loss, params)


def momentum(loss, params, learning_rate, momentum=0.9):
    r"""SGD with momentum: :math:`v \leftarrow \mu v + g,\ p \leftarrow p - \eta v` (pytensor-ml's form)."""
    return from_optim(optim.sgd(learning_rate, momentum=momentum), loss, params)


def nesterov_momentum(loss, params, learning_rate, momentum=0.9):
    r"""SGD with Nesterov momentum: the gradient is taken after the momentum carry."""
    return from_optim(optim.sgd(learning_rate, momentum=momentum, nesterov=True), loss, params)


def adagrad(loss, params, learning_rate=1.0, epsilon=1e-6):
    r"""Adagrad: :math:`a \leftarrow a + g^2,\ p \leftarrow p - \eta g / (\sqrt{a} + \epsilon)`."""
    return from_optim(optim.adagrad(learning_rate, epsilon=epsilon), loss, params)


def rmsprop(loss, params, learning_rate=1.0, rho=0.9, epsilon=1e-6):
    r"""RMSProp: :math:`a \leftarrow \rho a + (1-\rho) g^2,\ p \leftarrow p - \eta g / (\sqrt{a} + \epsilon)`."""
    return from_optim(optim.rmsprop(learning_rate, rho=rho, epsilon=epsilon), loss, params)


def adadelta(loss, params, learning_rate=1.0, rho=0.95, epsilon=1e-6):
    r"""Adadelta: step scaled by the ratio of running RMS of past steps and of gradients."""
    return from_optim(optim.adadelta(learning_rate, rho=rho, epsilon=epsilon), loss, params)


def adam(loss, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
    r"""Adam, with bias-corrected first and second moments and ONE step counter for all parameters.

    .. math:: m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
              p \leftarrow p - \eta \hat m / (\sqrt{\hat v} + \epsilon)
    """
    return from_optim(optim.adam(learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon), loss, params)


def adamax(loss, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8):
    r"""Adamax: Adam with an infinity-norm second moment :math:`u \leftarrow \max(\beta_2 u, |g|)`."""
    return from_optim(optim.adamax(learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon), loss, params)
