"""The master's side of a call: post its plan, compute its own share, gather every rank's results.

:meth:`Calls.run` runs a validated :class:`~synkhronos.wire.plan.CallPlan` on
every rank of the node, the master's share included; on several nodes the
nodes' results are then exchanged (and compared: nodes making different calls
raise ``NodesDiverged``). A training step's tail (its all-reduce and update)
may ride in the same command (:class:`synkhronos.api.step.Step`).

A call that raises anywhere leaves every rank's shared variables as they were
(:mod:`synkhronos.rank.undo`): until a call's argument shapes have run once on
every rank, every rank keeps what its updates replace, and a failure has every
rank put it back. Anything that may change a shared variable's shape on some
rank (:meth:`Calls.forget_shapes`) makes every call careful again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from ..platform.values import faces_held
from ..rank.commands import call_share, fused_step_share, step_share
from ..rank.undo import HalfStep, half_step
from ..wire.control import STEP_COLLECTIVE_AT, ControlBlock, Op, Words
from ..wire.plan import PlanSlots
from .part import Part

if TYPE_CHECKING:
    from ..comm import Reservation
    from ..rank.fused import StepProgram
    from ..wire.plan import CallPlan

__all__ = ["Calls", "FusedOutputs"]


class FusedOutputs(list):
    """A fused step's outputs, reduced across the ranks inside its program (device arrays)."""


class Tail(Protocol):
    """What every rank runs after its share of a call, in the call's command
    (:class:`synkhronos.api.step.StepTail` has it)."""

    @property
    def fill(self) -> Callable[[Words], None]:
        """``fill(words)`` writes the all-reduce."""
        ...

    @property
    def reservation(self) -> Reservation:
        """What the all-reduce needs of the collective implementation."""
        ...

    @property
    def update_fid(self) -> int:
        """The function (without inputs) every rank runs after the all-reduce."""
        ...


class _Kept(NamedTuple):
    """A fused program the master keeps (None: the step cannot be one), with the step tail its
    key names by ``id``."""

    program: StepProgram | None
    tail: Tail


#: fused programs the master keeps (by plan shapes, outputs and step tail)
PROGRAMS_KEPT = 256


class Calls(Part):
    """Calls of one runtime's functions (see the module notes)."""

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self._plans = PlanSlots()
        #: the shape keys (CallPlan.shape_key) of calls that have run on every rank
        self._ran_everywhere: set[tuple] = set()
        #: every rank's shapes of shared variables, by their uids, until a command may change them
        self._shapes: dict[tuple[int, ...], list[list[tuple[int, ...]]]] = {}
        #: per function id, the uids of the shared variables its updates write
        self._writes: dict[int, frozenset[int]] = {}
        #: the master's fused step programs, by plan shapes, outputs and tail
        self._programs: dict[tuple, _Kept] = {}
        #: a step run as its commands' phases, while it runs (see :meth:`put_back_half_step`)
        self._step_begun: HalfStep | None = None

    def name(self, plan: CallPlan, values: str = "") -> tuple[str, str, str]:
        """What a call is called in the exchange of its results: ``("a call of", name, on what)``;
        ``values``: what the nodes compare beyond the plan (the digests of its arguments given as
        values and of its graphs: ``Function._values_compared``).

        Nodes calling the same function on other rows, other data or other values, or a function
        of that name built from other graphs, both raise NodesDiverged, naming both calls.
        """
        return ("a call of", self._state.registry.specs[plan.fid].name,
                f"({plan.arguments_text()}{values})")

    def run(self, plan: CallPlan, record: np.dtype | None, tail: Tail | None = None,
            reduce: Callable[[Any, list], Any] | None = None, values: str = "") -> Any:
        """Run ``plan`` (a :class:`~synkhronos.wire.plan.CallPlan`) everywhere.

        The caller has brought the workers up to date (``Registry.ensure_shipped``)
        and checked that the function is still registered.

        Parameters
        ----------
        plan : CallPlan
        record : numpy.dtype or None
            The structured dtype in which ranks return the results
            (:func:`~synkhronos.wire.plan.result_record`), or None.
        tail : StepTail, optional
            What every rank runs after its share, in the same command, if every
            rank computed its share: a collective, then a function without
            inputs (a training step's all-reduce and update; one node only).
        reduce : callable, optional
            ``reduce(rows, columns)``: what the call returns instead of ``(rows,
            columns)``. A reduction that raises (an output whose rows do not
            combine in its mode) undoes the call's updates on every rank, as
            any failed call does.
        values : str
            On several nodes, what they compare beyond the plan: the digests
            of the arguments given as values and of the function's graphs.

        Returns
        -------
        rows : list of int
            Rows each rank computed (0: it computed nothing and returned nothing).
        columns : list
            Per selected output, its value on every rank: a 1-D array over ranks
            when the results travel as records, else a list by rank (None for a
            rank without rows).
        """
        state = self._state
        channel, ctl, nodes = state.channel, state.channel.ctl, state.nodes
        if self._shapes:
            self._forget_written_shapes(plan.fid)
            if tail is not None:
                self._forget_written_shapes(tail.update_fid)
        if state.worker_ranks:      # (the master's own share reads the plan as it is)
            index_arrays = plan.index_arrays()
            if index_arrays:
                plan.index_gen = state.data.write_indices(index_arrays)
            self._plans.publish(plan.encode(), ctl.header, ctl.args)
        fields = ctl.record_fields(record) if record is not None else None
        context, local_master = state.context, state.local_master
        shapes = plan.shape_key()
        keep_all = shapes not in self._ran_everywhere
        ctl.header[ControlBlock.KEEP_UNDO] = keep_all
        context.undo.begin(keep_all)

        def local() -> list | None:
            return call_share(context, plan, ctl, record)[1]

        fused = self._fused_program(plan, tail) if tail is not None and not keep_all else None
        ctl.header[ControlBlock.FUSED] = fused is not None
        try:
            if fused is not None:
                rows, values = channel.fused_step(lambda: self._fused_local(plan, fused),
                                                  state.n_parallel > 1, kind=(Op.STEP, plan.fid))
                return FusedOutputs(values)
            if tail is None:
                outs = channel.command(Op.CALL, local=local, kind=(Op.CALL, plan.fid))
            else:
                outs = self._run_step(plan, record, tail, kind=(Op.STEP, plan.fid))
        except Exception as e:
            self._undo()
            if nodes is not None and state.is_open:
                nodes.tell_failed(self.name(plan, values), e)
            raise
        if not plan.subset and nodes is None:      # a call selecting no outputs (only updates)
            if keep_all:
                self._ran_everywhere.add(shapes)
            return reduce(None, []) if reduce is not None else (None, [])
        rows = ctl.rows.tolist()
        columns: list
        if fields is not None:
            columns = [np.array(f) for f in fields]
        elif not plan.subset:       # (on several nodes: no rank wrote a result to read)
            columns = []
        else:
            per_rank = [outs if rank == local_master else
                        channel.read_result_arrays(rank) if rows[rank] else None
                        for rank in range(state.n_local)]
            columns = [[None if values is None else values[j] for values in per_rank]
                       for j in range(len(plan.subset))]
        if nodes is not None:
            try:
                rows, columns = nodes.results_of_every_node(self.name(plan, values), rows, columns)
            except Exception:
                self._undo()          # another node failed: this one's call did not happen either
                raise
        result = (rows, columns) if plan.subset else (None, [])
        if reduce is not None:
            try:
                result = reduce(*result)
            except Exception:
                # (the first run of these shapes kept what its updates replaced: a reduction fails
                # the same way for the same shapes, so a later run of them never gets here)
                self._undo()
                raise
        if keep_all:
            self._ran_everywhere.add(shapes)
        return result

    def _fused_program(self, plan: CallPlan, tail: Tail) -> StepProgram | None:
        """The master's program of a step run as one program on every rank, or None if it cannot be.

        A step is one program (:mod:`synkhronos.rank.fused`) on one node, once
        its shapes have run everywhere, while no other thread reads the
        variables, in one slice, and on several devices only through a
        collective implementation that reduces inside a program, with every
        rank's share of the same size (shard_map needs equal shapes).
        """
        state = self._state
        if state.nodes is not None or faces_held() or plan.num_slices != 1:
            return None
        n = state.n_parallel
        if n > 1:
            if state.context.comm.program_reducer() is None:
                return None
            counts = [b.total for b in plan.sliced] if plan.sliced else \
                [hi - lo for lo, hi in plan.split(n)] if plan.scattered else []
            if len(set(counts)) > 1:
                return None
        ctl = state.channel.ctl
        args = ctl.args
        state.context.undo.begin(False)
        if n > 1:           # the workers read the step's tail
            tail.fill(Words(args[STEP_COLLECTIVE_AT:]))
            ctl.header[ControlBlock.UPDATE_FID] = tail.update_fid
        key = (plan.shape_key(), tuple(plan.subset), id(tail))
        kept = self._programs.get(key)
        if kept is None:
            if n == 1:
                tail.fill(Words(args[STEP_COLLECTIVE_AT:]))
            program = state.context.fused_step(plan, Words(args[STEP_COLLECTIVE_AT:]), tail.update_fid)
            if len(self._programs) >= PROGRAMS_KEPT:
                self._programs.clear()
            # (the tail, kept with its program, keeps its id for the key)
            kept = self._programs[key] = _Kept(program, tail)
        return kept.program

    def _fused_local(self, plan: CallPlan, program: StepProgram) -> tuple[int, list]:
        """The master's part of a fused step: its share, run as one program."""
        return fused_step_share(self._state.context, plan, self._state.channel.ctl, program)

    def release_programs(self) -> None:
        """Drop the master's fused step programs: through their collectives' mesh they hold the JAX
        backend, which must be able to go when the runtime closes though the user keeps the step."""
        self._programs.clear()

    def forget_shapes(self) -> None:
        """Count no call's shapes as run everywhere, and keep no shared variable's shapes: a shared
        variable may have another shape on some rank (a scatter, a broadcast, a value set on one
        rank or by the user)."""
        self._ran_everywhere.clear()
        self._shapes.clear()

    def shapes_known(self, uids: tuple[int, ...]) -> list[list[tuple[int, ...]]] | None:
        """Every rank's shapes of the shared variables ``uids`` as last asked, or None."""
        return self._shapes.get(uids)

    def keep_shapes(self, uids: tuple[int, ...], shapes: list[list[tuple[int, ...]]]) -> None:
        """Keep every rank's shapes of ``uids`` until a command may change them."""
        self._shapes[uids] = shapes

    def _forget_written_shapes(self, fid: int) -> None:
        """Before a call of function ``fid``: forget the kept shapes of the variables it updates
        (an update may give a value of another shape)."""
        writes = self._writes.get(fid)
        if writes is None:
            registry = self._state.registry
            writes = self._writes[fid] = frozenset(registry.uid_of(s) for s, _, _ in
                                                   registry.specs[fid].updates)
        for uids in [u for u in self._shapes if writes.intersection(u)]:
            del self._shapes[uids]

    def _undo(self) -> None:
        """Put back, on every rank of this node, what the failed command's updates replaced."""
        state = self._state
        if not state.is_open:     # shut down by the fault: nothing is left to put back
            return
        state.context.undo.restore()
        with contextlib.suppress(Exception):     # a fault here shuts the runtime down itself
            state.channel.command(Op.UNDO)

    def _run_step(self, plan: CallPlan, record: np.dtype | None, tail: Tail, kind: Hashable) -> list | None:
        """The call's command extended by ``tail`` (see :meth:`run` and ``Channel.step``)."""
        state = self._state
        comm, ctl = state.context.comm, state.channel.ctl
        comm.reserve(tail.reservation)
        tail.fill(Words(ctl.args[STEP_COLLECTIVE_AT:]))
        ctl.header[ControlBlock.UPDATE_FID] = tail.update_fid

        def prepare() -> Callable[[], list | None]:
            run_tail, _, outs = step_share(state.context, plan, ctl, record)

            def reduce_and_update() -> list | None:
                run_tail()
                return outs
            return reduce_and_update
        specs = state.registry.specs
        self._step_begun = half_step(specs[plan.fid].updates, specs[tail.update_fid].updates)
        if self._step_begun is not None:
            self._step_begun.begin()
        try:
            return state.channel.step(prepare, comm.waits_in_python, kind)
        finally:
            self._step_begun = None

    def put_back_half_step(self) -> None:
        """Before a fault's teardown (a Ctrl-C): if a step's gradient function stored its state
        updates and its update function did not store yet, put the master's state back, so that
        the values the script keeps are those of a whole step."""
        begun, self._step_begun = self._step_begun, None
        if begun is not None:
            begun.put_back_if_half()
