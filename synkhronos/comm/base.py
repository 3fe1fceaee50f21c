"""The interface every collective implementation provides.

An implementation is called by every rank at once with a list of arrays of
one dtype (the same shapes on every rank) and returns a list of device
arrays, one per input, in one launch for the whole list. The runtime builds
one per process from a :class:`CommContext` and calls nothing but what
:class:`Comm` declares, so a new implementation (a hierarchical one for
several nodes, say) is a subclass and an entry in :data:`synkhronos.comm.KINDS`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence

__all__ = ["Comm", "CommContext", "Reservation", "ProgramReducer", "NOTHING_TO_KEEP"]

#: what :meth:`ProgramReducer.running` gives where nothing is kept from the output (reusable)
NOTHING_TO_KEEP: AbstractContextManager[None] = contextlib.nullcontext()


@dataclass(frozen=True)
class CommContext:
    """What a process knows when it builds its collective implementation.

    Attributes
    ----------
    prefix : str
        The runtime's shared-memory name prefix (segments an implementation
        makes must start with it, so that ``close()`` and the tests find them).
    rank, n_ranks, master_rank : int
    check : callable
        Raises to abandon a wait (a dead peer, a stall, a closed runtime); an
        implementation whose waits return to Python calls it between slices.
    spin : float
        Seconds a waiting process may poll before it sleeps.
    topology : Topology, optional
        On several nodes, where the process sits (``rank``, ``n_ranks`` and
        ``master_rank`` are then global ranks, ``master_rank`` this node's
        master's); None on one node.
    """

    prefix: str
    rank: int
    n_ranks: int
    master_rank: int
    check: Callable[[], None]
    spin: float = 0.0
    topology: Any = None

    def on_this_node(self) -> CommContext:
        """The context of this process among its node's processes only (local ranks)."""
        t = self.topology
        if t is None:
            return self
        return replace(self, rank=t.local_of(self.rank), n_ranks=t.n_local,
                       master_rank=t.local_of(self.master_rank), topology=None)


@dataclass(frozen=True)
class Reservation:
    """What the master tells an implementation before a collective (:meth:`Comm.reserve`).

    Attributes
    ----------
    nbytes : int
        The largest buffer per rank the collective moves.
    result_bytes : int
        The size of its one all-reduce result, if it makes just one (else 0).
    reduce_bytes : int
        The size of the all-reduce it runs, if any (else 0).
    result_consumed : bool
        Every rank is done with each all-reduce result before it enters the
        next all-reduce (a training loop's gradient), so results of any size
        may share one buffer.
    """

    nbytes: int = 0
    result_bytes: int = 0
    reduce_bytes: int = 0
    result_consumed: bool = False


class ProgramReducer:
    """Reductions across ranks inside one compiled program: the identity, on one rank.

    A fused training step (:mod:`synkhronos.rank.fused`) traces its body once
    per rank and calls :meth:`reduce` where a value is reduced across ranks;
    :meth:`wrap` makes the body the program every rank runs, and
    :meth:`globals_of` / :meth:`locals_of` turn this rank's values into the
    program's arguments and its results back (on one rank: the values
    themselves); each run of the program goes inside :meth:`running`.
    :meth:`Comm.program_reducer` gives the one of a collective
    implementation that can reduce inside a program.
    """

    def reduce(self, x: Any, mode: str | None) -> Any:
        """``x`` reduced across ranks by ``mode`` (sum, avg, max, min; None: this rank's own)."""
        return x

    def wrap(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """The program every rank runs, from the per-rank ``body``."""
        return body

    def globals_of(self, tree: Any) -> Any:
        """This rank's values (a pytree of device arrays) as the program's arguments."""
        return tree

    def locals_of(self, tree: Any) -> Any:
        """The program's results as this rank's values."""
        return tree

    def running(self) -> AbstractContextManager[None]:
        """Around a run of a program :meth:`wrap` made: what the collective library prints of
        its own as the ranks first meet is kept from the user's output (nothing to keep here)."""
        return NOTHING_TO_KEEP


class Comm(ABC):
    """Collectives among the ranks of one runtime, each process with its single local device.

    Parameters
    ----------
    context : CommContext
    """

    #: the name ``fork(collectives=...)`` takes
    name: ClassVar[str]
    #: True if every wait returns to Python between slices and calls ``context.check``: the
    #: master then runs its part in its own thread (else in a thread the master watches)
    waits_in_python: ClassVar[bool] = False
    #: the JAX platforms ("cpu", "gpu", ...) the implementation works on
    platforms: ClassVar[tuple] = ("cpu", "gpu")

    def __init__(self, context: CommContext) -> None:
        self.context = context
        self.rank, self.n_ranks = context.rank, context.n_ranks

    @abstractmethod
    def all_reduce(self, values: Sequence, op: str) -> list:
        """Element-wise reduction across ranks; ``op`` in sum, avg (sum / n_ranks), prod, min, max."""

    def all_reduce_host(self, values: Sequence, op: str) -> list:
        """:meth:`all_reduce`, the results as host (numpy) arrays.

        For a caller that hands the results straight to a jitted function (a
        training loop's update): an implementation that reduces on the host
        then skips making device arrays of them.
        """
        import numpy as np
        return [np.asarray(v) for v in self.all_reduce(values, op)]

    @abstractmethod
    def all_gather(self, values: Sequence) -> list:
        """Each value stacked across ranks, shape ``(n_ranks, *shape)``."""

    @abstractmethod
    def broadcast(self, values: Sequence, root: int) -> list:
        """``root``'s values on every rank."""

    def program_reducer(self) -> ProgramReducer | None:
        """How a compiled program reduces across the ranks inside itself, or None if this
        implementation reduces only between programs (in host memory, say)."""
        return None

    def reserve(self, reservation: Reservation) -> None:
        """Master, before the collective's command goes out: make room for it (nothing by default)."""

    def refresh(self) -> None:
        """Every rank, after a collective: let go of what no result holds (nothing by default)."""

    def release(self) -> None:
        """At close: free what the implementation holds (nothing by default)."""
