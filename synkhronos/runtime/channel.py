"""The master's side of the command channel: post a command, wait for every rank, read its results.

One :class:`Channel` per runtime owns the control block, the payload segment
the master writes and the mappings of every worker's result and warning
segments. Its waits are its :class:`~synkhronos.runtime.watch.Watch`'s: a dead
worker or a stall calls ``on_fault`` (which tears the runtime down) and raises
a clear error instead of a hang.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ..errors import NodesDiverged
from ..ipc.packing import read_pickle, unpack_arrays, write_bytes
from ..ipc.segments import GrowableSegment, SegmentMirror, unlink_if_ours
from ..platform.cpu_tuning import on_cores
from ..wire.control import ControlBlock, Decision, Op, Status
from .reports import RAISED_AS_THEY_ARE, RankReports
from .watch import Watch

__all__ = ["Channel"]

log = logging.getLogger(__name__)


#: a command of a kind whose last one took this long runs on this rank's cores (see Channel)
BIND_MIN_SECONDS = 10e-3

#: on several nodes: whether this node prepared -> (whether every node did, the error of one that did not)
Agree = Callable[[bool], tuple[bool, BaseException | None]]
#: this rank's first phase of a two-phase command, which returns the second (``execute``)
Prepare = Callable[[], Callable[[], Any]]


class Channel:
    """Commands from the master to the workers, and their results and errors back.

    Parameters
    ----------
    prefix : str
        The runtime's segment prefix.
    n_ranks, master_rank : int
    spin : float
        Seconds a wait polls before it sleeps.
    stall_timeout : float
        Seconds a wait allows before it raises :class:`StallError`.
    on_fault : callable
        Called (with no arguments) before a fault is raised: a dead worker, a
        stall, Ctrl-C during a wait.
    rank_offset : int
        The global rank of local rank 0 (on several nodes); errors name global ranks.
    node : int, optional
        This node, named in errors on several nodes.
    local_cores : list of int, optional
        This rank's cores: its part of a loop phase, and of any command whose
        kind took :data:`BIND_MIN_SECONDS` or more the last time, runs on them
        (see :func:`synkhronos.platform.cpu_tuning.on_cores`); None: any core.
    """

    def __init__(self, prefix: str, n_ranks: int, master_rank: int, spin: float, stall_timeout: float,
                 on_fault: Callable[[], None], rank_offset: int = 0, node: int | None = None,
                 local_cores: list[int] | None = None) -> None:
        self.prefix = prefix
        self.local_cores = local_cores
        self._long_kinds: set[Hashable] = set()      # kinds of command whose last one took BIND_MIN_SECONDS or more
        self.rank_offset, self.node = rank_offset, node
        self.n_ranks, self.master_rank = n_ranks, master_rank
        self.worker_ranks = [r for r in range(n_ranks) if r != master_rank]
        self.spin, self.stall_timeout = spin, stall_timeout
        self.on_fault = on_fault
        self.procs: dict[int, subprocess.Popen] = {}
        self.ctl = ControlBlock(f"{prefix}_ctl", n_ranks, create=True)
        self.ctl.header[ControlBlock.MASTER_RANK] = master_rank
        self.payload = GrowableSegment(f"{prefix}_p")
        self.results = {r: SegmentMirror(f"{prefix}_r{r}") for r in self.worker_ranks}
        self.worker_warnings = {r: SegmentMirror(f"{prefix}_w{r}") for r in self.worker_ranks}
        #: errors and warnings the ranks report
        self.reports = RankReports(self)
        #: how the master waits for the ranks and notices their faults
        self.watch = Watch(self)

    # --- one command ------------------------------------------------------------------------
    def command(self, opcode: Op, ranks: Sequence[int] | None = None, local: Callable[[], Any] | None = None,
                kind: Hashable | None = None) -> Any:
        """Run command ``opcode`` on ``ranks`` (default: all workers) and ``local()`` here.

        Every addressed rank finishes before this returns or raises, so a failure
        never leaves the control channel half-way through a command. ``kind``
        (default: the opcode) groups commands for :meth:`_on_own_cores_if_long`.
        """
        return self._on_own_cores_if_long(opcode if kind is None else kind, self._command,
                                          opcode, ranks, local)

    def _command(self, opcode: Op, ranks: Sequence[int] | None, local: Callable[[], Any] | None) -> Any:
        ranks = self.worker_ranks if ranks is None else ranks
        self.ctl.post_command(opcode, ranks)
        local_result, local_error = self.watch.run_local(local)
        self.watch.wait_done(ranks, what=opcode)     # named only if something goes wrong
        self.reports.raise_for(local_error, ranks)
        return local_result

    def _on_own_cores_if_long(self, kind: Hashable, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)``, on this rank's cores if the last command of ``kind`` took
        :data:`BIND_MIN_SECONDS` or more.

        Binding the thread and giving its cores back are two system calls, and
        the move of a running thread onto its core costs more than the calls:
        nothing next to a large step's computation, a good part of a small
        model's step. So only commands that proved long run bound.
        """
        start = time.perf_counter()
        try:
            if self.local_cores is not None and kind in self._long_kinds:
                with on_cores(self.local_cores):
                    return run(*args)
            return run(*args)
        finally:
            if time.perf_counter() - start >= BIND_MIN_SECONDS:
                self._long_kinds.add(kind)
            else:
                self._long_kinds.discard(kind)

    def collective(self, local_prepare: Prepare, waits_in_python: bool,
                   agree: Agree | None = None, kind: Hashable = "collective") -> Any:
        """Run a collective in two phases: every rank prepares, then (if all could) executes.

        A rank that fails to prepare makes every rank skip the collective, so no
        rank waits in it for a peer that will never come; the runtime stays usable.
        The execution is watched: a dead rank, or one that does not finish within
        the stall timeout, shuts the runtime down with an error instead of a hang.
        ``agree(prepared)``, on several nodes, returns ``(go, error)``:
        whether every node prepared, and else the error naming the node that
        did not (this node's own error is raised first). ``waits_in_python``:
        the collective implementation calls
        ``watch.during_collective()`` while it waits (see
        :attr:`synkhronos.comm.Comm.waits_in_python`), so this rank's part runs
        in this thread; otherwise in a thread watched from this one.
        """
        return self._on_own_cores_if_long(kind, self._two_phases, Op.COLLECTIVE, local_prepare,
                                          waits_in_python, agree, "a collective")

    def step(self, local_prepare: Prepare, waits_in_python: bool, kind: Hashable) -> Any:
        """Run a training step in one command: a call, then a collective and an update on every rank.

        The two phases of :meth:`collective`, with each rank's share of the call
        computed in the first: a rank whose call fails makes every rank skip the
        rest, exactly as a failed call followed by nothing. ``local_prepare()``
        computes this rank's share and returns the ``execute()`` that runs the
        collective and the update and returns the share's results.
        """
        return self._on_own_cores_if_long(kind, self._two_phases, Op.STEP, local_prepare,
                                          waits_in_python, None, "a training step")

    def fused_step(self, local: Callable[[], Any], in_collective: bool, kind: Hashable) -> Any:
        """Run a training step that every rank runs as one program, in one phase.

        Its shapes have run on every rank before (the first run of a step goes
        through :meth:`step`), so nothing is left to vote on: every rank runs
        its program at once. ``in_collective``: the program reduces across the
        ranks inside itself, so this rank's part runs in a thread watched from
        this one (a dead or stalled peer shuts the runtime down, as in any
        collective); otherwise (one rank) it runs here.
        """
        return self._on_own_cores_if_long(kind, self._fused_step, local, in_collective)

    def _fused_step(self, local: Callable[[], Any], in_collective: bool) -> Any:
        ranks = self.worker_ranks
        if not in_collective:
            return self._command(Op.STEP, ranks, local)
        self.ctl.post_command(Op.STEP, ranks)
        result = self.watch.run_in_thread(local, ranks, what="a training step")
        self.reports.raise_for(None, ranks)
        return result

    def _two_phases(self, opcode: Op, local_prepare: Prepare, waits_in_python: bool,
                    agree: Agree | None, what: str) -> Any:
        """The body of :meth:`collective` and :meth:`step`."""
        ranks = self.worker_ranks
        self.ctl.header[ControlBlock.DECISION] = Decision.SKIP
        self.ctl.post_command(opcode, ranks)
        execute, local_error = self.watch.run_local(local_prepare)
        self.watch.wait_done(ranks, what=f"preparing {what}")
        failed = [r for r in ranks if self.ctl.state(r) == Status.ERROR]
        go = local_error is None and not failed
        elsewhere: BaseException | None = None
        if agree is not None:
            try:
                go, elsewhere = agree(go)
            except NodesDiverged as diverged:
                # (this node's ranks prepared and wait for the decision: they skip, as for a node
                # that could not prepare, so that the next command finds them waiting for it)
                go, elsewhere = False, diverged
        self.ctl.header[ControlBlock.DECISION] = Decision.GO if go else Decision.SKIP
        self.ctl.release(ranks)
        if not go:
            self.watch.wait_done(ranks, what=f"skipping {what}")
            self.reports.raise_for(local_error, ranks)
            assert elsewhere is not None, "another node said skip"
            raise elsewhere
        if waits_in_python:
            result = self.watch.run_inline(execute, ranks, what=what)
        else:
            result = self.watch.run_in_thread(execute, ranks, what=what)
        self.reports.raise_for(None, ranks)
        return result

    # --- device-driven loops ----------------------------------------------------------------
    def loop_phase(self, local: Callable[[], Any], threaded: bool,
                   stop: Callable[[], None] | None = None) -> Any:
        """Run one phase of a device-driven loop: every worker, and ``local()`` here.

        A phase runs many steps with collectives among the ranks and no command
        in between, so any failure inside it leaves peers waiting for a rank
        that will not come: a worker that raises or dies, a stall (no rank
        still running made a step for ``stall_timeout`` seconds) or an error
        of ``local()`` shuts the runtime down and raises. ``threaded``:
        ``local()`` blocks in native collectives, so it runs in a thread
        while this one watches, and a Ctrl-C calls ``stop()`` (which asks it to end
        after its step) before the teardown; otherwise it calls
        ``watch.during_collective()`` (through its collectives and after every step).
        """
        with on_cores(self.local_cores):
            return self._loop_phase(local, threaded, stop)

    def _loop_phase(self, local: Callable[[], Any], threaded: bool, stop: Callable[[], None] | None) -> Any:
        """The body of :meth:`loop_phase`, on this rank's cores."""
        ranks, what = self.worker_ranks, "a training loop"
        self.ctl.status[:, ControlBlock.PROGRESS] = 0
        self.ctl.post_command(Op.LOOP, ranks)
        watch = self.watch.loop_check(ranks, what)
        # the thread running local() in native waits leaves the watching to this one
        self.watch.set_collective_check(None if threaded else watch)
        try:
            if threaded:
                result, error = self.watch.run_local_in_thread(local, watch, stop)
            else:
                result, error = self.watch.run_local(local)
            if error is not None:
                if isinstance(error, RAISED_AS_THEY_ARE):
                    raise error
                # a peer that died or raised makes this rank's collective fail too: its end is the
                # cause to name, if it shows
                self.watch.raise_a_peers_end(watch)
                self.on_fault()
                raise self.reports.own_error(error) from error
            self.watch.wait_watched(ranks, watch)
            watch(force=True)    # a worker that failed after the others finished: as during the phase
        finally:
            self.watch.set_collective_check(None)
        self.reports.raise_for(None, ranks)
        return result

    # --- payloads and results ---------------------------------------------------------------
    def send_payload(self, blob: bytes) -> None:
        """Put pickled bytes where the next command's workers read them."""
        nbytes = write_bytes(self.payload, blob)
        self.ctl.header[ControlBlock.PAYLOAD_GEN] = self.payload.gen
        self.ctl.header[ControlBlock.PAYLOAD_NBYTES] = nbytes

    def send_pickled(self, obj: object) -> None:
        """:meth:`send_payload` for a plain picklable object."""
        self.send_payload(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def read_result_pickle(self, rank: int) -> Any:
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        return read_pickle(seg, int(self.ctl.status[rank, ControlBlock.RESULT_NBYTES]))

    def read_result_arrays(self, rank: int, copy: bool = True) -> list[np.ndarray]:
        """The arrays ``rank`` packed into its result segment (``copy=False``: views of the
        segment, valid until that rank's next result)."""
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        arrays = unpack_arrays(seg.mm)
        return [np.array(a) for a in arrays] if copy else arrays

    # --- end --------------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """Ask every worker to stop and wait a little; the caller reaps them either way."""
        if not all(p.poll() is None for p in self.procs.values()):
            return
        self.ctl.post_command(Op.STOP, self.worker_ranks)
        try:
            self.watch.wait_done(self.worker_ranks, what="shutdown", deadline=time.time() + 5)
        except Exception:       # the caller stops them by force
            log.debug("workers did not stop when asked", exc_info=True)

    def release(self) -> None:
        """Unlink the channel's segments, the workers' result and warning segments included.

        A worker's segments are unlinked by the generation it published and the
        next one (made, if it died growing it, before the old one was freed);
        workers are gone by now, and their resource trackers unlink the rest.
        Only this user's files are unlinked: another user may hold a name the
        worker skipped.
        """
        self.watch.release()
        self.payload.free()
        for rank in self.worker_ranks:
            for kind, mirror, field in (("r", self.results[rank], ControlBlock.RESULT_GEN),
                                        ("w", self.worker_warnings[rank], ControlBlock.WARN_GEN)):
                mirror.release()
                gen = int(self.ctl.status[rank, field])
                for g in range(max(1, gen), gen + 2):
                    unlink_if_ours(f"{self.prefix}_{kind}{rank}g{g}")
        self.ctl.unlink()
        self.ctl.close()
