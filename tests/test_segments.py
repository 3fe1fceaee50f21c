"""Shared memory that belongs to someone else is never removed: the sweep of ``fork()`` and
``python -m synkhronos.cleanup`` decides that a run is over by the lock its master holds, not by the
pid in the segments' names, and skips whatever in /dev/shm is not this user's segment.
"""

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import N_PARALLEL, synk_segments
from helpers import source_env

import synkhronos as synk
from synkhronos.runtime import session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM = "/dev/shm"
#: every run's fork() sweeps the segments of ended runs: these tests own /dev/shm while they run
pytestmark = pytest.mark.serial

#: a run that makes a function and a Data, says it is ready, and uses them only when told to
LIVE_RUN = """
    import os, sys, time
    import numpy as np, pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.runtime import session, state

    ready, go, result, pid = sys.argv[1:5]
    if pid:     # the names a run in another PID namespace gives its segments
        made = state.new_prefix
        state.new_prefix = lambda: made().replace(f"synk_{os.getpid()}_", f"synk_{pid}_", 1)
    synk.fork(2)
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    d = synk.data(np.ones((1000, 100)))
    with open(ready + ".part", "w") as fh:
        fh.write(session.current().prefix)
    os.rename(ready + ".part", ready)
    while not os.path.exists(go):
        time.sleep(0.05)
    first = float(f(d))
    d.set_value(np.ones((3000, 100)))               # grows: a new segment of the same run
    second = float(f(d))
    with open(result, "w") as fh:
        fh.write(f"{first} {second}")
    synk.close()
"""


def _dead_pid():
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _unshare_works():
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _cleanup(*args):
    return subprocess.run([sys.executable, "-m", "synkhronos.cleanup", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _wait_for(path, proc, within=90):
    deadline = time.time() + within
    while not os.path.exists(path) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    if not os.path.exists(path):
        proc.kill()
        raise AssertionError(f"the run did not get ready: {proc.communicate()[1][-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("namespace", ["own PID namespace", "names a dead pid"])
def test_a_live_run_of_another_pid_namespace_keeps_its_segments(tmp_path, namespace):
    """A live run whose segments name a pid that means nothing here (pid 1 of its own PID
    namespace, or a pid that has ended) keeps every segment through ``python -m
    synkhronos.cleanup`` and ``fork()`` in another process, and its next calls work."""
    if namespace == "own PID namespace" and not _unshare_works():
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here")
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent(LIVE_RUN))
    ready, go, result = tmp_path / "ready", tmp_path / "go", tmp_path / "result"
    pid = "" if namespace == "own PID namespace" else str(_dead_pid())
    command = [sys.executable, str(script), str(ready), str(go), str(result), pid]
    if namespace == "own PID namespace":
        command = ["unshare", "--pid", "--fork", "--mount-proc"] + command
    run = subprocess.Popen(command, start_new_session=True, env=source_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, run)
        prefix = ready.read_text()
        assert prefix.startswith(f"synk_{pid or 1}_"), prefix
        live = {name for name in synk_segments() if name.startswith(prefix)}
        assert live
        listed = _cleanup("--dry-run")
        assert listed.returncode == 0, listed.stderr
        assert not live & set(listed.stdout.split()), listed.stdout
        removed = _cleanup()
        assert removed.returncode == 0, removed.stderr
        assert live <= set(synk_segments()), live - set(synk_segments())
        if session.active() is not None:
            synk.close()
        synk.fork(N_PARALLEL)                   # sweeps /dev/shm
        synk.close()
        assert live <= set(synk_segments()), live - set(synk_segments())
        go.write_text("go")
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
        assert result.read_text().split() == ["100000.0", "300000.0"]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        _cleanup()
    assert not [name for name in synk_segments() if name.startswith(prefix)]


def _foreign_entries(prefix, target):
    """Make, named like segments of the dead run ``prefix``, entries that are not this user's
    segments; return {name: what it is}."""
    made = {}
    lock = f"{prefix}_live"                             # where a run's lock would be
    os.mkdir(os.path.join(SHM, lock))
    made[lock] = "a directory"
    os.mkdir(os.path.join(SHM, f"{prefix}_d1g1"))
    made[f"{prefix}_d1g1"] = "a directory"
    os.symlink(target, os.path.join(SHM, f"{prefix}_d2g1"))
    made[f"{prefix}_d2g1"] = "a symbolic link"
    os.mkfifo(os.path.join(SHM, f"{prefix}_d3g1"), 0o600)
    made[f"{prefix}_d3g1"] = "a fifo"
    if os.geteuid() == 0:                               # an unprivileged user's, swept by root
        for name in (lock, f"{prefix}_d1g1"):
            os.chown(os.path.join(SHM, name), 65534, 65534)
        theirs = os.path.join(SHM, f"{prefix}_d4g1")
        with open(theirs, "wb") as fh:
            fh.write(b"x" * 100)
        os.chown(theirs, 65534, 65534)
        made[f"{prefix}_d4g1"] = "another user's"
    return made


def _remove_entries(names):
    for name in names:
        path = os.path.join(SHM, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass


def _our_stale_segment(prefix):
    name = f"{prefix}_d5g1"
    with open(os.path.join(SHM, name), "wb") as fh:
        fh.write(b"\0" * 4096)
    return name


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_entries_named_like_a_dead_runs_segments_that_are_not_ours_are_skipped(tmp_path):
    """A directory, a symbolic link, a fifo and another user's file named like segments of a run
    that has ended stop neither ``python -m synkhronos.cleanup`` nor ``fork()``: each is listed as
    skipped and left where it is (the link not followed); the run's own segment is removed."""
    prefix = f"synk_{_dead_pid()}_0_{secrets.token_hex(8)}"
    target = os.path.join(SHM, f"not-synk-{secrets.token_hex(4)}")     # the link's target
    with open(target, "wb") as fh:
        fh.write(b"keep")
    foreign = _foreign_entries(prefix, target)
    ours = _our_stale_segment(prefix)
    try:
        for args in (["--dry-run"], []):
            done = _cleanup(*args)
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            for name in foreign:
                assert any(name in line and "skipped" in line for line in lines), (name, lines)
            assert ours in lines, lines
            assert all(os.path.lexists(os.path.join(SHM, name)) for name in foreign)
            assert os.path.exists(os.path.join(SHM, ours)) == bool(args)
        ours = _our_stale_segment(prefix)
        if session.active() is not None:
            synk.close()
        synk.fork(N_PARALLEL)                   # sweeps /dev/shm: never fails for what is not ours
        assert not os.path.exists(os.path.join(SHM, ours))
        assert all(os.path.lexists(os.path.join(SHM, name)) for name in foreign)
        with open(target, "rb") as fh:
            assert fh.read() == b"keep"
        assert os.path.islink(os.path.join(SHM, f"{prefix}_d2g1"))
    finally:
        _remove_entries(list(foreign) + [ours, os.path.basename(target)])


#: a run that makes a child by os.fork() that exits, and one that leaves its process group and stays
FORKING_RUN = """
    import os, sys, time
    import numpy as np
    import synkhronos as synk
    from synkhronos.runtime import session

    ready, stays = sys.argv[1:3]
    synk.fork(2)
    d = synk.data(np.ones((1000, 100)))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if os.fork() == 0:
        os.setpgid(0, 0)             # outlives a kill of the run's process group
        with open(stays + ".part", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(stays + ".part", stays)
        time.sleep(600)
        os._exit(0)
    while not os.path.exists(stays):     # ready only once the child has said who it is
        time.sleep(0.01)
    with open(ready + ".part", "w") as fh:
        fh.write(session.current().prefix)
    os.rename(ready + ".part", ready)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_children_made_by_os_fork_neither_end_nor_keep_the_runs_lock(tmp_path):
    """A child of the master made by ``os.fork()`` shares none of the run's lock: its exit leaves
    the run alive, and a child outliving the run killed whole does not keep the run's segments
    from the sweep."""
    script = tmp_path / "forking.py"
    script.write_text(textwrap.dedent(FORKING_RUN))
    ready, stays = tmp_path / "ready", tmp_path / "stays"
    run = subprocess.Popen([sys.executable, str(script), str(ready), str(stays)],
                           start_new_session=True, env=source_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        _wait_for(ready, run)
        child = int(stays.read_text())
        prefix = ready.read_text()
        mine = {name for name in synk_segments() if name.startswith(prefix)}
        assert f"{prefix}_live" in mine
        assert not mine & set(_cleanup("--dry-run").stdout.split())     # alive: a child exited
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        os.kill(child, 0)                                                 # the child lives on
        assert _cleanup().returncode == 0          # (or another process's fork() sweeps first)
        assert not [name for name in synk_segments() if name.startswith(prefix)]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)
        _cleanup()
