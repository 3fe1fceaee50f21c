"""The master's one runtime :class:`State`, and its lifecycle: :func:`begin` ... :func:`end`.

``synk.fork()`` validates its arguments and calls :func:`begin`, which starts
one worker process per extra device (the master is itself a rank), all of
them joining the JAX multi-process runtime. The :class:`State` owns every
shared-memory segment and every process of that session; :func:`end` (what
``synk.close()`` and the exit hook call) stops and joins the workers, unlinks
the segments and gives the process back what ``begin`` changed in it.

Everything that talks to the workers runs under one lock (:func:`serialized`):
a call, a collective or a Data change is one conversation through the one
control block.
"""

import atexit
import functools
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass

import numpy as np
from pytensor.tensor.type import TensorType

from ..comm import CommContext, Reservation, class_path
from ..compile import randomness, rewrites, shipping
from ..errors import SynkError, WorkerError, verbose
from ..ipc.segments import new_prefix, remove_stale_segments
from ..platform import jax_init
from ..platform.coordination import ServiceProcess
from ..platform.device_arrays import device_face, host_face, place_on_device, to_device
from ..rank.collectives import prepare_collective
from ..rank.executor import run_share, run_update
from ..tracing import trace
from ..wire.collective import KIND_NAMES, shapes_of
from ..wire.control import ARGS, STEP_COLLECTIVE_AT, ControlBlock, Op, Words
from ..wire.plan import PlanSlots
from ..wire.topology import Topology
from .channel import Channel
from .data_store import DataStore
from .nodes import NodeLink
from .processes import free_port, launch_worker, reap

__all__ = ["State", "Settings", "begin", "end", "current", "active", "serialized", "lock",
           "CLOSE_WAIT"]

log = logging.getLogger(__name__)

#: how long end() waits for another thread's command to finish before it stops the workers anyway
CLOSE_WAIT = 10.0


class _Lifecycle:
    """The module's one piece of global state: the running State and how the last one ended."""

    def __init__(self):
        self.state = None
        self.closed_once = False
        self.forked_from = None      # in a child made by os.fork() of a master: the master's pid
        #: one thread at a time talks to the workers (re-entrant: a collective may stage a Data)
        self.lock = threading.RLock()
        #: how many serialized calls the thread holding the lock is inside
        self.depth = 0


_life = _Lifecycle()


def serialized(fn):
    """Run ``fn`` holding the runtime's lock, so that threads take turns with the workers.

    Two threads calling functions at once would otherwise write their commands
    into the same control block and read each other's results.
    """
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with _life.lock:
            outermost = _life.depth == 0
            _life.depth += 1
            try:
                if outermost and _life.state is not None:
                    _life.state.values_to_devices()
                return fn(*args, **kwargs)
            except WorkerError as e:
                if not outermost or verbose():
                    raise
                # the report names what the user needs; synkhronos's own frames are left out
                raise e.with_traceback(None) from None
            finally:
                _life.depth -= 1
                if outermost and _life.state is not None and _life.state.is_open:
                    _life.state.values_to_user()
    return locked


def lock():
    """The runtime's lock (re-entrant), for a caller that spans several commands: ``with lock(): ...``."""
    return _life.lock


def current():
    """Return the running :class:`State`, or raise (saying what to do) if there is none."""
    state = _life.state
    if state is None:
        if _life.forked_from is not None:
            raise RuntimeError(f"this process was made by os.fork() from synkhronos's master (pid "
                               f"{_life.forked_from}); the runtime belongs to that process and cannot "
                               f"be used here: call synkhronos from the master")
        if _life.closed_once:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")
        raise RuntimeError("synkhronos is not running; call synk.fork() first")
    return state


def active():
    """The running :class:`State`, or None."""
    return _life.state


def forked_from():
    """In a child made by ``os.fork()`` of a master: the master's pid; else None."""
    return _life.forked_from


def _forget_runtime_in_child():
    """After ``os.fork()`` in the master: the child leaves the parent's runtime alone.

    A data-loader pool or a helper process forked from the user's script
    inherits the runtime's objects; at its exit it must not stop the parent's
    workers, unlink the parent's segments or shut down the parent's JAX
    runtime (which hung and left the parent to abort).
    """
    # another thread of the parent may have held the lock at the fork: it is never released here
    _life.lock = threading.RLock()
    if _life.state is not None:
        _life.forked_from = os.getppid()
        _life.state = None
        jax_init.forget_runtime_in_child()


os.register_at_fork(after_in_child=_forget_runtime_in_child)


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
    collectives: type
    #: where fork(timeline=...) writes every rank's timeline at close, or None
    timeline: str = None
    topology: Topology = None


class State:
    """Processes, segments and registries of one ``fork() ... close()`` session.

    Read-only to the rest of the package: ``n_parallel`` (devices of every
    node), ``master_rank`` (this process's global rank), ``topology``,
    ``platform``, ``comm_kind`` (the name of the collective implementation),
    ``prefix`` (every segment's name starts with it), ``worker_pids`` and
    ``is_open``. ``worker_ranks`` and ``local_master`` are this node's local
    ranks (the control channel's).
    """

    def __init__(self, settings):
        self.settings = settings
        self.topology = settings.topology or Topology(1, 0, settings.n_parallel)
        self.n_local, self.local_master = settings.n_parallel, settings.master_rank
        self.n_parallel = self.topology.n_devices
        self.master_rank = self.topology.global_rank(self.local_master)
        self.platform = settings.platform
        self._comm_class = settings.collectives
        self.comm_kind = self._comm_class.name
        self.prefix = new_prefix()
        self.worker_ranks = [r for r in range(self.n_local) if r != self.local_master]
        #: on several nodes, the exchanges with the other nodes' masters (after start)
        self.nodes = None
        #: on several nodes, node 0's master's: the process serving JAX's coordination service
        self.service = None
        self._own_streams = {}      # id -> generator already made this node master's own stream
        self.is_open = False
        self._channel = None
        self.data = DataStore(self.prefix)
        #: values a layer above keeps per runtime (numpy arguments staged as Data, say)
        self.staging = {}
        self._compiled = {}         # function id -> this process's CompiledFunction
        self._unshipped = []        # function ids (with their specs) not yet sent to the workers
        self._specs = {}
        self._next_fid = 0
        self._shared = {}           # id(var) -> (uid, var)
        self._shared_by_uid = {}
        self._tensor_shared = []    # the tensors among them: what user code reads as numpy
        self._shipped_uids = set()
        self._comm = None
        self._plans = PlanSlots()
        self._loops = {}            # loop id -> the master's DeviceLoop, from its first phase to finish
        self._centers = {}          # loop id -> its central parameters, until the master's loop takes them
        self._next_loop = 0

    # --- start and stop ---------------------------------------------------------------------
    def start(self):
        """Start the workers, wait until each is ready, then join the JAX runtime with them."""
        s, t = self.settings, self.topology
        started = time.monotonic()          # fork(timeout=...) counts from here, the join included
        cores = jax_init.device_cores(s.platform, s.threads, self.local_master)
        self._channel = Channel(self.prefix, self.n_local, self.local_master, s.spin,
                                s.stall_timeout, on_fault=self.abort, rank_offset=t.offset,
                                node=t.node_rank if t.several_nodes else None, local_cores=cores)
        self.is_open = True
        coordinator = t.coordinator or f"127.0.0.1:{free_port()}"
        env = jax_init.configure_environment(dict(os.environ), s.platform, s.threads)
        if t.several_nodes and t.node_rank == 0:
            self.service = ServiceProcess(coordinator, self.n_parallel, jax_init.NODE_HEARTBEAT_TIMEOUT,
                                          env)
        for rank in self.worker_ranks:
            self._channel.procs[rank] = launch_worker(dict(
                prefix=self.prefix, rank=rank, n_ranks=self.n_local, coordinator=coordinator,
                topology=t.to_dict(), platform=s.platform, timeout=s.timeout, spin=s.spin,
                comm=class_path(self._comm_class), float_x=self.float_x(), threads=s.threads,
                profile=bool(s.profile_workers)), env)
        self._channel.wait_done(self.worker_ranks, what="start-up")
        try:
            jax_init.initialize_process(self.master_rank, self.n_parallel, coordinator, s.platform,
                                        max(1.0, s.timeout - (time.monotonic() - started)),
                                        self.float_x(), threads=s.threads,
                                        local_rank=self.local_master, n_local=self.n_local,
                                        cores=cores)
        except Exception as e:
            if not t.several_nodes:
                raise
            if self.service is not None:          # nobody joined it: nothing to wait for
                self.service.stop(at_once=True)
                self.service = None
            others = [node for node in range(t.n_nodes) if node != t.node_rank]
            missing = f"node {others[0]}" if len(others) == 1 else \
                "some of nodes " + ", ".join(map(str, others))
            raise SynkError(
                f"{missing} did not join this runtime within fork(timeout={s.timeout:g}) seconds "
                f"(node {t.node_rank} of {t.n_nodes}, coordinator {coordinator}): start the same "
                f"script on every node with its --node-rank, or give fork() a longer timeout; "
                f"nothing of this node's runtime is left ({type(e).__name__}: {e})") from None
        if t.several_nodes:
            self.nodes = NodeLink(t, self._check_during_collective, s.stall_timeout, self.abort)
            self._check_nodes_agree()

    def _check_nodes_agree(self):
        """Every node must run with the same settings; raise naming the first that differs."""
        s = self.settings
        mine = dict(devices=self.n_local, master_rank=self.local_master, platform=s.platform,
                    collectives=self.comm_kind, floatX=self.float_x())
        for node, theirs in enumerate(self.nodes.exchange("fork()", mine)):
            for key in mine:
                if theirs[key] != mine[key]:
                    raise ValueError(
                        f"node {node} forked with {key}={theirs[key]!r} but node "
                        f"{self.topology.node_rank} with {key}={mine[key]!r}: every node must call "
                        f"fork() alike (the same devices per node, master_rank, platform, "
                        f"collectives and pytensor.config.floatX)")

    @property
    def worker_pids(self):
        """The process id of every worker, by rank."""
        return {rank: p.pid for rank, p in self._channel.procs.items()} if self._channel else {}

    @staticmethod
    def float_x():
        import pytensor
        return pytensor.config.floatX

    def stop(self, clean=True):
        """Stop workers (politely, then by force), unlink every segment, leave the JAX runtime.

        On several nodes a ``clean`` stop (``close()``, not a fault) first
        waits until every node closes; node 0 leaves last and then ends the
        coordination service (JAX aborts a process whose service is gone
        before it left). After a fault the service stays a while for the
        other nodes to leave (:mod:`synkhronos.platform.coordination`).
        """
        if not self.is_open:
            return
        try:
            if clean and self.nodes is not None:
                self.nodes.exchange("close()", None)
            self._channel.stop_workers()
        finally:
            reap(self._channel.procs.values())
            self._release_segments()
            self._detach_shared_values()
            self.is_open = False
            if self.nodes is not None:
                try:
                    self._leave_nodes(clean)
                except Exception:       # the coordinator is gone: nobody is left to wait for
                    log.debug("leaving the other nodes failed", exc_info=True)
            try:
                jax_init.shutdown_process()
            except Exception:           # the workers are gone already; nothing is left to wait for
                log.debug("leaving the JAX runtime failed in the master", exc_info=True)
            if self.service is not None:
                # after a fault the other nodes may still be leaving: the service stays a while,
                # unless every one of them was found lost
                self.service.stop(at_once=clean or self.nodes is not None and
                                  self.nodes.every_other_node_lost())
                self.service = None

    def _leave_nodes(self, clean):
        """On several nodes: stop beating; node 0 (which started the coordination service) leaves last."""
        if not clean:
            self.nodes.close()
        elif self.topology.node_rank == 0:
            self.nodes.close()
            self.nodes.wait_until_others_left()
        else:
            self.nodes.leave()

    def abort(self):
        """Tear everything down after a fault (dead worker, stall, Ctrl-C)."""
        if _life.state is self:
            _life.state = None
        if self._channel is None:
            return
        for p in self._channel.procs.values():
            if p.poll() is None:
                p.kill()
        self.stop(clean=False)

    def _release_segments(self):
        centers = list(self._centers.values()) + [loop.center for loop in self._loops.values()]
        for center in centers:
            if center is not None:
                center.close()
        self._loops, self._centers = {}, {}
        self.data.release_all()
        if self._comm is not None:
            self._comm.release()
        self._channel.release()

    def _detach_shared_values(self):
        """Move the master's shared values to numpy arrays of their own, which outlive the JAX backend."""
        import jax
        for _, var in self._shared.values():
            value = device_face(var.container.storage[0])
            if isinstance(value, jax.Array):
                var.container.storage[0] = np.array(value)

    def values_to_user(self):
        """Give user code the master's shared values as numpy arrays (:func:`host_face`).

        Called whenever a synkhronos call returns: the user's own PyTensor
        functions, in any mode, read the same shared variables.
        """
        for var in self._tensor_shared:
            cell = var.container.storage
            cell[0] = host_face(cell[0])

    def values_to_devices(self):
        """Take the master's shared values back as device arrays, before a synkhronos call.

        A host face becomes its device array again; a numpy value the user set
        is copied to the device (every rank computes on device arrays).
        """
        for var in self._tensor_shared:
            cell = var.container.storage
            value = cell[0]
            if isinstance(value, np.ndarray):
                device = device_face(value)
                cell[0] = device if device is not value else to_device(value.astype(var.type.dtype, copy=False))

    @property
    def fuses_steps(self):
        """Whether a training step travels as one command (:class:`synkhronos.api.step.Step`).

        On one node, unless every rank's CPU pool spreads over every core
        (``threads_per_device`` = all of them): there the ranks' gradient programs
        fall out of balance under the one-command step, and three commands per
        step run faster (see docs/design.md).
        """
        return self.nodes is None and not (self.platform == "cpu" and
                                           self._channel.local_cores is None)

    def check_open(self):
        if not self.is_open:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")

    # --- the collective implementation ------------------------------------------------------
    @property
    def comm(self):
        """This process's collective implementation (built on first use)."""
        if self._comm is None:
            self._comm = self._comm_class(CommContext(
                prefix=self.prefix, rank=self.master_rank, n_ranks=self.n_parallel,
                master_rank=self.master_rank, check=self._check_during_collective,
                spin=self.settings.spin,
                topology=self.topology if self.topology.several_nodes else None))
        return self._comm

    def _check_during_collective(self):
        self.check_open()
        self._channel.check_during_collective()

    # --- registries -------------------------------------------------------------------------
    def next_function_id(self):
        return self._next_fid

    def register_function(self, spec, compiled):
        """Keep ``spec`` (to ship) and this process's ``compiled`` function (to run calls)."""
        self._specs[spec.fid], self._compiled[spec.fid] = spec, compiled
        self._unshipped.append(spec.fid)
        self._next_fid = spec.fid + 1
        for var in spec.shared_variables():
            self.uid_of(var)

    @property
    def n_functions(self):
        """How many functions are registered (built, and shipped or about to be)."""
        return len(self._specs)

    def is_registered(self, fid):
        """False once a function that could not be shipped was unregistered."""
        return fid in self._specs

    def uid_of(self, var):
        """The stable id under which every process knows shared variable ``var``."""
        entry = self._shared.get(id(var))
        if entry is None:
            entry = self._shared[id(var)] = (len(self._shared), var)
            self._shared_by_uid[entry[0]] = var
            if isinstance(var.type, TensorType):
                self._tensor_shared.append(var)
        return entry[0]

    def uids_of(self, vars_):
        return [self.uid_of(v) for v in vars_]

    def known_shared(self):
        """Every shared variable some function of this runtime uses."""
        return [var for _, var in self._shared.values()]

    def scattered_shared(self):
        """Every shared variable some function slices (``sliceable_shareds``: data, not state)."""
        return [var for spec in self._specs.values() for var in spec.sliceable_shareds]

    def shared_by_uid(self, uid):
        return self._shared_by_uid[uid]

    # --- Data -------------------------------------------------------------------------------
    def drop_data(self, data_ids):
        """Have the workers let go of their mappings of ``data_ids``."""
        self.check_open()
        ids = list(data_ids)
        self._channel.ctl.args[0] = len(ids)
        self._channel.ctl.args[1:1 + len(ids)] = ids
        self._channel.command(Op.DROP_DATA)

    def _drop_released_data(self):
        ids, released = [], self.data.released
        while released and len(ids) < ARGS - 1:
            ids.append(released.popleft())
        self.drop_data(ids)

    # --- shipping functions -----------------------------------------------------------------
    def ensure_shipped(self):
        """Bring the workers up to date before a command: new functions shipped, freed Data dropped.

        Checked on every call: keep it O(1).
        """
        self.check_open()
        if self.data.released:
            self._drop_released_data()
        if self._unshipped:
            self.ship(sync_values=False)

    def ship(self, sync_values):
        """Send every function not yet shipped to every worker, which compiles them.

        With ``sync_values``, every shared variable the workers already hold is
        set to the master's value.
        """
        self.check_open()
        specs = [self._specs[fid] for fid in self._unshipped]
        new_shared, values = {}, {}
        for spec in specs:
            for var in spec.shared_variables():
                uid = self.uid_of(var)
                if uid not in self._shipped_uids:
                    new_shared[uid] = var
        if sync_values:
            for uid, var in self._shared.values():
                if uid in self._shipped_uids:
                    value = var.get_value(borrow=True)
                    values[uid] = value if randomness.is_generator(var) else np.asarray(value)
        shipped = self._shipped_uids

        def uid_of_shipped(obj):
            entry = self._shared.get(id(obj))
            return entry[0] if entry is not None and entry[0] in shipped and entry[1] is obj else None

        # every rank compiles as the master does: with its precision and its choice of products
        cpu_rewrite = rewrites.use_cpu_rewrite() if self.platform == "cpu" else False
        payload = dict(functions=specs, shared=new_shared, values=values, float_x=self.float_x(),
                       cpu_rewrite=cpu_rewrite)
        graph_vars = [v for spec in specs for v in spec.graph_vars()]
        try:
            blob = shipping.dumps(payload, graph_vars, uid_of_shipped)
        except Exception as e:
            # what cannot travel now never will: unregister it, so other functions still ship
            for spec in specs:
                del self._specs[spec.fid], self._compiled[spec.fid]
            self._unshipped = []
            names = ", ".join(spec.name for spec in specs)
            raise TypeError(f"{names} cannot be sent to the workers ({type(e).__name__}: {e}); "
                            f"they were unregistered, other functions still work") from e
        self._channel.send_payload(blob)
        self._channel.command(Op.SHIP)
        self._shipped_uids.update(new_shared)
        self._unshipped = []

    def own_streams(self, variables):
        """Before the master compiles a function: on a node after the first, its new generators
        become its own device's streams.

        Every node's script seeded them alike; node 0's master keeps the draws of the
        single-process function and every other device (this master included) draws from that
        stream jumped by its rank's distance, as the workers do (theirs are the master's jumped
        by their distance from it). A compiled function keeps a copy of its generators' state,
        so this happens before compiling, once per generator.
        """
        distance = (self.master_rank - self.root_rank) % self.n_parallel
        for var in variables:
            if distance and randomness.is_generator(var) and id(var) not in self._own_streams:
                self._own_streams[id(var)] = var        # (kept: the id stays this variable's)
                var.set_value(randomness.device_stream(var.get_value(borrow=True), distance))

    # --- calls ------------------------------------------------------------------------------
    def run_call(self, plan, record, tail=None):
        """Run ``plan`` (a :class:`~synkhronos.wire.plan.CallPlan`) everywhere.

        The caller has brought the workers up to date (:meth:`ensure_shipped`)
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

        Returns
        -------
        rows : list of int
            Rows each rank computed (0: it computed nothing and returned nothing).
        columns : list
            Per selected output, its value on every rank: a 1-D array over ranks
            when the results travel as records, else a list by rank (None for a
            rank without rows).
        """
        channel, ctl = self._channel, self._channel.ctl
        index_arrays = plan.index_arrays()
        if index_arrays:
            plan.index_gen = self.data.write_indices(index_arrays)
        self._plans.publish(plan.encode(), ctl.header, ctl.args)
        fields = ctl.record_fields(record) if record is not None else None
        compiled, local_master = self._compiled[plan.fid], self.local_master
        rank, n_ranks = plan.ranks(self.master_rank, self.n_parallel, local_master, self.n_local)

        def local():
            rows, outs = run_share(compiled, plan, rank, n_ranks, self.data.view)
            ctl.rows[local_master] = rows
            if fields is None:
                return [np.asarray(o) for o in outs] if rows else None
            if rows:
                ctl.put_record(record, local_master, outs)

        try:
            if tail is None:
                outs = channel.command(Op.CALL, local=local, kind=(Op.CALL, plan.fid))
            else:
                outs = self._run_step(local, tail, kind=(Op.STEP, plan.fid))
        except Exception as e:
            self._tell_other_nodes(self._call_name(plan), e)
            raise
        if not plan.subset and self.nodes is None:   # a call selecting no outputs (only updates)
            return None, []
        rows = ctl.rows.tolist()
        if fields is not None:
            columns = [np.array(f) for f in fields]
        else:
            per_rank = [outs if rank == local_master else
                        channel.read_result_arrays(rank) if rows[rank] else None
                        for rank in range(self.n_local)]
            columns = [[None if values is None else values[j] for values in per_rank]
                       for j in range(len(plan.subset))]
        if self.nodes is not None:
            rows, columns = self._results_of_every_node(self._call_name(plan), rows, columns)
        return (rows, columns) if plan.subset else (None, [])

    def _run_step(self, local, tail, kind):
        """The call's command extended by ``tail`` (see :meth:`run_call` and ``Channel.step``)."""
        comm, ctl = self.comm, self._channel.ctl
        comm.reserve(tail.reservation)
        tail.fill(Words(ctl.args[STEP_COLLECTIVE_AT:]))
        ctl.header[ControlBlock.UPDATE_FID] = tail.update_fid
        update = self._compiled[tail.update_fid]

        def prepare():
            outs = local()
            execute = self._prepare_collective(Words(ctl.args[STEP_COLLECTIVE_AT:]))

            def reduce_and_update():
                execute()
                run_update(update)
                return outs
            return reduce_and_update
        return self._channel.step(prepare, comm.waits_in_python, kind)

    # --- several nodes ----------------------------------------------------------------------
    def _call_name(self, plan):
        """What a call is called in the exchange of its results: ``("a call of", name, on what)``.

        Nodes calling the same function on other rows or other data both raise
        NodesDiverged, naming both calls.
        """
        return ("a call of", self._specs[plan.fid].name, f"({plan.arguments_text()})")

    def rows_of_every_node(self, rows):
        """The rows of every node's batch together (each node's own count on one node)."""
        if self.nodes is None:
            return rows
        return int(sum(self.nodes.exchange("rows of every node", int(rows))))

    @property
    def root_rank(self):
        """The rank whose values a broadcast sends: the master of node 0."""
        return self.local_master

    def _every_node_prepared(self, kind):
        """The agreement of a collective's two phases across nodes (see ``Channel.collective``)."""
        def agree(prepared):
            nodes = self.nodes.exchange(("collective", kind), prepared)
            failed = [node for node, ok in enumerate(nodes) if not ok]
            if not failed:
                return True, None
            return False, self._error_on(failed[0], f"it could not prepare the {kind}; every node "
                                                    f"skipped it")
        return agree

    def _error_on(self, node, what):
        """The error this node raises for a failure on another ``node``."""
        return WorkerError(self.topology.ranks_of(node)[0], "raised", "error on another node",
                           f"node {node}: {what}", node=node)

    def joined_over_nodes(self, what, per_local_rank):
        """``per_local_rank`` (a list over this node's ranks) of every node, by global rank."""
        if self.nodes is None:
            return list(per_local_rank)
        return [item for node in self.nodes.exchange(what, list(per_local_rank)) for item in node]

    def _tell_other_nodes(self, what, error):
        """On several nodes, after this node failed a command: let the others raise too."""
        if self.nodes is not None and self.is_open:
            self.nodes.exchange(what, ("failed", f"{type(error).__name__}: {error}"))

    def _results_of_every_node(self, what, rows, columns):
        """Every node's per-rank ``rows`` and ``columns``, joined in global rank order."""
        nodes = self.nodes.exchange(what, ("ok", (rows, columns)))
        for node, (status, payload) in enumerate(nodes):
            if status == "failed":
                raise self._error_on(node, f"it failed this call ({payload}); this node's part "
                                           f"was done and is discarded")
        rows = [r for _, (node_rows, _) in nodes for r in node_rows]
        joined = []
        for j in range(len(columns)):
            parts = [node_columns[j] for _, (_, node_columns) in nodes]
            joined.append(np.concatenate(parts) if isinstance(parts[0], np.ndarray)
                          else [v for part in parts for v in part])
        return rows, joined

    # --- collectives and shared values ------------------------------------------------------
    def run_collective(self, fill, reservation=None):
        """Write a collective with ``fill(Words)`` and run it on every rank; return the master's results.

        ``reservation`` (a :class:`~synkhronos.comm.Reservation`) is handed to
        the collective implementation first.
        """
        since = trace.now() if trace.on else None
        self.ensure_shipped()
        comm, ctl = self.comm, self._channel.ctl
        comm.reserve(reservation or Reservation())
        fill(Words(ctl.args))

        def local_prepare():
            execute = self._prepare_collective(Words(ctl.args))
            if trace.on:
                trace.mark("prepare")
            return execute
        kind = KIND_NAMES.get(int(ctl.args[0]), "collective")
        if since is not None:
            trace.begin("collective", kind, since)
        try:
            agree = None if self.nodes is None else self._every_node_prepared(kind)
            try:
                results = self._channel.collective(local_prepare, comm.waits_in_python, agree, kind)
            except Exception as e:
                if self.nodes is not None and not isinstance(e, SynkError) and self.is_open:
                    self.nodes.raise_dead_node(f"the {kind} across nodes", e)   # a lost peer's name
                raise
            return [np.asarray(v) for v in results]
        finally:
            if since is not None:
                trace.end("execute")

    def _prepare_collective(self, words):
        """This rank's part of the collective in ``words``, prepared; returns its ``execute()``."""
        return prepare_collective(self.comm, words, self.master_rank, self.n_parallel,
                                  self.master_rank, self.shared_by_uid, self.data.view,
                                  self.data.index_view, root=self.root_rank)

    def all_shapes(self, vars_):
        """Per variable, its shape on every rank (one round trip)."""
        self.ensure_shipped()
        Words(self._channel.ctl.args).put_list(self.uids_of(vars_))
        own = shapes_of(v.container.storage[0] for v in vars_)
        self._channel.command(Op.GET_SHAPES)
        per_rank = {self.local_master: own}
        for rank in self.worker_ranks:
            per_rank[rank] = [tuple(int(s) for s in a) for a in self._channel.read_result_arrays(rank)]
        ordered = self.joined_over_nodes("shapes", [per_rank[r] for r in range(self.n_local)])
        return [[ordered[r][i] for r in range(self.n_parallel)] for i in range(len(vars_))]

    def get_values(self, rank, vars_):
        """The values of ``vars_`` on global ``rank``, as numpy arrays, on every node.

        On several nodes every node makes the same call; the node holding
        ``rank`` reads the values and the others receive them through the
        coordination service's exchange.
        """
        self.ensure_shipped()
        t = self.topology
        owner = t.node_of(rank)
        values = self.local_values(t.local_of(rank), vars_) if owner == t.node_rank else None
        if self.nodes is not None:
            values = self.nodes.exchange(("get_value", int(rank)), values)[owner]
        return values

    def local_values(self, rank, vars_):
        """The values of ``vars_`` on this node's local ``rank`` (no other node takes part)."""
        if rank == self.local_master:
            return [np.array(v.get_value()) for v in vars_]
        self._channel.send_pickled(self.uids_of(vars_))
        self._channel.command(Op.GET_SHARED, ranks=[rank])
        return self._channel.read_result_arrays(rank)

    def set_values(self, rank, vars_, arrays):
        """Set ``vars_`` to ``arrays`` on global ``rank`` only (by the node that holds it).

        On several nodes every node makes the same call; the others do nothing.
        """
        self.ensure_shipped()
        t = self.topology
        if t.node_of(rank) != t.node_rank:
            return
        rank = t.local_of(rank)
        if rank == self.local_master:
            for var, arr in zip(vars_, arrays):
                var.set_value(arr)
            place_on_device(vars_)
        else:
            self._channel.send_pickled(dict(zip(self.uids_of(vars_), arrays)))
            self._channel.command(Op.SET_SHARED, ranks=[rank])

    # --- timeline ---------------------------------------------------------------------------
    def start_timeline(self):
        """Every rank starts recording its timeline (:mod:`synkhronos.tracing.trace`)."""
        self.check_open()
        trace.start()
        self._channel.ctl.args[0] = 1
        self._channel.command(Op.TIMELINE)

    def stop_timeline(self):
        """Every rank stops recording; return ``{rank: spans}``."""
        self.check_open()
        self._channel.ctl.args[0] = 0
        self._channel.command(Op.TIMELINE)
        spans = {self.master_rank: trace.stop()}
        for rank in self.worker_ranks:
            spans[self.topology.global_rank(rank)] = pickle.loads(
                self._channel.read_result_arrays(rank)[0].tobytes())
        return spans

    def write_timeline(self, path):
        """Stop recording and write every rank's timeline to ``path`` (Chrome trace JSON)."""
        trace.write_chrome_trace(path, self.stop_timeline(), self.master_rank,
                                 self.topology.node_rank if self.topology.several_nodes else None)

    # --- device-driven loops ----------------------------------------------------------------
    def new_loop_id(self):
        self._next_loop += 1
        return self._next_loop

    def center_name(self, loop_id):
        """The segment of loop ``loop_id``'s central parameters."""
        return f"{self.prefix}_center{loop_id}"

    def run_loop(self, spec, phase, first=0, last=0):
        """Run one phase of a device-driven loop on every rank (see :mod:`synkhronos.rank.loop`).

        Parameters
        ----------
        spec : LoopSpec
        phase : {"run", "finish"}
            Global steps ``[first, last)``, or the rule's finish (the final
            parameters on every device), after which the loop is forgotten.

        Returns
        -------
        numpy.ndarray or None
            For "run": every rank's counters, shape ``(n_ranks, len(STAT_FIELDS))``.
        """
        from ..rank.loop import DeviceLoop
        self.ensure_shipped()
        if not spec.rule.asynchronous:
            self.comm.reserve(self._loop_reservation(spec))
        elif spec.loop_id not in self._centers and spec.loop_id not in self._loops:  # before workers map it
            self._centers[spec.loop_id] = self._new_center(spec, first)
        self._channel.send_pickled(dict(spec=spec, phase=phase, first=first, last=last))

        def master_loop():
            # made once the workers have the command: a rule may start with a collective
            loop = self._loops.get(spec.loop_id)
            if loop is None:
                loop = self._loops[spec.loop_id] = DeviceLoop(
                    spec, self.master_rank, self.n_parallel, self.master_rank,
                    self._compiled.__getitem__, self.shared_by_uid, self.data.view, self.comm,
                    self._centers.pop(spec.loop_id, None), self._channel.check_during_collective)
            return loop

        def local():
            loop = master_loop()
            try:
                return loop.finish() if phase == "finish" else loop.run(first, last)
            except Exception as e:
                if self.nodes is None or isinstance(e, SynkError):
                    raise
                # a collective across nodes failed: a lost node is named, as in a call
                self.nodes.raise_dead_node("train.run across nodes", e)
        threaded = not self.comm.waits_in_python and not spec.rule.asynchronous
        if trace.on:
            trace.begin("loop", f"train.run {phase}")
        try:
            own = self._channel.loop_phase(local, threaded)
        finally:
            if trace.on:
                trace.end(None, first=first, last=last)
            if phase == "finish" or not self.is_open:
                self._loops.pop(spec.loop_id, None)
        if phase == "finish":
            return None
        stats = np.zeros((self.n_local, len(own)))
        stats[self.local_master] = own
        for rank in self.worker_ranks:
            stats[rank] = self._channel.read_result_arrays(rank)[0]
        return np.array(self.joined_over_nodes(("train.run", phase), stats))

    def center_values(self, spec):
        """Loop ``spec``'s center now (copies), or the master's parameters for a rule without one."""
        loop = self._loops.get(spec.loop_id)
        values = loop.rule.center_values(loop) if loop is not None else None
        if values is None:
            values = [np.array(self.shared_by_uid(uid).get_value())
                      for uid in spec.synced_uids]
        return values

    def _new_center(self, spec, first):
        """The loop's central parameters, made from the master's values, its claims starting at
        global step ``first`` (a resumed run's)."""
        from ..rank.center import Center
        center = Center.of(spec.center, [self.shared_by_uid(uid) for uid in spec.synced_uids],
                           create=True, check=self._channel.check_during_collective)
        center.start_claims_at(first * self.n_parallel)
        return center

    def _loop_reservation(self, spec):
        """What a synchronous loop's collectives need: the flat gradient, or the parameters and state."""
        def nbytes(uid):
            return np.asarray(self.shared_by_uid(uid).container.storage[0]).nbytes
        if spec.rule.reduces_gradient:
            grad = nbytes(spec.grad_uid)
            return Reservation(nbytes=grad + 64, result_bytes=grad, reduce_bytes=grad,
                               result_consumed=True)
        padded = sum(nbytes(uid) + 64 for uid in spec.synced_uids + spec.state_uids)
        return Reservation(nbytes=padded, reduce_bytes=padded)


# ------------------------------------------------------------------------------------------------
# Lifecycle
# ------------------------------------------------------------------------------------------------

#: the environment variables begin() changed in this process, with their earlier values
_user_environment = {}


def begin(settings):
    """Start a runtime with ``settings`` (validated by ``synk.fork``); return its :class:`State`.

    The master's environment gets what JAX and BLAS read at start-up
    (:func:`~synkhronos.platform.jax_init.configure_environment`); :func:`end`
    puts it back.
    """
    if _life.state is not None:
        raise RuntimeError("fork() was already called; call synk.close() before forking again")
    removed = remove_stale_segments()       # of runs killed whole, their trackers too
    if removed:
        log.info("removed %d shared-memory segments of runs that no longer run", len(removed))
    _user_environment.update({k: os.environ.get(k) for k in jax_init.ENV_VARS
                              if k not in _user_environment})
    jax_init.configure_environment(os.environ, settings.platform, settings.threads)
    state = _life.state = State(settings)
    try:
        state.start()
    except BaseException:
        state.abort()
        _life.state = None
        _restore_environment()
        raise
    # atexit runs handlers last-in first-out: registering now (after JAX registered its own
    # clean-up, which shuts the distributed runtime down) stops our workers before JAX's
    # shutdown barrier waits for them.
    atexit.unregister(end)
    atexit.register(end)
    return state


def end():
    """Stop the running State, if any, and restore the environment (idempotent).

    A command that another thread is running is let finish first (for up to
    ``CLOSE_WAIT`` seconds; after that the workers are stopped anyway and that
    command raises).
    """
    locked = _life.lock.acquire(timeout=CLOSE_WAIT)
    try:
        state, _life.state = _life.state, None
        if state is not None:
            _life.closed_once = True
            if state.settings.timeline and state.is_open:
                try:
                    state.write_timeline(state.settings.timeline)
                except Exception:       # closing must not fail for the timeline's sake
                    log.warning("the timeline could not be written to %s", state.settings.timeline,
                                exc_info=True)
            state.stop()
            _restore_environment()
    finally:
        if locked:
            _life.lock.release()


def _restore_environment():
    for key, value in _user_environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _user_environment.clear()
