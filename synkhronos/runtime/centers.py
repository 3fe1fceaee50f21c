"""Node 0's master's handle on the process that serves its loops' centers to the other nodes.

The process is :mod:`synkhronos.rank.center_server` (``python -m
synkhronos.rank.center_server HOST``); this side starts it with the first
asynchronous loop of a runtime that spans nodes, opens and closes each loop's
center on it, and stops it with the runtime.
"""

import pickle
import subprocess
import sys

import numpy as np

from ..rank.center_server import SCHEME, RemoteCenter
from .processes import package_env, reap

__all__ = ["CenterServer"]


class CenterServer:
    """The server process of this runtime's centers, bound to ``host``.

    Parameters
    ----------
    host : str
        The address the server binds (the one the other nodes reach node 0
        at); the port is the system's choice.

    Raises
    ------
    OSError
        The server could not start or bind ``host``.
    """

    def __init__(self, host):
        self.proc = subprocess.Popen([sys.executable, "-m", "synkhronos.rank.center_server", host],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=package_env(), text=True)
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            self.stop()
            raise OSError(f"the center's server could not bind {host} (exit code "
                          f"{self.proc.returncode})")
        port, token = line
        #: ``tcp://host:port#token``: what a center's address starts with
        self.endpoint = f"{SCHEME}{host}:{port}#{token}"

    def serve(self, name, shapes, dtypes, rule):
        """Serve the center in segment ``name`` (blocks ``shapes``, ``dtypes``) under ``rule``'s
        merge; returns its address for the other nodes' devices."""
        address = f"{self.endpoint}#{name}"
        self._ask(address, b"open", [pickle.dumps(([tuple(s) for s in shapes],
                                                   [np.dtype(d).str for d in dtypes], rule))])
        return address

    def forget(self, name):
        """Stop serving the center in segment ``name`` (every node is done with its loop)."""
        self._ask(f"{self.endpoint}#{name}", b"close")

    @staticmethod
    def _ask(address, op, frames=()):
        control = RemoteCenter(address, [], [])
        try:
            control.request(op, frames)
        finally:
            control.close()

    def stop(self):
        """End the server process (it ends when its standard input closes)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        reap([self.proc])

    @property
    def pid(self):
        return self.proc.pid
