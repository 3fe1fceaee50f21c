"""Training helpers built on the flattened-gradient rules of :mod:`.updates`."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt

from ..api import collectives
from ..runtime.master import current
from ..api.function import function
from ..scatter import batch_from_spec, parse_batch_s

__all__ = ["make_train_function", "make_device_train_function", "make_single_process_train_function",
           "make_train_function_theano"]


def make_train_function(loss, params, x, y, update_rule, *args, **kwargs):
    """Build ``train_minibatch(x_data, y_data, batch=None, num_slices=1)`` for all devices.

    One step is: every device computes its local gradient into the flat vector,
    ``all_reduce(grad_shared, "avg")`` in one collective, then the same update
    on every device. Returns the batch loss (row-weighted average).

    Each device scales its gradient by ``n_devices * its_rows / batch_rows``
    before the average, so the step equals the full-batch gradient step even
    when the batch does not split evenly across devices.

    Parameters
    ----------
    loss : TensorVariable
        Mean loss over the rows of ``x``/``y``.
    params : list of SharedVariable
    x, y : TensorVariable
        The scattered inputs.
    update_rule : callable
        A rule of :mod:`synkhronos.extensions.updates`, e.g. ``updates.adam``.
    *args, **kwargs
        Passed to ``update_rule`` (learning rate etc.).

    Examples
    --------
    >>> train = make_train_function(loss, params, x, y, updates.adam, learning_rate=1e-3)  # doctest: +SKIP
    >>> for idx in batches:                                                                   # doctest: +SKIP
    ...     batch_loss = train(x_dat, y_dat, batch=idx)
    """
    step = _WeightedStep(loss, params, x, update_rule, args, kwargs, inputs=[x, y])

    def train_minibatch(x_data, y_data, batch=None, num_slices=1):
        rows = len(x_data) if batch is None else batch_from_spec(batch, len(x_data)).total
        return step(rows, x_data, y_data, batch=batch, num_slices=num_slices)

    return step.expose(train_minibatch)


class _WeightedStep:
    """Gradient function (row-weighted flat gradient), one all-reduce, update function.

    Each device scales its local mean gradient by ``n_devices * its_rows /
    batch_rows``; the average over devices is then the full-batch gradient.
    """

    def __init__(self, loss, params, x, update_rule, args, kwargs, inputs=(), **function_kwargs):
        grad_updates, param_updates, self.grad_shared = update_rule(loss, params, *args, **kwargs)
        (target, flat_grad), = grad_updates
        dtype = self.grad_shared.type.dtype
        batch_rows = pt.scalar("batch_rows", dtype=dtype)
        weight = pt.cast(x.shape[0], dtype) * current().n_parallel / batch_rows
        self.f_grad = function(list(inputs), (loss, "avg"), bcast_inputs=[batch_rows],
                               updates=[(target, flat_grad * weight, "sum")], name="train_grad",
                               **function_kwargs)
        self.f_upd = function([], updates=param_updates, name="train_update")

    def __call__(self, batch_rows, *data, **call_kwargs):
        rows = np.asarray(batch_rows, dtype=self.grad_shared.type.dtype)
        batch_loss = self.f_grad(*data, rows, **call_kwargs)
        collectives.all_reduce(self.grad_shared, op="avg")
        self.f_upd()
        return batch_loss

    def expose(self, train_minibatch):
        """Give the user's step function handles on what it runs."""
        train_minibatch.grad_shared = self.grad_shared
        train_minibatch.functions = (self.f_grad, self.f_upd)
        return train_minibatch


def make_device_train_function(loss, params, x, y, x_shared, y_shared, update_rule, *args, **kwargs):
    """Like :func:`make_train_function`, on data kept on the devices.

    ``x_shared`` and ``y_shared`` hold each device's own rows (fill them with
    ``synk.scatter``); they replace ``x`` and ``y`` in the graph. Returns
    ``train_minibatch(batch_s=None, num_slices=1)``, where ``batch_s`` picks
    rows of each device's data (e.g. one shuffled index array per device).

    Examples
    --------
    >>> synk.scatter([x_sh, y_sh], [X_train, Y_train])                          # doctest: +SKIP
    >>> train = make_device_train_function(loss, params, x, y, x_sh, y_sh, updates.sgd, 0.1)  # doctest: +SKIP
    >>> train(batch_s=[perm0[:64], perm1[:64]])                                # doctest: +SKIP
    """
    step = _WeightedStep(loss, params, x, update_rule, args, kwargs,
                         givens=[(x, x_shared), (y, y_shared)], sliceable_shareds=[x_shared, y_shared])

    def train_minibatch(batch_s=None, num_slices=1):
        lengths = collectives.get_lengths([x_shared, y_shared])
        rows = sum(b.total for b in parse_batch_s(batch_s, lengths, ["x", "y"]))
        return step(rows, batch_s=batch_s, num_slices=num_slices)

    return step.expose(train_minibatch)


def make_single_process_train_function(loss, params, x, y, update_rule, *args, **kwargs):
    """The same step in one process (plain PyTensor), for comparisons.

    Returns ``train_minibatch(x_value, y_value)`` on numpy arrays.
    """
    grad_updates, param_updates, _ = update_rule(loss, params, *args, **kwargs)
    f_grad = pytensor.function([x, y], loss, updates=grad_updates, mode="JAX")
    f_upd = pytensor.function([], [], updates=param_updates, mode="JAX")

    def train_minibatch(x_value, y_value):
        batch_loss = f_grad(x_value, y_value)
        f_upd()
        return batch_loss

    return train_minibatch


def make_train_function_theano(loss, params, x, y, update_rule, *args, **kwargs):
    """The original's name of :func:`make_single_process_train_function` (deprecated)."""
    warnings.warn("make_train_function_theano is make_single_process_train_function now",
                  DeprecationWarning, stacklevel=2)
    return make_single_process_train_function(loss, params, x, y, update_rule, *args, **kwargs)
