"""Node 0's master's handle on the process that serves its loops' centers to the other nodes.

The process is :mod:`synkhronos.runtime.centers.server` (``python -m
synkhronos.runtime.centers HOST``); this side starts it with the first
asynchronous loop of a runtime that spans nodes, opens and closes each loop's
center on it through its standard input, watches it, and stops it with the
runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy.typing as npt

from ...platform.coordination import pipes
from ...platform.threads import start_thread
from ...seams.rule import Rule
from ..processes import describe_exit, package_env, reap
from .server import SCHEME, open_command

__all__ = ["CenterServer"]


class CenterServer:
    """The server process of this runtime's centers, serving them at ``host``.

    Parameters
    ----------
    host : str
        The address the server binds (the one the other nodes reach node 0
        at); each center's port is the system's choice.
    on_death : callable, optional
        Called with a sentence naming the server when it ends without being
        stopped (from a thread of its own).

    Raises
    ------
    OSError
        The server could not start.
    """

    def __init__(self, host: str, on_death: Callable[[str], None] | None = None) -> None:
        self.host, self.on_death = host, on_death
        self.proc = subprocess.Popen([sys.executable, "-m", "synkhronos.runtime.centers", host],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=package_env(), text=True)
        self._stdin, self._stdout = pipes(self.proc)
        self._token = self._stdout.readline().strip()
        if not self._token:
            self.stop()
            raise OSError(f"the center's server for {host} did not start "
                          f"({describe_exit(self.proc.returncode)})")
        self._stopping = False
        self._watcher = start_thread(self._watch, "synk-center-server")

    def serve(self, name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[npt.DTypeLike],
              rule: Rule) -> str:
        """Serve the center in segment ``name`` (blocks ``shapes``, ``dtypes``) under ``rule``'s
        merge; returns its address for the other nodes' devices.

        Raises
        ------
        OSError
            The server could not serve it (its port, or the server is gone).
        """
        reply = self._ask(open_command(name, shapes, dtypes, rule))
        return f"{SCHEME}{self.host}:{reply['port']}#{self._token}#{name}"

    def forget(self, name: str) -> None:
        """Stop serving the center in segment ``name`` (every node is done with its loop)."""
        self._ask(json.dumps({"op": "close", "center": name}))

    def _ask(self, line: str) -> dict[str, Any]:
        """Send one command line; its reply (raises OSError for the server's error or its end)."""
        try:
            self._stdin.write(line + "\n")
            self._stdin.flush()
            answer = self._stdout.readline()
        except OSError as e:
            raise OSError(f"node 0's center server is gone ({e})") from None
        if not answer:
            raise OSError(f"node 0's center server is gone ({describe_exit(self.proc.poll())})")
        reply: dict[str, Any] = json.loads(answer)
        if "error" in reply:
            raise OSError(f"node 0's center server refused: {reply['error']}")
        return reply

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._stopping and self.on_death is not None:
            self.on_death(f"node 0's center server (pid {self.proc.pid}) died "
                          f"({describe_exit(code)})")

    @property
    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.proc.poll() is None

    def stop(self) -> None:
        """End the server process (it ends when its standard input closes)."""
        self._stopping = True
        try:
            self._stdin.close()
        except OSError:
            pass
        reap([self.proc])
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5)

    @property
    def pid(self) -> int:
        return self.proc.pid

