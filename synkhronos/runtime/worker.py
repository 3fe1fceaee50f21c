"""The worker process: wait for a command, run it, report, repeat.

Started by the master as ``python -m synkhronos.runtime.worker`` with its settings in
the ``SYNK_WORKER`` environment variable. A worker ignores SIGINT (the master
handles Ctrl-C and stops the workers) and exits on its own when the master
process goes away.
"""

from __future__ import annotations

import cProfile
import ctypes
import ctypes.util
import faulthandler
import json
import logging
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import numpy as np

from ..comm import comm_class
from ..compile import randomness, rewrites, shipping
from ..errors import graph_line, what_raised
from ..ipc.packing import pack_arrays, packed_nbytes, write_pickle
from ..ipc.segments import GrowableSegment, SegmentMirror
from ..platform import cpu_tuning, jax_init
from ..platform.device_arrays import place_on_device
from ..platform.pinned import use_pinned
from ..platform.values import stored, use_host_faces
from ..rank.context import RankContext
from ..rank.rows import set_gather_threads
from ..tracing import trace
from ..wire.collective import shapes_of
from ..wire.control import (
    ControlBlock,
    Decision,
    Op,
    Status,
    Words,
    op_name,
)
from ..wire.plan import PlanMemo, result_record
from ..wire.topology import Topology
from ..wire.worker_settings import WorkerSettings
from .data_store import DataMirrors

if TYPE_CHECKING:
    from ..rank.compiled import CompiledFunction
    from ..rank.loop import DeviceLoop
    from ..seams.loop import CenterClient
    from ..wire.plan import CallPlan

_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


class MasterGone(SystemExit):
    """Raised in a worker whose master process has ended."""


class Terminated(SystemExit):
    """Raised in a worker that received SIGTERM; it ends by that signal after cleaning up."""


#: commands whose updates a rank keeps the replaced values of when the master asks (KEEP_UNDO)
_UPDATING = (int(Op.CALL), int(Op.STEP))
_UNDO = int(Op.UNDO)


class Worker:
    """State of one worker: its rank, the control block, functions, shared vars, Data views.

    ``rank`` and ``n_ranks`` are the node's (the control block's); ``grank``
    and ``n_devices`` count every device of every node (what the work is split by).
    """

    def __init__(self, cfg: WorkerSettings) -> None:
        self.rank = cfg["rank"]
        self.n_ranks = cfg["n_ranks"]
        self.topology = Topology(**cfg["topology"])
        self.grank, self.n_devices = self.topology.global_rank(self.rank), self.topology.n_devices
        self.master_pid = cfg["master_pid"]
        self.spin = cfg["spin"]
        self.comm_class = comm_class(cfg["comm"])
        self.prefix = cfg["prefix"]
        prefix = cfg["prefix"]
        self.ctl = ControlBlock(f"{prefix}_ctl", self.n_ranks)
        # Tracked by this worker's resource tracker (a separate process), which unlinks it even
        # when this process is aborted (e.g. by JAX's coordination client once the master is gone).
        self.result = GrowableSegment(f"{prefix}_r{self.rank}", track=True)
        #: warnings this rank's commands raised, for the master to show through its own filters
        self.warnings_out = GrowableSegment(f"{prefix}_w{self.rank}", track=True)
        self.pending_warnings: list[tuple[str, type[Warning], str, int]] = []
        self.payload = SegmentMirror(f"{prefix}_p")
        self.datas = DataMirrors(prefix)
        self.functions: dict[int, CompiledFunction] = {}
        self.shared: dict[int, Any] = {}
        self.plans = PlanMemo()
        self._commands: Any = None     # synkhronos.rank.commands, imported by the first SHIP
        #: this rank, as the rank code sees it
        self.context = RankContext(
            rank=self.grank, n_ranks=self.n_devices, local_rank=self.rank, n_local=self.n_ranks,
            master_rank=self.topology.global_rank(int(self.ctl.header[ControlBlock.MASTER_RANK])),
            root_rank=int(self.ctl.header[ControlBlock.MASTER_RANK]),
            function=self.functions.__getitem__, variable=self.shared.__getitem__,
            view=self.datas.view, index_view=self.datas.index_view, check=self.check_master,
            comm_class=self.comm_class, prefix=self.prefix, spin=self.spin,
            topology=self.topology if self.topology.several_nodes else None)
        self.handlers: dict[int, Callable[[], Any]] = {
                         Op.SHIP: self.ship, Op.CALL: self.call, Op.DROP_DATA: self.drop_data,
                         Op.GET_SHARED: self.get_shared, Op.SET_SHARED: self.set_shared,
                         Op.COLLECTIVE: self.collective, Op.GET_SHAPES: self.get_shapes,
                         Op.LOOP: self.loop, Op.TIMELINE: self.timeline, Op.STEP: self.step,
                         Op.UNDO: self.context.undo.restore, Op.STOP: lambda: None}
        self.loops: dict[int, DeviceLoop] = {}       # loop id -> this rank's DeviceLoop, from its first phase to finish

    def check_master(self) -> None:
        if os.getppid() != self.master_pid:
            raise MasterGone(3)

    def serve(self) -> None:
        """The command loop; returns after STOP."""
        go = self.ctl.go[self.rank]
        while True:
            waiting = trace.now() if trace.on else None
            go.wait(self.check_master, spin=self.spin, slice_=0.5)
            opcode = int(self.ctl.header[ControlBlock.OPCODE])
            if opcode != _UNDO:           # the last command succeeded everywhere: let its values go
                self.context.undo.begin(opcode in _UPDATING and bool(self.ctl.header[ControlBlock.KEEP_UNDO]))
            if trace.on:
                trace.begin("command", op_name(opcode), waiting)
                trace.mark("wait for the command")
            try:
                rows = self.handlers[opcode]()
                self.report(Status.OK, rows or 0)
            except Exception as e:
                self.report_error(e)
            if self.pending_warnings:
                self.report_warnings()
            reported = trace.now() if trace.on else None
            self.ctl.done.post()
            if reported is not None:       # the bookkeeping after the post: off the master's path
                trace.end("report", at=reported)
            if opcode == Op.STOP:
                return

    def report(self, state: int, rows: int = 0, nbytes: int = 0) -> None:
        self.ctl.set_status(self.rank, state, self.result.gen, nbytes, rows)

    def record_warning(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                       file: TextIO | None = None, line: str | None = None) -> None:
        """``warnings.showwarning`` in a worker: keep the warning for the master instead of printing it."""
        self.pending_warnings.append((str(message), category, filename, lineno))

    def report_warnings(self) -> None:
        nbytes = write_pickle(self.warnings_out, self.pending_warnings)
        self.pending_warnings = []
        row = self.ctl.status[self.rank]
        row[ControlBlock.WARN_GEN], row[ControlBlock.WARN_NBYTES] = self.warnings_out.gen, nbytes

    def report_error(self, e: BaseException) -> None:
        tb = traceback.format_exc()
        nbytes = write_pickle(self.result, (*what_raised(e), tb, graph_line(e)))
        self.ctl.set_status(self.rank, Status.ERROR, self.result.gen, nbytes, 0)

    def write_arrays(self, arrays: Sequence[np.ndarray]) -> int:
        self.result.ensure(packed_nbytes(arrays), oversize=1.5)
        return pack_arrays(self.result.made.mm, arrays)

    def payload_bytes(self) -> bytes:
        gen = int(self.ctl.header[ControlBlock.PAYLOAD_GEN])
        nbytes = int(self.ctl.header[ControlBlock.PAYLOAD_NBYTES])
        return self.payload.get(gen).mm[:nbytes]

    def payload_object(self) -> Any:
        """The plain pickled object of a command (see ``Channel.send_pickled``)."""
        return pickle.loads(self.payload_bytes())

    # --- handlers ---------------------------------------------------------------------------
    def ship(self) -> None:
        # imported on the first SHIP (every CALL comes after one), not at start-up: PyTensor
        # loads once the JAX runtime is up, and no call pays for an import statement
        from ..rank import commands
        from ..rank.compiled import CompiledFunction
        self._commands = commands
        payload = shipping.loads(self.payload_bytes(), self.shared)
        jax_init.set_precision(payload["float_x"])   # the master's, so every rank computes alike
        rewrites.set_cpu_rewrite(payload["cpu_rewrite"])
        self.shared.update(payload["shared"])
        self._set_values({uid: var.get_value(borrow=True) for uid, var in payload["shared"].items()
                          if randomness.is_generator(var)})      # this rank's own streams
        self._set_values(payload["values"])
        for spec in payload["functions"]:
            self.functions[spec.fid] = CompiledFunction(spec)

    def call(self) -> int:
        plan = self._plan()
        rows, outs = self._commands.call_share(self.context, plan, self.ctl, self._record(plan))
        if outs:
            self.write_arrays(outs)
        return rows

    def _plan(self) -> CallPlan:
        """The plan of the call the control block holds."""
        assert self._commands is not None, "a function is called after it was shipped"
        return self.plans.plan(self.ctl.header, self.ctl.args, self.datas.index_view)

    def _record(self, plan: CallPlan) -> np.dtype | None:
        """How this rank's results of ``plan`` travel: their record dtype, or None (as arrays)."""
        return result_record(self.functions[plan.fid].spec, plan)

    def drop_data(self) -> None:
        n = int(self.ctl.args[0])
        self.datas.drop(self.ctl.args[1:1 + n])

    def get_shared(self) -> None:
        uids = self.payload_object()
        self.write_arrays([np.asarray(self.shared[uid].get_value(borrow=True)) for uid in uids])

    def set_shared(self) -> None:
        self._set_values(self.payload_object())

    def _set_values(self, values: Mapping[int, Any]) -> None:
        """Set shared values from the master; a random generator becomes this rank's own stream."""
        # relative to this node's master, whose own stream is the root's jumped by its distance
        offset = (self.grank - self.context.master_rank) % self.n_devices
        for uid, value in values.items():
            var = self.shared[uid]
            if randomness.is_generator(var):
                value = randomness.device_stream(value, offset)
            var.set_value(value)
            place_on_device([var])

    def collective(self) -> int:
        """Prepare, report, wait for the master's decision, then execute (or skip)."""
        def prepare() -> tuple[Callable[[], list[Any]], int]:
            return self.context.prepare_collective(Words(self.ctl.args)), 0
        return self._two_phases(prepare)

    def step(self) -> int:
        """A training step: this rank's share of the call and the collective's preparation; then,
        on the master's word, the collective and the update function (see ``Channel.step``).
        A step whose shapes ran everywhere before is one program, in one phase
        (``Channel.fused_step``)."""
        if self.ctl.header[ControlBlock.FUSED]:
            return self.fused_step()

        def prepare() -> tuple[Callable[[], None], int]:
            plan = self._plan()
            run_tail, rows, outs = self._commands.step_share(self.context, plan, self.ctl,
                                                             self._record(plan))
            if outs:
                self.write_arrays(outs)
            return run_tail, rows
        return self._two_phases(prepare)

    def fused_step(self) -> int:
        """This rank's share of a step as one program (see ``synkhronos.rank.fused``)."""
        return self._commands.fused_step_share(self.context, self._plan(), self.ctl)[0]

    def _two_phases(self, prepare: Callable[[], tuple[Callable[[], Any], int]]) -> int:
        """``prepare()`` (returning ``(execute, rows)``), report, wait for the master's decision,
        then ``execute()`` (or skip); return the rows."""
        error, rows = None, 0
        try:
            execute, rows = prepare()
            self.ctl.set_status(self.rank, Status.PREPARED, self.result.gen, 0, rows)
        except Exception as e:
            error = e
            self.report_error(e)
        if trace.on:
            trace.mark("prepare")
        self.ctl.done.post()
        self.ctl.go[self.rank].wait(self.check_master, spin=self.spin, slice_=0.5)
        if trace.on:
            trace.mark("wait for the go-ahead")
        if int(self.ctl.header[ControlBlock.DECISION]) != Decision.GO:
            if error is not None:
                raise error
            return rows
        execute()
        if trace.on:
            trace.mark("execute")
        return rows

    def loop(self) -> int:
        """Run one phase of a device-driven loop (many steps), report this rank's counters."""
        from .centers.server import attach_center
        message = self.payload_object()
        spec = message["spec"]

        def center() -> CenterClient | None:
            # a center on another node is waited for as long as this node's master lives: the
            # master finds a lost node 0 and ends the runtime
            return attach_center(spec.center, [self.shared[uid] for uid in spec.synced_uids],
                                 spec.rule.merge, check=self.check_master) if spec.center else None
        stats = self._commands.loop_phase(self.loops, self.context, spec, message["phase"],
                                          message["first"], message["last"], center, self._beat())
        if stats is not None:
            self.write_arrays([stats])
        return 0

    def _beat(self, every: float = 0.1) -> Callable[[], None]:
        """After every step of a loop: count it for the master's watch; check the master now and then."""
        row = self.ctl.status[self.rank]
        field = ControlBlock.PROGRESS
        next_check = [0.0]

        def beat() -> None:
            row[field] += 1
            now = time.perf_counter()
            if now > next_check[0]:
                next_check[0] = now + every
                self.check_master()
        return beat

    def timeline(self) -> int:
        """Start recording this rank's timeline, or stop and hand the master what it recorded."""
        if self.ctl.args[0]:
            trace.start()
            return 0
        spans = trace.stop()
        self.write_arrays([np.frombuffer(pickle.dumps(spans, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)])
        return 0

    def get_shapes(self) -> None:
        uids = Words(self.ctl.args).get_list()
        shapes = shapes_of(stored(self.shared[uid]) for uid in uids)
        self.write_arrays([np.array(s, dtype=np.int64) for s in shapes])

    def cleanup(self) -> None:
        self.result.free()
        self.warnings_out.free()
        if self.context.comm_made:
            self.context.comm.release()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the master dies (best effort)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:       # the pid checks in every wait still notice a dead master
        log.debug("no parent-death signal for this worker", exc_info=True)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated(128 + signum)


def _end_by_sigterm() -> None:
    """End this process by SIGTERM itself, so that the master reports "killed by SIGTERM"."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    cfg: WorkerSettings = json.loads(os.environ["SYNK_WORKER"])
    fault_fd = cfg.get("fault_fd")
    if fault_fd is not None:   # a death in native code leaves its Python stacks to the master
        faulthandler.enable(file=fault_fd, all_threads=True)
    use_host_faces(cfg["host_faces"])
    use_pinned(not cfg["host_faces"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cfg["die_with_parent"]:
        _die_with_parent()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    worker = Worker(cfg)
    # a warning shows once per place here, and then through the master's filters (see the Channel)
    warnings.simplefilter("default")
    warnings.showwarning = worker.record_warning
    # JAX logs the traceback of every host callback that raises; the master reports it already
    logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL)
    if os.getppid() != worker.master_pid:
        return 3
    profiler = cProfile.Profile() if cfg["profile"] else None
    try:
        worker.ctl.done.post()  # ready: the master now joins the JAX runtime with us
        cores = jax_init.device_cores(cfg["platform"], cfg["threads"], worker.rank)
        jax_init.initialize_process(worker.grank, worker.n_devices, cfg["coordinator"],
                                    cfg["platform"], cfg["timeout"], cfg["float_x"],
                                    threads=cfg["threads"], local_rank=worker.rank,
                                    n_local=worker.n_ranks, cores=cores,
                                    compile_cache_dir=cfg["compile_cache"],
                                    master_rank=worker.context.master_rank)
        # the worker's thread runs its programs (no async dispatch): on its own cores, as its pool
        cpu_tuning.stay_on_cores(cores)
        set_gather_threads(cfg["threads"])
        if profiler:
            profiler.enable()
        worker.serve()
    except Terminated:
        worker.cleanup()
        _end_by_sigterm()
        raise
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(f"synk_profile_rank{worker.rank}.prof")
        worker.cleanup()
    try:
        # the process ends next, and what holds its backend with it: no collecting first
        jax_init.shutdown_process(collect=False)
    except Exception:       # the master may have left the JAX runtime first
        log.debug("leaving the JAX runtime failed in rank %d", worker.rank, exc_info=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
