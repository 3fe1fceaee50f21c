"""Test helpers: a reference run that leaves the master's state alone, ops that fail or warn,
and the real events fault tests wait for (a process inside a call or a collective)."""

import atexit
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from dataclasses import dataclass

import jax
import numpy as np
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.dispatch import jax_funcify

from synkhronos.comm import ShmComm
from synkhronos.comm.shm.paths import PIPELINED
from synkhronos.extensions.sync import EASGD, AllReduce, Downpour, RateLimited, Rule, RuleState
from synkhronos.seams.loop import RuleLoop


def reference(f, *arrays):
    """``f.as_pytensor(*arrays)`` with the master's shared values restored afterwards."""
    targets = [s for s, _, _ in f.spec.updates]
    saved = [np.array(s.get_value()) for s in targets]
    try:
        return f.as_pytensor(*arrays)
    finally:
        for s, v in zip(targets, saved):
            s.set_value(v)


def close(a, b, rtol=1e-10, atol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _check_rows(values):
    if np.any(np.asarray(values) < 0):
        raise ValueError("RaiseIfNegative saw a negative value")
    return np.asarray(values)


def _warn_rows(values):
    warnings.warn(f"WarnRows saw {len(values)} rows", UserWarning)
    return np.asarray(values)


def _host_identity(name, host_fn, doc):
    """An identity op that runs ``host_fn`` on its input in the host (a JAX callback under JAX)."""
    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = host_fn(inputs[0])

    def grad(self, inputs, output_grads):         # (an identity: a loss may run through it)
        return [output_grads[0]]
    op = type(name, (Op,), {"__props__": (), "__doc__": doc, "__module__": __name__,
                            "make_node": make_node, "perform": perform, "grad": grad})

    @jax_funcify.register(op)
    def _jax(op, **kwargs):
        def call(x):
            return jax.pure_callback(host_fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return call
    return op


def _sleep_a_while(values):
    time.sleep(3.0)
    return np.asarray(values)


def _leave_work_for_the_exit(values):
    """In the process it runs in (once): a line left in an open file's buffer, an atexit handler and
    a non-daemon thread, each writing a file named by the process in $SYNK_TEST_EXIT_DIR."""
    directory, pid = os.environ["SYNK_TEST_EXIT_DIR"], os.getpid()
    if pid not in _LEFT_FOR_THE_EXIT:
        log = open(os.path.join(directory, f"log-{pid}"), "w")       # never closed: left to the exit
        log.write("rows\n")

        def later():
            time.sleep(0.5)
            with open(os.path.join(directory, f"thread-{pid}"), "w") as fh:
                fh.write("done\n")

        def at_exit():
            with open(os.path.join(directory, f"atexit-{pid}"), "w") as fh:
                fh.write("ran\n")
        atexit.register(at_exit)
        threading.Thread(target=later).start()
        _LEFT_FOR_THE_EXIT[pid] = log
    return np.asarray(values)


_LEFT_FOR_THE_EXIT: dict = {}

LeavesWorkForTheExit = _host_identity("LeavesWorkForTheExit", _leave_work_for_the_exit,
                                      "Identity that leaves an open file, an atexit handler and a thread "
                                      "to its process's exit.")
SlowOnHost = _host_identity("SlowOnHost", _sleep_a_while, "Identity that sleeps 3 s on the host.")
RaiseIfNegative = _host_identity("RaiseIfNegative", _check_rows,
                                 "Identity that raises ValueError when its input holds a negative value.")
WarnRows = _host_identity("WarnRows", _warn_rows,
                          "Identity that warns (UserWarning) with the number of rows it sees.")


def check_an_error_keeps_every_variable(n, failing_rank):
    """A call raising while computing on ``failing_rank`` (a host callback) leaves every variable on
    every rank as before it: a 2.9 MB one (its buffer donated where that pays) and a small one; the
    error names the rank; the next call is exact on every rank."""
    import pytensor

    import synkhronos as synk
    w = pytensor.shared(np.arange(360_000.0).reshape(600, 600) / 1e3, name="w_kept")
    m = pytensor.shared(np.zeros(3), name="m_kept")
    x = pt.matrix("x")
    s = RaiseIfNegative()(x).sum()
    f = synk.function([x], (s, "sum"), updates=[(w, w * 0.5 + s), (m, m + x.sum(0))],
                      local_updates=True, name="keeps")
    good = np.ones((2 * n, 3))
    f(good)
    before = [[np.array(v) for v in synk.get_value(r, [w, m])] for r in range(n)]
    bad = good.copy()
    bad[2 * failing_rank + 1, 0] = -1.0           # 2 rows a device: only this rank sees it
    for _ in range(2):                             # and again: nothing was lost the first time
        try:
            f(bad)
        except synk.WorkerError as e:
            assert e.rank == failing_rank and e.how == "raised" and isinstance(e, ValueError), e
            assert "RaiseIfNegative saw a negative value" in str(e)
        else:
            raise AssertionError("the call did not raise")
        np.testing.assert_array_equal(w.get_value(), before[0][0])
        for r in range(n):
            for got, kept in zip(synk.get_value(r, [w, m]), before[r]):
                np.testing.assert_array_equal(got, kept)
    close(f(good), 6.0 * n)
    for r in range(n):
        w_r, m_r = synk.get_value(r, [w, m])
        close(w_r, before[r][0] * 0.5 + 6.0)
        close(m_r, before[r][1] + 2.0)


def source_env(*paths, **variables):
    """This process's environment with the checkout (then ``paths``) first on ``PYTHONPATH``, plus
    ``variables``. What was on the path stays after them: a GPU image's wheels may be there."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, *paths, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **variables)


def run_script(code, timeout=120, env=None, args=()):
    """Run ``code`` (dedented) in a fresh Python with this checkout and these helpers importable.

    For what must happen in a process of its own: a script's exit, os.fork(),
    a small /dev/shm. ``env`` adds variables; a value of None removes one;
    ``args`` become ``sys.argv[1:]``.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environ = {k: v for k, v in source_env(os.path.join(root, "tests"), **(env or {})).items() if v is not None}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=environ)


# ------------------------------------------------------------------------------------------------
# Real events for fault tests: a process says it is inside a call or a collective, then waits there
# ------------------------------------------------------------------------------------------------

def marker_path(directory, pid):
    """The file a process creates when it is inside the call or collective a test watches."""
    return os.path.join(str(directory), f"inside-{pid}")


def _announce_and_hold(directory, hold_pid, seconds=60.0):
    """Create this process's marker in ``directory``; if it is ``hold_pid``, stay here ``seconds``."""
    with open(marker_path(directory, os.getpid()), "w"):
        pass
    if os.getpid() == hold_pid:
        time.sleep(seconds)


def wait_until_dead(pid, timeout=20):
    """Wait until child process ``pid`` has ended (a zombie its parent has not reaped yet)."""
    deadline = time.time() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        if time.time() > deadline:
            raise AssertionError(f"process {pid} is still running")
        time.sleep(0.01)


def wait_for_marker(directory, pid, timeout=60):
    """Wait until process ``pid`` created its marker (it is inside); raise if it never does."""
    deadline = time.time() + timeout
    while not os.path.exists(marker_path(directory, pid)):
        if time.time() > deadline:
            raise AssertionError(f"process {pid} never reported being inside")
        time.sleep(0.01)


class InsideCall(Op):
    """Identity that, when computed, creates the process's marker in ``directory``; the process
    ``hold_pid`` then stays inside the call for ``seconds`` (for a test to act on it there)."""

    __props__ = ("directory", "hold_pid", "seconds")

    def __init__(self, directory, hold_pid, seconds=60.0):
        self.directory, self.hold_pid, self.seconds = str(directory), int(hold_pid), float(seconds)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        _announce_and_hold(self.directory, self.hold_pid, self.seconds)
        outputs[0][0] = inputs[0]


@jax_funcify.register(InsideCall)
def _jax_inside_call(op, **kwargs):
    def host(x):
        _announce_and_hold(op.directory, op.hold_pid, op.seconds)
        return np.asarray(x)

    def call(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return call


class HoldingShmComm(ShmComm):
    """A shared-memory Comm that announces itself inside its collectives and holds one rank there.

    Configured through ``SYNK_TEST_HOLD`` = ``directory:rank:where`` (inherited by the workers):
    ``where="collective"`` holds at the start of every all-reduce, ``"ring"`` at the third chunk
    of a pipelined all-reduce, which then is the path every large all-reduce takes.
    """

    name = "holding-shm"

    def __init__(self, context):
        super().__init__(context)
        directory, rank, self.where = os.environ["SYNK_TEST_HOLD"].split(":")
        self.directory, self.holds = directory, int(rank) == context.rank
        self._chunks = 0
        if self.paths is not None and self.where == "ring":
            self.paths.fixed = PIPELINED

    def _hold(self):
        _announce_and_hold(self.directory, os.getpid() if self.holds else -1)

    def all_reduce(self, values, op):
        if self.where == "collective":
            self._hold()
        return super().all_reduce(values, op)

    def _reduce_into(self, out, own, peer_parts, op):
        self._chunks += 1
        if self.where == "ring" and self._chunks == 3:
            self._hold()
        return super()._reduce_into(out, own, peer_parts, op)


# ------------------------------------------------------------------------------------------------
# Device-driven loops: a straggler
# ------------------------------------------------------------------------------------------------

#: the rank the slowed rules slow down: the master, whose own per-step Python work (and, in a long
#: test session, its large heap's collections) then slows the straggler, not the device that
#: outpaces it
SLOW_RANK = 0


class _SlowOneRank:
    """Mixin for a sync rule: rank ``SLOW_RANK`` sleeps as long as it computed, every step (2x slower).

    The sleep counts as computing, not as syncing.
    """

    def after_update(self, state, loop, rows, batch_rows):
        slept = 0.0
        now = time.perf_counter()
        if loop.rank == SLOW_RANK:
            # as long as the step computed: since this hook last returned (gathering, gradient, update)
            slept = now - getattr(state, "step_start", now)
            time.sleep(slept)
        synced = super().after_update(state, loop, rows, batch_rows)
        if synced:
            loop.sync_seconds -= slept       # the loop times a sync from before this hook
        state.step_start = time.perf_counter()
        return synced


class SlowAllReduce(_SlowOneRank, AllReduce):
    pass


class SlowDownpour(_SlowOneRank, Downpour):
    pass


class SlowEASGD(_SlowOneRank, EASGD):
    pass


class SlowRateLimited(_SlowOneRank, RateLimited):
    pass


class _AnnounceAtStart:
    """Mixin for a sync rule: every rank creates its marker (:func:`marker_path`) in ``directory``
    as its loop starts."""

    def start(self, loop):
        state = super().start(loop)
        _announce_and_hold(self.directory, -1)
        return state


@dataclass(frozen=True)
class AnnouncingAllReduce(_AnnounceAtStart, AllReduce):
    directory: str = ""


@dataclass(frozen=True)
class AnnouncingDownpour(_AnnounceAtStart, Downpour):
    directory: str = ""


class _FailOnRank1:
    """Mixin for a sync rule: rank 1 raises ``ValueError`` after its third step."""

    def after_update(self, state, loop, rows, batch_rows):
        state.seen = getattr(state, "seen", 0) + 1
        if loop.rank == 1 and state.seen == 3:
            raise ValueError("rank 1 gives up at its third step")
        return super().after_update(state, loop, rows, batch_rows)


class FailingAllReduce(_FailOnRank1, AllReduce):
    pass


class FailingDownpour(_FailOnRank1, Downpour):
    pass


# ------------------------------------------------------------------------------------------------
# The demo's digits model
# ------------------------------------------------------------------------------------------------

def digits_step(spec, rule, learning_rate):
    """The demo's digits data and model ``spec`` with a master-driven step, on a running runtime:
    ``(data, step, params, (x, y, loss, accuracy))``."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from demos.mnist import build_model, load_data
    from synkhronos.extensions import train
    data = load_data()
    make_graph, params, _ = build_model(spec, data["side"])
    x, y, loss, accuracy = make_graph()
    step = train.make_train_function(loss, params, x, y, rule, learning_rate=learning_rate)
    return data, step, params, (x, y, loss, accuracy)


# --- extension points written only against their contracts (synkhronos.seams.loop) ---------------

@dataclass
class _ToyRows(RuleState):
    mine: int = 0
    all: int = 0


@dataclass(frozen=True)
class ToyAverage(Rule):
    """A sync rule that uses nothing of the loop but :class:`~synkhronos.seams.loop.RuleLoop`:
    every ``every`` steps, the parameters averaged, each device weighted by its rows since the last."""

    every: int = 1

    def start(self, loop: RuleLoop) -> _ToyRows:
        return _ToyRows()

    def after_update(self, state: _ToyRows, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps, state.mine, state.all = state.steps + 1, state.mine + rows, state.all + batch_rows
        if state.steps < self.every:
            return False
        self._average(state, loop)
        return True

    def _average(self, state: _ToyRows, loop: RuleLoop) -> None:
        weighted = [v * (state.mine / state.all) for v in loop.param_values()]
        loop.set_values(loop.params, loop.all_reduce(loop.params, weighted, "sum"))
        state.steps = state.mine = state.all = 0

    def finish(self, state: _ToyRows, loop: RuleLoop) -> None:
        if state.steps:
            self._average(state, loop)


class ListCenter:
    """A center client (:class:`~synkhronos.seams.loop.CenterClient`) held in this process: blocks
    merged by a rule's ``merge``, and a counter of units of work."""

    def __init__(self, blocks, merge):
        self.blocks, self.merge, self.claimed = [np.array(b, float) for b in blocks], merge, 0

    def claim(self, limit):
        if self.claimed >= limit:
            return None
        self.claimed += 1
        return self.claimed - 1

    def exchange(self, pushes, take=np.array):
        return [take(self.merge(block, push)) for block, push in zip(self.blocks, pushes)]

    def values(self):
        return [b.copy() for b in self.blocks]

    def close(self):
        self.blocks = []


def _abort(values):
    """End a worker in native code, as a C++ ``std::terminate`` does (SIGABRT); the master goes on."""
    import ctypes
    if "SYNK_WORKER" in os.environ:
        ctypes.CDLL(None).abort()
    return np.asarray(values)


AbortOnHost = _host_identity("AbortOnHost", _abort, "Identity that aborts a worker natively.")


#: the device counts of the module fixtures that run a test on each: 1, 2 and 3 in the full suite; in
#: the fast tier 2, the count of the suite's own runtime (no fork of its own; its tests' batches split
#: unevenly over 2 as well)
DEVICE_COUNTS = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]


def forked(n):
    """A runtime of ``n`` devices (the suite's 2-device one is re-forked by the next fixture)."""
    import synkhronos as synk
    from synkhronos.runtime import session
    if session.active() is not None and session.active().n_parallel != n:
        synk.close()
    if session.active() is None:
        synk.fork(n)
    return session.current()
