"""The central parameters across nodes: a process on node 0 serves the loops' centers over
ZeroMQ, and the devices of the other nodes exchange with them at their own pace.

An asynchronous rule's center lives in node 0's shared memory, as on one node
(:class:`~synkhronos.rank.center.Center`), and node 0's devices use it there.
For the other nodes, node 0's master starts one server process per runtime
(:func:`_serve`, run as ``python -m synkhronos.rank.center_server HOST``;
:class:`synkhronos.runtime.centers.CenterServer` is the master's handle on it):
its own process, so that serving never waits for the master's own training to
let go of Python's lock. It binds one ZeroMQ
``ROUTER`` socket to the host the other nodes reach node 0 at, attaches to
each loop's center, and applies every request under the same mutexes node 0's
devices take: an exchange is atomic per block whichever node it comes from,
and no device waits for another, only for its own round trip. Every device of
another node holds a :class:`RemoteCenter` with a Center's three operations:
``claim`` (the next unit of work from the counter every device of every node
shares), ``exchange`` (a push merged into the center by the rule, and what
the device takes back) and ``values``.

Wire format (ZeroMQ multipart messages): a request is ``[token, op, center,
*args]`` with ``op`` one of ``claim`` (one int64: the limit), ``exchange`` (one
raw array per block, in block order), ``values``, and from the master
``open`` (the pickled layout and rule) and ``close``; the reply is arrays (or
one int64, -1 for "no more work"). ``token`` is a random secret the server
hands its master, and the master the other nodes through JAX's coordination
service: a request without it is dropped, so a process that merely reaches
the port cannot read or change a center. The server process ends when its
master closes its standard input, or dies.
"""

import pickle
import secrets
import sys
import threading
import time

import numpy as np
import zmq

from .center import Center

__all__ = ["RemoteCenter", "attach_center", "SCHEME"]

#: how a center's address starts when it is a server's, not a shared-memory segment's name
SCHEME = "tcp://"
#: seconds between a waiting side's checks (its own runtime, the other nodes)
_SLICE_S = 0.1
#: the first frame of a reply that reports the server's error
_ERROR = b"!error"


def _frames_to_arrays(frames, shapes, dtypes):
    return [np.frombuffer(f.buffer if hasattr(f, "buffer") else f, dtype=d).reshape(s)
            for f, s, d in zip(frames, shapes, dtypes)]


def _split(address):
    """``tcp://host:port#token#center`` -> (endpoint, token, center name)."""
    endpoint, token, name = address.split("#", 2)
    return endpoint, token.encode(), name.encode()


def _serve(host):
    """The server process: serve centers until the master closes standard input or dies.

    Its first line of output is ``PORT TOKEN``."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port(f"tcp://{host}")
    token = secrets.token_hex(16).encode()
    print(port, token.decode(), flush=True)
    lifeline = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), lifeline.set()), daemon=True).start()
    socket.setsockopt(zmq.RCVTIMEO, int(_SLICE_S * 1000))    # a receive that waits, sliced
    centers = {}
    try:
        while not lifeline.is_set():
            try:
                sender, given, op, name, *args = socket.recv_multipart(copy=False)
            except zmq.Again:
                continue
            if given.bytes != token:
                continue
            try:
                reply = _answer(centers, op.bytes, name.bytes.decode(), args)
            except Exception as e:      # noqa: BLE001 - the asking device raises it
                reply = [_ERROR, f"{type(e).__name__}: {e}".encode()]
            socket.send_multipart([sender] + reply, copy=False)
    finally:
        for center in centers.values():
            center.close()
        socket.close()


def _answer(centers, op, name, args):
    """The reply to one request ``op`` about the center in segment ``name``."""
    if op == b"open":
        shapes, dtypes, rule = pickle.loads(args[0].bytes)
        centers[name] = Center(name, shapes, dtypes, merge=rule.merge)
        return [b"ok"]
    if op == b"close":
        centers.pop(name).close()
        return [b"ok"]
    center = centers[name]
    if op == b"claim":
        unit = center.claim(int(np.frombuffer(args[0].buffer, np.int64)[0]))
        return [np.int64(-1 if unit is None else unit).tobytes()]
    if op == b"exchange":
        return center.exchange(_frames_to_arrays(args, [b.shape for b in center.blocks],
                                                 [b.dtype for b in center.blocks]))
    return center.values()


class RemoteCenter:
    """A device's handle on node 0's center, from another node: a :class:`Center`'s operations.

    Parameters
    ----------
    address : str
        The center's address, ``tcp://host:port#token#center`` (from
        :meth:`synkhronos.runtime.centers.CenterServer.serve`).
    shapes, dtypes : sequence
        One per parameter block.
    check : callable
        Called between slices of a wait for the server (raises to abandon it).
    on_silence : callable
        Called with the seconds waited when the server has not answered for
        ``silence`` seconds (raises to give up; else the wait goes on).
    silence : float
    """

    def __init__(self, address, shapes, dtypes, check=lambda: None, on_silence=lambda s: None,
                 silence=5.0):
        endpoint, self._token, self.name = _split(address)
        self.shapes, self.dtypes = [tuple(s) for s in shapes], [np.dtype(d) for d in dtypes]
        self.check, self.on_silence, self.silence = check, on_silence, silence
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, int(_SLICE_S * 1000))    # a receive that waits, sliced
        self._socket.connect(endpoint)

    @classmethod
    def of(cls, address, params, **kwargs):
        """The remote center of the shared variables ``params`` (their values give the shapes)."""
        from ..platform.internals import stored
        values = [np.asarray(stored(p)) for p in params]
        return cls(address, [v.shape for v in values], [p.type.dtype for p in params], **kwargs)

    def request(self, op, frames=()):
        """Send request ``op`` about this center; return the reply's frames."""
        self._socket.send_multipart([self._token, op, self.name, *frames], copy=False)
        start = time.monotonic()
        while True:
            try:
                reply = self._socket.recv_multipart(copy=False)
                break
            except zmq.Again:
                pass
            self.check()
            waited = time.monotonic() - start
            if waited > self.silence:
                self.on_silence(waited)
        if reply and reply[0].bytes == _ERROR:
            raise RuntimeError(f"node 0's center server: {reply[1].bytes.decode()}")
        return reply

    def claim(self, limit):
        """The next unit of work below ``limit`` (every device of every node shares the counter)."""
        reply, = self.request(b"claim", [np.int64(limit).tobytes()])
        unit = int(np.frombuffer(reply.buffer, np.int64)[0])
        return None if unit < 0 else unit

    def exchange(self, pushes, take=np.array):
        """One device's exchange with the center: ``take`` of what the rule's merge answers, per block."""
        pushes = [np.ascontiguousarray(p, dtype=d) for p, d in zip(pushes, self.dtypes)]
        replies = _frames_to_arrays(self.request(b"exchange", pushes), self.shapes, self.dtypes)
        return [take(r) for r in replies]

    def values(self):
        """A copy of every block of the center."""
        return [np.array(v) for v in
                _frames_to_arrays(self.request(b"values"), self.shapes, self.dtypes)]

    def close(self):
        self._socket.close()


def attach_center(where, params, merge, check=lambda: None, on_silence=lambda s: None):
    """A device's handle on a loop's center at ``where``: its shared-memory segment on node 0, or
    node 0's server from another node."""
    if where.startswith(SCHEME):
        return RemoteCenter.of(where, params, check=check, on_silence=on_silence)
    return Center.of(where, params, create=False, merge=merge, check=check)


if __name__ == "__main__":
    _serve(sys.argv[1])
