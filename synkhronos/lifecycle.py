"""fork / distribute / close: the one global runtime, its processes and its commands.

``fork()`` starts one worker process per extra device (the master is itself a
rank), all of them joining the JAX multi-process runtime. The :class:`Runtime`
owns every shared-memory segment and every process; ``close()`` (also run at
exit) stops and joins the workers and unlinks the segments.
"""

import atexit
import collections
import functools
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref

import numpy as np

from . import devices, randomness, shipping
from .control import ARGS, PLAN_CACHE, ControlBlock, Decision, Op, Status, Words
from .errors import StallError, SynkError, WorkerError
from .shmem import GrowableSegment, SegmentMirror, new_prefix, unlink
from .transport import read_pickle, unpack_arrays, write_bytes

__all__ = ["fork", "close", "distribute", "get_n_devices", "get_n_gpu", "current", "Runtime",
           "serialized"]

log = logging.getLogger(__name__)

_runtime = None
_closed_once = False
_forked_from = None      # in a child made by os.fork() of a master: the master's pid
_user_environment = {}   # the variables fork() changed in this process, to restore at close
#: one thread at a time talks to the workers: a call, a collective or a Data change is one
#: conversation through the one control block (re-entrant: a collective may stage a Data)
_lock = threading.RLock()
#: how long close() waits for another thread's command to finish before it stops the workers anyway
CLOSE_WAIT = 10.0


def serialized(fn):
    """Run ``fn`` holding the runtime's lock, so that threads take turns with the workers.

    Two threads calling functions at once would otherwise write their commands
    into the same control block and read each other's results.
    """
    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with _lock:
            return fn(*args, **kwargs)
    return locked


def current():
    """Return the running :class:`Runtime`, or raise if fork() has not run."""
    if _runtime is None:
        if _forked_from is not None:
            raise RuntimeError(f"this process was made by os.fork() from synkhronos's master (pid "
                               f"{_forked_from}); the runtime belongs to that process and cannot be "
                               f"used here: call synkhronos from the master")
        if _closed_once:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")
        raise RuntimeError("synkhronos is not running; call synk.fork() first")
    return _runtime


def _forget_runtime_in_child():
    """After ``os.fork()`` in the master: the child leaves the parent's runtime alone.

    A data-loader pool or a helper process forked from the user's script
    inherits the runtime's objects; at its exit it must not stop the parent's
    workers, unlink the parent's segments or shut down the parent's JAX
    runtime (which hung and left the parent to abort).
    """
    global _runtime, _forked_from, _lock
    # another thread of the parent may have held the lock at the fork: it is never released here
    _lock = threading.RLock()
    if _runtime is not None:
        _forked_from = os.getppid()
        _runtime = None
        _user_environment.clear()
        devices.forget_runtime_in_child()


os.register_at_fork(after_in_child=_forget_runtime_in_child)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Runtime:
    """Processes, segments and registries of one fork() ... close() session."""

    def __init__(self, n_parallel, master_rank, platform, threads, timeout, profile_workers,
                 spin=0.0, stall_timeout=600.0, collectives="jax"):
        self.n_parallel = n_parallel
        self.comm_kind = collectives
        self.stall_timeout = stall_timeout
        self.spin = spin
        self.master_rank = master_rank
        self.platform = platform
        self.threads = threads
        self.timeout = timeout
        self.profile_workers = profile_workers
        self.prefix = new_prefix()
        self.worker_ranks = [r for r in range(n_parallel) if r != master_rank]
        self.procs = {}
        self.functions = []
        self._n_shipped = 0
        self._shared_vars = {}     # id(var) -> (uid, var)
        self._shared_by_uid = {}   # uid -> var
        self._shipped_uids = set()
        self._datas = weakref.WeakValueDictionary()   # a Data goes with its last reference
        #: ids of Data freed by the garbage collector whose mappings the workers still hold
        self.released_data = collections.deque()
        self._next_data_id = 0
        self.ctl = None
        self.payload = GrowableSegment(f"{self.prefix}_p")
        self.indices = GrowableSegment(f"{self.prefix}_ix")
        self.results = {r: SegmentMirror(f"{self.prefix}_r{r}") for r in self.worker_ranks}
        self.worker_warnings = {r: SegmentMirror(f"{self.prefix}_w{r}") for r in self.worker_ranks}
        self._warning_registry = {}    # shared by every rank: one warning shows once
        self.staging = {}
        self._comm = None
        self._collective_watch = None
        self._plan_ids = {}        # encoded plan -> id (see _publish_plan)
        self._next_plan_id = 0
        self.is_open = False

    # --- start and stop ---------------------------------------------------------------------
    def start(self):
        self.ctl = ControlBlock(f"{self.prefix}_ctl", self.n_parallel, create=True)
        self.ctl.header[ControlBlock.MASTER_RANK] = self.master_rank
        self.is_open = True
        port = _free_port()
        for rank in self.worker_ranks:
            self.procs[rank] = self._launch(rank, port)
        self._wait_done(self.worker_ranks, what="start-up")
        devices.initialize_process(self.master_rank, self.n_parallel, port, self.platform, self.timeout,
                                   self.float_x(), threads=self.threads)

    def _launch(self, rank, port):
        env = devices.configure_environment(dict(os.environ), self.platform, self.threads)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in sys.path if p])
        env["SYNK_WORKER"] = json.dumps(dict(
            prefix=self.prefix, rank=rank, n_ranks=self.n_parallel, master_pid=os.getpid(),
            port=port, platform=self.platform, timeout=self.timeout, spin=self.spin,
            comm=self.comm_kind,
            float_x=self.float_x(),
            threads=self.threads,
            # Linux sends the parent-death signal when the *thread* that started the child ends;
            # started from another thread, workers watch the master's pid instead
            die_with_parent=threading.current_thread() is threading.main_thread(),
            profile=bool(self.profile_workers)))
        return subprocess.Popen([sys.executable, "-m", "synkhronos.worker"], env=env,
                                stdin=subprocess.DEVNULL)

    @staticmethod
    def float_x():
        import pytensor
        return pytensor.config.floatX

    def stop(self):
        """Stop workers (politely, then by force), unlink every segment, leave the JAX runtime."""
        if not self.is_open:
            return
        try:
            if all(p.poll() is None for p in self.procs.values()):
                self.ctl.post_command(Op.STOP, self.worker_ranks)
                try:
                    self._wait_done(self.worker_ranks, what="shutdown", deadline=time.time() + 5)
                except Exception:       # they are stopped by force below
                    log.debug("workers did not stop when asked", exc_info=True)
        finally:
            self._reap_workers()
            self._release_segments()
            self._detach_shared_values()
            self.is_open = False
            try:
                devices.shutdown_process()
            except Exception:           # the workers are gone already; nothing is left to wait for
                log.debug("leaving the JAX runtime failed in the master", exc_info=True)

    def _reap_workers(self):
        deadline = time.time() + 5
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _release_segments(self):
        for d in list(self._datas.values()):
            d._release()
        self.payload.free()
        self.indices.free()
        if self._comm is not None and hasattr(self._comm, "release"):
            self._comm.release()
        for rank in self.worker_ranks:
            for kind, mirror, field in (("r", self.results[rank], ControlBlock.RESULT_GEN),
                                        ("w", self.worker_warnings[rank], ControlBlock.WARN_GEN)):
                mirror.release()
                gen = int(self.ctl.status[rank, field])
                for g in range(max(1, gen - 1), gen + 2):
                    unlink(f"{self.prefix}_{kind}{rank}g{g}")
        self.ctl.unlink()

    def _detach_shared_values(self):
        """Move the master's shared values to numpy so they outlive the JAX backend."""
        for _, var in self._shared_vars.values():
            value = var.container.storage[0]
            if not isinstance(value, np.ndarray):
                var.container.storage[0] = np.asarray(value)

    def check_open(self):
        if not self.is_open:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")

    # --- commands ---------------------------------------------------------------------------
    def command(self, opcode, ranks=None, local=None):
        """Run command ``opcode`` on ``ranks`` (default: all workers) and ``local()`` here.

        Every addressed rank finishes before this returns or raises, so a failure
        never leaves the control channel half-way through a command.
        """
        self.check_open()
        ranks = self.worker_ranks if ranks is None else ranks
        self.ctl.post_command(opcode, ranks)
        local_result, local_error = self._run_local(local)
        self._wait_done(ranks, what=opcode)     # named only if something goes wrong
        self._raise_rank_errors(local_error, ranks)
        return local_result

    def collective_command(self, local_prepare):
        """Run a collective in two phases: every rank prepares, then (if all could) executes.

        A rank that fails to prepare makes every rank skip the collective, so no
        rank waits in it for a peer that will never come; the runtime stays usable.
        The execution is watched: a dead rank, or one that does not finish within
        the stall timeout, shuts the runtime down with an error instead of a hang.
        """
        self.check_open()
        ranks = self.worker_ranks
        self.ctl.header[ControlBlock.DECISION] = Decision.SKIP
        self.ctl.post_command(Op.COLLECTIVE, ranks)
        execute, local_error = self._run_local(local_prepare)
        self._wait_done(ranks, what="preparing a collective")
        failed = [r for r in ranks if self.ctl.status[r, ControlBlock.STATE] == Status.ERROR]
        go = local_error is None and not failed
        self.ctl.header[ControlBlock.DECISION] = Decision.GO if go else Decision.SKIP
        self.ctl.release(ranks)
        if not go:
            self._wait_done(ranks, what="skipping a collective")
            self._raise_rank_errors(local_error, ranks)
        if getattr(self.comm, "calls_check_while_waiting", False):
            result = self._run_inline_watched(execute, ranks, what="a collective")
        else:
            result = self._run_watched(execute, ranks, what="a collective")
        self._raise_worker_errors(ranks)
        return result

    def _run_local(self, fn):
        """Run this rank's part; Ctrl-C tears the runtime down, other errors are returned."""
        try:
            return (fn() if fn is not None else None), None
        except KeyboardInterrupt:
            self._abort()
            raise
        except Exception as e:
            return None, e

    def _run_inline_watched(self, fn, ranks, what):
        """Run ``fn`` (this rank's part of a collective) here; its waits call the watch.

        For collectives whose every wait returns to Python between slices (shared
        memory): no thread to start and join, and the GIL never changes hands.
        """
        self._collective_watch = self._watch(ranks, what, time.time() + self.stall_timeout)
        try:
            result = fn()
        except KeyboardInterrupt:
            self._abort()
            raise
        finally:
            self._collective_watch = None
        self._wait_done(ranks, what=what)
        return result

    def check_during_collective(self):
        """The check the master's collective waits call: peers alive, not stalled, still open."""
        self.check_open()
        if self._collective_watch is not None:
            self._collective_watch()

    def _run_watched(self, fn, ranks, what):
        """Run ``fn`` (this rank's part of a collective) in a thread while watching the workers.

        For collectives that block inside native code (the JAX runtime): only
        another thread can notice a dead or stalled peer meanwhile.
        """
        box = {}

        def target():
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                box["error"] = e
        thread = threading.Thread(target=target, name="synk-collective", daemon=True)
        thread.start()
        deadline = time.time() + self.stall_timeout
        # no spinning here: a spinning main thread would hold the GIL the collective thread needs
        self._wait_done(ranks, what=what, deadline=deadline, spin=0)
        thread.join(max(0.0, deadline - time.time()))
        if thread.is_alive():
            self._abort()
            raise StallError(what, arrived=sorted(ranks), missing=[self.master_rank],
                             timeout=self.stall_timeout)
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _raise_rank_errors(self, local_error, ranks):
        """Raise the error of this rank's part (``local_error``), else of the first worker that failed.

        Either way it is a :class:`WorkerError` naming the rank (also an
        instance of the original builtin type, see :meth:`WorkerError.raised`).
        """
        if isinstance(local_error, SynkError):
            raise local_error
        if local_error is not None:
            raise WorkerError.from_exception(self.master_rank, local_error) from local_error
        self._raise_worker_errors(ranks)

    def _raise_worker_errors(self, ranks):
        status = self.ctl.status
        for rank in ranks:
            if status[rank, ControlBlock.WARN_NBYTES]:
                self.forward_warnings(rank)
            if status[rank, ControlBlock.STATE] == Status.ERROR:
                exc_type, message, tb = self.read_result_pickle(rank)
                raise WorkerError.raised(rank, exc_type, message, tb)

    def forward_warnings(self, rank):
        """Show the warnings worker ``rank`` raised through this process's ``warnings``.

        They obey the script's filters, and one the ranks share shows once.
        """
        row = self.ctl.status[rank]
        seg = self.worker_warnings[rank].get(int(row[ControlBlock.WARN_GEN]))
        caught = read_pickle(seg, int(row[ControlBlock.WARN_NBYTES]))
        row[ControlBlock.WARN_NBYTES] = 0
        for message, category, filename, lineno in caught:
            warnings.warn_explicit(message, category, filename, lineno,
                                   registry=self._warning_registry)

    def _wait_done(self, ranks, what, deadline=None, spin=None):
        """Wait until every rank in ``ranks`` posted ``done``, watching for death and stalls."""
        spin = self.spin if spin is None else spin
        check = self._watch(ranks, what, deadline or time.time() + self.stall_timeout)
        try:
            for _ in ranks:
                self.ctl.done.wait(check, spin=spin)
        except KeyboardInterrupt:
            self._abort()
            raise

    def _watch(self, ranks, what, deadline):
        """A check that raises (after shutting the runtime down) if a rank died or ``deadline`` passed.

        ``what`` names the wait in messages: a phrase, or the opcode of a command.
        """
        def check():
            nonlocal what
            if not isinstance(what, str):
                what = f"a {Op.name(what)} command"
            dead = {r: self.procs[r].poll() for r in ranks if self.procs[r].poll() is not None}
            if dead:
                rank, code = next(iter(dead.items()))
                self._abort()
                raise WorkerError(rank, "died", _describe_exit(code),
                                  f"worker process ended during {what}; the runtime was shut down, "
                                  f"call synk.fork() to start again")
            if time.time() > deadline:
                arrived = [r for r in ranks if self.ctl.status[r, ControlBlock.STATE] != Status.IDLE]
                missing = [r for r in ranks if r not in arrived]
                self._abort()
                raise StallError(what, arrived=sorted(arrived + [self.master_rank]), missing=missing,
                                 timeout=self.stall_timeout)
        return check

    def inject_collective_fault(self, rank, during="prepare"):
        """Testing hook: make worker ``rank`` fail in the next collective.

        ``during="prepare"``: it raises while preparing; ``"ring"``: it kills
        itself in the middle of a pipelined shared-memory all-reduce, while its
        peers stream chunks to it (set ``self.comm.paths.fixed`` to
        :data:`synkhronos.comm.paths.PIPELINED` so that a large all-reduce takes that path).
        """
        self.ctl.header[ControlBlock.FAULT] = (rank + 1) * (1 if during == "prepare" else -1)

    def _abort(self):
        """Tear everything down after a fault (dead worker, Ctrl-C)."""
        global _runtime
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        self.stop()
        if _runtime is self:
            _runtime = None

    def read_result_pickle(self, rank):
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        return read_pickle(seg, int(self.ctl.status[rank, ControlBlock.RESULT_NBYTES]))

    def read_result_arrays(self, rank):
        seg = self.results[rank].get(int(self.ctl.status[rank, ControlBlock.RESULT_GEN]))
        return [np.array(a) for a in unpack_arrays(seg.mm)]

    # --- registries -------------------------------------------------------------------------
    def next_function_id(self):
        return len(self.functions)

    def register_function(self, f):
        self.functions.append(f)
        for var in f.spec.shared_variables():
            self.uid_of(var)

    def uid_of(self, var):
        """The stable id under which every process knows shared variable ``var``."""
        entry = self._shared_vars.get(id(var))
        if entry is None:
            entry = self._shared_vars[id(var)] = (len(self._shared_vars), var)
            self._shared_by_uid[entry[0]] = var
        return entry[0]

    def shared_by_uid(self, uid):
        return self._shared_by_uid[uid]

    def new_data(self, dtype, ndim, minibatch=False, name=None):
        from .data import Data
        self.check_open()
        d = Data(self, self._next_data_id, dtype, ndim, minibatch=minibatch, name=name)
        self._datas[d.id] = d
        self._next_data_id += 1
        return d

    def scratch_data(self, key, value):
        """A runtime-owned Data holding ``value`` (staging numpy values for the workers)."""
        d = self.staging.get(key)
        if d is None or d.dtype != value.dtype or d.ndim != value.ndim:
            d = self.staging[key] = self.new_data(value.dtype, value.ndim, name=f"scratch:{key}")
        d.set_value(value, oversize=1 if d.alloc_size >= value.size else 1.25)
        return d

    def write_indices(self, batches):
        """Put the explicit indices of ``batches`` where every rank reads them.

        Sets each batch's ``index_offset`` and returns the segment generation.
        """
        total = sum(len(b.indices) for b in batches)
        self.indices.ensure(8 * total, oversize=1.5)
        view = self.indices.segment.array(np.int64, (total,))
        pos = 0
        for b in batches:
            view[pos:pos + len(b.indices)] = b.indices
            b.index_offset = pos
            pos += len(b.indices)
        return self.indices.gen

    def index_view(self, gen, start, n):
        return self.indices.segment.array(np.int64, (n,), offset=8 * start)

    @property
    def comm(self):
        """This process's collective implementation (built on first use)."""
        if self._comm is None:
            from .comm import make_comm
            self._comm = make_comm(self.comm_kind, ctl=self.ctl, prefix=self.prefix,
                                   rank=self.master_rank, n_ranks=self.n_parallel,
                                   master_rank=self.master_rank, check=self.check_during_collective,
                                   spin=self.spin)
        return self._comm

    def send_payload(self, blob):
        """Put pickled bytes where the next command's workers read them."""
        nbytes = write_bytes(self.payload, blob)
        self.ctl.header[ControlBlock.PAYLOAD_GEN] = self.payload.gen
        self.ctl.header[ControlBlock.PAYLOAD_NBYTES] = nbytes

    def send_pickled(self, obj):
        """:meth:`send_payload` for a plain picklable object."""
        self.send_payload(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def announce_data_drop(self, data_ids):
        self.ctl.args[0] = len(data_ids)
        self.ctl.args[1:1 + len(data_ids)] = data_ids
        self.command(Op.DROP_DATA)

    def data_view(self, ref):
        d = self._datas[ref.data_id]
        return d._segment.segment.view(d.dtype, ref.shape)

    # --- shipping functions -----------------------------------------------------------------
    def ensure_shipped(self):
        """Bring the workers up to date before a command: new functions shipped, freed Data dropped.

        Checked on every call: keep it O(1).
        """
        if self.released_data:
            self.drop_released_data()
        if self._n_shipped < len(self.functions):
            self.ship([f for f in self.functions if not f.shipped], sync_values=False)

    def drop_released_data(self):
        """Have the workers let go of the Data the garbage collector freed in the master."""
        ids = []
        while self.released_data and len(ids) < ARGS - 1:
            ids.append(self.released_data.popleft())
        self.announce_data_drop(ids)

    def ship(self, functions, sync_values):
        """Send ``functions`` to every worker, which compiles them.

        With ``sync_values``, every shared variable the workers already hold is
        set to the master's value.
        """
        new_shared, values = {}, {}
        for f in functions:
            for var in f.spec.shared_variables():
                uid = self.uid_of(var)
                if uid not in self._shipped_uids:
                    new_shared[uid] = var
        if sync_values:
            for uid, var in self._shared_vars.values():
                if uid in self._shipped_uids:
                    value = var.get_value(borrow=True)
                    values[uid] = value if randomness.is_generator(var) else np.asarray(value)
        shipped = self._shipped_uids

        def uid_of_shipped(obj):
            entry = self._shared_vars.get(id(obj))
            return entry[0] if entry is not None and entry[0] in shipped and entry[1] is obj else None

        payload = dict(functions=[f.spec for f in functions], shared=new_shared, values=values,
                       float_x=self.float_x())
        graph_vars = [v for f in functions for v in f.spec.graph_vars()]
        try:
            blob = shipping.dumps(payload, graph_vars, uid_of_shipped)
        except Exception as e:
            # what cannot travel now never will: unregister it, so other functions still ship
            self.functions = [f for f in self.functions if f not in functions]
            self._n_shipped = sum(f.shipped for f in self.functions)
            names = ", ".join(f.name for f in functions)
            raise TypeError(f"{names} cannot be sent to the workers ({type(e).__name__}: {e}); "
                            f"they were unregistered, other functions still work") from e
        self.send_payload(blob)
        self.command(Op.SHIP)
        self._shipped_uids.update(new_shared)
        for f in functions:
            f.shipped = True
        self._n_shipped = sum(f.shipped for f in self.functions)

    # --- calls ------------------------------------------------------------------------------
    def _publish_plan(self, words):
        """Name the call's plan (a tuple of ints) by an id; write its words only the first time.

        Training calls the same function on the same data layout over and over:
        workers keep the decoded plans of the last ``PLAN_CACHE`` ids, so a
        repeated plan costs them one header read instead of a decode.
        """
        key = words
        plan_id = self._plan_ids.get(key)
        if plan_id is None:
            Words(self.ctl.args).put(*words)
            if len(self._plan_ids) >= PLAN_CACHE:
                self._plan_ids.clear()
            self._next_plan_id += 1
            plan_id = self._plan_ids[key] = self._next_plan_id
        self.ctl.header[ControlBlock.PLAN_ID] = plan_id

    def run_call(self, f, plan):
        """Run ``plan`` of function ``f`` everywhere.

        Returns
        -------
        rows : list of int
            Rows each rank computed (0: it computed nothing and returned nothing).
        columns : list
            Per selected output, its value on every rank: a 1-D array over ranks
            when the call's results travel as records (scalars, see
            :func:`.function.result_record`), else a list by rank (None for a
            rank without rows).
        """
        index_arrays = plan.index_arrays()
        if index_arrays:
            plan.index_gen = self.write_indices(index_arrays)
        self._publish_plan(plan.encode())
        record = f.result_record(plan)
        fields = self.ctl.record_fields(record) if record is not None else None
        master = self.master_rank

        def local():
            rows, outs = f.run_share(plan, master, self.n_parallel, self.data_view)
            self.ctl.rows[master] = rows
            if fields is None:
                return [np.asarray(o) for o in outs] if rows else None
            if rows:
                self.ctl.put_record(record, master, outs)

        outs = self.command(Op.CALL, local=local)
        if not plan.subset:            # a call selecting no outputs (only updates) returns nothing
            return None, []
        rows = self.ctl.rows.tolist()
        if fields is not None:
            return rows, list(fields)
        per_rank = [outs if rank == master else
                    self.read_result_arrays(rank) if rows[rank] else None
                    for rank in range(self.n_parallel)]
        return rows, [[None if values is None else values[j] for values in per_rank]
                      for j in range(len(plan.subset))]


@serialized
def fork(n_parallel=None, master_rank=0, platform=None, profile_workers=False,
         threads_per_device=None, timeout=60, spin_us=None, stall_timeout=600, collectives=None,
         **options):
    """Start one process per device; the calling process becomes rank ``master_rank``.

    Parameters
    ----------
    n_parallel : int, optional
        Number of devices (processes). Default: every GPU, or on a machine
        without accelerators one CPU device per available core.
    master_rank : int
        The rank of the calling process.
    platform : {"cpu", "gpu", None}
        JAX platform; default: GPU if a JAX GPU plugin finds one, else CPU.
    profile_workers : bool
        Run every worker under cProfile, writing ``synk_profile_rank{r}.prof``.
    threads_per_device : int, optional
        CPU threads each process may use (XLA and BLAS pools); default
        ``cores // n_parallel``, at least 1.
    timeout : float
        Seconds allowed for the JAX runtime to connect all processes.
    stall_timeout : float
        Seconds the master waits for every rank to finish a command or reach a
        collective before it raises :class:`StallError` (naming the ranks that
        arrived and those that did not) and shuts the runtime down. Set it above
        your longest single call.
    collectives : {"shm", "jax", None}
        How collectives on shared variables travel: ``"jax"`` through the JAX
        runtime (Gloo on CPU, NCCL on GPU), ``"shm"`` through shared memory (CPU
        only, near memory bandwidth). Default: ``"shm"`` on CPU, else ``"jax"``.
    spin_us : float, optional
        Microseconds a waiting process polls before it sleeps. Polling keeps the
        per-call latency low (a sleeping process takes tens of µs to wake); it
        costs CPU only while idle between calls. Default 2000 when every process
        has a core of its own, else 0.

    Returns
    -------
    int
        The number of devices in use.

    Examples
    --------
    >>> import synkhronos as synk
    >>> n = synk.fork(2)            # doctest: +SKIP
    """
    global _runtime
    platform = _old_fork_options(options, platform)
    if options:
        raise TypeError(f"fork() got unknown options {sorted(options)}")
    if _forked_from is not None:
        raise RuntimeError(f"fork() cannot run in a process made by os.fork() from synkhronos's "
                           f"master (pid {_forked_from}): it inherited the master's JAX runtime "
                           f"without its threads; start such processes with multiprocessing's "
                           f"'spawn' start method instead")
    if _runtime is not None:
        raise RuntimeError("fork() was already called; call synk.close() before forking again")
    if devices.backend_exists():
        raise RuntimeError("a JAX backend (device context) already exists in this process, so it "
                           "cannot join the multi-process runtime; call synk.fork() before anything "
                           "runs a JAX computation or compiles a JAX-mode PyTensor function")
    platform = platform or devices.default_platform()
    if n_parallel is None:
        n_parallel = devices.count_devices(platform)
    n_parallel = int(n_parallel)
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be >= 1, got {n_parallel}")
    if not 0 <= master_rank < n_parallel:
        raise ValueError(f"master_rank must be in [0, {n_parallel}), got {master_rank}")
    if not stall_timeout or stall_timeout <= 0:
        raise ValueError(f"stall_timeout must be a positive number of seconds, got {stall_timeout!r}")
    from .comm import KINDS, default_kind
    collectives = collectives or default_kind(platform)
    if collectives not in KINDS or (collectives == "shm" and platform != "cpu"):
        raise ValueError(f"collectives must be one of {list(KINDS)} ('shm' only on CPU), "
                         f"got {collectives!r}")
    cores = devices.count_devices("cpu")
    threads = threads_per_device or max(1, cores // n_parallel)
    if spin_us is None:
        spin_us = 2000 if n_parallel <= cores else 0
    # everything is validated: only now touch this process's environment
    _user_environment.update({k: os.environ.get(k) for k in devices.ENV_VARS
                              if k not in _user_environment})
    devices.configure_environment(os.environ, platform, threads)
    rt = Runtime(n_parallel, master_rank, platform, threads, timeout, profile_workers,
                 spin=float(spin_us) * 1e-6, stall_timeout=float(stall_timeout),
                 collectives=collectives)
    _runtime = rt
    try:
        rt.start()
    except BaseException:
        rt._abort()
        _runtime = None
        _restore_environment()
        raise
    # atexit runs handlers last-in first-out: registering now (after JAX registered its own
    # clean-up, which shuts the distributed runtime down) stops our workers before JAX's
    # shutdown barrier waits for them.
    atexit.unregister(close)
    atexit.register(close)
    return n_parallel


@serialized
def _old_fork_options(options, platform):
    """Take the original's ``fork()`` options out of ``options``; return the platform they ask for.

    ``use_gpu`` still means something (the platform); ``max_n_var`` and
    ``max_dim`` sized the original's fixed shared-memory arrays and are refused.
    """
    if "use_gpu" in options:
        use_gpu = options.pop("use_gpu")
        new = "gpu" if use_gpu else "cpu"
        warnings.warn(f"fork(use_gpu={use_gpu!r}) is fork(platform={new!r}) now", DeprecationWarning,
                      stacklevel=3)
        platform = platform or new
    for name in ("max_n_var", "max_dim"):
        if name in options:
            raise TypeError(f"fork() no longer takes {name}=: it sized the original's fixed "
                            f"shared-memory arrays, and synkhronos sizes its control block itself; "
                            f"remove it")
    return platform


@serialized
def distribute():
    """Ship every function to the workers and make their shared values equal the master's."""
    rt = current()
    rt.ship([f for f in rt.functions if not f.shipped], sync_values=True)


def close():
    """Stop and join the workers and free every shared-memory segment (idempotent).

    A command that another thread is running is let finish first (for up to
    ``CLOSE_WAIT`` seconds; after that the workers are stopped anyway and that
    command raises).
    """
    global _runtime, _closed_once
    locked = _lock.acquire(timeout=CLOSE_WAIT)
    try:
        rt, _runtime = _runtime, None
        if rt is not None:
            _closed_once = True
            rt.stop()
            _restore_environment()
    finally:
        if locked:
            _lock.release()


def _restore_environment():
    for key, value in _user_environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _user_environment.clear()


def get_n_devices(platform=None):
    """Number of devices ``fork()`` would use, counted without creating a context here."""
    return devices.count_devices(platform)


def get_n_gpu():
    """Number of GPUs, counted without creating a context here."""
    return devices.count_devices("gpu") if devices._has_gpu_plugin() else 0

