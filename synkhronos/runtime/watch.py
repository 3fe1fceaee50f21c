"""How the master waits for the ranks and notices their faults: the watch of a :class:`Channel`.

Every wait is sliced and checks between slices that no worker died and that
the stall timeout has not passed; either fault calls the channel's
``on_fault`` (which tears the runtime down) and raises a clear error instead of
a hang. A collective that waits in native code runs in a thread of its own
(:class:`_Runner`) while this thread watches; one that waits in Python calls
:meth:`Watch.during_collective` from its waits.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as future_wait
from typing import Any, Protocol

from ..errors import Failure, SynkError, WorkerError
from ..platform.interrupt_hold import held
from ..platform.threads import start_thread
from ..wire.control import ControlBlock, Op, Status, op_name
from .processes import describe_exit, native_crash_site
from .reports import RankReports, Reported

__all__ = ["Watch", "Watched", "LoopCheck"]


#: seconds this rank's part of a collective may still take once a peer reported that it failed
FAILED_PEER_GRACE = 2.0
#: seconds a loop running in a thread of the master may take to end its step after a Ctrl-C
STOP_WAIT = 10.0


class Watched(Reported, Protocol):
    """What the watch uses of a :class:`~synkhronos.runtime.channel.Channel`."""

    worker_ranks: list[int]
    procs: dict[int, subprocess.Popen]
    reports: RankReports
    spin: float
    on_fault: Callable[[], None]


class LoopCheck(Protocol):
    """A loop's check (:meth:`Watch.loop_check`): ``force`` polls the processes however recently it did."""

    def __call__(self, force: bool = False) -> None: ...


class Watch:
    """The waits of one :class:`~synkhronos.runtime.channel.Channel`, and the checks between their
    slices.

    Parameters
    ----------
    channel : Channel
        Its control block, worker processes, reports, timeouts and ``on_fault``.
    """

    def __init__(self, channel: Watched) -> None:
        self.channel = channel
        self._collective_check: Callable[[], None] | None = None
        self._collective_runner: _Runner | None = None     # the thread of native-waiting collectives

    def run_local(self, fn: Callable[[], Any] | None) -> tuple[Any, Exception | None]:
        """Run this rank's part; Ctrl-C tears the runtime down, other errors are returned."""
        try:
            return (fn() if fn is not None else None), None
        except KeyboardInterrupt:
            self.channel.on_fault()
            raise
        except Exception as e:
            return None, e

    def run_inline(self, fn: Callable[[], Any], ranks: Sequence[int], what: str) -> Any:
        """Run ``fn`` (this rank's part of a collective) here; its waits call the watch."""
        self._collective_check = self.check(ranks, what, time.time() + self.channel.stall_timeout)
        error = result = None
        try:
            result = fn()
        except KeyboardInterrupt:
            self.channel.on_fault()
            raise
        except SynkError:        # the watch's own: the runtime was shut down
            raise
        except Exception as e:   # this rank's part failed after the others started theirs
            error = e
        finally:
            self._collective_check = None
        self.wait_done(ranks, what=what)
        self.channel.reports.raise_for(error, ranks)
        return result

    def release(self) -> None:
        """At the runtime's end: the thread of native-waiting collectives ends (one stuck in a
        collective a dead peer left is a daemon, which never holds up the interpreter's exit)."""
        if self._collective_runner is not None:
            self._collective_runner.stop()
            self._collective_runner = None

    def set_collective_check(self, check: Callable[[], None] | None) -> None:
        """What :meth:`during_collective` calls from now on (None: nothing)."""
        self._collective_check = check

    def during_collective(self) -> None:
        """The check the master's collective waits call: peers alive and not stalled."""
        if self._collective_check is not None:
            self._collective_check()

    def run_in_thread(self, fn: Callable[[], Any], ranks: Sequence[int], what: str) -> Any:
        """Run ``fn`` (this rank's part of a collective) in a thread while watching the workers.

        For collectives that block inside native code (the JAX runtime): only
        another thread can notice a dead or stalled peer meanwhile. A Ctrl-C lands
        here, not in the thread: the thread's part is given up to :data:`STOP_WAIT`
        seconds to end (a step's update stored whole, or failed with its peers)
        before the runtime is torn down, with any further Ctrl-C held meanwhile;
        torn down first, a half step would be put back while the thread went on to
        store its update.
        """
        if self._collective_runner is None:
            self._collective_runner = _Runner("synk-collective")
        future = self._collective_runner.submit(fn)
        try:
            return self._watch_thread(future, ranks, what)
        except KeyboardInterrupt:
            self._tear_down_after(lambda: future_wait([future], timeout=STOP_WAIT))
            raise

    def _tear_down_after(self, let_thread_end: Callable[[], object]) -> None:
        """After a Ctrl-C here: ``let_thread_end()`` (bounded by :data:`STOP_WAIT`), then the
        teardown, any further Ctrl-C held until both have run."""
        with held():
            try:
                let_thread_end()
            finally:
                self.channel.on_fault()

    def _watch_thread(self, future: Future[Any], ranks: Sequence[int], what: str) -> Any:
        """The body of :meth:`run_in_thread`: wait for the workers and ``future``, watching them."""
        deadline = time.time() + self.channel.stall_timeout
        failed_at: list[float] = []

        def own_part_failed() -> None:
            # this rank failed: a peer waiting for it in the collective cannot finish either
            if not (future.done() and future.exception() is not None):
                return
            failed_at[:] = failed_at or [time.time()]
            if time.time() - failed_at[0] > FAILED_PEER_GRACE:
                self.channel.on_fault()
                self.channel.reports.raise_for(future.exception(), [])
        # no spinning here: a spinning main thread would hold the GIL the collective thread needs
        self.wait_done(ranks, what=what, deadline=deadline, spin=0, also=own_part_failed,
                       interrupt_ends_runtime=False)
        failed = [r for r in ranks if self.channel.ctl.state(r) == Status.ERROR]
        if failed:
            # a rank that failed never joins the collective: this one's part cannot finish
            try:
                return future.result(timeout=FAILED_PEER_GRACE)
            except FutureTimeout:
                self.channel.on_fault()
                self.channel.reports.raise_for(None, failed)
                raise self.channel.reports.stalled(what, arrived=ranks,
                                                   missing=[self.channel.master_rank]) from None
        try:
            return future.result(timeout=max(0.0, deadline - time.time()))
        except FutureTimeout:
            self.channel.on_fault()
            raise self.channel.reports.stalled(what, arrived=ranks, missing=[self.channel.master_rank]) from None

    def wait_done(self, ranks: Sequence[int], what: str | Op, deadline: float | None = None,
                  spin: float | None = None, bound: tuple[float, str] | None = None,
                  also: Callable[[], None] | None = None, interrupt_ends_runtime: bool = True) -> None:
        """Wait until every rank in ``ranks`` posted ``done``, watching for death and stalls.

        ``bound``: ``(seconds, fork argument)`` that ``deadline`` comes from, for the
        error (default: the stall timeout); ``also()``, if given, is called at every check too;
        ``interrupt_ends_runtime=False``: a Ctrl-C is raised as it is, the caller tears down."""
        spin = self.channel.spin if spin is None else spin
        check = self.check(ranks, what, deadline or time.time() + self.channel.stall_timeout, bound)
        if also is not None:
            watched = check

            def check() -> None:
                watched()
                also()
        try:
            for _ in ranks:
                self.channel.ctl.done.wait(check, spin=spin)
        except KeyboardInterrupt:
            if interrupt_ends_runtime:
                self.channel.on_fault()
            raise

    def check(self, ranks: Sequence[int], what: str | Op, deadline: float,
              bound: tuple[float, str] | None = None) -> Callable[[], None]:
        """A check that raises (after ``on_fault``) if a rank died or ``deadline`` passed.

        ``what`` names the wait in messages: a phrase, or the opcode of a command.
        """
        limit: dict[str, Any] = {} if bound is None else dict(timeout=bound[0], setting=bound[1])

        def check() -> None:
            nonlocal what
            if not isinstance(what, str):
                what = f"a {op_name(what)} command"
            self.check_alive(ranks, what)
            if time.time() > deadline:
                arrived = [r for r in ranks if self.channel.ctl.state(r) != Status.IDLE]
                missing = [r for r in ranks if r not in arrived]
                self.channel.on_fault()
                raise self.channel.reports.stalled(what, arrived=arrived + [self.channel.master_rank], missing=missing,
                                                   **limit)
        return check

    def check_alive(self, ranks: Sequence[int], what: str) -> None:
        """Raise (after ``on_fault``) if a worker of ``ranks`` has ended."""
        dead = {r: self.channel.procs[r].poll() for r in ranks if self.channel.procs[r].poll() is not None}
        if dead:
            rank, code = next(iter(dead.items()))
            where, stacks = native_crash_site(self.channel.procs[rank])
            self.channel.on_fault()
            inside = f", in native code called from {where} (every thread's stack: " \
                f"error.worker_traceback)" if where else ""
            raise WorkerError(rank + self.channel.rank_offset, Failure.DIED, describe_exit(code),
                              f"worker process ended during {what}{inside}; the runtime was shut down, "
                              f"call synk.fork() to start again", worker_traceback=stacks,
                              node=self.channel.node)

    def loop_check(self, ranks: Sequence[int], what: str, poll: float = 0.02) -> LoopCheck:
        """The loop's check: workers alive, none failed, and steps still being made.

        Polls the processes at most every ``poll`` seconds (it is called after every step).
        """
        status = self.channel.ctl.status
        last: dict[str, Any] = {"at": 0.0, "moved": time.time(), "progress": None}

        def check(force: bool = False) -> None:
            now = time.time()
            if now < last["at"] + poll and not force:
                return
            last["at"] = now
            self.check_alive(ranks, what)
            failed = [r for r in ranks if self.channel.ctl.state(r) == Status.ERROR]
            if failed:
                exc_type, message, tb, where = self.channel.read_result_pickle(failed[0])
                self.channel.on_fault()
                raise self.channel.reports.raised(failed[0], exc_type, message + " (the runtime was shut down: "
                                   "call synk.fork() to start again)", tb, where)
            running = [r for r in ranks if self.channel.ctl.state(r) == Status.IDLE]
            progress = status[running, ControlBlock.PROGRESS].tolist()
            if progress != last["progress"] or not running:
                last["progress"], last["moved"] = progress, now
            elif now - last["moved"] > self.channel.stall_timeout:
                self.channel.on_fault()
                raise self.channel.reports.stalled(what, missing=running,
                                    arrived=list(set(self.channel.worker_ranks) - set(running)
                                                 | {self.channel.master_rank}))
        return check

    def raise_a_peers_end(self, check: LoopCheck, grace: float = FAILED_PEER_GRACE) -> None:
        """After this rank's part of a loop failed: raise (through ``check``, a :meth:`loop_check`)
        what ended a peer, a death or an error, if one shows within ``grace`` seconds.

        A peer's end fails this rank's collective too (Gloo's "connection closed by
        peer"), and the peer's own end is what the user needs to read.
        """
        deadline = time.time() + grace
        while True:
            check(force=True)
            if time.time() >= deadline:
                return
            time.sleep(0.02)

    def run_local_in_thread(self, local: Callable[[], Any], watch: Callable[[], None],
                            stop: Callable[[], None] | None = None) -> tuple[Any, Exception | None]:
        """Run ``local()`` in a thread, calling ``watch()`` here until it ends.

        A Ctrl-C lands here, not in the thread: ``stop()`` asks ``local()`` to end
        after its step (the thread's values are then a whole step's), which it is
        given up to :data:`STOP_WAIT` seconds to do before the runtime is torn down.
        A second Ctrl-C meanwhile is held until the teardown has run: cutting the
        wait short would tear the runtime down in the middle of the thread's step.
        """
        future: Future[tuple[Any, Exception | None]] = Future()
        # (waited for by an event, not Thread.join: a KeyboardInterrupt inside join() leaves the
        # thread looking ended to every later join while it runs on)
        ended = threading.Event()

        def target() -> None:
            try:
                future.set_result(self.run_local(local))
            finally:
                ended.set()
        start_thread(target, "synk-loop")
        try:
            while not ended.wait(0.02):
                watch()
        except KeyboardInterrupt:
            def let_thread_end() -> None:
                if stop is not None:
                    stop()
                    ended.wait(STOP_WAIT)
            self._tear_down_after(let_thread_end)
            raise
        return future.result()

    def wait_watched(self, ranks: Sequence[int], watch: Callable[[], None]) -> None:
        """Wait until every rank in ``ranks`` posted ``done``, calling ``watch`` between slices."""
        try:
            for _ in ranks:
                self.channel.ctl.done.wait(watch, spin=self.channel.spin, slice_=0.05)
        except KeyboardInterrupt:
            self.channel.on_fault()
            raise


class _Runner:
    """One daemon thread that runs the functions handed to it, one at a time.

    Starting a thread per collective would cost more than a small collective;
    a daemon thread never holds up the interpreter's exit, even when
    a peer left it stuck in a native collective (a ``ThreadPoolExecutor``'s
    threads are joined at exit).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        start_thread(self._serve, name)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)
            # a job's closure holds its programs, and through them the JAX backend: nothing of
            # it may outlive the job while the thread waits for the next
            del job, fn, future

    def stop(self) -> None:
        """End the thread once the job it runs (if any) has ended."""
        self._jobs.put(None)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` in the thread; return the :class:`concurrent.futures.Future` of its result."""
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future
