"""The training step of :func:`synkhronos.extensions.train.make_train_function` in one process.

Plain PyTensor, for comparisons: the same rule, scalar inputs, ``givens``,
``state_updates`` and ``consider_constant`` (see :mod:`.step_graph`), in any
PyTensor compilation mode.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytensor

from ..errors import warn
from .step_graph import build_step_graph, call_values, givens_scalars, input_list

__all__ = ["make_single_process_train_function", "make_train_function_theano"]


def make_single_process_train_function(loss: Any, params: Sequence[Any], x: Any, y: Any,
                                       update_rule: Callable, *args: Any, mode: Any = "JAX",
                                       givens: dict | None = None,
                                       state_updates: Sequence[tuple] | dict | None = None,
                                       consider_constant: Sequence[Any] | None = None,
                                       allow_input_downcast: bool = False, **kwargs: Any) -> Callable:
    """The step of :func:`~synkhronos.extensions.train.make_train_function` in one process (plain PyTensor).

    ``x``, ``y``, ``givens``, ``state_updates``, ``consider_constant``,
    ``allow_input_downcast`` and the rule's arguments as there. Returns ``train_minibatch(*values, **named)`` on
    numpy arrays and scalars: one per input of ``x``, then per target of ``y``
    (with ``givens``: per scalar of the slices' bounds), then per scalar input,
    by position or by name; it returns the loss.

    Parameters
    ----------
    mode : str or pytensor Mode
        The compilation mode of both functions (``"JAX"``, ``"FAST_RUN"`` for
        PyTensor's C backend, ...). JAX needs a scan's length and a slice's
        bounds at compile time: a graph scanning over a length that varies per
        call, or ``givens`` slicing rows at a scalar input's bounds (the
        tutorials' ``X[i * bs:(i + 1) * bs]``), runs in ``"FAST_RUN"``.

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt
    >>> from synkhronos.extensions import updates
    >>> x, y, lr = pt.matrix("x"), pt.vector("y"), pt.scalar("lr")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> calls = pytensor.shared(np.array(0), name="calls")
    >>> train = make_single_process_train_function(((x.dot(w) - y) ** 2).mean(), [w], x, y,
    ...                                            updates.sgd, learning_rate=lr, mode="FAST_RUN",
    ...                                            state_updates=[(calls, calls + 1)])
    >>> float(train(np.ones((4, 3)), np.ones(4), lr=0.1))
    1.0
    >>> w.get_value(), int(calls.get_value())
    (array([0.2, 0.2, 0.2]), 1)
    """
    inputs = input_list(x, "x", "make_single_process_train_function") + input_list(y, "y")
    bounds = givens_scalars(givens) if givens else []
    known = inputs + (list(dict(givens)) + bounds if givens else [])
    graph = build_step_graph(loss, params, update_rule, args, kwargs, known, state_updates,
                             consider_constant)
    takes = (bounds if givens else inputs) + graph.scalars
    side = [(var, value) for var, value, _ in graph.side_updates]
    f_grad = pytensor.function(takes, graph.loss, updates=graph.grad_updates + side, mode=mode,
                               givens=givens, allow_input_downcast=allow_input_downcast)
    f_upd = pytensor.function([], [], updates=graph.param_updates, mode=mode)

    def train_minibatch(*values: Any, **named: Any) -> Any:
        batch_loss = f_grad(*call_values(values, named, takes))
        f_upd()
        return batch_loss

    return train_minibatch


def make_train_function_theano(loss: Any, params: Sequence[Any], x: Any, y: Any, update_rule: Callable,
                               *args: Any, **kwargs: Any) -> Callable:
    """The original's name of :func:`make_single_process_train_function` (deprecated)."""
    warn("make_train_function_theano is make_single_process_train_function now", DeprecationWarning)
    return make_single_process_train_function(loss, params, x, y, update_rule, *args, **kwargs)
