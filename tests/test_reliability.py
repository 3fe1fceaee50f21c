"""Faults become prompt, clear errors; nothing is left behind; the machine stays closed.

These tests kill, stop and interrupt real processes.
"""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL, child_pids, synk_segments
from helpers import HoldingShmComm, InsideCall, close, marker_path, run_script, source_env, wait_for_marker

import synkhronos as synk
from synkhronos.extensions import train, updates
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_clean(prefix, worker_pids, within=10.0):
    """No worker alive or zombie, no segment of ``prefix``, within ``within`` seconds."""
    deadline = time.time() + within
    while time.time() < deadline:
        alive = {pid for pid, _ in child_pids()} & set(worker_pids)
        left = [n for n in synk_segments() if n.startswith(prefix)]
        if not alive and not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: processes {alive}, segments {left}")


def heavy_function():
    x = pt.matrix("x")
    w = pt.matrix("w")
    return synk.function([x], ((x @ w @ w.T).sum(), "sum"), bcast_inputs=[w], name="heavy")


def _kill_when_inside(directory, pid):
    """Kill ``pid`` with SIGKILL once it reports being inside (a thread of its own)."""
    def kill():
        wait_for_marker(directory, pid)
        os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _assert_died_promptly(call, prefix, pids, t_max=10):
    t0 = time.time()
    with pytest.raises(synk.WorkerError) as info:
        call()
    assert time.time() - t0 < t_max
    assert info.value.rank == 1 and info.value.how == "died" and "SIGKILL" in str(info.value)
    assert session.active() is None
    assert_clean(prefix, pids)
    named = r"(synk\.\w+|a call of .+?)"          # synk.all_reduce; a call of the function 'f'
    with pytest.raises(RuntimeError, match=rf"shut down by an error in {named} \(WorkerError.*SIGKILL"):
        call()                       # the next call says why the runtime ended


def _usable_again(**fork_options):
    synk.fork(N_PARALLEL, **fork_options)                       # usable again in the same script
    x = pt.vector("x")
    close(synk.function([x], (x.sum(), "sum"))(np.arange(4.0)), 6.0)


@pytest.mark.slow
def test_worker_killed_while_idle_becomes_worker_error(synk2):
    rt = synk2
    prefix, pids = rt.prefix, list(rt.worker_pids.values())
    f = heavy_function()
    synk.distribute()
    os.kill(rt.worker_pids[1], signal.SIGKILL)
    _assert_died_promptly(lambda: f(np.ones((40, 6)), np.ones((6, 6))), prefix, pids)
    _usable_again()


def test_worker_killed_inside_a_call_becomes_worker_error(synk2, tmp_path):
    """The worker reports it is computing its share (a host callback in the graph), then is killed."""
    rt = synk2
    prefix, pids = rt.prefix, list(rt.worker_pids.values())
    victim = rt.worker_pids[1]
    x = pt.matrix("x")
    f = synk.function([x], (InsideCall(tmp_path, victim)(x).sum(), "sum"), name="held")
    synk.distribute()
    killer = _kill_when_inside(tmp_path, victim)
    _assert_died_promptly(lambda: f(np.ones((8, 3))), prefix, pids)
    killer.join()
    assert os.path.exists(marker_path(tmp_path, os.getpid()))   # the master computed its share
    _usable_again()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["collective", "ring"])
def test_worker_killed_inside_a_collective_becomes_worker_error(tmp_path, monkeypatch, where):
    """A rank reports it is inside an all-reduce (``ring``: while its peer streams chunks to it
    through their rings), then is killed: an error, no hang, no leak.

    The collectives are the shared-memory ones, through a subclass that announces itself
    (``fork(collectives=...)`` takes any Comm subclass the workers can import).
    """
    if session.active() is not None:
        synk.close()
    monkeypatch.setenv("SYNK_TEST_HOLD", f"{tmp_path}:1:{where}")
    synk.fork(N_PARALLEL, collectives=HoldingShmComm)
    rt = session.current()
    assert rt.comm_kind == "holding-shm"
    prefix, pids = rt.prefix, list(rt.worker_pids.values())
    size = 3_000_000 if where == "ring" else 10          # 12 MB: large enough for the rings
    v = pytensor.shared(np.ones(size, "float32"), name=f"v_held_{where}")
    synk.function([], [(v.sum(), "sum")])
    synk.distribute()
    killer = _kill_when_inside(tmp_path, rt.worker_pids[1])
    _assert_died_promptly(lambda: synk.all_reduce(v, op="sum"), prefix, pids)
    killer.join()
    monkeypatch.delenv("SYNK_TEST_HOLD")
    _usable_again()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["gradient", "collective"])
def test_worker_killed_inside_a_training_step_becomes_worker_error(tmp_path, monkeypatch, where):
    """A master-driven step is one command (gradient, all-reduce, update): a worker killed while it
    computes its gradient, or inside the step's all-reduce, is an error, no hang, no leak."""
    if session.active() is not None:
        synk.close()
    monkeypatch.setenv("SYNK_TEST_HOLD", f"{tmp_path}:1:{where}")
    synk.fork(N_PARALLEL, collectives=HoldingShmComm)
    rt = session.current()
    prefix, pids = rt.prefix, list(rt.worker_pids.values())
    victim = rt.worker_pids[1]
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.ones(3), name=f"w_step_{where}")
    rows = InsideCall(tmp_path, victim)(x) if where == "gradient" else x
    step = train.make_train_function(pt.mean((rows @ w - y) ** 2), [w], x, y, updates.sgd,
                                     learning_rate=0.1)
    synk.distribute()
    killer = _kill_when_inside(tmp_path, victim)
    _assert_died_promptly(lambda: step(np.ones((8, 3)), np.ones(8)), prefix, pids)
    killer.join()
    monkeypatch.delenv("SYNK_TEST_HOLD")
    _usable_again()


def test_worker_failing_to_prepare_a_collective_keeps_runtime_usable(synk2):
    """Only the worker cannot read the Data (its segment is gone): it fails while preparing, every
    rank skips the collective, and nothing changed anywhere."""
    v = pytensor.shared(np.ones(3), name="v_fault")
    synk.function([], [(v.sum(), "sum")])
    synk.set_value(1, v, np.full(3, 5.0))
    d = synk.data(np.full(3, 7.0))
    os.unlink("/dev/shm/" + d.segment_name())      # the master keeps its mapping; workers cannot map it
    with pytest.raises(synk.WorkerError) as info:
        synk.broadcast(v, d)
    assert info.value.rank == 1 and info.value.how == "raised"
    assert isinstance(info.value, FileNotFoundError)
    assert "Traceback" in info.value.worker_traceback
    close(synk.get_value(0, v), 1.0)                            # nobody changed anything
    close(synk.get_value(1, v), 5.0)
    synk.all_reduce(v, op="sum")
    close(synk.get_value(1, v), 6.0)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["collective", "call"])
def test_stall_names_the_ranks(what):
    if session.active() is not None:
        synk.close()
    synk.fork(N_PARALLEL, stall_timeout=2)
    rt = session.current()
    prefix, pids = rt.prefix, list(rt.worker_pids.values())
    v = pytensor.shared(np.ones(3), name=f"v_stall_{what}")
    x = pt.vector("x")
    f = synk.function([x], [(x.sum() + v.sum(), "sum")])
    f(np.ones(4))
    os.kill(rt.worker_pids[1], signal.SIGSTOP)
    t0 = time.time()
    with pytest.raises(synk.StallError) as info:
        synk.all_reduce(v) if what == "collective" else f(np.ones(4))
    assert 1.5 < time.time() - t0 < 10
    assert info.value.arrived == [0] and info.value.missing == [1]
    assert "ranks [0] arrived, ranks [1] did not" in str(info.value)
    assert_clean(prefix, pids)
    synk.fork(N_PARALLEL)


@pytest.mark.slow
def test_starting_the_workers_is_bounded_by_the_fork_timeout_not_the_stall_timeout():
    """A stall timeout shorter than the workers take to start (they import JAX) leaves fork() and the
    calls after it working (starting is bounded by fork(timeout=...))."""
    if session.active() is not None:
        synk.close()
    synk.fork(N_PARALLEL, stall_timeout=0.5)
    x = pt.vector("x")
    assert float(synk.function([x], (x.sum(), "sum"))(np.ones(4))) == 4.0
    synk.close()
    synk.fork(N_PARALLEL)


def _script(code, marker_dir="."):
    """Start a master script; its calls create markers in ``marker_dir`` (see helpers.InsideCall)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(marker_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=source_env(os.path.join(ROOT, "tests")))


def _read_ready(proc):
    line = proc.stdout.readline()
    prefix, *pids = line.split()
    return prefix, [int(p) for p in pids]


MASTER = """
    import sys, time, numpy as np, pytensor.tensor as pt, synkhronos as synk
    from helpers import InsideCall
    synk.fork(2)
    rt = synk.runtime.session.current()
    x, w = pt.matrix("x"), pt.matrix("w")
    # every process says when it is inside a call (sys.argv[1]: where), and goes on
    f = synk.function([x], ((InsideCall(sys.argv[1], -1)(x) @ w @ w.T).sum(), "sum"),
                      bcast_inputs=[w])
    d = synk.data(np.ones((100, 10)))
    f(np.ones((8, 10)), np.ones((10, 10)))
    print(rt.prefix, *list(rt.worker_pids.values()), flush=True)
    X, W = np.ones((4000, 600)), np.ones((600, 600)) * 1e-3
    while True:
        f(X, W, num_slices=40)
"""


def _pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_workers_and_segments_gone(prefix, pids, within=10):
    """The workers ``pids`` exit and the segments named ``prefix...`` go within ``within`` seconds."""
    deadline = time.time() + within
    while time.time() < deadline and (any(_pid_alive(p) for p in pids)
                                      or any(n.startswith(prefix) for n in synk_segments())):
        time.sleep(0.1)
    assert not any(_pid_alive(p) for p in pids)
    assert not [n for n in synk_segments() if n.startswith(prefix)]


@pytest.mark.slow
def test_master_killed_workers_exit_and_memory_is_freed(tmp_path):
    proc = _script(MASTER, tmp_path)
    prefix, pids = _read_ready(proc)
    proc.kill()
    proc.wait()
    _assert_workers_and_segments_gone(prefix, pids)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["idle", "in a call"])
def test_sigterm_ends_the_script_and_frees_everything(when, tmp_path):
    """JAX's runtime catches SIGTERM for itself; synkhronos gives it back to the script."""
    idle = MASTER.replace("    while True:\n        f(X, W, num_slices=40)", "    time.sleep(60)")
    proc = _script(idle if when == "idle" else MASTER, tmp_path)
    prefix, pids = _read_ready(proc)
    if when == "in a call":
        _wait_inside_a_loop_call(tmp_path, proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == -signal.SIGTERM
    _assert_workers_and_segments_gone(prefix, pids)


def _wait_inside_a_loop_call(directory, pid):
    """Wait until the script's master is inside a call of its loop (past the first, warm-up one)."""
    marker = marker_path(directory, pid)
    if os.path.exists(marker):                   # the warm-up call's marker: start afresh
        os.unlink(marker)
    wait_for_marker(directory, pid)


@pytest.mark.slow
def test_ctrl_c_during_a_long_call(tmp_path):
    proc = _script(MASTER, tmp_path)
    prefix, pids = _read_ready(proc)
    _wait_inside_a_loop_call(tmp_path, proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert "KeyboardInterrupt" in err and proc.returncode != 0
    assert not any(_pid_alive(p) for p in pids)
    assert not [n for n in synk_segments() if n.startswith(prefix)]


# ------------------------------------------------------------------------------------------------
# Security
# ------------------------------------------------------------------------------------------------

def _socket_inodes(pid):
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def test_listens_on_loopback_only_and_segments_are_private(synk2):
    v = pytensor.shared(np.ones(3), name="v_security")
    synk.function([], [(v.sum(), "sum")])
    for kind in ("shm", "jax"):
        synk.all_reduce(v) if kind == synk2.comm_kind else None
    pids = [os.getpid()] + list(synk2.worker_pids.values())
    inodes = set().union(*[_socket_inodes(p) for p in pids])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":          # LISTEN
                listening.append(fields[1].split(":")[0])
    assert listening, "expected the JAX coordination service to listen"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert set(listening) <= loopback, listening
    mine = [n for n in synk_segments() if n.startswith(synk2.prefix)]
    assert mine
    token = synk2.prefix.split("_")[-1]
    assert len(token) == 16 and int(token, 16) >= 0                 # 64 random bits
    for name in mine:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)
        assert mode == 0o600, (name, oct(mode))


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_killed_whole_leaves_segments_that_fork_and_cleanup_remove(tmp_path):
    """kill -9 of the whole process group (master, workers, resource trackers) leaves the run's
    segments, its lock segment (``<prefix>_live``) among them, no longer locked; the cleanup command
    lists them, and the next fork() removes them, never those of a live run, which holds its lock."""
    script = tmp_path / "killed_whole.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, numpy as np, synkhronos as synk
        from synkhronos.runtime import session
        synk.fork(2)
        d = synk.data(np.ones((1000, 100)))
        open(sys.argv[1] + ".part", "w").write(session.current().prefix)
        os.rename(sys.argv[1] + ".part", sys.argv[1])
        time.sleep(600)
    """))
    marker = tmp_path / "ready"

    def segments_of(marker):            # of that run only: other runs may come and go meanwhile
        return {name for name in synk_segments() if name.startswith(marker.read_text() + "_")}

    proc = subprocess.Popen([sys.executable, str(script), str(marker)], start_new_session=True,
                            env=source_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    left = segments_of(marker)
    assert f"{marker.read_text()}_live" in left, "a run killed whole leaves its segments"
    listed = subprocess.run([sys.executable, "-m", "synkhronos.cleanup", "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert set(listed.stdout.split()) >= left and "segment(s) left by runs" in listed.stdout
    assert left <= set(synk_segments())                      # a dry run removes nothing
    other = subprocess.Popen([sys.executable, str(script), str(tmp_path / "other")],   # a live run
                             start_new_session=True, env=source_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (tmp_path / "other").exists() and time.time() < deadline + 60:
            time.sleep(0.1)
        live = segments_of(tmp_path / "other")
        assert live
        if session.active() is not None:
            synk.close()
        synk.fork(N_PARALLEL)                                    # sweeps what the killed run left
        assert not left & set(synk_segments()) and live <= set(synk_segments())
        removed = subprocess.run([sys.executable, "-m", "synkhronos.cleanup"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
        assert "segment(s) removed" in removed.stdout and live <= set(synk_segments())
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
        subprocess.run([sys.executable, "-m", "synkhronos.cleanup"], cwd=ROOT, timeout=60)


CTRL_C_WHILE_BUILDING = """
    import os, random, signal, sys, threading, time
    import numpy as np, pytensor, pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.runtime import session
    random.seed(int(sys.argv[1]))
    synk.fork(2)
    shut, wrong = 0, []
    for trial in range(int(sys.argv[2])):
        if session.active() is None:
            synk.fork(2)
        timer = threading.Timer(random.uniform(0, 0.2), lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            x = pt.matrix("x")
            for k in range(3):
                w = pytensor.shared(np.zeros(2), name=f"w{trial}_{k}")
                g = synk.function([x], (x.sum() * (k + 1), "sum"), updates=[(w, w + x.sum(0))])
                synk.distribute()
                g(np.ones((4, 2)))
            time.sleep(0.25)
        except KeyboardInterrupt as interrupt:
            if session.active() is None:
                shut += 1
                assert "call synk.fork() again" in str(getattr(interrupt, "__notes__", "")), interrupt
                try:
                    synk.function([pt.matrix("x")], pt.matrix("x").sum())
                except RuntimeError as e:
                    assert "Ctrl-C" in str(e) and "synk.fork() again" in str(e), e
                continue
        timer.join()
        if session.active() is None:
            continue
        x = pt.matrix("x")
        f = synk.function([x], (x.sum(), "sum"))
        if float(f(np.ones((4, 2)))) != 8.0:
            wrong.append(trial)
    synk.close()
    print("RESULT", shut, wrong)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_at_any_moment_of_building_shipping_and_calling_leaves_the_runtime_right_or_shut_down():
    """Thirty Ctrl-Cs at random moments while functions are recorded, shipped and called: after
    each, the runtime computes a fresh function right, or it was shut down and says so (on the
    interrupt, and at the next call), and fork() starts again; one landing in an import of JAX's
    waits for the import to end (an interrupted import of JAX's MLIR dialects cannot be done again)."""
    # seed 3 lands one interrupt inside JAX's first import of its MLIR dialects (at distribute)
    out = run_script(CTRL_C_WHILE_BUILDING, timeout=380, args=("3", "30"))
    assert out.returncode == 0, out.stderr[-3000:]
    line = [t for t in out.stdout.splitlines() if t.startswith("RESULT")][-1]
    shut, wrong = line.split(" ", 2)[1:]
    assert wrong == "[]", out.stdout
    assert int(shut) > 0, out.stdout          # some interrupts did land inside synkhronos


CTRL_C_IN_A_GC_CALLBACK = """
    import gc, os, signal, sys, threading, time
    from synkhronos.runtime import interrupts
    interrupts.install()

    def slow(phase, info):           # a collection's callback that takes a while, as JAX's can
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            pass
    gc.callbacks.append(slow)
    for attempt in range(5):
        if attempt == 2:          # a debugger and a profiler hold two monitoring tool ids
            for tool in (3, 4):
                sys.monitoring.use_tool_id(tool, f"other tool {tool}")
        start = time.time()
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            while time.time() - start < 10:
                junk = [[i] for i in range(300)]
                gc.collect(0)
        except KeyboardInterrupt:
            print("DELIVERED", round(time.time() - start, 2), flush=True)
        else:
            print("LOST", flush=True)
    print("TOOLS", [sys.monitoring.get_tool(tool) for tool in range(6)], flush=True)
"""


@pytest.mark.serial
@pytest.mark.slow
def test_a_ctrl_c_landing_in_a_garbage_collection_callback_reaches_the_user():
    """Python swallows an exception raised in a gc callback ("Exception ignored in"); synkhronos's
    SIGINT handler raises it at the next line of the code the collection interrupted, however much
    of the time the callbacks take (here nearly all of it)."""
    out = run_script(CTRL_C_IN_A_GC_CALLBACK, timeout=120)
    lines = [t for t in out.stdout.splitlines() if t.startswith(("DELIVERED", "LOST"))]
    assert len(lines) == 5 and all(t.startswith("DELIVERED") for t in lines), out.stdout + out.stderr[-2000:]
    assert max(float(t.split()[1]) for t in lines) < 2.0, lines      # signalled at 0.2 s
    # the tool id that raised each interrupt was given back at once; the other tools' stay theirs
    assert "TOOLS [None, None, None, 'other tool 3', 'other tool 4', None]" in out.stdout, out.stdout


CTRL_C_IN_A_CALL_AND_IN_CLOSE = """
    import os, signal, sys, threading, time
    import numpy as np, pytensor.tensor as pt
    import synkhronos as synk
    from helpers import SlowOnHost

    def interrupt_in(seconds):
        threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT)).start()

    synk.fork(2)
    x = pt.matrix("x")
    slow = synk.function([x], (SlowOnHost()(x).sum(), "sum"), name="slow")
    interrupt_in(0.5)
    try:
        slow(np.ones((4, 2)))
    except KeyboardInterrupt as e:
        print("NOTE", " ".join(getattr(e, "__notes__", [])))
    try:
        slow(np.ones((4, 2)))
    except RuntimeError as e:
        print("NEXT", e)
    for delay in (0.02, 0.06, 0.1):
        synk.fork(2)
        f = synk.function([x], (x.sum(), "sum"))
        f(np.ones((4, 2)))
        interrupt_in(delay)
        try:
            synk.close()
            time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        synk.close()
    synk.fork(2)
    f = synk.function([x], (x.sum(), "sum"))
    print("AGAIN", float(f(np.ones((4, 2)))))
    synk.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_inside_a_call_is_named_and_ctrl_c_during_close_leaves_fork_working():
    out = run_script(CTRL_C_IN_A_CALL_AND_IN_CLOSE, timeout=220)
    lines = {t.split(" ", 1)[0]: t for t in out.stdout.splitlines() if t.split(" ", 1)[0] in
             ("NOTE", "NEXT", "AGAIN")}
    assert "Ctrl-C inside a call of the function 'slow'" in lines.get("NOTE", ""), out.stdout + out.stderr[-3000:]
    assert "Ctrl-C" in lines.get("NEXT", "") and "synk.fork() again" in lines["NEXT"], lines
    assert lines.get("AGAIN") == "AGAIN 8.0", out.stdout + out.stderr[-3000:]
