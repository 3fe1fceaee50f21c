"""The rows behind each device's value of a shared variable that a call wrote from its rows.

A call's updates that read its scattered rows leave every device a value of
its own: a gradient of its rows' mean loss, say. When the devices got unequal
rows (7 rows over 3 devices: 2, 2 and 3), the plain mean of those values over
the devices is not the value of all the rows together: each device's mean
weighs alike. ``synk.all_reduce(var, op="avg")`` weighs them by these rows
instead, so that the contract's loop (a gradient function, the all-reduce of
its flat gradient, the update) steps as one process does on any batch. It does
so by itself for the gradient vectors of :mod:`synkhronos.extensions.updates`,
which hold one call's gradient of a mean loss; for any other variable only
when the script says its values are means over rows (``by_rows=True``): a sum
over rows is no such mean. An update that reads its own variable (a sum over
several calls) is never recorded: its value holds more than one call's rows.

A record holds while the master's value is the one the call left: anything
else writing the variable (another call, a collective, a loop, ``set_value``)
ends it, either by replacing that value or by :meth:`RowsBehind.forget`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..platform.values import reference, stored

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["RowsBehind"]


class RowsBehind:
    """Per shared variable, the rows each device's value came from, while the devices' rows differed.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> g = pytensor.shared(np.zeros(2), name="g")
    >>> behind = RowsBehind()
    >>> behind.note([g], [2, 2, 3]); behind.rows_of(g)
    (2, 2, 3)
    >>> behind.note([g], [3, 3]); behind.rows_of(g) is None        # an even split: a plain mean
    True
    >>> behind.note([g], [2, 3]); g.set_value(np.ones(2)); behind.rows_of(g) is None
    True
    """

    def __init__(self) -> None:
        self._rows: dict[SharedVariable, tuple[tuple[int, ...], Callable[[], Any]]] = {}
        self._said: set[SharedVariable] = set()

    def note(self, written: Iterable[SharedVariable], rows: Sequence[int]) -> None:
        """A call wrote ``written`` on every device from its ``rows`` (per rank, in rank order)."""
        uneven = len(set(rows)) > 1
        for var in written:
            if uneven:
                self._rows[var] = (tuple(rows), reference(stored(var)))
            else:
                self._rows.pop(var, None)

    def rows_of(self, var: SharedVariable) -> tuple[int, ...] | None:
        """The rows behind each device's value of ``var``, or None (not a call's, or an even split)."""
        kept = self._rows.get(var)
        if kept is None:
            return None
        if kept[1]() is not stored(var):      # written since, by anything else
            del self._rows[var]
            return None
        return kept[0]

    def forget(self, written: Iterable[SharedVariable]) -> None:
        """Something other than a call wrote ``written`` (on some device, or every device alike)."""
        for var in written:
            self._rows.pop(var, None)

    def plain_mean_said(self, var: SharedVariable) -> bool:
        """Whether a plain mean of ``var``'s values of unequal rows was taken, and said, before."""
        return var in self._said

    def said_plain_mean(self, vars_: Iterable[SharedVariable]) -> None:
        """A plain mean of ``vars_``'s values of unequal rows was said, and taken."""
        self._said.update(vars_)
