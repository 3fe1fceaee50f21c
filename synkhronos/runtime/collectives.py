"""The master's side of a collective and of one rank's values: run it on every rank, read, set.

:meth:`Collectives.run` runs a collective the api layer encoded (every rank
prepares, then all execute only if all could; on several nodes the nodes agree
first). The other methods read or set shared values on ranks, and gather every
rank's shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm import Reservation
from ..errors import SynkError
from ..platform.device_arrays import place_on_device
from ..platform.values import host_face, stored
from ..rank import collectives as kinds
from ..tracing import trace
from ..wire.collective import Kind, group_bytes, kind_name, shapes_of
from ..wire.control import Op, Words
from .nodes import joined_over_nodes
from .part import Part

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["Collectives"]


class Collectives(Part):
    """Collectives and per-rank values of one runtime."""

    def run(self, fill: Callable[[Words], None], reservation: Reservation | None = None,
            given: str = "") -> list[np.ndarray]:
        """Write a collective with ``fill(Words)`` and run it on every rank; return the master's results.

        ``reservation`` (a :class:`~synkhronos.comm.Reservation`) is handed to
        the collective implementation first. On several nodes they compare the
        collective's kind and variables before any of them runs it, and
        ``given``: its options, and the
        :func:`~synkhronos.wire.plan.values_text` of the values each gives whole.
        """
        state = self._state
        since = trace.now() if trace.on else None
        state.registry.ensure_shipped()
        comm, ctl, nodes = state.context.comm, state.channel.ctl, state.nodes
        comm.reserve(reservation or Reservation())
        fill(Words(ctl.args))

        def local_prepare() -> Callable[[], Any]:
            execute = state.context.prepare_collective(Words(ctl.args))
            if trace.on:
                trace.mark("prepare")
            return execute
        kind = kind_name(int(ctl.args[0]))
        if int(ctl.args[0]) != Kind.ALL_REDUCE:       # the others may give values of new shapes
            state.calls.forget_shapes()
        if since is not None:
            trace.begin("collective", kind, since)
        try:
            agree = None if nodes is None else nodes.every_node_prepared(
                kind, f" of {self._variables_named(Words(ctl.args))}{given}")
            try:
                results = state.channel.collective(local_prepare, comm.waits_in_python, agree, kind)
            except Exception as e:
                if nodes is not None and not isinstance(e, SynkError) and state.is_open:
                    nodes.raise_dead_node(f"the {kind} across nodes", e)   # a lost peer's name
                raise
            return [np.asarray(v) for v in results]
        finally:
            if since is not None:
                trace.end("execute")

    def _variables_named(self, words: Words) -> str:
        """The variables a collective written in ``words`` acts on (every kind's words name them
        first, after its kind), as the nodes compare them."""
        words.get()
        return ", ".join(str(self._state.registry.shared_by_uid(uid)) for uid in words.get_list())

    def all_shapes(self, vars_: Sequence[SharedVariable]) -> list[list[tuple[int, ...]]]:
        """Per variable, its shape on every rank (one round trip, the first time: they are kept
        until a command may change them, see :meth:`~.calls.Calls.forget_shapes`)."""
        state = self._state
        state.registry.ensure_shipped()
        uids = tuple(state.registry.uids_of(vars_))
        known = state.calls.shapes_known(uids)
        if known is not None:
            return known
        shapes = self._ask_shapes(vars_)
        state.calls.keep_shapes(uids, shapes)
        return shapes

    def _ask_shapes(self, vars_: Sequence[SharedVariable]) -> list[list[tuple[int, ...]]]:
        """Per variable, its shape on every rank, asked of every rank."""
        state = self._state
        channel = state.channel
        Words(channel.ctl.args).put_list(state.registry.uids_of(vars_))
        own = shapes_of(stored(v) for v in vars_)
        channel.command(Op.GET_SHAPES)
        per_rank = {state.local_master: own}
        for rank in state.worker_ranks:
            per_rank[rank] = [tuple(int(s) for s in a) for a in channel.read_result_arrays(rank)]
        ordered = joined_over_nodes(state.nodes, "shapes", [per_rank[r] for r in range(state.n_local)])
        return [[ordered[r][i] for r in range(state.n_parallel)] for i in range(len(vars_))]

    def get_values(self, rank: int, vars_: Sequence[SharedVariable]) -> list[np.ndarray]:
        """The values of ``vars_`` on global ``rank``, as numpy arrays, on every node.

        On several nodes every node makes the same call; the node holding
        ``rank`` reads the values and the others receive them through the
        coordination service's exchange.
        """
        state = self._state
        state.registry.ensure_shipped()
        t = state.topology
        owner = t.node_of(rank)
        values = self.local_values(t.local_of(rank), vars_) if owner == t.node_rank else None
        if state.nodes is not None:
            names = ", ".join(str(var) for var in vars_)
            values = state.nodes.exchange(("get_value", int(rank), f"of {names}"), values)[owner]
        assert values is not None, "one node holds every rank"
        return values

    def local_values(self, rank: int, vars_: Sequence[SharedVariable], copy: bool = True) -> list[np.ndarray]:
        """The values of ``vars_`` on this node's local ``rank`` (no other node takes part).

        ``copy=False``: views where they come without a copy (the master's own
        values on a CPU device; a worker's, in its result segment), valid until
        the next command that changes them or that rank's next result.
        """
        state = self._state
        if rank == state.local_master:
            if not copy:
                return [np.asarray(host_face(stored(v))) for v in vars_]
            return [np.array(v.get_value()) for v in vars_]
        state.registry.ensure_shipped()
        state.channel.send_pickled(state.registry.uids_of(vars_))
        state.channel.command(Op.GET_SHARED, ranks=[rank])
        return state.channel.read_result_arrays(rank, copy=copy)

    def broadcast_from_master(self, vars_: Sequence[SharedVariable]) -> None:
        """Copy the master's values of ``vars_`` to every rank (``synk.broadcast``; and a value set
        in the master, at the next call: see ``Registry.values_to_devices``)."""
        state = self._state
        state.rows_behind.forget(vars_)
        shapes = shapes_of(stored(v) for v in vars_)
        sizes = [math.prod(shape) for shape in shapes]

        def fill(w: Words) -> None:
            kinds.broadcast.encode(w, state.registry.uids_of(vars_), shapes)
        self.run(fill, Reservation(group_bytes(vars_, sizes)))

    def set_values(self, rank: int, vars_: Sequence[SharedVariable], arrays: Sequence[np.ndarray]) -> None:
        """Set ``vars_`` to ``arrays`` on global ``rank`` only (by the node that holds it).

        On several nodes every node makes the same call; the others do nothing.
        """
        state = self._state
        state.registry.ensure_shipped()
        state.calls.forget_shapes()
        state.rows_behind.forget(vars_)
        t = state.topology
        if t.node_of(rank) != t.node_rank:
            return
        rank = t.local_of(rank)
        if rank == state.local_master:
            for var, arr in zip(vars_, arrays):
                var.set_value(arr)
            place_on_device(vars_)
        else:
            state.channel.send_pickled(dict(zip(state.registry.uids_of(vars_), arrays)))
            state.channel.command(Op.SET_SHARED, ranks=[rank])
