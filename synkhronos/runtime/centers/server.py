"""The central parameters across nodes: a process on node 0 serves the loops' centers over
ZeroMQ, and the devices of the other nodes exchange with them at their own pace.

An asynchronous rule's center lives in node 0's shared memory, as on one node
(:class:`~synkhronos.runtime.centers.shared.Center`), and node 0's devices use it there.
For the other nodes, node 0's master starts one server process per runtime
(:func:`serve`, run as ``python -m synkhronos.runtime.centers HOST``;
:class:`synkhronos.runtime.centers.process.CenterServer` is the master's handle on it):
its own process, so that serving never waits for the master's own training to
let go of Python's lock. The server attaches to each loop's center and serves
it on a ZeroMQ ``ROUTER`` socket of its own, bound to the host the other nodes
reach node 0 at, applying every request under the same mutexes node 0's
devices take: an exchange is atomic per block whichever node it comes from,
and no device waits for another, only for its own round trip. Every device of
another node holds a :class:`RemoteCenter` with a Center's three operations:
``claim`` (the next unit of work from the counter every device of every node
shares), ``exchange`` (a push merged into the center by the rule, and what
the device takes back) and ``values``.

Who may speak to it. The server draws a random token and hands it to its
master, which hands it to the other nodes through JAX's coordination service.
A connection must log in with it (ZeroMQ's PLAIN mechanism, checked by this
process's ZAP handler, :func:`_authenticate`, in constant time), so a process
that merely reaches the port is disconnected during the handshake, before a
byte of a message of its own is buffered. Each request carries the token again.
Each center's socket accepts no frame larger than the largest the center can
need (ZeroMQ's ``MAXMSGSIZE``: the largest block, at least :data:`_FLOOR_BYTES`);
a peer sending one is disconnected before the frame is buffered whole.

Wire format (ZeroMQ multipart messages, no pickles): a request is
``[token, op, *args]`` with ``op`` one of ``claim`` (one int64: the limit),
``exchange`` (one raw array per block, in block order, each exactly the
block's bytes) and ``values`` (nothing); the reply is arrays, or one int64
(-1 for "no more work"), or ``[!error, message]``. A request with another
token is dropped without a reply; a malformed one with the right token gets an
error reply and changes nothing. The master opens and closes centers through
the server's standard input, one JSON line each (the rule travels in it pickled,
:func:`rule_document`: only the master that started the server writes there), and
reads one JSON line back; the server ends
when its standard input closes (its master closed it, or died).
"""

from __future__ import annotations

import base64
import hmac
import json
import math
import os
import pickle
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import cloudpickle
import numpy as np
import numpy.typing as npt
import zmq

from ...seams.rule import Rule
from .shared import Center, Merge

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["RemoteCenter", "attach_center", "SCHEME", "GONE_KEY", "server_gone", "open_command",
           "rule_document"]

#: how a center's address starts when it is a server's, not a shared-memory segment's name
SCHEME = "tcp://"
#: the key of JAX's coordination service under which node 0's master says its center server died
GONE_KEY = "synk/center_server_gone"
#: seconds between a waiting side's checks (its own runtime, the other nodes)
_SLICE_S = 0.1
#: the first frame of a reply that reports the server's error
_ERROR = b"!error"
#: the PLAIN user name of every device (the token is the password)
_USER = b"synk"
#: where ZeroMQ asks this process whether a connection may log in (ZAP, ZeroMQ RFC 27)
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: the least frame bound: ZMTP's handshake commands and a request's small frames fit in it
_FLOOR_BYTES = 1024
#: the kinds of numpy dtype a block may have (numbers)
_NUMBER_KINDS = "biufc"
#: the bytes of a request's longest op (``exchange``)
_OP_BYTES = 8

#: the centers a server serves: each one's socket -> (its segment's name, the Center)
Served = dict[zmq.Socket, tuple[str, Center]]


def _frames_to_arrays(frames: Sequence[zmq.Frame | bytes], shapes: Sequence[tuple[int, ...]],
                      dtypes: Sequence[np.dtype]) -> list[np.ndarray]:
    arrays = []
    for f, s, d in zip(frames, shapes, dtypes):
        data = f.buffer if isinstance(f, zmq.Frame) else f
        if len(data) != math.prod(s) * np.dtype(d).itemsize:
            raise ValueError(f"a block of {len(data)} bytes where shape {tuple(s)} of {np.dtype(d)} "
                             f"takes {math.prod(s) * np.dtype(d).itemsize}")
        arrays.append(np.frombuffer(data, dtype=d).reshape(s))
    return arrays


def _split(address: str) -> tuple[str, bytes, str]:
    """``tcp://host:port#token#center`` -> (endpoint, token, center name)."""
    endpoint, token, name = address.split("#", 2)
    return endpoint, token.encode(), name


# --- the master's side of the format ------------------------------------------------------------
def open_command(name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[npt.DTypeLike],
                 rule: Rule) -> str:
    """The JSON line that asks the server to serve the center in segment ``name``.

    JSON, not a binary layout: a center has any number of blocks of any rank;
    a JSON document says so with a parser that builds only lists, numbers and
    strings, which :func:`_open` then checks field by field. The rule rides in
    it as :func:`rule_document` makes it.
    """
    return json.dumps({"op": "open", "center": name,
                       "blocks": [{"shape": [int(n) for n in s], "dtype": np.dtype(d).str}
                                  for s, d in zip(shapes, dtypes)],
                       "rule": rule_document(rule)})


def rule_document(rule: Rule) -> str:
    """``rule`` as the server rebuilds it to apply its :meth:`~synkhronos.seams.rule.Rule.merge`
    (see :func:`open_command`): the rule pickled by value (cloudpickle), so that a rule of the
    user's own, a class of the script itself included, merges on node 0's server as on node 0.

    The document travels only from node 0's master to the server it started (through the
    server's standard input), never over the network.
    """
    return base64.b64encode(cloudpickle.dumps(rule, protocol=pickle.HIGHEST_PROTOCOL)).decode()


# --- the server process -------------------------------------------------------------------------
def serve(host: str) -> None:
    """The server process: serve centers until standard input closes.

    Its first line of output is the token; then one JSON line answers each
    command line of standard input."""
    context = zmq.Context.instance()
    token = secrets.token_hex(16).encode()
    zap = context.socket(zmq.REP)
    zap.setsockopt(zmq.LINGER, 0)
    zap.bind(_ZAP_ENDPOINT)          # before any socket of a center can meet a peer
    poller = zmq.Poller()
    poller.register(zap, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    served: Served = {}
    commands = _Lines(stdin)
    print(token.decode(), flush=True)
    try:
        while True:
            for ready, _ in poller.poll():
                if ready is zap:
                    _authenticate(zap, token)
                elif ready == stdin:
                    lines = commands.read()
                    if lines is None:
                        return
                    for line in lines:
                        print(json.dumps(_command(line, host, served, poller)), flush=True)
                else:
                    _serve_request(ready, served[ready][1], token)
    finally:
        for socket, (_, center) in served.items():
            socket.close()
            center.close()
        zap.close()


class _Lines:
    """The complete lines arriving on a file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = fd, b""

    def read(self) -> list[bytes] | None:
        """The lines completed by what can be read now; None at the end of the input."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        return lines


def _authenticate(zap: zmq.Socket, token: bytes) -> None:
    """Answer one of ZeroMQ's requests to let a connection in: PLAIN with the token only."""
    request = zap.recv_multipart()
    # version, request id, domain, address, identity, mechanism, user name, password
    allowed = (len(request) == 8 and request[0] == b"1.0" and request[5] == b"PLAIN"
               and hmac.compare_digest(request[7], token))
    request_id = request[1] if len(request) > 1 else b""
    zap.send_multipart([b"1.0", request_id, b"200" if allowed else b"400",
                        b"OK" if allowed else b"denied", b"", b""])


def _command(line: bytes, host: str, served: Served, poller: zmq.Poller) -> dict[str, Any]:
    """The reply to one command of the master: ``open`` or ``close`` a center."""
    try:
        command = json.loads(line)
        if command["op"] == "open":
            return {"port": _open(command, host, served, poller)}
        if command["op"] == "close":
            socket = next(s for s, (name, _) in served.items() if name == command["center"])
            poller.unregister(socket)
            socket.close()
            served.pop(socket)[1].close()
            return {"ok": True}
        raise ValueError(f"unknown command {command['op']!r}")
    except Exception as e:          # noqa: BLE001 - the master raises it
        return {"error": f"{type(e).__name__}: {e}"}


def _open(command: dict[str, Any], host: str, served: Served, poller: zmq.Poller) -> int:
    """Attach to the center ``command`` names and serve it on a socket of its own; its port."""
    shapes: list[tuple[int, ...]] = []
    dtypes: list[np.dtype] = []
    for block in command["blocks"]:
        shape, dtype = block["shape"], np.dtype(block["dtype"])
        if not all(type(n) is int and n >= 0 for n in shape) or dtype.kind not in _NUMBER_KINDS:
            raise ValueError(f"not a block of numbers: {block!r}")
        shapes.append(tuple(shape))
        dtypes.append(dtype)
    center = Center(str(command["center"]), shapes, dtypes, merge=_merge(command["rule"]))
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max([_FLOOR_BYTES] + [b.nbytes for b in center.blocks]))
        socket.plain_server = True
        port = socket.bind_to_random_port(f"tcp://{host}")
    except Exception:
        socket.close()
        center.close()
        raise
    served[socket] = (command["center"], center)
    poller.register(socket, zmq.POLLIN)
    return port


def _merge(document: str) -> Merge:
    """The merge of the rule ``document`` holds (see :func:`rule_document`)."""
    rule = pickle.loads(base64.b64decode(document, validate=True))
    if not isinstance(rule, Rule) or type(rule).merge is Rule.merge:
        raise ValueError(f"not an asynchronous rule with a merge: {rule!r}")
    return rule.merge


def _serve_request(socket: zmq.Socket, center: Center, token: bytes) -> None:
    """Receive one request on a center's socket and answer it, unless it is a stranger's."""
    sender, *frames = socket.recv_multipart(copy=False)
    if not frames or len(frames[0]) != len(token) or \
            not hmac.compare_digest(frames[0].bytes, token):
        return
    reply = _answer(center, frames[1:])
    socket.send_multipart([sender] + reply, copy=False)


def _answer(center: Center, frames: Sequence[zmq.Frame]) -> list[Any]:
    """The reply to one authenticated request ``frames`` (``[op, *args]``) about ``center``."""
    op = frames[0].bytes if frames and len(frames[0]) <= _OP_BYTES else None
    sizes = [len(f) for f in frames[1:]]
    expected = {b"claim": [8], b"exchange": [b.nbytes for b in center.blocks], b"values": []}
    if op not in expected or sizes != expected[op]:
        return [_ERROR, b"malformed request (this node's synkhronos differs from node 0's?)"]
    try:
        if op == b"claim":
            unit = center.claim(int(np.frombuffer(frames[1].buffer, np.int64)[0]))
            return [np.int64(-1 if unit is None else unit).tobytes()]
        if op == b"exchange":
            return center.exchange(_frames_to_arrays(frames[1:], [b.shape for b in center.blocks],
                                                     [b.dtype for b in center.blocks]))
        return center.values()
    except Exception as e:      # noqa: BLE001 - the asking device raises it
        return [_ERROR, f"{type(e).__name__}: {e}".encode()]


# --- the devices of the other nodes -------------------------------------------------------------
def server_gone() -> str | None:
    """What node 0's master said of its center server's death, or None if it said nothing.

    Read from JAX's coordination service (:data:`GONE_KEY`); None too when
    the service cannot be asked (the waits that watch the nodes name that)."""
    try:
        from ...platform.internals import distributed_client
        return distributed_client().key_value_try_get(GONE_KEY)
    except Exception:               # noqa: BLE001 - not set, or no service to ask
        return None


def _raise_gone(why: str) -> NoReturn:
    raise RuntimeError(why)


class RemoteCenter:
    """A device's handle on node 0's center, from another node: a :class:`Center`'s operations.

    Parameters
    ----------
    address : str
        The center's address, ``tcp://host:port#token#center`` (from
        :meth:`synkhronos.runtime.centers.process.CenterServer.serve`).
    shapes, dtypes : sequence
        One per parameter block.
    check : callable
        Called between slices of a wait for the server (raises to abandon it).
    on_silence : callable
        Called with the seconds waited when the server has not answered for
        ``silence`` seconds (raises to give up; else the wait goes on).
    on_gone : callable
        Called with node 0's words when node 0's master said its server died
        (:func:`server_gone`, read between slices of a wait); it must raise.
        By default a ``RuntimeError`` with those words.
    silence : float
    """

    def __init__(self, address: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[npt.DTypeLike],
                 check: Callable[[], None] = lambda: None,
                 on_silence: Callable[[float], None] = lambda s: None,
                 on_gone: Callable[[str], None] = _raise_gone, silence: float = 5.0) -> None:
        endpoint, self._token, self.name = _split(address)
        self.shapes, self.dtypes = [tuple(s) for s in shapes], [np.dtype(d) for d in dtypes]
        self.check, self.on_silence, self.on_gone = check, on_silence, on_gone
        self.silence = silence
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, int(_SLICE_S * 1000))    # a receive that waits, sliced
        self._socket.plain_username, self._socket.plain_password = _USER, self._token
        self._socket.connect(endpoint)

    @classmethod
    def of(cls, address: str, params: Sequence[SharedVariable], **kwargs: Any) -> RemoteCenter:
        """The remote center of the shared variables ``params`` (their values give the shapes)."""
        from ...platform.values import stored
        values = [np.asarray(stored(p)) for p in params]
        return cls(address, [v.shape for v in values], [p.type.dtype for p in params], **kwargs)

    def request(self, op: bytes, frames: Sequence[bytes | np.ndarray] = ()) -> list[zmq.Frame]:
        """Send request ``op`` about this center; return the reply's frames."""
        start = time.monotonic()
        message = [self._token, op, *frames]
        while True:
            try:
                self._socket.send_multipart(message, flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                if not self._socket.poll(int(_SLICE_S * 1000), zmq.POLLOUT):
                    self._between_slices(start)
        while True:
            try:
                reply = self._socket.recv_multipart(copy=False)     # waits a slice at most
                break
            except zmq.Again:
                self._between_slices(start)
        if reply and reply[0].bytes == _ERROR:
            raise RuntimeError(f"node 0's center server: {reply[1].bytes.decode()}")
        return reply

    def _between_slices(self, start: float) -> None:
        """Between two slices of a wait for the server: this node's checks, node 0's word."""
        self.check()
        why = server_gone()
        if why is not None:
            self.on_gone(why)
        waited = time.monotonic() - start
        if waited > self.silence:
            self.on_silence(waited)

    def claim(self, limit: int) -> int | None:
        """The next unit of work below ``limit`` (every device of every node shares the counter)."""
        reply, = self.request(b"claim", [np.int64(limit).tobytes()])
        unit = int(np.frombuffer(reply.buffer, np.int64)[0])
        return None if unit < 0 else unit

    def exchange(self, pushes: Sequence[npt.ArrayLike], take: Callable[[np.ndarray], Any] = np.array) -> list[Any]:
        """One device's exchange with the center: ``take`` of what the rule's merge answers, per block."""
        arrays = [np.ascontiguousarray(p, dtype=d) for p, d in zip(pushes, self.dtypes)]
        replies = _frames_to_arrays(self.request(b"exchange", arrays), self.shapes, self.dtypes)
        return [take(r) for r in replies]

    def values(self) -> list[np.ndarray]:
        """A copy of every block of the center."""
        return [np.array(v) for v in
                _frames_to_arrays(self.request(b"values"), self.shapes, self.dtypes)]

    def close(self) -> None:
        self._socket.close()


def attach_center(where: str, params: Sequence[SharedVariable], merge: Merge,
                  check: Callable[[], None] = lambda: None,
                  on_silence: Callable[[float], None] = lambda s: None) -> Center | RemoteCenter:
    """A device's handle on a loop's center at ``where``: its shared-memory segment on node 0, or
    node 0's server from another node."""
    if where.startswith(SCHEME):
        return RemoteCenter.of(where, params, check=check, on_silence=on_silence)
    return Center.of(where, params, create=False, merge=merge, check=check)
