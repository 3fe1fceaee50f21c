"""The values a call's updates replace, kept until the call has succeeded on every rank.

A call that raises on one rank must leave every rank's shared variables as they
were before it (API.md, part 4): the ranks that computed their share have
already stored their updates, and a rank that raised while computing may have
given XLA its old buffers to compute into (donation). So before a graph that
could fail stores anything, its rank keeps the values its updates will replace
in an :class:`UndoLog`; the master then either lets the log go (at the next
command) or has every rank :meth:`~UndoLog.restore` it.

Keeping a value is keeping a reference: a graph that donates its updated
buffers sees the extra reference and computes from a copy instead
(:func:`~.jitted.copy_values_held_elsewhere`), so the kept value is never
overwritten. Only calls that can fail keep anything: a call whose argument
shapes have already run on every rank (nothing left to trace, so nothing rank
specific to fail) and whose graph calls no host code is not kept, and donates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Iterable

from ..platform.internals import storage_cell
from ..platform.values import reference

__all__ = ["UndoLog", "HalfStep", "half_step"]


class UndoLog:
    """One rank's record of the values the current command's updates replaced.

    Examples
    --------
    >>> cell = [1.0]
    >>> log = UndoLog()
    >>> log.begin(keep_all=True)
    >>> log.keep([cell]); cell[0] = 2.0
    >>> log.keep([cell]); cell[0] = 3.0        # the value before the command is kept, once
    >>> log.restore(); cell
    [1.0]
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[list, Any]] = {}
        #: keep what every graph of this command replaces, not only what graphs calling host code
        #: replace (the master asks for it while the call's shapes have not run on every rank)
        self.keep_all = False

    def begin(self, keep_all: bool) -> None:
        """Start a command: what the last one kept is let go (it succeeded everywhere)."""
        self._kept.clear()
        self.keep_all = keep_all

    def keep(self, cells: Iterable[list]) -> None:
        """Remember what each storage cell holds now, unless this command remembered it already."""
        kept = self._kept
        for cell in cells:
            if id(cell) not in kept:
                kept[id(cell)] = (cell, cell[0])

    def restore(self) -> None:
        """Put every kept value back into its cell, and forget them."""
        for cell, value in self._kept.values():
            cell[0] = value
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


class HalfStep:
    """A training step of several graphs: the state updates its gradient graph stores (a step
    counter), and the cells its update graph writes. A Ctrl-C landing between the two stores
    would leave the state one step ahead of the parameters; :meth:`put_back_if_half` puts the
    state back then, so that what the script keeps is a whole step's.

    Examples
    --------
    >>> import numpy as np
    >>> count, weights = [np.array(0.0)], [np.array([1.0])]
    >>> guard = HalfStep([count], [weights])
    >>> guard.begin(); count[0] = np.array(1.0)         # the gradient graph stored; a Ctrl-C
    >>> guard.put_back_if_half(); float(count[0][()])
    0.0
    >>> guard.begin(); count[0] = np.array(1.0); weights[0] = np.array([0.5])   # a whole step
    >>> guard.put_back_if_half(); float(count[0][()])
    1.0
    """

    def __init__(self, side: list[list], updated: list[list]) -> None:
        self.side, self.updated = side, updated
        self._before: list = []
        self._refs: list[Callable[[], Any]] = []

    def begin(self) -> None:
        """A step starts: remember the state's values, and (weakly) what the update graph's cells hold."""
        self._before = [cell[0] for cell in self.side]
        self._refs = [reference(cell[0]) for cell in self.updated]

    def put_back_if_half(self) -> None:
        """If the update graph has not stored since :meth:`begin`, put the state's values back."""
        if self._before and all(ref() is cell[0] for cell, ref in zip(self.updated, self._refs)):
            for cell, value in zip(self.side, self._before):
                cell[0] = value
        self._before, self._refs = [], []


def half_step(grad_updates: Iterable[tuple], update_updates: Iterable[tuple]) -> HalfStep | None:
    """The :class:`HalfStep` of a step whose gradient graph has ``grad_updates`` and whose update
    graph has ``update_updates`` (``(shared, value, mode)`` triples), or None where the gradient
    graph stores nothing but the step's flat gradient (its scratch buffer: nothing to put back)."""
    side = [storage_cell(var) for var, _, _ in grad_updates if not getattr(var.tag, "synk_gradient", False)]
    return HalfStep(side, [storage_cell(var) for var, _, _ in update_updates]) if side else None

