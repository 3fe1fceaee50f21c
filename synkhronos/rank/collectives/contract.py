"""What a collective's part takes of its rank (:class:`CollectiveContext`), and how it is prepared
(:data:`Prepare`).

:class:`~synkhronos.rank.context.RankContext` has it. The rank context imports
the collectives, so they take it through this contract instead of importing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    from pytensor.compile.sharedvalue import SharedVariable

    from ...comm import Comm
    from ...wire.control import Words
    from ...wire.plan import InputRef

__all__ = ["CollectiveContext", "Prepare"]


class CollectiveContext(Protocol):
    """One rank, as a collective's part sees it (see :class:`~synkhronos.rank.context.RankContext`)."""

    rank: int
    n_ranks: int
    master_rank: int
    root_rank: int

    def variable(self, uid: int) -> Any:
        """A shared variable by uid."""
        ...

    def view(self, ref: InputRef) -> Any:
        """The numpy view of a Data."""
        ...

    def index_view(self, gen: int, start: int, n: int) -> np.ndarray:
        """The numpy view of ``n`` explicit indices at ``start`` of generation ``gen`` of the index segment."""
        ...

    @property
    def comm(self) -> Comm:
        """This rank's collective implementation (built on first use)."""
        ...

    @property
    def comm_made(self) -> bool:
        """True once :attr:`comm` was built."""
        ...


#: what every rank runs first of a collective: ``prepare(context, vars_, words)`` reads the rest of
#: the command from ``words`` and returns its ``execute()``, which returns the results the master keeps
type Prepare = Callable[[CollectiveContext, Sequence[SharedVariable], Words], Callable[[], list[Any]]]
