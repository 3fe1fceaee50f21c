"""The master's side of the command channel: post a command, wait for every rank, watch for faults.

One :class:`Channel` per runtime owns the control block, the payload segment
the master writes and the mappings of every worker's result and warning
segments. Every wait is sliced and checks between slices that no worker died
and that the stall timeout has not passed; either fault calls ``on_fault``
(which tears the runtime down) and raises a clear error instead of a hang.
"""

import logging
import pickle
import queue
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from ..errors import SynkError, WorkerError
from ..ipc.packing import read_pickle, unpack_arrays, write_bytes
from ..ipc.segments import GrowableSegment, SegmentMirror, unlink
from ..platform.cpu_tuning import on_cores
from ..platform.threads import start_thread
from ..wire.control import ControlBlock, Decision, Op, Status, op_name
from .processes import describe_exit
from .reports import RankReports

__all__ = ["Channel"]

log = logging.getLogger(__name__)


#: a command of a kind whose last one took this long runs on this rank's cores (see Channel)
BIND_MIN_SECONDS = 10e-3


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

    def __init__(self, prefix, n_ranks, master_rank, spin, stall_timeout, on_fault, rank_offset=0,
                 node=None, local_cores=None):
        self.prefix = prefix
        self.local_cores = local_cores
        self._long_kinds = set()      # kinds of command whose last one took BIND_MIN_SECONDS or more
        self.rank_offset, self.node = rank_offset, node
        self.n_ranks, self.master_rank = n_ranks, master_rank
        self.worker_ranks = [r for r in range(n_ranks) if r != master_rank]
        self.spin, self.stall_timeout = spin, stall_timeout
        self.on_fault = on_fault
        self.procs = {}
        self.ctl = ControlBlock(f"{prefix}_ctl", n_ranks, create=True)
        self.ctl.header[ControlBlock.MASTER_RANK] = master_rank
        self.payload = GrowableSegment(f"{prefix}_p")
        self.results = {r: SegmentMirror(f"{prefix}_r{r}") for r in self.worker_ranks}
        self.worker_warnings = {r: SegmentMirror(f"{prefix}_w{r}") for r in self.worker_ranks}
        #: errors and warnings the ranks report
        self.reports = RankReports(self)
        self._collective_watch = None
        self._collective_runner = None     # the thread of collectives that wait in native code

    # --- one command ------------------------------------------------------------------------
    def command(self, opcode, ranks=None, local=None, kind=None):
        """Run command ``opcode`` on ``ranks`` (default: all workers) and ``local()`` here.

        Every addressed rank finishes before this returns or raises, so a failure
        never leaves the control channel half-way through a command. ``kind``
        (default: the opcode) groups commands for :meth:`_on_own_cores_if_long`.
        """
        return self._on_own_cores_if_long(opcode if kind is None else kind, self._command,
                                          opcode, ranks, local)

    def _command(self, opcode, ranks, local):
        ranks = self.worker_ranks if ranks is None else ranks
        self.ctl.post_command(opcode, ranks)
        local_result, local_error = self._run_local(local)
        self.wait_done(ranks, what=opcode)     # named only if something goes wrong
        self.reports.raise_for(local_error, ranks)
        return local_result

    def _on_own_cores_if_long(self, kind, run, *args):
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

    def collective(self, local_prepare, waits_in_python, agree=None, kind="collective"):
        """Run a collective in two phases: every rank prepares, then (if all could) executes.

        A rank that fails to prepare makes every rank skip the collective, so no
        rank waits in it for a peer that will never come; the runtime stays usable.
        The execution is watched: a dead rank, or one that does not finish within
        the stall timeout, shuts the runtime down with an error instead of a hang.
        ``agree(prepared)``, on several nodes, returns ``(go, error)``:
        whether every node prepared, and else the error naming the node that
        did not (this node's own error is raised first). ``waits_in_python``:
        the collective implementation calls
        :meth:`check_during_collective` while it waits (see
        :attr:`synkhronos.comm.Comm.waits_in_python`), so this rank's part runs
        in this thread; otherwise in a thread watched from this one.
        """
        return self._on_own_cores_if_long(kind, self._two_phases, Op.COLLECTIVE, local_prepare,
                                          waits_in_python, agree, "a collective")

    def step(self, local_prepare, waits_in_python, kind):
        """Run a training step in one command: a call, then a collective and an update on every rank.

        The two phases of :meth:`collective`, with each rank's share of the call
        computed in the first: a rank whose call fails makes every rank skip the
        rest, exactly as a failed call followed by nothing. ``local_prepare()``
        computes this rank's share and returns the ``execute()`` that runs the
        collective and the update and returns the share's results.
        """
        return self._on_own_cores_if_long(kind, self._two_phases, Op.STEP, local_prepare,
                                          waits_in_python, None, "a training step")

    def _two_phases(self, opcode, local_prepare, waits_in_python, agree, what):
        """The body of :meth:`collective` and :meth:`step`."""
        ranks = self.worker_ranks
        self.ctl.header[ControlBlock.DECISION] = Decision.SKIP
        self.ctl.post_command(opcode, ranks)
        execute, local_error = self._run_local(local_prepare)
        self.wait_done(ranks, what=f"preparing {what}")
        failed = [r for r in ranks if self.ctl.state(r) == Status.ERROR]
        go = local_error is None and not failed
        elsewhere: BaseException | None = None
        if agree is not None:
            go, elsewhere = agree(go)
        self.ctl.header[ControlBlock.DECISION] = Decision.GO if go else Decision.SKIP
        self.ctl.release(ranks)
        if not go:
            self.wait_done(ranks, what=f"skipping {what}")
            self.reports.raise_for(local_error, ranks)
            assert elsewhere is not None, "another node said skip"
            raise elsewhere
        if waits_in_python:
            result = self._run_inline_watched(execute, ranks, what=what)
        else:
            result = self._run_in_watched_thread(execute, ranks, what=what)
        self.reports.raise_for(None, ranks)
        return result

    def _run_local(self, fn):
        """Run this rank's part; Ctrl-C tears the runtime down, other errors are returned."""
        try:
            return (fn() if fn is not None else None), None
        except KeyboardInterrupt:
            self.on_fault()
            raise
        except Exception as e:
            return None, e

    def _run_inline_watched(self, fn, ranks, what):
        """Run ``fn`` (this rank's part of a collective) here; its waits call the watch."""
        self._collective_watch = self._watch(ranks, what, time.time() + self.stall_timeout)
        error = result = None
        try:
            result = fn()
        except KeyboardInterrupt:
            self.on_fault()
            raise
        except SynkError:        # the watch's own: the runtime was shut down
            raise
        except Exception as e:   # this rank's part failed after the others started theirs
            error = e
        finally:
            self._collective_watch = None
        self.wait_done(ranks, what=what)
        self.reports.raise_for(error, ranks)
        return result

    def check_during_collective(self):
        """The check the master's collective waits call: peers alive and not stalled."""
        if self._collective_watch is not None:
            self._collective_watch()

    def _run_in_watched_thread(self, fn, ranks, what):
        """Run ``fn`` (this rank's part of a collective) in a thread while watching the workers.

        For collectives that block inside native code (the JAX runtime): only
        another thread can notice a dead or stalled peer meanwhile.
        """
        if self._collective_runner is None:
            self._collective_runner = _Runner("synk-collective")
        future = self._collective_runner.submit(fn)
        deadline = time.time() + self.stall_timeout
        # no spinning here: a spinning main thread would hold the GIL the collective thread needs
        self.wait_done(ranks, what=what, deadline=deadline, spin=0)
        try:
            return future.result(timeout=max(0.0, deadline - time.time()))
        except FutureTimeout:
            self.on_fault()
            raise self.reports.stalled(what, arrived=ranks, missing=[self.master_rank]) from None

    # --- waiting ----------------------------------------------------------------------------
    def wait_done(self, ranks, what, deadline=None, spin=None, bound=None):
        """Wait until every rank in ``ranks`` posted ``done``, watching for death and stalls.

        ``bound``: ``(seconds, fork argument)`` that ``deadline`` comes from, for the
        error (default: the stall timeout)."""
        spin = self.spin if spin is None else spin
        check = self._watch(ranks, what, deadline or time.time() + self.stall_timeout, bound)
        try:
            for _ in ranks:
                self.ctl.done.wait(check, spin=spin)
        except KeyboardInterrupt:
            self.on_fault()
            raise

    def _watch(self, ranks, what, deadline, bound=None):
        """A check that raises (after ``on_fault``) if a rank died or ``deadline`` passed.

        ``what`` names the wait in messages: a phrase, or the opcode of a command.
        """
        def check():
            nonlocal what
            if not isinstance(what, str):
                what = f"a {op_name(what)} command"
            self._check_alive(ranks, what)
            if time.time() > deadline:
                arrived = [r for r in ranks if self.ctl.state(r) != Status.IDLE]
                missing = [r for r in ranks if r not in arrived]
                self.on_fault()
                raise self.reports.stalled(what, arrived=arrived + [self.master_rank], missing=missing,
                                           **({} if bound is None else dict(zip(("timeout", "setting"), bound))))
        return check

    def _check_alive(self, ranks, what):
        """Raise (after ``on_fault``) if a worker of ``ranks`` has ended."""
        dead = {r: self.procs[r].poll() for r in ranks if self.procs[r].poll() is not None}
        if dead:
            rank, code = next(iter(dead.items()))
            self.on_fault()
            raise WorkerError(rank + self.rank_offset, "died", describe_exit(code),
                              f"worker process ended during {what}; the runtime was shut down, "
                              f"call synk.fork() to start again", node=self.node)

    # --- device-driven loops ----------------------------------------------------------------
    def loop_phase(self, local, threaded):
        """Run one phase of a device-driven loop: every worker, and ``local()`` here.

        A phase runs many steps with collectives among the ranks and no command
        in between, so any failure inside it leaves peers waiting for a rank
        that will not come: a worker that raises or dies, a stall (no rank
        still running made a step for ``stall_timeout`` seconds) or an error
        of ``local()`` shuts the runtime down and raises. ``threaded``:
        ``local()`` blocks in native collectives, so it runs in a thread
        while this one watches; otherwise it calls :meth:`check_during_collective`
        (through its collectives and after every step).
        """
        with on_cores(self.local_cores):
            return self._loop_phase(local, threaded)

    def _loop_phase(self, local, threaded):
        """The body of :meth:`loop_phase`, on this rank's cores."""
        ranks, what = self.worker_ranks, "a training loop"
        self.ctl.status[:, ControlBlock.PROGRESS] = 0
        self.ctl.post_command(Op.LOOP, ranks)
        watch = self._loop_watch(ranks, what)
        # the thread running local() in native waits leaves the watching to this one
        self._collective_watch = None if threaded else watch
        try:
            if threaded:
                result, error = self._run_local_in_thread(local, watch)
            else:
                result, error = self._run_local(local)
            if error is not None:
                if isinstance(error, SynkError):
                    raise error
                self.on_fault()
                raise self.reports.own_error(error) from error
            self._wait_watched(ranks, watch)
            watch(force=True)    # a worker that failed after the others finished: as during the phase
        finally:
            self._collective_watch = None
        self.reports.raise_for(None, ranks)
        return result

    def _loop_watch(self, ranks, what, poll=0.02):
        """The loop's check: workers alive, none failed, and steps still being made.

        Polls the processes at most every ``poll`` seconds (it is called after every step).
        """
        status = self.ctl.status
        last: dict[str, Any] = {"at": 0.0, "moved": time.time(), "progress": None}

        def check(force=False):
            now = time.time()
            if now < last["at"] + poll and not force:
                return
            last["at"] = now
            self._check_alive(ranks, what)
            failed = [r for r in ranks if self.ctl.state(r) == Status.ERROR]
            if failed:
                exc_type, message, tb, where = self.read_result_pickle(failed[0])
                self.on_fault()
                raise self.reports.raised(failed[0], exc_type, message + " (the runtime was shut down: "
                                   "call synk.fork() to start again)", tb, where)
            running = [r for r in ranks if self.ctl.state(r) == Status.IDLE]
            progress = status[running, ControlBlock.PROGRESS].tolist()
            if progress != last["progress"] or not running:
                last["progress"], last["moved"] = progress, now
            elif now - last["moved"] > self.stall_timeout:
                self.on_fault()
                raise self.reports.stalled(what, missing=running,
                                    arrived=list(set(self.worker_ranks) - set(running)
                                                 | {self.master_rank}))
        return check

    def _run_local_in_thread(self, local, watch):
        """Run ``local()`` in a thread, calling ``watch()`` here until it ends."""
        future: Future = Future()

        def target():
            future.set_result(self._run_local(local))
        thread = start_thread(target, "synk-loop")
        try:
            while not future.done():
                thread.join(0.02)
                watch()
        except KeyboardInterrupt:
            self.on_fault()
            raise
        return future.result()

    def _wait_watched(self, ranks, watch):
        """Wait until every rank in ``ranks`` posted ``done``, calling ``watch`` between slices."""
        try:
            for _ in ranks:
                self.ctl.done.wait(watch, spin=self.spin, slice_=0.05)
        except KeyboardInterrupt:
            self.on_fault()
            raise

    # --- payloads and results ---------------------------------------------------------------
    def send_payload(self, blob):
        """Put pickled bytes where the next command's workers read them."""
        nbytes = write_bytes(self.payload, blob)
        self.ctl.header[ControlBlock.PAYLOAD_GEN] = self.payload.gen
        self.ctl.header[ControlBlock.PAYLOAD_NBYTES] = nbytes

    def send_pickled(self, obj):
        """:meth:`send_payload` for a plain picklable object."""
        self.send_payload(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def read_result_pickle(self, rank):
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        return read_pickle(seg, int(self.ctl.status[rank, ControlBlock.RESULT_NBYTES]))

    def read_result_arrays(self, rank, copy=True):
        """The arrays ``rank`` packed into its result segment (``copy=False``: views of the
        segment, valid until that rank's next result)."""
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        arrays = unpack_arrays(seg.mm)
        return [np.array(a) for a in arrays] if copy else arrays

    # --- end --------------------------------------------------------------------------------
    def stop_workers(self):
        """Ask every worker to stop and wait a little; the caller reaps them either way."""
        if not all(p.poll() is None for p in self.procs.values()):
            return
        self.ctl.post_command(Op.STOP, self.worker_ranks)
        try:
            self.wait_done(self.worker_ranks, what="shutdown", deadline=time.time() + 5)
        except Exception:       # the caller stops them by force
            log.debug("workers did not stop when asked", exc_info=True)

    def release(self):
        """Unlink the channel's segments, the workers' result and warning segments included.

        A worker's segments are unlinked by every generation it may have made
        (workers are gone by now; their resource trackers unlink the rest).
        """
        self.payload.free()
        for rank in self.worker_ranks:
            for kind, mirror, field in (("r", self.results[rank], ControlBlock.RESULT_GEN),
                                        ("w", self.worker_warnings[rank], ControlBlock.WARN_GEN)):
                mirror.release()
                gen = int(self.ctl.status[rank, field])
                for g in range(max(1, gen - 1), gen + 2):
                    unlink(f"{self.prefix}_{kind}{rank}g{g}")
        self.ctl.unlink()


class _Runner:
    """One daemon thread that runs the functions handed to it, one at a time.

    Starting a thread per collective would cost more than a small collective;
    a daemon thread never holds up the interpreter's exit, even when
    a peer left it stuck in a native collective (a ``ThreadPoolExecutor``'s
    threads are joined at exit).
    """

    def __init__(self, name):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        start_thread(self._serve, name)

    def _serve(self):
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)

    def submit(self, fn):
        """Run ``fn`` in the thread; return the :class:`concurrent.futures.Future` of its result."""
        future: Future = Future()
        self._jobs.put((fn, future))
        return future
