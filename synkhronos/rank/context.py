"""What the code every rank runs needs to know about the rank it runs on: one :class:`RankContext`.

The master and every worker each build one when they start
(``runtime.state.State`` and ``runtime.worker.Worker``). Everything in
:mod:`synkhronos.rank` takes it: a call's share, a collective's part, a step's
tail, a device-driven loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..comm import CommContext
from .undo import UndoLog

if TYPE_CHECKING:
    from ..comm import Comm, ProgramReducer
    from ..seams.loop import CenterClient
    from ..wire.control import Words
    from ..wire.loop import LoopSpec
    from ..wire.plan import CallPlan
    from ..wire.topology import Topology
    from .compiled import CompiledFunction
    from .executor import ArgUploads
    from .fused import StepProgram, StepPrograms
    from .loop import DeviceLoop

__all__ = ["RankContext"]


@dataclass
class RankContext:
    """One rank, as the rank code sees it.

    Attributes
    ----------
    rank, n_ranks : int
        This rank among every device of every node (what work is split by).
    local_rank, n_local : int
        This rank among its node's devices (a node-local call is split so).
    master_rank : int
        The global rank of this node's master (which keeps or returns results).
    root_rank : int
        The global rank a broadcast sends from, and random streams start at: node 0's master.
    function : callable
        This rank's compiled function by function id.
    variable : callable
        A shared variable by uid.
    view, index_view : callable
        The numpy view of a Data (by ``InputRef``), and of explicit indices.
    check : callable
        Called while waiting (raises to abandon a wait: a dead master, a fault).
    comm_class : type
        The collective implementation; :attr:`comm` is built from it at first use.
    prefix : str
        The runtime's segment prefix.
    spin : float
        Seconds a wait polls before it sleeps.
    topology : Topology or None
        Where the nodes are, on several nodes.
    undo : UndoLog
        What the current command's updates replaced, while the command could still fail on
        some rank (see :mod:`.undo`).
    stepped_apart : set
        ``(gradient function id, rows)`` of the steps a device loop took apart on this rank:
        the same on every rank, which run the same loops (see :mod:`.blocks`).
    """

    rank: int
    n_ranks: int
    local_rank: int
    n_local: int
    master_rank: int
    root_rank: int
    function: Callable[[int], CompiledFunction]
    variable: Callable[[int], Any]
    view: Callable[[Any], Any]
    index_view: Callable[..., Any]
    check: Callable[[], None]
    comm_class: type[Comm]
    prefix: str
    spin: float
    topology: Topology | None = None
    undo: UndoLog = field(default_factory=UndoLog)
    stepped_apart: set[tuple[int, int]] = field(default_factory=set)
    _comm: Comm | None = field(default=None, repr=False)
    _programs: StepPrograms | None = field(default=None, repr=False)
    _uploads: ArgUploads | None = field(default=None, repr=False)

    def release_programs(self) -> None:
        """Drop the step programs, the uploads and the values the last command kept to undo, which
        hold the JAX backend (the runtime closes)."""
        self._programs = self._uploads = None
        self.undo.begin(keep_all=False)

    @property
    def step_programs(self) -> StepPrograms:
        """The fused step programs this rank built (see :mod:`.fused`), made at first use."""
        if self._programs is None:
            from .fused import StepPrograms
            self._programs = StepPrograms()
        return self._programs

    @property
    def uploads(self) -> ArgUploads:
        """This rank's small step arguments on the device (see :class:`~.executor.ArgUploads`)."""
        if self._uploads is None:
            from .executor import ArgUploads
            self._uploads = ArgUploads()
        return self._uploads

    @property
    def comm(self) -> Comm:
        """This rank's collective implementation (built on first use)."""
        if self._comm is None:
            self._comm = self.comm_class(CommContext(
                prefix=self.prefix, rank=self.rank, n_ranks=self.n_ranks,
                master_rank=self.master_rank, check=self.check, spin=self.spin,
                topology=self.topology))
        return self._comm

    @property
    def comm_made(self) -> bool:
        """True once :attr:`comm` was built (it then holds segments to release)."""
        return self._comm is not None

    def prepare_collective(self, words: Words) -> Callable[[], list[Any]]:
        """This rank's part of the collective encoded in ``words``, prepared; returns its ``execute()``."""
        from .collectives import prepare_collective
        return prepare_collective(self, words)

    def step_tail(self, words: Words, update_fid: int) -> Callable[[], None]:
        """A training step's tail on this rank, prepared: ``run()`` all-reduces then updates.

        ``words`` hold the all-reduce; ``update_fid`` is the update function
        (see :class:`synkhronos.api.step.Step`).
        """
        from .executor import run_update
        execute = self.prepare_collective(words)
        update = self.function(update_fid)

        def run() -> None:
            execute()
            run_update(update, self.undo)
        return run

    def program_reducer(self) -> ProgramReducer | None:
        """How a program reduces across the ranks inside itself: nothing to reduce on one rank,
        else the collective implementation's way, or None if it reduces only between programs."""
        from ..comm import ProgramReducer
        return ProgramReducer() if self.n_ranks == 1 else self.comm.program_reducer()

    def fused_step(self, plan: CallPlan, words: Words, update_fid: int) -> StepProgram | None:
        """The step's program on this rank (see :mod:`.fused`), or None if it cannot be one."""
        from .executor import fused_step_of
        return fused_step_of(self, plan, words, update_fid)

    def device_loop(self, spec: LoopSpec, center: CenterClient | None,
                    beat: Callable[[], None]) -> DeviceLoop:
        """This rank's part of the device-driven loop ``spec`` (see :class:`~.loop.DeviceLoop`)."""
        from .loop import DeviceLoop
        return DeviceLoop(spec, self, center, beat)

    def share_of_call(self, plan: CallPlan) -> tuple[int, int]:
        """``(rank, n_ranks)`` a call's rows are split by: the node's own for a node-local call."""
        return plan.ranks(self.rank, self.n_ranks, self.local_rank, self.n_local)
