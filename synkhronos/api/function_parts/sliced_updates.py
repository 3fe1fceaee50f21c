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

from collections.abc import Callable

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors
from pytensor.scalar import Add, Cast, Identity, Sub
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.subtensor import AdvancedIncSubtensor, IncSubtensor

from .row_sums import is_zero

__all__ = ["sums_its_changes", "added_terms"]


def sums_its_changes(shared: SharedVariable, value: Variable, mode: str | None,
                     reads_rows: Callable[[Variable], bool] | None = None) -> bool:
    """True if the update ``(shared, value, mode)`` is ``shared`` plus a change, combined over slices
    by ``"sum"``: its slices' changes are summed onto ``shared``'s value.

    Raises ``ValueError`` for a ``"sum"`` or ``"prod"`` update that reads ``shared``
    otherwise (its slices' values would count ``shared``'s value once per slice),
    and for such a sum whose change adds a term that ``reads_rows`` says reads
    none of the rows (every slice would add it).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> s, x = pytensor.shared(np.zeros(3), name="s"), pt.matrix("x")
    >>> sums_its_changes(s, s + x.sum(0), "sum"), sums_its_changes(s, x.sum(0), "sum")
    (True, False)
    >>> sums_its_changes(s, pt.inc_subtensor(s[0], x.sum()), "sum")     # a count in one place
    True
    >>> sums_its_changes(s, 0.9 * s + x.mean(0), "avg")     # a moving average: the slices' mean
    False
    >>> sums_its_changes(s, 0.9 * s + x.sum(0), "sum")
    Traceback (most recent call last):
    ...
    ValueError: the update of s reads s otherwise than as s + change, and is combined over slices by 'sum': ...
    >>> sums_its_changes(s, s + x.sum(0) + 1, "sum", reads_rows=lambda v: x in ancestors([v]))
    Traceback (most recent call last):
    ...
    ValueError: the update of s is combined over slices by 'sum' and adds ExpandDims{axis=0}.0, which ...
    """
    if mode not in ("sum", "prod") or shared not in ancestors([value]):
        return False
    if mode == "sum":
        terms = added_terms(value, signed=True)
        own = [(term, sign) for term, sign in terms if term is shared]
        change = [term for term, _ in terms if term is not shared]
        if own == [(shared, 1)] and not any(shared in ancestors([term]) for term in change):
            rowless = [] if reads_rows is None else [t for t in change if not reads_rows(t) and not is_zero(t)]
            if rowless:
                raise ValueError(
                    f"the update of {shared} is combined over slices by 'sum' and adds {rowless[0]}, which "
                    f"reads none of the rows: every slice would add it, where a call in one slice adds "
                    f"it once; give that part its own update of mode None, or the whole the mode "
                    f"'avg' if it is a mean over the rows")
            return True
    how = f"otherwise than as {shared} + change" if mode == "sum" else "itself"
    fix = f"write it as {shared} + (a sum over the rows), or " if mode == "sum" else ""
    raise ValueError(
        f"the update of {shared} reads {shared} {how}, and is combined over slices by {mode!r}: "
        f"every slice computes it from {shared}'s value before the call, so their "
        f"{'sum' if mode == 'sum' else 'product'} would count that value once per slice; {fix}give "
        f"it the mode None (the last slice's value) if it reads no rows")


def added_terms(value: Variable, signed: bool = False) -> list:
    """The terms of ``value`` if it is a sum (``a + b - c``, however nested, through casts and
    increments of parts, ``inc_subtensor(a[i], b)``), else ``[value]``; with ``signed``, each
    as ``(term, +1 or -1)``.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a, b, c = pt.scalars("abc")
    >>> [str(t) for t in added_terms(pt.cast(a + b, "float32") - c)]
    ['a', 'b', 'c']
    >>> [(str(t), sign) for t, sign in added_terms(a - (b - c), signed=True)]
    [('a', 1), ('b', -1), ('c', 1)]
    """
    terms = _signed_terms(value, 1)
    return terms if signed else [term for term, _ in terms]


def _signed_terms(value: Variable, sign: int) -> list[tuple[Variable, int]]:
    owner = value.owner
    if owner is None:
        return [(value, sign)]
    op = owner.op
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, Add):
        return [term for operand in owner.inputs for term in _signed_terms(operand, sign)]
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, Sub):
        return _signed_terms(owner.inputs[0], sign) + _signed_terms(owner.inputs[1], -sign)
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, Cast | Identity):
        return _signed_terms(owner.inputs[0], sign)
    if isinstance(op, IncSubtensor | AdvancedIncSubtensor) and not op.set_instead_of_inc:
        return _signed_terms(owner.inputs[0], sign) + _signed_terms(owner.inputs[1], sign)
    return [(value, sign)]
