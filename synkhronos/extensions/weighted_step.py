"""A training step as ``make_train_function`` builds it: the weighted gradient, one all-reduce, the update.

:class:`WeightedStep` joins the gradient function (each device's gradient
weighted by its share of the batch's rows), the all-reduce of the flat
gradient and the update function into one :class:`~synkhronos.api.step.Step`;
:class:`TrainStep` is what the user calls, with handles on what it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor.tensor as pt
from pytensor_ml.params import NonTrainableParameter

from ..api.data import data
from ..api.function import function
from ..api.step import Step
from ..runtime.session import current, serialized

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable
    from pytensor.tensor.variable import TensorVariable

    from .step_graph import StepGraph

__all__ = ["WeightedStep", "TrainStep"]


class WeightedStep:
    """Gradient function (row-weighted flat gradient), one all-reduce, update function.

    Each device scales its local mean gradient by ``n_devices * its_rows /
    batch_rows`` (its rows along ``x``'s axis ``row_axis``); the average over
    devices is then the full-batch gradient.
    """

    def __init__(self, graph: StepGraph, x: TensorVariable, inputs: Sequence[Variable] = (),
                 row_axis: int = 0, **function_kwargs: Any) -> None:
        self.graph, self.grad_shared, self.params = graph, graph.grad_shared, graph.params
        (target, flat_grad), = graph.grad_updates
        dtype = self.grad_shared.type.dtype
        batch_rows = pt.scalar("batch_rows", dtype=dtype)
        weight = pt.cast(x.shape[row_axis], dtype) * current().n_parallel / batch_rows
        # the step's scalars follow its data, whole on every device (0-d inputs are broadcast)
        self.f_grad = function(list(inputs) + graph.scalars, (graph.loss, "avg"), bcast_inputs=[batch_rows],
                               updates=[(target, flat_grad * weight, "sum")] + graph.side_updates,
                               name="train_grad", **function_kwargs)
        # (its gradient carries its rows' weight: the all-reduce's average weighs the devices alike)
        self.f_grad.row_written = frozenset()
        self.f_upd = function([], updates=graph.param_updates, name="train_update")
        self.step = Step(self.f_grad, self.grad_shared, self.f_upd, op="avg")
        # the batch's rows travel in a Data the step writes: every call then has the same
        # arguments, so the call's plan is validated once and reused
        self._batch_rows = data(np.zeros((), dtype), name="batch_rows")

    def touched_now(self, *_: Any) -> list | None:
        """What the step hands to the devices and back (see :meth:`Step.touched_now`)."""
        return self.step.touched_now()

    # the rows written and the step that reads them: one thread's turn
    @serialized(touches=touched_now)
    def __call__(self, batch_rows: int, *inputs: Any, **call_kwargs: Any) -> Any:
        self.step.check_current()       # before the rows' Data, which a closed runtime freed
        self._batch_rows.data[()] = batch_rows
        return self.step(*inputs, self._batch_rows, **call_kwargs)

    def expose(self, call: Callable[..., Any], inputs: Sequence[Variable] = (),
               runs_on_devices: bool = False) -> TrainStep:
        """The user's step: ``call`` with handles on what it runs (a :class:`TrainStep`)."""
        return TrainStep(call, self, list(inputs), runs_on_devices)


class TrainStep:
    """A training step as :func:`make_train_function` returns it: call it, and it knows what it trains.

    Attributes
    ----------
    params : list of SharedVariable
    statistics : list of SharedVariable
        The model's statistics the step writes back (batch norm's running mean and variance).
    optimizer_state : list of SharedVariable
        The optimizer's state (moments, step counters, training clocks).
    extra_state : list of SharedVariable
        What the step's ``state_updates`` write.
    state_variables : list of SharedVariable
        The parameters, statistics, optimizer's state and extra state: what a
        checkpoint of this training holds.
    grad_shared : SharedVariable
        The flat vector the gradients (and statistics) travel in.
    functions : (Function, Function)
        The gradient function and the update function.
    inputs : list of Variable
        What a call takes, in order: x's, then y's (or the scalars of the
        givens' bounds), then the scalar inputs.
    scalars : list of Variable
        The scalar inputs (hyperparameters such as a learning rate), whole on every device.
    runs_on_devices : bool
        Whether :func:`run` takes it (its data in shared memory).
    """

    def __init__(self, call: Callable[..., Any], step: WeightedStep, inputs: list[Variable],
                 runs_on_devices: bool) -> None:
        self._call = call
        self.grad_shared, self.params = step.grad_shared, step.params
        self.functions = (step.f_grad, step.f_upd)
        written = [s for s, _, _ in step.f_upd.spec.updates if all(s is not p for p in step.params)]
        self.statistics = [s for s in written if isinstance(s, NonTrainableParameter)]
        self.optimizer_state = [s for s in written if not isinstance(s, NonTrainableParameter)]
        self.extra_state = step.graph.state
        self.state_variables = self.params + self.statistics + self.optimizer_state + self.extra_state
        self.inputs, self.runs_on_devices = inputs, runs_on_devices
        self.scalars = step.graph.scalars

    def __call__(self, *data: Any, **kwargs: Any) -> Any:
        return self._call(*data, **kwargs)

    def __repr__(self) -> str:
        return f"TrainStep(params={[p.name for p in self.params]})"
