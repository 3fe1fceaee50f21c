"""Starting, describing and reaping the runtime's child processes (the workers above all)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping

from ..wire.worker_settings import WorkerSettings

__all__ = ["free_port", "package_env", "launch_worker", "native_crash_site", "describe_exit", "reap"]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) for a child that runs ``python -m
    synkhronos...``: it finds this checkout first on its path, then this process's."""
    env = dict(os.environ if env is None else env)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in sys.path if p])
    return env


#: a worker's result segments are tracked by its resource tracker (a process of its own, given the
#: worker's -W options), which unlinks them if the worker is killed: as a fault's teardown kills it,
#: after the master unlinked them, the tracker's notices of that are no news to the user
QUIET_RESOURCE_TRACKER = "ignore:resource_tracker:UserWarning:multiprocessing.resource_tracker"


def launch_worker(settings: WorkerSettings, env: dict | None) -> subprocess.Popen:
    """Start ``python -m synkhronos.runtime.worker`` with ``settings`` and ``env``.

    The worker finds this checkout first on its path, then the master's.
    Linux sends the parent-death signal when the *thread* that started the
    child ends, so a worker asks for it only when started from the main thread
    (``die_with_parent``); otherwise it watches the master's pid alone.
    """
    env = package_env(env)
    # where the worker's Python stacks go if it dies in native code (faulthandler): a file
    # already unlinked, so nothing is left behind however either process ends
    fault_log = tempfile.TemporaryFile()
    settings = WorkerSettings(**settings, master_pid=os.getpid(), fault_fd=fault_log.fileno(),
                              die_with_parent=threading.current_thread() is threading.main_thread())
    env["SYNK_WORKER"] = json.dumps(settings)
    proc = subprocess.Popen([sys.executable, "-W", QUIET_RESOURCE_TRACKER, "-m", "synkhronos.runtime.worker"],
                            env=env, stdin=subprocess.DEVNULL, pass_fds=(fault_log.fileno(),))
    proc.fault_log = fault_log  # type: ignore[attr-defined]  # read by native_crash_site
    return proc


def native_crash_site(proc: subprocess.Popen) -> tuple[str, str]:
    r"""(where, stacks): the innermost Python frame of the thread of ``proc`` (a worker) that died in
    native code, and every thread's stack as faulthandler wrote them; ("", "") if it wrote none.

    Examples
    --------
    >>> _innermost_frame("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
    ...                  '  File "/x/jitted.py", line 120 in call\n  File "/x/compiled.py", line 9 in run\n')
    'call (/x/jitted.py, line 120)'
    """
    log = getattr(proc, "fault_log", None)
    if log is None:
        return "", ""
    try:
        log.seek(0)
        stacks = log.read().decode(errors="replace")
    except (OSError, ValueError):
        return "", ""
    return _innermost_frame(stacks), stacks


def _innermost_frame(stacks: str) -> str:
    """``"function (file, line N)"`` of the first frame of faulthandler's current thread, or ""."""
    lines = stacks.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread")]
    for line in lines[starts[-1] + 1:] if starts else []:
        found = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if found:
            return f"{found.group(3)} ({found.group(1)}, line {found.group(2)})"
    return ""


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: ``"killed by SIGKILL"``, ``"exited with code 3"``.

    Examples
    --------
    >>> describe_exit(-9), describe_exit(3), describe_exit(None)
    ('killed by SIGKILL', 'exited with code 3', 'still running')
    """
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def reap(procs: Iterable[subprocess.Popen], within: float = 5.0) -> None:
    """Wait for ``procs`` to end, ``within`` seconds in all; kill those still running."""
    deadline = time.time() + within
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log = getattr(p, "fault_log", None)
        if log is not None:
            log.close()
