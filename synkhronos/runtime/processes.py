"""Starting, describing and reaping the runtime's child processes (the workers above all)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["free_port", "package_env", "launch_worker", "describe_exit", "reap"]


def free_port():
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_env(env=None):
    """``env`` (default: this process's environment) for a child that runs ``python -m
    synkhronos...``: it finds this checkout first on its path, then this process's."""
    env = dict(os.environ if env is None else env)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in sys.path if p])
    return env


def launch_worker(settings, env):
    """Start ``python -m synkhronos.runtime.worker`` with ``settings`` (a JSON-able dict) and ``env``.

    The worker finds this checkout first on its path, then the master's.
    Linux sends the parent-death signal when the *thread* that started the
    child ends, so a worker asks for it only when started from the main thread
    (``die_with_parent``); otherwise it watches the master's pid alone.
    """
    env = package_env(env)
    settings = dict(settings, master_pid=os.getpid(),
                    die_with_parent=threading.current_thread() is threading.main_thread())
    env["SYNK_WORKER"] = json.dumps(settings)
    return subprocess.Popen([sys.executable, "-m", "synkhronos.runtime.worker"], env=env,
                            stdin=subprocess.DEVNULL)


def describe_exit(code):
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


def reap(procs, within=5.0):
    """Wait for ``procs`` to end, ``within`` seconds in all; kill those still running."""
    deadline = time.time() + within
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
