"""A training step's graph beside its data: scalar hyperparameters, state updates, constants.

:func:`synkhronos.extensions.train.make_train_function` and
:func:`~synkhronos.extensions.train.make_single_process_train_function` build
their step from the same :class:`StepGraph`:

- ``consider_constant=[v, ...]``: the gradient treats each ``v`` as a
  constant, as ``pytensor.grad(loss, params, consider_constant=[v, ...])``
  does (the RBM's chain end). The loss is rewritten with
  :func:`pytensor.gradient.disconnected_grad` around each ``v`` before the
  rule takes its gradient, so any rule, pytensor-ml's included, sees it;
  the loss's value is unchanged.
- Scalar hyperparameters: a 0-d symbolic input that the loss, the rule's
  updates or the state updates read and that is none of the step's data (the
  SdA tutorial's corruption level and learning rate) is an input of the
  step, after the data, in the order the step computes with them: the
  loss's first (``step.inputs`` lists them). The gradient function takes them whole on every device. The
  rule's updates run in a function without inputs, so the gradient function
  also writes each scalar they read into a 0-d shared variable of its own,
  which the updates read instead.
- ``state_updates=[(var, expr), ...]`` (or ``(var, expr, mode)``): updates
  applied with the step (a counter, a persistent chain). They are computed in
  the gradient function, from the values before the step, as
  ``pytensor.function`` computes all its updates at once. With ``num_slices``
  the mode combines the slices' values (default None: the last slice's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.gradient import disconnected_grad
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors, graph_inputs, io_toposort

from ..comm.reduction import check_update_mode
from .updates import plain_parameters

__all__ = ["StepGraph", "build_step_graph", "input_list", "givens_scalars", "call_values"]

#: ``state_updates=``: a dict ``{var: expr}``, or ``(var, expr)`` and ``(var, expr, mode)`` items (checked)
StateUpdates = Mapping[Any, Any] | Iterable[Any]
#: a state update, checked: the shared variable, its new value, how the slices combine (None: the last)
StateUpdate = tuple[SharedVariable, Variable, str | None]


@dataclass
class StepGraph:
    """One training step's graph, as the gradient and update functions take it.

    Attributes
    ----------
    loss : TensorVariable
        The loss (its gradient blind to ``consider_constant``).
    params : list of SharedVariable
    grad_updates, param_updates : list
        The rule's first two parts (:mod:`.updates`); ``param_updates`` read
        the scalar hyperparameters from their carriers.
    grad_shared : SharedVariable
        The flat vector the gradients travel in.
    scalars : list of Variable
        The step's scalar inputs after its data, in call order.
    carried_updates : list of (SharedVariable, Variable, None)
        What the gradient function writes for the updates: each scalar the
        rule's updates read, into its carrier.
    state_updates : list of (SharedVariable, Variable, str or None)
        The user's state updates, checked.
    """

    loss: Variable
    params: list
    grad_updates: list
    param_updates: list
    grad_shared: SharedVariable
    scalars: list = field(default_factory=list)
    carried_updates: list = field(default_factory=list)
    state_updates: list = field(default_factory=list)

    @property
    def state(self) -> list:
        """The variables ``state_updates`` write."""
        return [var for var, _, _ in self.state_updates]

    @property
    def side_updates(self) -> list:
        """The gradient function's updates besides the gradient: the carriers', then the state's."""
        return self.carried_updates + self.state_updates


def build_step_graph(loss: Variable, params: Sequence[Any], update_rule: Callable[..., Any],
                     args: Sequence[Any], kwargs: Mapping[str, Any], known: Sequence[Variable],
                     state_updates: StateUpdates | None = None,
                     consider_constant: Sequence[Variable] | None = None) -> StepGraph:
    """The :class:`StepGraph` of ``update_rule(loss, params, *args, **kwargs)``.

    Parameters
    ----------
    known : list of Variable
        What the step takes otherwise: its data (``x``, ``y``), the keys of
        its ``givens`` and the scalars of their bounds. Every other symbolic
        input the step reads must be 0-d (a scalar input of the step).

    Raises
    ------
    TypeError, ValueError
        For a malformed ``state_updates`` or ``consider_constant``, a state
        update of what the rule writes, and an input that is none of the
        step's data and not 0-d; each before anything is compiled.
    """
    loss = held_constant(loss, consider_constant)
    grad_updates, param_updates, grad_shared = update_rule(loss, params, *args, **kwargs)
    written = {id(var) for var, _ in list(grad_updates) + list(param_updates)}
    state = _checked_state_updates(state_updates, written)
    reads = [loss] + [value for _, value in param_updates] + [value for _, value, _ in state]
    scalars = _scalar_inputs(reads, known)
    param_updates, carried = _carry_scalars(list(param_updates), scalars)
    return StepGraph(loss, plain_parameters(params), list(grad_updates), param_updates, grad_shared, scalars,
                     carried, state)


def held_constant(loss: Variable, consider_constant: Sequence[Variable] | None) -> Variable:
    """``loss`` with each variable of ``consider_constant`` behind a gradient stop.

    The gradient of the result is what ``pytensor.grad(loss, wrt,
    consider_constant=consider_constant)`` gives, whatever takes it.

    Examples
    --------
    >>> x = pt.vector("x")
    >>> h = pt.tanh(x)
    >>> float(pytensor.grad(held_constant((h * x).sum(), [h]), x).eval({x: [0.5]})[0])
    0.46211715726000974
    """
    if consider_constant is None:
        return loss
    if not isinstance(consider_constant, (list, tuple)):
        raise TypeError(f"consider_constant must be a list of variables of the loss, got "
                        f"{consider_constant!r}")
    part_of_loss = set(ancestors([loss]))
    for var in consider_constant:
        if not isinstance(var, Variable):
            raise TypeError(f"consider_constant holds {var!r}, which is not a PyTensor variable")
        if var not in part_of_loss:
            raise ValueError(f"consider_constant holds {var}, which the loss does not read: nothing "
                             f"would be held constant; give variables of the loss's graph (as "
                             f"pytensor.grad's consider_constant)")
    if not consider_constant:
        return loss
    return clone_replace(loss, {var: disconnected_grad(var) for var in consider_constant})


def _checked_state_updates(state_updates: StateUpdates | None, written: set[int]) -> list[StateUpdate]:
    """``state_updates`` as ``(shared, value, mode)`` triples, checked."""
    if state_updates is None:
        return []
    items = list(state_updates.items()) if isinstance(state_updates, dict) else list(state_updates)
    triples: list[StateUpdate] = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise TypeError(f"each state update must be (shared, new_value) or (shared, new_value, "
                            f"mode), got {item!r}")
        var, value = item[0], pt.as_tensor_variable(item[1])
        mode = check_update_mode(var, item[2] if len(item) == 3 else None)
        if not isinstance(var, SharedVariable):
            raise TypeError(f"a state update writes {var!r}, which is not a shared variable; "
                            f"state_updates write shared variables (pytensor.shared)")
        if id(var) in written:
            raise ValueError(f"state_updates writes {var}, which the update rule writes too (a "
                             f"parameter, the optimizer's state or a statistic); leave it out")
        if (value.type.dtype, value.type.ndim) != (var.type.dtype, var.type.ndim):
            raise TypeError(f"the state update of {var} gives dtype {value.type.dtype} and ndim "
                            f"{value.type.ndim}, but {var} holds dtype {var.type.dtype} and ndim "
                            f"{var.type.ndim}; cast it: expr.astype({var.type.dtype!r})")
        triples.append((var, value, mode))
    if len({id(var) for var, _, _ in triples}) < len(triples):
        raise ValueError("state_updates writes a variable more than once; give one update each")
    return triples


def _scalar_inputs(reads: Sequence[Variable], known: Iterable[Variable]) -> list[Variable]:
    """The symbolic inputs ``reads`` read besides ``known`` (all 0-d), in the order they are computed
    with: the first of ``reads`` first, and within one in PyTensor's order of computation."""
    known = set(known)
    found: dict = {}
    for root in reads:
        leaves = {v for v in graph_inputs([root])
                  if not isinstance(v, (Constant, SharedVariable)) and v not in known}
        for node in io_toposort(list(graph_inputs([root])), [root]):
            found.update((v, None) for v in node.inputs if v in leaves)
        if root in leaves:
            found[root] = None
    for var in found:
        if var.ndim != 0:
            raise TypeError(
                f"the training step reads {var} ({var.ndim}-d), which is none of its data: a step "
                f"takes its rows through x or y (give {var} there) and reads everything else "
                f"from shared variables (pytensor.shared); only 0-d inputs (a learning rate) are "
                f"taken besides")
    return list(found)


def _carry_scalars(param_updates: list[tuple[Any, Any]], scalars: Sequence[Variable]
                   ) -> tuple[list[tuple[Any, Any]], list[tuple[SharedVariable, Variable, None]]]:
    """The rule's updates reading each scalar from a 0-d shared carrier, and the carriers' updates."""
    read = set(graph_inputs([value for _, value in param_updates]))
    carriers = {}
    for var in scalars:
        if var in read:
            carrier = pytensor.shared(np.zeros((), dtype=var.type.dtype), name=f"{var.name or 'scalar'}_of_step")
            carrier.tag.synk_gradient = True          # scratch between steps: checkpoints leave it out
            carriers[var] = carrier
    if not carriers:
        return param_updates, []
    values = clone_replace([value for _, value in param_updates], carriers)
    return ([(target, value) for (target, _), value in zip(param_updates, values)],
            [(carrier, var, None) for var, carrier in carriers.items()])


def input_list(value: Any, name: str, caller: str = "make_train_function") -> list[Any]:
    """``x`` or ``y`` of a training step as a list of variables (None: none; ``x`` needs one)."""
    if value is None:
        if name == "x":
            raise TypeError(f"{caller} needs at least one input x (a variable or a list)")
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if name == "x" and not values:
        raise TypeError(f"{caller} needs at least one input x (a variable or a list)")
    return values


def givens_scalars(givens: Mapping[Variable, Variable] | Iterable[tuple[Variable, Variable]]) -> list[Variable]:
    """The scalar inputs the values of ``givens`` read (the tutorials' index), in order."""
    return list(dict.fromkeys(
        v for value in dict(givens).values() for v in graph_inputs([value])
        if not isinstance(v, (Constant, SharedVariable)) and v.ndim == 0))  # type: ignore[attr-defined]


def call_values(values: Sequence[Any], named: Mapping[str, Any], inputs: Sequence[Variable],
                what: str = "the step") -> Any:
    """One value per variable of ``inputs``, given by position or by the variable's name.

    Examples
    --------
    >>> index, lr = pt.lscalar("index"), pt.scalar("lr")
    >>> call_values((3,), {"lr": 0.1}, [index, lr])
    [3, 0.1]
    """
    names = [v.name for v in inputs]
    if len(values) > len(inputs):
        raise TypeError(f"{what} takes {len(inputs)} inputs {names}, got {len(values)}")
    out = list(values) + [_MISSING] * (len(inputs) - len(values))
    for key, value in named.items():
        at = [i for i, name in enumerate(names) if name == key]
        if len(at) != 1 or out[at[0]] is not _MISSING:
            why = ("given twice" if len(at) == 1 else "the name of several" if at else "not one of them")
            raise TypeError(f"{what} takes the inputs {names}; {key!r} is {why}")
        out[at[0]] = value
    missing = [name for name, value in zip(names, out) if value is _MISSING]
    if missing:
        raise TypeError(f"{what} is missing inputs {missing} (its inputs are {names})")
    return out


_MISSING = object()
