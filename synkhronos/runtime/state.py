"""The master's runtime :class:`State`: the processes, segments and parts of one ``fork() ... close()``.

A thin owner, as JAX's ``distributed.State`` is: its settings and where this
node stands, the command channel to the workers, the Data segments, this
rank's :class:`~synkhronos.rank.context.RankContext`, and one part per job:
:attr:`~State.registry` (functions and shared variables),
:attr:`~State.calls`, :attr:`~State.collectives`, :attr:`~State.loops`,
:attr:`~State.timeline`, and on several nodes :attr:`~State.nodes` (what
the masters tell each other). :meth:`State.start` starts the workers and joins
the JAX runtime with them; :meth:`State.stop` undoes it all.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ..comm import Comm, class_path
from ..compile import rewrites
from ..errors import SynkError
from ..ipc.segments import Claim, new_prefix
from ..platform import jax_init
from ..platform.coordination import ServiceProcess
from ..platform.pinned import use_pinned
from ..platform.process_changes import changes
from ..platform.values import host_faces_wanted, use_host_faces
from ..rank.context import RankContext
from ..rank.rows import set_gather_threads
from ..wire.topology import Topology
from ..wire.worker_settings import WorkerSettings
from . import interrupts
from .calls import Calls
from .channel import Channel
from .collectives import Collectives
from .data_store import DataStore
from .loops import Loops
from .nodes import NodeLink
from .processes import free_port, launch_worker, reap
from .registry import Registry
from .rows_behind import RowsBehind
from .timeline import Timeline

__all__ = ["State", "Settings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """A runtime's validated settings (see ``synk.fork`` for their meaning).

    ``spin`` and ``stall_timeout`` are in seconds; ``collectives`` is the
    :class:`~synkhronos.comm.Comm` class. ``n_parallel`` and ``master_rank``
    are this node's (local); ``topology`` places the node among several.
    """

    n_parallel: int
    master_rank: int
    platform: str
    threads: int
    timeout: float
    profile_workers: bool
    spin: float
    stall_timeout: float
    collectives: type[Comm]
    #: where fork(timeline=...) writes every rank's timeline at close, or None
    timeline: str | None = None
    #: the directory of this node's compile cache (synkhronos.platform.compile_cache), or None (off)
    compile_cache: str | None = None
    topology: Topology | None = None


class State:
    """The processes, segments and parts of one ``fork() ... close()`` session.

    Read-only to the rest of the package: ``n_parallel`` (devices of every
    node), ``master_rank`` (this process's global rank), ``topology``,
    ``platform``, ``comm_kind`` (the name of the collective implementation),
    ``prefix`` (every segment's name starts with it), ``worker_pids`` and
    ``is_open``. ``worker_ranks`` and ``local_master`` are this node's local
    ranks (the control channel's).

    Parameters
    ----------
    settings : Settings
    on_abort : callable
        Called when a fault tears the runtime down (the session forgets it).
    """

    def __init__(self, settings: Settings,
                 on_abort: Callable[[State], None] = lambda state: None) -> None:
        self.settings = settings
        self.topology = settings.topology or Topology(1, 0, settings.n_parallel)
        self.n_local, self.local_master = settings.n_parallel, settings.master_rank
        self.n_parallel = self.topology.n_devices
        self.master_rank = self.topology.global_rank(self.local_master)
        #: the global rank broadcasts send from and random streams start at: node 0's master
        self.root_rank = self.local_master
        self.platform = settings.platform
        self.comm_kind = settings.collectives.name
        self.prefix = new_prefix()
        #: the lock that says this run is alive, held from before its first segment to after its last
        self.claim = Claim(self.prefix)
        self.worker_ranks = [r for r in range(self.n_local) if r != self.local_master]
        self._on_abort = on_abort
        self.is_open = False
        #: a teardown (stop or abort) is under way: a fault it meets itself (a worker it just
        #: killed, seen dead by its own wait) leaves it to go on, instead of starting another
        self._tearing_down = False
        #: a fault met during a clean stop: it ends as after a fault (the other nodes are given
        #: time to leave the coordination service)
        self._fault_met = False
        # the channel and the context exist from start() on, and nothing uses a State before
        #: the command channel to this node's workers
        self.channel: Channel = None  # type: ignore[assignment]
        #: this rank, as the rank code sees it
        self.context: RankContext = None  # type: ignore[assignment]
        #: on several nodes, the exchanges with the other nodes' masters (after start)
        self.nodes: NodeLink | None = None
        #: on several nodes, node 0's master's: the process serving JAX's coordination service
        self.service: ServiceProcess | None = None
        self.data = DataStore(self.prefix)
        #: values a layer above keeps per runtime (numpy arguments staged as Data, say)
        self.staging: dict[Hashable, Any] = {}
        self.registry = Registry(self)
        self.calls = Calls(self)
        self.collectives = Collectives(self)
        #: the rows behind each device's value of what a call wrote, by which an average weighs them
        self.rows_behind = RowsBehind()
        self.loops = Loops(self)
        self.timeline = Timeline(self)

    # --- start and stop ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers, wait until each is ready, then join the JAX runtime with them."""
        s, t = self.settings, self.topology
        started = time.monotonic()          # fork(timeout=...) counts from here, the join included
        cores = jax_init.device_cores(s.platform, s.threads, self.local_master)
        # (only a CPU device's arrays have faces: on any other, every value is a device array)
        faces = host_faces_wanted(os.environ) and s.platform == "cpu"
        use_host_faces(faces)
        use_pinned(not faces)          # (values stay device arrays: rows go up from pinned memory)
        self.channel = Channel(self.prefix, self.n_local, self.local_master, s.spin,
                               s.stall_timeout, on_fault=self.abort, rank_offset=t.offset,
                               node=t.node_rank if t.several_nodes else None, local_cores=cores)
        self.context = self._rank_context()
        self.is_open = True
        coordinator = t.coordinator or f"127.0.0.1:{free_port()}"
        env = jax_init.configure_environment(dict(os.environ), s.platform, s.threads)
        if jax_init.served_apart(t.several_nodes, self.master_rank) and t.node_rank == 0:
            self.service = ServiceProcess(coordinator, self.n_parallel,
                                          jax_init.heartbeat_timeout(t.several_nodes, s.timeout), env)
        for rank in self.worker_ranks:
            self.channel.procs[rank] = launch_worker(WorkerSettings(
                prefix=self.prefix, rank=rank, n_ranks=self.n_local, coordinator=coordinator,
                topology=t.to_dict(), platform=s.platform, timeout=s.timeout, spin=s.spin,
                comm=class_path(s.collectives), float_x=self.float_x(), threads=s.threads,
                profile=bool(s.profile_workers), compile_cache=s.compile_cache, host_faces=faces), env)
        jax_init.import_modules()
        # starting is bounded by fork(timeout) (the join included), not by the stall timeout
        left = s.timeout - (time.monotonic() - started)
        self.channel.watch.wait_done(self.worker_ranks, what="start-up", deadline=time.time() + left,
                               bound=(s.timeout, "timeout"))
        try:
            jax_init.initialize_process(self.master_rank, self.n_parallel, coordinator, s.platform,
                                        max(1.0, s.timeout - (time.monotonic() - started)),
                                        self.float_x(), threads=s.threads,
                                        local_rank=self.local_master, n_local=self.n_local,
                                        cores=cores, compile_cache_dir=s.compile_cache,
                                        master_rank=self.master_rank)
            rewrites.keep_decision_in(s.compile_cache)
            set_gather_threads(s.threads)
        except Exception as e:
            if not t.several_nodes:
                raise
            raise self._join_failed(coordinator, e) from None
        if t.several_nodes:
            self.nodes = NodeLink(t, self.check_during_collective, s.stall_timeout, self.abort)
            self.nodes.check_settings_agree(dict(
                devices=self.n_local, master_rank=self.local_master, platform=s.platform,
                collectives=self.comm_kind, floatX=self.float_x()))

    def _rank_context(self) -> RankContext:
        t = self.topology
        return RankContext(
            rank=self.master_rank, n_ranks=self.n_parallel, local_rank=self.local_master,
            n_local=self.n_local, master_rank=self.master_rank, root_rank=self.root_rank,
            function=self.registry.compiled.__getitem__, variable=self.registry.shared_by_uid,
            view=self.data.view, index_view=self.data.index_view, check=self.check_during_collective,
            comm_class=self.settings.collectives, prefix=self.prefix, spin=self.settings.spin,
            topology=t if t.several_nodes else None)

    def _join_failed(self, coordinator: str, error: Exception) -> SynkError:
        """The error of a node whose peers did not all join (the service, if ours, stopped)."""
        s, t = self.settings, self.topology
        if self.service is not None:          # nobody joined it: nothing to wait for
            self.service.stop(at_once=True)
            self.service = None
        others = [node for node in range(t.n_nodes) if node != t.node_rank]
        missing = f"node {others[0]}" if len(others) == 1 else \
            "some of nodes " + ", ".join(map(str, others))
        return SynkError(
            f"{missing} did not join this runtime within fork(timeout={s.timeout:g}) seconds "
            f"(node {t.node_rank} of {t.n_nodes}, coordinator {coordinator}): start the same "
            f"script on every node with its --node-rank, or give fork() a longer timeout; "
            f"nothing of this node's runtime is left ({type(error).__name__}: {error})")

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process id of every worker, by rank."""
        return {rank: p.pid for rank, p in self.channel.procs.items()} if self.channel else {}

    @staticmethod
    def float_x() -> str:
        import pytensor
        return pytensor.config.floatX

    def stop(self, clean: bool = True) -> None:
        """Stop workers (politely, then by force), unlink every segment, leave the JAX runtime, and
        give the process back every setting the runtime changed in it.

        On several nodes a ``clean`` stop (``close()``, not a fault) first
        waits until every node closes; node 0 leaves last and then ends the
        coordination service (JAX aborts a process whose service is gone
        before it left). After a fault the service stays a while for the
        other nodes to leave (:mod:`synkhronos.platform.coordination`).
        """
        if not self.is_open or self._tearing_down:
            return
        self._tearing_down = True
        try:
            if clean and self.nodes is not None:
                # a node an asynchronous run went on without does not close with the others
                self.nodes.exchange("close()", None, tolerate_loss=bool(self.nodes.lost))
            self.channel.stop_workers()
        finally:
            clean = clean and not self._fault_met
            reap(self.channel.procs.values())
            self._release_segments()
            self.claim.release()
            self.registry.detach_values()
            self.registry.release_programs()
            self.calls.release_programs()
            self.context.release_programs()
            self.is_open = False
            # another node says it left once its backend is gone (node 0 ends the service soon
            # after), so that leaving the runtime is all that follows: one message to the service
            says_it_left = clean and self.nodes is not None and self.topology.node_rank != 0
            if self.nodes is not None and not says_it_left:
                self._leave_nodes_quietly(clean)
            try:
                jax_init.shutdown_process(before_leaving=self._leave_nodes_quietly if says_it_left else None)
            except Exception:           # the workers are gone already; nothing is left to wait for
                log.debug("leaving the JAX runtime failed in the master", exc_info=True)
            if self.service is not None:
                # after a fault the other nodes may still be leaving: the service stays a while,
                # unless every one of them was found lost (or it served one node's processes)
                self.service.stop(at_once=clean or not self.topology.several_nodes or
                                  self.nodes is not None and self.nodes.every_other_node_lost())
                self.service = None
            changes.restore()       # the environment, JAX's settings, BLAS threads, allocator
            use_host_faces(True)
            use_pinned(False)
            set_gather_threads(1)

    def _leave_nodes_quietly(self, clean: bool = True) -> None:
        """:meth:`_leave_nodes`; a failure only means the coordinator is gone: nobody is left to
        wait for."""
        try:
            self._leave_nodes(clean)
        except Exception:
            log.debug("leaving the other nodes failed", exc_info=True)

    def _leave_nodes(self, clean: bool) -> None:
        """On several nodes: stop beating; node 0 (which started the coordination service) leaves last."""
        nodes = self.nodes
        assert nodes is not None, "on several nodes only"
        if not clean:
            nodes.close(fault=True)
        elif self.topology.node_rank == 0:
            nodes.close()
            nodes.wait_until_others_left()
        else:
            nodes.leave()

    def tell_nodes_refused(self, what: str, error: BaseException) -> None:
        """On several nodes, while the runtime runs: ``what`` (a call, a set_value, a restore),
        refused on this node before its exchange, is said to the other nodes
        (:meth:`~.nodes.NodeLink.tell_refused`); the caller raises its own ``error``."""
        if self.nodes is not None and self.is_open:
            self.nodes.tell_refused(what, error)

    def abort(self) -> None:
        """Tear everything down after a fault (dead worker, stall, Ctrl-C); another Ctrl-C meanwhile
        is raised once everything is down (the process could not start again otherwise). A fault
        the teardown meets itself (a worker it killed, seen dead by its wait) kills what still runs
        and leaves the teardown under way to go on: run twice, it would put back and release twice."""
        if self._tearing_down:
            self._fault_met = True
            self._kill_workers()
            return
        self._on_abort(self)
        with interrupts.deferred():
            try:
                if self.channel is None:
                    return
                self.calls.put_back_half_step()
                self.loops.put_back_half_steps()
                self._kill_workers()
                self.stop(clean=False)
            finally:
                self.claim.release()

    def _kill_workers(self) -> None:
        for p in self.channel.procs.values():
            if p.poll() is None:
                p.kill()

    def _release_segments(self) -> None:
        self.loops.release()
        self.data.release_all()
        if self.context is not None and self.context.comm_made:
            self.context.comm.release()
        self.channel.release()

    @property
    def fuses_steps(self) -> bool:
        """Whether a training step travels as one command (:class:`synkhronos.api.step.Step`).

        On one node, unless every rank's CPU pool spreads over every core
        (``threads_per_device`` = all of them): there the ranks' gradient programs
        fall out of balance under the one-command step, and three commands per
        step run faster (see docs/design.md). One device has no ranks to balance.
        """
        return self.nodes is None and (self.n_parallel == 1 or not (
            self.platform == "cpu" and self.channel.local_cores is None))

    def check_open(self) -> None:
        if not self.is_open:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")

    def check_during_collective(self) -> None:
        """While the master waits inside a collective: the runtime is open and no worker failed."""
        self.check_open()
        self.channel.watch.during_collective()
