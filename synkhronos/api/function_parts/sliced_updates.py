"""How an update's values on the slices of a call (``num_slices > 1``) combine into one.

Every slice computes an update from the values before the call, and the
update's mode combines the slices' values. For ``"sum"`` that is right for a
sum over the rows (``x.sum(0)``: the slices' sums add up to the batch's),
but an accumulator, a variable plus a sum over the rows (``seen + x.shape[0]``,
``s + x.sum(0)``), would count the variable's value once per slice. Such an
update is found here (:func:`sums_its_changes`): its slices' changes are
summed onto the value before the call, so that the result is the one of a call
in one slice. An update of ``"sum"`` or ``"prod"`` that reads its own variable
in any other way cannot be combined from its slices' values and is refused
when the function is built.
"""

from __future__ import annotations

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors
from pytensor.scalar import Add
from pytensor.tensor.elemwise import Elemwise

__all__ = ["sums_its_changes", "added_terms"]


def sums_its_changes(shared: SharedVariable, value: Variable, mode: str | None) -> bool:
    """True if the update ``(shared, value, mode)`` is ``shared`` plus a change, combined over slices
    by ``"sum"``: its slices' changes are summed onto ``shared``'s value.

    Raises ``ValueError`` for a ``"sum"`` or ``"prod"`` update that reads ``shared``
    otherwise: its slices' values would count ``shared``'s value once per slice.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> s, x = pytensor.shared(np.zeros(3), name="s"), pt.matrix("x")
    >>> sums_its_changes(s, s + x.sum(0), "sum"), sums_its_changes(s, x.sum(0), "sum")
    (True, False)
    >>> sums_its_changes(s, 0.9 * s + x.mean(0), "avg")     # a moving average: the slices' mean
    False
    >>> sums_its_changes(s, 0.9 * s + x.sum(0), "sum")
    Traceback (most recent call last):
    ...
    ValueError: the update of s reads s otherwise than as s + change, and is combined over slices by 'sum': ...
    """
    if mode not in ("sum", "prod") or shared not in ancestors([value]):
        return False
    if mode == "sum":
        terms = added_terms(value)
        if terms.count(shared) == 1 and not any(shared in ancestors([t]) for t in terms if t is not shared):
            return True
    how = f"otherwise than as {shared} + change" if mode == "sum" else "itself"
    fix = f"write it as {shared} + (a sum over the rows), or " if mode == "sum" else ""
    raise ValueError(
        f"the update of {shared} reads {shared} {how}, and is combined over slices by {mode!r}: "
        f"every slice computes it from {shared}'s value before the call, so their "
        f"{'sum' if mode == 'sum' else 'product'} would count that value once per slice; {fix}give "
        f"it the mode None (the last slice's value) if it reads no rows")


def added_terms(value: Variable) -> list[Variable]:
    """The terms of ``value`` if it is a sum (``a + b + c``, however nested), else ``[value]``."""
    owner = value.owner
    if owner is None or not (isinstance(owner.op, Elemwise) and isinstance(owner.op.scalar_op, Add)):
        return [value]
    return [term for operand in owner.inputs for term in added_terms(operand)]
