"""What the masters of several nodes tell each other, through JAX's coordination service.

Every node's master runs the same script and makes the same synkhronos calls
in the same order. Where a node needs what the others computed (a call's
per-rank results, the shapes of a collective's values, whether every node
could prepare a collective), the masters :meth:`NodeLink.exchange` small
Python objects through the key-value store of JAX's coordination service
(the same runtime the collectives use; large arrays go through the
collectives). Each exchange is numbered; its payload names what it is for, so
masters that drifted apart (a call made on one node only) raise at once
instead of mixing the results of different calls.

Every master beats: a thread of its own writes a counter under its node's
key every :data:`BEAT_EVERY` seconds while the runtime runs. Every wait is
sliced: between slices the master checks its own workers and the other
nodes' beats (a node not heard from for :data:`LOST_AFTER` seconds is named
as lost) and gives up after the stall timeout. (The coordination service's
own list of live processes is no use here: asking it waits until every
process asked has asked too.)
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, Protocol, TypeVar

import numpy as np

from ..errors import Failure, NodesDiverged, StallError, WorkerError
from ..platform import internals
from ..platform.jax_init import NODE_HEARTBEAT_TIMEOUT
from ..platform.threads import start_thread
from ..wire.topology import Topology

__all__ = ["NodeLink", "NodeStore", "joined_over_nodes", "rows_of_every_node"]

#: milliseconds of one slice of a wait for another node's key
_SLICE_MS = 100
#: exchanges per key directory; a directory two behind the current one is deleted
_PER_DIRECTORY = 64
#: seconds between two beats of a master
BEAT_EVERY = 0.5
#: seconds without a beat after which a node counts as lost
LOST_AFTER = NODE_HEARTBEAT_TIMEOUT

T = TypeVar("T")
#: what an exchange is for: a phrase, or a tuple of the phrase and its details
What = str | tuple[Any, ...]


class NodeStore(Protocol):
    """The transport of the masters' exchanges: a key-value store every node's master reaches.

    JAX's coordination service client (``jax._src.distributed.global_state.client``)
    is the one :class:`NodeLink` uses by default; another transport (etcd, a
    ZeroMQ server of its own) implements these five methods and is given to
    :class:`NodeLink` as ``store``.
    """

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        """Store ``value`` (text) under ``key``."""

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        """Store ``value`` (bytes) under ``key``."""

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        """The bytes under ``key``, waiting up to ``timeout_in_ms`` for them (an error after)."""
        ...

    def key_value_try_get_bytes(self, key: str) -> bytes:
        """The bytes under ``key`` now (an error if there are none)."""
        ...

    def key_value_delete(self, key: str) -> None:
        """Remove ``key`` and every key below it (``key/...``)."""


class NodeLink:
    """One master's side of the exchanges among the masters of every node.

    Parameters
    ----------
    topology : Topology
    check : callable
        Raises if this node's own runtime failed (called between slices).
    stall_timeout : float
        Seconds a wait for another node allows before :class:`StallError`.
    on_fault : callable
        Shuts this node's runtime down before a lost node or a stall is raised.
    store : NodeStore, optional
        The key-value store the exchanges travel through (default: JAX's
        coordination service, which every process joined at ``fork()``).
    """

    def __init__(self, topology: Topology, check: Callable[[], None], stall_timeout: float,
                 on_fault: Callable[[], None], store: NodeStore | None = None) -> None:
        self.topology = topology
        self.check = check
        self.on_fault = on_fault
        self.stall_timeout = stall_timeout
        self.client: NodeStore = store if store is not None else internals.distributed_client()
        self.seq = 0
        self._heard: dict[int, tuple[bytes | None, float]] = {}    # node -> (its last beat, when it changed)
        #: the nodes found lost (their masters gone or stopped)
        self.lost: set[int] = set()
        #: the nodes whose runtime said it was shut down by a fault, with what they said
        self._faulted: dict[int, str] = {}
        #: what this node tells the others when a fault shuts its runtime down (if it knows)
        self.fault_reason: str | None = None
        #: more checks between the slices of a wait, added by parts of the runtime (each raises)
        self.watches: list[Callable[[], None]] = []
        self._stop_beating = threading.Event()
        self._beater = start_thread(self._beat, "synk-node-beat")

    def _beat(self) -> None:
        count = 0
        key = f"synk/beat/{self.topology.node_rank}"
        while not self._stop_beating.is_set():
            count += 1
            try:
                self.client.key_value_set(key, str(count), allow_overwrite=True)
            except Exception:         # noqa: BLE001 - the coordinator is gone; the waits notice
                return
            self._stop_beating.wait(BEAT_EVERY)

    def close(self, fault: bool = False) -> None:
        """Stop beating (the runtime is ending); after a ``fault`` say so, so that the other nodes
        count this one lost at once instead of after :data:`LOST_AFTER` seconds of silence."""
        self._stop_beating.set()
        self._beater.join(timeout=2 * BEAT_EVERY)
        if fault:
            with contextlib.suppress(Exception):     # no service: its silence says the same
                self.client.key_value_set(f"synk/fault/{self.topology.node_rank}",
                                          self.fault_reason or "its own error names it",
                                          allow_overwrite=True)

    def exchange(self, what: What, obj: Any, tolerate_loss: bool = False) -> list[Any]:
        """Give every node ``obj``; return every node's, in node order.

        ``what`` names the exchange (a string or tuple); every node must
        exchange the same ``what`` at the same point, else :class:`NodesDiverged`.
        ``tolerate_loss``: a node other than node 0 lost before or during the
        exchange gives None (it joins :attr:`lost`, this node's runtime goes
        on); else, and always for node 0 (it serves the runtime), it raises.
        A Ctrl-C meanwhile shuts this node's runtime down as a fault does (its
        exchanges are out of step with the others' for good), and the other
        nodes are told at once, naming it; then it is raised.
        """
        try:
            return self._exchanged(what, obj, tolerate_loss)
        except KeyboardInterrupt:
            # (the others would wait for this node's next exchange, or its close, until a stall)
            self.fault_reason = f"a Ctrl-C stopped it in {_describe(what)}"
            self.on_fault()
            raise

    def _exchanged(self, what: What, obj: Any, tolerate_loss: bool) -> list[Any]:
        t, seq = self.topology, self.seq
        self.seq += 1
        directory = f"synk/x/{seq // _PER_DIRECTORY}"
        if seq % _PER_DIRECTORY == 0 and seq >= 2 * _PER_DIRECTORY:
            # every node is past the exchanges of two directories ago (each waits for all others)
            self.client.key_value_delete(f"synk/x/{seq // _PER_DIRECTORY - 2}")
        self.client.key_value_set_bytes(f"{directory}/{seq}/{t.node_rank}",
                                        pickle.dumps((what, obj), protocol=pickle.HIGHEST_PROTOCOL))
        out: list[Any] = []
        for node in range(t.n_nodes):
            if node == t.node_rank:
                out.append(obj)
                continue
            spared = tolerate_loss and node != 0
            raw = None if spared and node in self.lost else \
                self._wait_for(f"{directory}/{seq}/{node}", node, what, spared)
            if raw is None:
                out.append(None)
                continue
            their_what, their_obj = pickle.loads(raw)
            if their_what != what:
                raise NodesDiverged(
                    f"node {t.node_rank} made {_describe(what)} while node {node} made "
                    f"{_describe(their_what)}: every node must run the same script and make the "
                    f"same synkhronos calls in the same order")
            out.append(their_obj)
        return out

    def _wait_for(self, key: str, node: int, what: What, tolerate_loss: bool = False) -> bytes | None:
        """The bytes ``node`` set under ``key``; None if ``tolerate_loss`` and the node is lost."""
        deadline = time.monotonic() + self.stall_timeout
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(key, _SLICE_MS)
            except Exception as e:      # JAX raises its runtime error on a slice's deadline
                if "DEADLINE_EXCEEDED" not in str(e):
                    self.raise_dead_node(f"waiting for node {node}", e)
            # a blocking get that timed out can miss the key's later arrival: look for it
            # directly as well
            found = self._try_get(key)
            if found is not None:
                return found
            self.check()
            for watch in self.watches:
                watch()
            silent = self.silent_nodes()
            if tolerate_loss and node in silent:
                self.lost.add(node)
                return None
            self._raise_for_silent(silent)
            if time.monotonic() > deadline:
                t = self.topology
                self.on_fault()
                raise StallError(f"{_describe(what)} on every node", arrived=list(t.ranks_of(t.node_rank)),
                                 missing=list(t.ranks_of(node)), timeout=self.stall_timeout)

    def _try_get(self, key: str) -> bytes | None:
        try:
            return self.client.key_value_try_get_bytes(key)
        except Exception as e:     # NOT_FOUND: not there yet
            if "NOT_FOUND" not in str(e):
                raise
            return None

    def check_nodes_alive(self) -> None:
        """Raise :class:`WorkerError` naming a node not heard from for :data:`LOST_AFTER` seconds."""
        self._raise_for_silent(self.silent_nodes())

    def _raise_for_silent(self, silent: list[int]) -> None:
        if silent:
            node = silent[0]
            why = (f"node {node}'s runtime was shut down by a fault ({self._faulted[node]})"
                   if node in self._faulted else f"node {node} has not been heard from for {LOST_AFTER:g} s")
            raise self.node_died(node, self.topology.ranks_of(node)[0], why)

    def silent_nodes(self) -> list[int]:
        """The other nodes not heard from for :data:`LOST_AFTER` seconds (the lost ones included)."""
        t, now = self.topology, time.monotonic()
        silent = []
        for node in range(t.n_nodes):
            if node == t.node_rank:
                continue
            try:
                beat = self._try_get(f"synk/beat/{node}")
            except Exception as e:
                raise self.node_died(0, 0, f"the coordination service it served is gone ({e})") from e
            if node not in self._faulted:
                said = self._try_get(f"synk/fault/{node}")
                if said is not None:
                    self._faulted[node] = said.decode()
            if node in self._faulted:
                silent.append(node)
                continue
            last = self._heard.get(node)
            if last is None or beat != last[0]:
                self._heard[node] = (beat, now)
            elif now - last[1] > LOST_AFTER:
                silent.append(node)
        return silent

    def leave(self) -> None:
        """Before this master leaves the JAX runtime (its workers already left): say so."""
        self.close()
        self.client.key_value_set(f"synk/left/{self.topology.node_rank}", "1", allow_overwrite=True)

    def wait_until_others_left(self, within: float = 10.0) -> None:
        """Serving the coordination service: wait (up to ``within`` s) until every other node left."""
        deadline = time.monotonic() + within
        for node in range(1, self.topology.n_nodes):
            while time.monotonic() < deadline and self._try_get(f"synk/left/{node}") is None:
                time.sleep(0.02)
        time.sleep(0.5)     # their last message to the service (leaving) follows the key

    def raise_dead_node(self, doing: str, error: Exception) -> NoReturn:
        """After a failed exchange or cross-node collective: name the dead node if there is one."""
        deadline = time.monotonic() + LOST_AFTER + 2
        while time.monotonic() < deadline:
            self.check_nodes_alive()
            time.sleep(0.2)
        raise WorkerError(self.topology.offset, Failure.RAISED, type(error).__name__, f"{doing}: {error}",
                          node=self.topology.node_rank) from error

    # --- what the masters tell each other ------------------------------------------------------
    def check_settings_agree(self, mine: Mapping[str, object]) -> None:
        """Every node must run with the same settings ``mine`` (a dict); raise naming the first
        that differs."""
        for node, theirs in enumerate(self.exchange("fork()", mine)):
            for key in mine:
                if theirs[key] != mine[key]:
                    raise ValueError(
                        f"node {node} forked with {key}={theirs[key]!r} but node "
                        f"{self.topology.node_rank} with {key}={mine[key]!r}: every node must call "
                        f"fork() alike (the same devices per node, master_rank, platform, "
                        f"collectives and pytensor.config.floatX)")

    def every_node_prepared(self, kind: str, given: str = "") -> Callable[[bool], tuple[bool, WorkerError | None]]:
        """The agreement of a collective's two phases across nodes (see ``Channel.collective``);
        nodes whose collectives differ in ``kind`` or in the values ``given`` raise NodesDiverged."""
        def agree(prepared: bool) -> tuple[bool, WorkerError | None]:
            nodes = self.exchange(("collective", kind + given), prepared)
            failed = [node for node, ok in enumerate(nodes) if not ok]
            if not failed:
                return True, None
            return False, self.error_on(failed[0], f"it could not prepare the {kind}; every node "
                                                   f"skipped it")
        return agree

    def error_on(self, node: int, what: str) -> WorkerError:
        """The error this node raises for a failure on another ``node``."""
        return WorkerError(self.topology.ranks_of(node)[0], Failure.RAISED, "error on another node",
                           f"node {node}: {what}", node=node)

    def tell_failed(self, what: What, error: BaseException) -> None:
        """After this node failed a command: let the others raise too."""
        self.exchange(what, ("failed", f"{type(error).__name__}: {error}"))

    def tell_refused(self, what: str, error: BaseException) -> None:
        """After this node refused ``what`` (a call, a set_value) before making its exchange: the
        others' same exchange raises NodesDiverged naming it ("refused on its node before it ran"),
        instead of pairing with this node's next one; this node then raises its own error."""
        with contextlib.suppress(NodesDiverged):
            self.tell_failed((what, "(refused on its node before it ran)"), error)

    def results_of_every_node(self, what: What, rows: list[int], columns: list[Any]
                              ) -> tuple[list[int], list[Any]]:
        """Every node's per-rank ``rows`` and ``columns`` of a call, joined in global rank order."""
        nodes = self.exchange(what, ("ok", (rows, columns)))
        for node, (status, payload) in enumerate(nodes):
            if status == "failed":
                raise self.error_on(node, f"it failed this call ({payload}); this node's part "
                                          f"was done and is discarded")
        rows = [r for _, (node_rows, _) in nodes for r in node_rows]
        joined: list[Any] = []
        for j in range(len(columns)):
            parts = [node_columns[j] for _, (_, node_columns) in nodes]
            joined.append(np.concatenate(parts) if isinstance(parts[0], np.ndarray)
                          else [v for part in parts for v in part])
        return rows, joined

    def every_other_node_lost(self) -> bool:
        """True once every other node was found lost: nobody is left to leave the runtime."""
        return self.lost >= set(range(self.topology.n_nodes)) - {self.topology.node_rank}

    def node_died(self, node: int, rank: int, why: str) -> WorkerError:
        self.lost.add(node)
        self.on_fault()
        return WorkerError(rank, Failure.DIED, "node lost", f"{why}; this node's runtime was shut down, "
                           f"call synk.fork() on every node to start again", node=node)


def joined_over_nodes(nodes: NodeLink | None, what: What, per_local_rank: Iterable[T]) -> list[T]:
    """``per_local_rank`` (a list over this node's ranks) of every node, by global rank.

    ``nodes`` is the runtime's :class:`NodeLink`, or None on one node.
    """
    if nodes is None:
        return list(per_local_rank)
    return [item for node in nodes.exchange(what, list(per_local_rank)) for item in node]


def rows_of_every_node(nodes: NodeLink | None, rows: int) -> int:
    """The rows of every node's batch together (this node's own count on one node)."""
    if nodes is None:
        return rows
    return int(sum(nodes.exchange("rows of every node", int(rows))))


def _describe(what: What) -> str:
    return what if isinstance(what, str) else " ".join(str(w) for w in what)
