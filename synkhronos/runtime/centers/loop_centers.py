"""The master's side of its loops' centers: made, served to the other nodes, watched, closed.

:class:`LoopCenters` belongs to the runtime's :class:`~synkhronos.runtime.loops.Loops`.
An asynchronous loop's center is made with the loop's first phase, from the
master's values, in node 0's shared memory (:class:`~.shared.Center`). On
several nodes node 0's server process (:class:`~.process.CenterServer`,
started with the first such loop, and again after one that ended) serves it
too, and node 0's master tells the other nodes where; their devices exchange
with it (:class:`~.server.RemoteCenter`). A server that dies while a loop uses
it ends the run on every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import Failure, WorkerError
from ...seams.loop import CenterClient
from ...wire.loop import LoopSpec
from ..part import Part
from .server import GONE_KEY, RemoteCenter, server_gone
from .shared import Center

if TYPE_CHECKING:
    from ..nodes import NodeLink
    from .process import CenterServer

__all__ = ["LoopCenters"]


class LoopCenters(Part):
    """The centers of one runtime's asynchronous loops, from its master's side."""

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self._handles: dict[int, CenterClient] = {}    # loop id -> the master's, until its loop takes it
        self._routes: dict[int, str] = {}   # loop id -> where its devices find it (a segment, or a server)
        self._server: CenterServer | None = None  # node 0's server of them to the other nodes
        self._server_died: str | None = None      # node 0: how its server ended while a loop used it

    def opened(self, loop_id: int) -> bool:
        """Whether loop ``loop_id``'s center was made (a device may have run)."""
        return loop_id in self._routes

    def route(self, spec: LoopSpec, first: int) -> str:
        """Where the devices find loop ``spec``'s center, made now if it is not yet, its claims
        starting at global step ``first`` (a resumed run's)."""
        if spec.loop_id not in self._routes:
            self._open(spec, first)
        return self._routes[spec.loop_id]

    def take(self, loop_id: int) -> CenterClient | None:
        """The master's handle on loop ``loop_id``'s center, for its device loop (once)."""
        return self._handles.pop(loop_id, None)

    def check(self) -> None:
        """Raise if node 0's server died while a loop used it."""
        if self._server_died is not None:
            raise self._lost(self._server_died)

    def finished(self, spec: LoopSpec) -> None:
        """After loop ``spec``'s last phase: node 0 serves its center until every node's devices
        took it, then stops serving it."""
        self._routes.pop(spec.loop_id, None)
        nodes = self._state.nodes
        if nodes is None:
            return
        nodes.exchange(("train.run finish", spec.loop_id), None, tolerate_loss=True)
        if self._server is not None:
            try:
                self._server.forget(self._segment(spec))
            except OSError:      # it ended after its last use: the next loop starts another
                pass

    def release(self) -> None:
        """At the runtime's end: close every center and the server."""
        for center in self._handles.values():
            center.close()
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._server_died = None
        self._handles, self._routes = {}, {}

    def _open(self, spec: LoopSpec, first: int) -> None:
        """Make loop ``spec``'s center from the master's values, and the master's handle on it;
        on several nodes, serve it from node 0 and tell every node where."""
        state, nodes = self._state, self._state.nodes
        segment = self._segment(spec)
        params = [state.registry.shared_by_uid(uid) for uid in spec.synced_uids]
        home = nodes is None or state.topology.node_rank == 0
        where: Any = segment
        if nodes is not None and self._watch not in nodes.watches:
            nodes.watches.append(self._watch)
        center: CenterClient
        if home:
            center = shared = Center.of(segment, params, create=True, merge=spec.rule.merge,
                                        check=state.channel.watch.during_collective)
            shared.start_claims_at(first * state.n_parallel)
            if nodes is not None:
                try:
                    where = self._running_server().serve(
                        segment, [b.shape for b in shared.blocks],
                        [b.dtype for b in shared.blocks], spec.rule)
                except OSError as e:         # every node raises, before any device starts
                    shared.close()
                    where = ("failed", str(e))
        if nodes is not None:
            where = nodes.exchange(("train.run's center", spec.loop_id), where if home else None)[0]
            if isinstance(where, tuple):
                raise nodes.error_on(0, f"node 0 could not serve the center of {spec.rule!r} to "
                                        f"the other nodes ({where[1]}); nothing ran. Check that "
                                        f"node 0's coordinator host accepts connections on a "
                                        f"free port, or use a synchronous rule")
        if not home:
            center = RemoteCenter.of(where, params, check=self._check_node_zero,
                                     on_silence=self._node_zero_silent, on_gone=self._node_zero_gone)
        self._handles[spec.loop_id] = center
        self._routes[spec.loop_id] = where

    @staticmethod
    def _segment(spec: LoopSpec) -> str:
        """The segment of asynchronous loop ``spec``'s center (an asynchronous loop has one)."""
        assert spec.center is not None, "an asynchronous loop names its center's segment"
        return spec.center

    @property
    def _nodes(self) -> NodeLink:
        """The link to the other nodes: the paths that use it run on several nodes only."""
        nodes = self._state.nodes
        assert nodes is not None, "on several nodes only"
        return nodes

    def _running_server(self) -> CenterServer:
        """Node 0's center server, started now if there is none or it ended."""
        from .process import CenterServer
        if self._server is not None and not self._server.alive:
            self._server.stop()
            self._server = None
        if self._server is None:
            coordinator = self._state.topology.coordinator
            assert coordinator is not None, "a center server runs on several nodes only"
            self._server = CenterServer(coordinator.rsplit(":", 1)[0], on_death=self._server_ended)
        return self._server

    def _server_ended(self, why: str) -> None:
        """From the server's watcher thread: a server that ended while a loop used it ends the
        run; node 0 tells the other nodes through the coordination service."""
        if not self._routes:
            return                       # no loop uses it: the next one starts another
        self._server_died = why
        try:
            self._nodes.client.key_value_set(GONE_KEY, why, allow_overwrite=True)
        except Exception:                # noqa: BLE001 - no service: the nodes' beats say the rest
            pass

    def _watch(self) -> None:
        """While this node's master waits for the other nodes, during a loop across nodes: a center
        server that node 0 said died."""
        if self._routes:
            why = self._server_died or server_gone()
            if why is not None:
                raise self._lost(why)

    def _node_zero_gone(self, why: str) -> None:
        raise self._lost(why)

    def _lost(self, why: str) -> WorkerError:
        """The error of every node whose run lost node 0's center server (the runtime shut down)."""
        nodes = self._nodes
        nodes.fault_reason = why
        nodes.on_fault()
        return WorkerError(nodes.topology.ranks_of(0)[0], Failure.DIED, "center server lost",
                           f"{why} during an asynchronous train.run, which cannot go on without it; "
                           f"this node's runtime was shut down, call synk.fork() on every node to "
                           f"start again", node=0)

    def _check_node_zero(self) -> None:
        """While a device of another node waits for node 0's center: this node's runtime, the nodes."""
        self._state.channel.watch.during_collective()
        self._nodes.check_nodes_alive()

    def _node_zero_silent(self, waited: float) -> None:
        raise self._nodes.node_died(0, 0, f"node 0's center has not answered for {waited:.0f} s")
