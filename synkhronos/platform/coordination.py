"""JAX's coordination service in a process of its own, for runtimes that span several nodes.

JAX serves the coordination service from the process of rank 0, and a
client that loses it ends its process (``LOG(FATAL)``, no Python exception,
no clean-up). On several nodes, rank 0 is node 0's master: had it served the
service, its death would end every process of every other node that way.
Served from a process of its own instead, the service outlives node 0's
master, so the other nodes see node 0 stop beating, name it and shut down
cleanly, like the death of any other node.

The service process lives until its parent (node 0's master) says stop, and
for :data:`GRACE` seconds after its parent died (the other nodes' time to
notice and leave). If node 0's machine itself goes down,
the service goes with it, and JAX ends the other nodes' processes.

Run as ``python .../synkhronos/platform/coordination.py ADDRESS N HEARTBEAT`` (by path: the
service process imports JAX's library and the adapter beside this file, :mod:`.internals`, not
the package).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from typing import IO

if __package__:
    from .internals import coordination_service
    from .native_output import RECOVERABLE_TASKS, native_lines_dropped
else:   # the service process, run by path: its directory is on sys.path, the package is not imported
    from internals import coordination_service  # type: ignore[no-redef]
    from native_output import RECOVERABLE_TASKS, native_lines_dropped  # type: ignore[no-redef]

__all__ = ["ServiceProcess", "GRACE", "wait_until_served", "pipes"]

#: seconds the service stays after its parent died: the other nodes notice a lost node within
#: NODE_HEARTBEAT_TIMEOUT seconds and then leave the runtime
GRACE = 10.0
_READY, _STOP = "ready", "stop"


class ServiceProcess:
    """The coordination service for ``n_processes`` processes, listening on ``address`` only.

    Parameters
    ----------
    address : str
        ``host:port`` to bind (the coordinator address every process is given).
    n_processes : int
    heartbeat_timeout : int
        Seconds without a heartbeat after which the service counts a process as dead.
    env : dict
        The environment of the service process (JAX's platform and log level).
    """

    def __init__(self, address: str, n_processes: int, heartbeat_timeout: float, env: dict[str, str]) -> None:
        # (a session of its own: the terminal's Ctrl-C, sent to the script's process group, must not
        # end the service before every process left it, which JAX answers by aborting them)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, address, str(n_processes), str(int(heartbeat_timeout))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
        self._stdin, self._stdout = pipes(self.proc)
        line = self._stdout.readline().strip()
        if line != _READY:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the coordination service could not start on {address} "
                               f"(exit code {self.proc.returncode}): is the port in use? Give every "
                               f"node a free port of node 0 (--coordinator HOST:PORT)")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, at_once: bool = True) -> None:
        """End the service: ``at_once`` when every process has left the runtime, else (after a
        fault, other nodes may still be leaving) :data:`GRACE` seconds from now."""
        try:
            if at_once:
                self._stdin.write(_STOP + "\n")
            self._stdin.close()
        except OSError:     # it ended already
            pass
        self._stdout.close()
        if not at_once:
            return
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_until_served(address: str, within: float) -> bool:
    """Return once something accepts connections at ``address`` (``host:port``), or after
    ``within`` seconds; True if it did.

    A process that joins before the service listens is refused, and JAX's client
    (gRPC) tries again only after its reconnect backoff, a second later; the
    processes started beside the one that serves it nearly always come first.
    Polling the port costs milliseconds.

    Examples
    --------
    >>> with socket.create_server(("127.0.0.1", 0)) as server:
    ...     wait_until_served(f"127.0.0.1:{server.getsockname()[1]}", within=1)
    True
    """
    try:
        host, port = address.rsplit(":", 1)
        target = (host.strip("[]"), int(port))
    except ValueError:      # not host:port: JAX's client names what is wrong with it
        return True
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection(target, timeout=1):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _serve(address: str, n_processes: int, heartbeat_timeout: int) -> None:
    """Serve until the parent says stop (then at once) or dies (then after :data:`GRACE` s).

    The service's notice that its tasks are recoverable (which synkhronos asks
    for) is dropped; anything else it prints reaches the terminal as it ends.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # its parent says when (see ServiceProcess)
    with native_lines_dropped(2, RECOVERABLE_TASKS):
        service = coordination_service(address, n_processes, heartbeat_timeout)
        print(_READY, flush=True)
        said = sys.stdin.read()                 # returns when the parent closes the pipe or dies
        if _STOP not in said:
            time.sleep(GRACE)
        service.shutdown()


def pipes(proc: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
    """The standard input and output of ``proc``, started with both as pipes."""
    assert proc.stdin is not None and proc.stdout is not None, "started with stdin and stdout piped"
    return proc.stdin, proc.stdout


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
