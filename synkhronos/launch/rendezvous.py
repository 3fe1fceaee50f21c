"""Where elastic launchers meet: node 0's launcher keeps the list of nodes, and tells every launcher
when it changes.

Every launcher of ``python -m synkhronos.launch --nnodes MIN:MAX`` keeps one TCP
connection to node 0's launcher (:class:`RendezvousServer`, at the
``--coordinator`` address) and speaks one JSON object a line. A round starts
once at least ``MIN`` launchers are connected (waiting ``settle`` seconds for
more, up to ``MAX``): each is told its node rank in the round, the number of
nodes and where the round's coordination service listens. A launcher whose
connection drops (its node died), one that joins during a round, or one
whose script failed, ends the round: every launcher stops its script and joins
the next. Node 0's launcher is the rendezvous; its loss ends the run (as
under torchrun's default rendezvous).

Examples
--------
>>> server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=1, settle=0.0)
>>> client = RendezvousClient(server.address, node_rank=0, timeout=5)
>>> client.join()
>>> client.next_message(5)["nnodes"]
1
>>> client.close(); server.close()
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from enum import StrEnum
from typing import Any

__all__ = ["RendezvousServer", "RendezvousClient", "RendezvousLost", "Kind"]


class Kind(StrEnum):
    """What a message of the rendezvous says (its ``"kind"``)."""

    #: a launcher's: it joins the next round (with its ``node_rank`` and ``job``)
    JOIN = "join"
    #: a launcher's: its script ended well in this round
    DONE = "done"
    #: a launcher's: its script failed (``why``); the round ends
    FAILED = "failed"
    #: the rendezvous's: a round starts (``round``, ``node_rank``, ``nnodes``, ``coordinator``)
    ROUND = "round"
    #: the rendezvous's: round ``round`` ended (``why``); join the next
    RESTART = "restart"
    #: the rendezvous's: every node's script ended well; the run is over
    FINISHED = "finished"
    #: the rendezvous's: this launcher may not join (``why``; ``busy``: not now, it may try again)
    REFUSED = "refused"


#: why a round ends when a launcher joins it (a change of membership, not a failure)
JOINED = "a node joined"
#: the longest message line; a connection sending more is dropped (the launchers' are far shorter)
MAX_LINE_BYTES = 64 << 10
#: seconds a connection may take to join; one that has not by then is dropped
JOIN_SECONDS = 10.0
#: connections served at once beyond the run's launchers (strangers beyond it are closed at once)
SPARE_CONNECTIONS = 64
#: seconds the accepting thread rests after an error (out of descriptors, say) before it goes on
ACCEPT_RETRY_SECONDS = 0.05
#: seconds a message to a joined launcher may wait for room in its connection; one that has read
#: nothing for so long that its buffers are full (a stopped process) is dropped, not waited for
SEND_SECONDS = 2.0


#: one message of the rendezvous: a JSON object with its ``"kind"`` (:class:`Kind`) and that kind's fields
Message = dict[str, Any]


class RendezvousLost(ConnectionError):
    """Node 0's launcher (the rendezvous) is gone."""


def _line(message: Message) -> bytes:
    """``message`` as the rendezvous speaks it: one JSON object a line."""
    return (json.dumps(message) + "\n").encode()


def _send(sock: socket.socket, message: Message) -> None:
    sock.sendall(_line(message))


def _send_within(sock: socket.socket, message: Message, seconds: float) -> None:
    """Send ``message`` or raise :class:`TimeoutError` once ``seconds`` have passed. Each send waits
    at most the socket's own send time (``SO_SNDTIMEO``, or its timeout); the deadline bounds a
    reader that takes a few bytes at a time."""
    deadline = time.monotonic() + seconds
    rest = memoryview(_line(message))
    while rest:
        if time.monotonic() > deadline:
            raise TimeoutError(f"a message found no room within {seconds} s")
        rest = rest[sock.send(rest):]


def _family(host: str) -> socket.AddressFamily:
    """The address family of ``host`` (an IPv6 literal holds a colon)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _free_port(host: str) -> int:
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RendezvousServer:
    """Node 0's side: who is here, which round runs, and on which nodes."""

    def __init__(self, address: str, min_nodes: int, max_nodes: int, settle: float = 1.0, job: str = "",
                 join_seconds: float = JOIN_SECONDS, send_seconds: float = SEND_SECONDS) -> None:
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        self.min_nodes, self.max_nodes, self.settle = min_nodes, max_nodes, settle
        #: what every launcher of this run says it runs; a join saying otherwise is refused
        self.job = job
        self._lock = threading.Lock()
        self._members: dict[socket.socket, tuple[float, int]] = {}  # connection -> (joined at, preferred node rank)
        self._waiting: set[socket.socket] = set()       # connections that asked for the next round
        self._round = 0
        self._running: list[socket.socket] = []
        self._done: set[socket.socket] = set()
        self._join_seconds = join_seconds
        self._send_seconds = send_seconds
        self._open = 0              # connections being served
        self._connections: set[socket.socket] = set()  # the sockets of those connections
        self._max_open = 2 * max_nodes + SPARE_CONNECTIONS
        self._listener = socket.create_server((self.host, int(port)), family=_family(self.host),
                                              reuse_port=False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="synk-rendezvous", daemon=True),
                         threading.Thread(target=self._start_rounds, name="synk-rendezvous-rounds",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    # --- connections --------------------------------------------------------------------------
    def _accept(self) -> None:
        """Serve every connection in a thread of its own, at most ``_max_open`` at once; an error
        accepting one (out of file descriptors, a connection reset) is waited out, never the end."""
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(ACCEPT_RETRY_SECONDS)
                continue
            with self._lock:
                full = self._open >= self._max_open
                self._open += 0 if full else 1
            if full:                            # a flood of strangers: told so, and closed at once
                self._tell(conn, {"kind": Kind.REFUSED, "busy": True,
                                  "why": f"the rendezvous has {self._max_open} connections open at "
                                         f"once (a flood?)"})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="synk-rendezvous-peer", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)
        # a stranger that has not joined in time is cut off, however slowly it keeps sending
        deadline = threading.Timer(self._join_seconds, self._drop_unless_joined, args=(conn,))
        deadline.daemon = True
        deadline.start()
        try:
            conn.settimeout(self._join_seconds)     # until it joins: a silent stranger is dropped
            reader = conn.makefile("rb")
            while True:
                line = reader.readline(MAX_LINE_BYTES + 1)
                if not line or len(line) > MAX_LINE_BYTES:
                    break                       # gone, or a line no launcher sends: dropped
                message = json.loads(line)
                if not isinstance(message, dict) or not self._on_message(conn, message):
                    break                       # a stranger, or garbage: dropped, counted nowhere
                if conn in self._members:
                    deadline.cancel()
                    self._become_members_connection(conn)
        except Exception:                       # whatever a stranger sends ends its connection only
            pass
        finally:
            deadline.cancel()
            self._on_drop(conn)
            with self._lock:
                self._open -= 1
                self._connections.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _become_members_connection(self, conn: socket.socket) -> None:
        """A joined launcher is quiet while its round runs: its reads wait without end. Its writes
        do not: the rendezvous tells it things holding its lock, and a launcher that reads
        nothing (a stopped process) must not stall the others once its buffers are full."""
        conn.settimeout(None)
        whole, part = divmod(self._send_seconds, 1.0)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(whole), int(part * 1e6)))

    def _drop_unless_joined(self, conn: socket.socket) -> None:
        """The join time is up: a connection that is not a member's is shut, ending its reader."""
        if conn not in self._members:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _on_message(self, conn: socket.socket, message: Message) -> bool:
        """Handle one message; False for one that ends the connection (a join of another run)."""
        with self._lock:
            kind = message.get("kind")
            if kind == Kind.JOIN:
                rank = message.get("node_rank")
                if message.get("job") != self.job:
                    self._tell(conn, {"kind": Kind.REFUSED, "why": f"this rendezvous serves the run "
                                      f"{self.job!r}, not {message.get('job')!r}: start every node "
                                      f"with the same script and --nnodes"})
                    return False
                if not isinstance(rank, int) or isinstance(rank, bool):
                    self._tell(conn, {"kind": Kind.REFUSED, "why": f"a node rank is a whole number, "
                                      f"not {rank!r}: give a whole --node-rank"})
                    return False
                if not 0 <= rank < self.max_nodes:
                    self._tell(conn, {"kind": Kind.REFUSED, "why": f"node rank {rank} is not one of "
                                      f"this run's ({self.job!r}): give a --node-rank from 0 to "
                                      f"{self.max_nodes - 1}"})
                    return False
                if self._running and conn not in self._running and len(self._running) >= self.max_nodes:
                    self._refuse_full(conn)
                    return False
                self._members.setdefault(conn, (time.monotonic(), rank))
                self._waiting.add(conn)
                if self._running and conn not in self._running:
                    self._end_round(JOINED)
            elif kind == Kind.FAILED and conn in self._running:
                self._end_round(message.get("why", "a script failed"))
            elif kind == Kind.DONE and conn in self._running:
                self._done.add(conn)
                if self._done >= set(self._running):
                    for c in self._running:
                        self._tell(c, {"kind": Kind.FINISHED})
                    self._running = []
            elif conn not in self._members:
                return False                    # anything but a join first: not a launcher
            return True

    def _on_drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._members.pop(conn, None)
            self._waiting.discard(conn)
            if conn in self._running and conn not in self._done:
                self._end_round("a node was lost")

    def _refuse_full(self, conn: socket.socket) -> None:
        self._tell(conn, {"kind": Kind.REFUSED, "why": f"the run already has its {self.max_nodes} nodes "
                          f"(--nnodes {self.min_nodes}:{self.max_nodes}); start this node again once "
                          f"one is lost"})
        try:
            conn.shutdown(socket.SHUT_RDWR)      # its thread ends; it is counted nowhere
        except OSError:
            pass

    def _tell(self, conn: socket.socket, message: Message) -> None:
        """Send ``message``; a connection that cannot take it in time is shut (its reader then
        drops it: a member lost, as if its node had died)."""
        try:
            _send_within(conn, message, self._send_seconds)
        except OSError:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # --- rounds -------------------------------------------------------------------------------
    def _end_round(self, why: str) -> None:
        """Every launcher of the running round stops its script and joins the next (lock held)."""
        for c in self._running:
            self._tell(c, {"kind": Kind.RESTART, "round": self._round, "why": why})
        self._running, self._done = [], set()

    def _start_rounds(self) -> None:
        ready_since: float | None = None
        while not self._closed:
            time.sleep(0.05)
            with self._lock:
                if self._running or len(self._waiting) < self.min_nodes:
                    ready_since = None
                    continue
                ready_since = ready_since or time.monotonic()
                if len(self._waiting) < self.max_nodes and time.monotonic() - ready_since < self.settle:
                    continue
                self._begin_round()
                ready_since = None

    def _begin_round(self) -> None:
        """Number the waiting launchers (node 0 first, then by their own node rank) and start (lock held)."""
        order = sorted(self._waiting, key=lambda c: (self._members[c][1], self._members[c][0]))
        self._round += 1
        self._running, self._done = order[:self.max_nodes], set()
        self._waiting -= set(self._running)
        for extra in order[self.max_nodes:]:        # came with the first ones, beyond MAX
            self._refuse_full(extra)
            self._waiting.discard(extra)
            self._members.pop(extra, None)
        coordinator = f"{self.host if ':' not in self.host else '[' + self.host + ']'}:{_free_port(self.host)}"
        for rank, c in enumerate(self._running):
            self._tell(c, {"kind": Kind.ROUND, "round": self._round, "node_rank": rank,
                           "nnodes": len(self._running), "coordinator": coordinator})

    def close(self) -> None:
        """Stop serving; return once the server's threads have ended."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)    # wakes the accepting thread (close does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for c in list(self._connections):   # members and strangers: each one's thread ends
                try:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)


class RendezvousClient:
    """A launcher's side: join a round, hear when it ends."""

    def __init__(self, address: str, node_rank: int, timeout: float, job: str = "") -> None:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no rendezvous listened at {address} within {timeout:.0f} s "
                                       f"(node 0's launcher starts it)") from None
                time.sleep(0.1)
        self._sock.settimeout(None)
        self._lines = self._sock.makefile("r")
        self.node_rank, self.job = node_rank, job
        self._messages: list[Message] = []
        self._cond = threading.Condition()
        self._lost = False
        self._reader = threading.Thread(target=self._read, name="synk-rendezvous-client", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self._lines:
                with self._cond:
                    self._messages.append(json.loads(line))
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            self._lost = True
            self._cond.notify_all()

    def join(self) -> None:
        """Ask for a place in the next round. Raises :class:`RendezvousLost` once node 0's
        launcher is gone (its connection closed)."""
        try:
            _send(self._sock, {"kind": Kind.JOIN, "node_rank": self.node_rank, "job": self.job})
        except OSError:
            raise RendezvousLost("node 0's launcher (the rendezvous) is gone") from None

    def tell(self, kind: Kind, **fields: Any) -> None:
        try:
            _send(self._sock, {"kind": kind, **fields})
        except OSError:
            pass

    def next_message(self, timeout: float | None = None) -> Message | None:
        """The next message from the rendezvous; None after ``timeout`` seconds. Raises
        :class:`RendezvousLost` once node 0's launcher is gone."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._messages or self._lost, timeout):
                return None
            if self._messages:
                return self._messages.pop(0)
            raise RendezvousLost("node 0's launcher (the rendezvous) is gone")

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)     # the reader's file holds the socket open
            self._sock.close()
        except OSError:
            pass
        self._reader.join(timeout=5)
