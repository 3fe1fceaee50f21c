"""A training step as one command: a call, an all-reduce, an update function.

``make_train_function``'s step is three things on every device: the gradient
call, ``all_reduce(grad_shared)``, the update function. Sent as three commands,
every device idles between them while the master plans the next one.
:class:`Step` sends them as one (``Op.STEP``): every rank computes its share of
the call and prepares the all-reduce; if every rank could, each all-reduces
and updates at once, and the master reduces the call's outputs as for any
call. A rank whose share fails makes every rank skip the rest, so a failed
step leaves the state exactly as a failed call followed by nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytensor.tensor.type import TensorType

from ..comm import Reservation
from ..platform.values import stored
from ..runtime.session import active, current, serialized
from ..runtime.state import State
from ..wire.collective import shapes_of
from ..wire.control import Words
from .collectives import (
    all_reduce,
    reduction_command,
    resolve_shareds,
    shapes_named_on_mismatch,
)
from .function import Function

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

    from .collectives import Shareds

__all__ = ["StepTail", "Step"]


@dataclass(frozen=True)
class StepTail:
    """What every rank runs after its share of a call, in the call's command.

    Attributes
    ----------
    fill : callable
        ``fill(words)`` writes the all-reduce.
    reservation : Reservation
        What the all-reduce needs of the collective implementation.
    update_fid : int
        The function (without inputs) every rank runs after the all-reduce.
    """

    fill: Callable[[Words], None]
    reservation: Reservation
    update_fid: int


class Step:
    """``call(*args)``, then ``all_reduce(reduced, op)``, then ``update()``: one training step.

    On one node every call of a Step is one command (see the module notes); on
    several nodes, or with every rank's CPU pool over every core, three
    (:attr:`~synkhronos.runtime.session.State.fuses_steps`). Built once, called
    every step: what the all-reduce sends is made once and again only when the
    reduced variables' shapes change.

    Parameters
    ----------
    call : Function
    reduced : shared variable or list of them
        What to all-reduce after the call (a flat gradient).
    update : Function
        A function without inputs (the optimizer's update).
    op : str
        The all-reduce's operation.

    Examples
    --------
    >>> from synkhronos.extensions import updates
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> loss = ((x.dot(w) - y) ** 2).mean()
    >>> grad_updates, param_updates, grad_shared = updates.sgd(loss, [w], 0.1)
    >>> f_grad = synk.function([x, y], (loss, "avg"), updates=grad_updates)
    >>> f_update = synk.function([], updates=param_updates)
    >>> train_step = Step(f_grad, grad_shared, f_update)
    >>> train_step(np.ones((4, 3)), np.ones(4))
    array(1.)
    >>> w.get_value()
    array([0.2, 0.2, 0.2])
    """

    def __init__(self, call: Function, reduced: Shareds, update: Function, op: str = "avg") -> None:
        if update.spec.all_inputs:
            raise TypeError(f"the update of a step runs without inputs, but {update.name} takes "
                            f"{len(update.spec.all_inputs)}; give it none")
        self.call, self.update, self.op = call, update, op
        self.reduced, _ = resolve_shareds(reduced)
        #: what a step hands to the devices and back: the call's variables, the update's, the reduced
        self.touched = list(dict.fromkeys(call.touched + update.touched + [
            var for var in self.reduced if isinstance(var.type, TensorType)]))
        self._tail: StepTail | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._command(current())         # checks the op against the variables' dtypes

    def touched_now(self, *_: object) -> list[SharedVariable] | None:
        """The shared variables a step hands to the devices and back (None, every one, when its
        functions belong to a closed runtime: the step raises)."""
        state = active()
        return self.touched if self.call._state is state and self.update._state is state else None

    def check_current(self) -> State:
        """The running runtime, if the step's functions belong to it; else raise, saying to build
        the step again (a runtime closed since) or to fork (none runs)."""
        state = current()
        if self.update._state is not state:
            raise RuntimeError(f"{self.update} was built before the runtime it belonged to was "
                               f"closed; build it again after fork()")
        return state

    @serialized(touches=touched_now)
    def __call__(self, *args: Any, **call_kwargs: Any) -> Any:
        """Run the step with the call's arguments (``batch=``, ``num_slices=`` ...); return what the
        call returns."""
        state = self.check_current()
        if not state.fuses_steps:
            result = self.call(*args, **call_kwargs)
            all_reduce(self.reduced, self.op)
            self.update()
            return result
        state.registry.ensure_shipped()
        if not state.registry.is_registered(self.update.spec.fid):
            raise TypeError(f"{self.update.name} could not be sent to the workers and was "
                            f"unregistered; build it again from picklable ops")
        options = {k: call_kwargs.pop(k) for k in _CALL_OPTIONS if k in call_kwargs}
        with shapes_named_on_mismatch(state, self.reduced, f"{self.op} reduction"):
            return self.call.call_with_tail(args, call_kwargs, **options, tail=self._command(state))

    def _command(self, state: State) -> StepTail:
        """The :class:`StepTail`, made again if the reduced variables' shapes changed."""
        shapes = shapes_of(stored(v) for v in self.reduced)
        if shapes != self._shapes:
            fill, reservation = reduction_command(state, self.reduced, self.op)
            self._tail, self._shapes = StepTail(fill, reservation, self.update.spec.fid), shapes
        assert self._tail is not None, "made at the first step (no shapes before it)"
        return self._tail


#: the keywords of a call that are not its inputs
_CALL_OPTIONS = ("batch", "batch_s", "num_slices", "output_subset")
