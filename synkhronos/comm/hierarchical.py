"""Collectives over several nodes: shared memory within a node, the JAX runtime between nodes.

A reduction runs in three steps: every node reduces its processes' values
through shared memory (:class:`~synkhronos.comm.shm.ShmComm`); one process per
node (the node's master, the *leader*) reduces the nodes' results through the
JAX runtime (:class:`~synkhronos.comm.jax_runtime.JaxComm` over the leaders'
devices: Gloo on CPU, NCCL on GPUs); the leader hands the result to its node
through shared memory. Nothing of one node's shared memory is read by
another. With one device per node the shared-memory steps are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Comm, CommContext, Reservation
from .jax_runtime import JaxComm
from .shm import ShmComm

__all__ = ["HierarchicalComm"]


class HierarchicalComm(Comm):
    """Within a node through shared memory, between nodes one process per node through the JAX runtime.

    Parameters
    ----------
    context : CommContext
        Global ranks, and the ``topology`` of the nodes. The leader of a node
        is its master (``context.master_rank``), the same local rank on every node.
    """

    name = "hierarchical"
    platforms = ("cpu",)

    def __init__(self, context: CommContext) -> None:
        from dataclasses import replace

        import jax
        super().__init__(context)
        t = self.topology = context.topology
        self.local = ShmComm(context.on_this_node()) if t.n_local > 1 else None
        self.leader_local = t.local_of(context.master_rank)
        self.is_leader = context.rank == context.master_rank
        self.across: JaxComm | None = None      # the leaders' communicator, of the node leaders only
        if self.is_leader:
            by_rank = {d.process_index: d for d in jax.devices()}
            leaders = [by_rank[t.ranks_of(node)[self.leader_local]] for node in range(t.n_nodes)]
            self.across = JaxComm(replace(context, rank=t.node_rank, n_ranks=t.n_nodes,
                                          master_rank=0, topology=None), devices=leaders)

    # --- the three steps --------------------------------------------------------------------
    def _from_leader(self, values: Sequence[Any]) -> list[Any]:
        """The leader's ``values`` on every process of the node (the others pass placeholders)."""
        if self.local is None:
            return list(values)
        return self.local.broadcast(values, self.leader_local)

    def all_reduce(self, values: Sequence[Any], op: str) -> list[Any]:
        within = "sum" if op == "avg" else op
        reduced = self.local.all_reduce(values, within) if self.local is not None else values
        if self.across is not None:      # this node's leader
            reduced = self.across.all_reduce(reduced, within)
            if op == "avg":
                reduced = [v / self.n_ranks for v in reduced]
        return self._from_leader(reduced)

    def all_gather(self, values: Sequence[Any]) -> list[Any]:
        import jax.numpy as jnp
        t = self.topology
        stacked = (self.local.all_gather(values) if self.local is not None
                   else [jnp.asarray(v)[None] for v in values])
        if self.across is not None:
            per_node = self.across.all_gather(stacked)       # (n_nodes, n_local, ...)
            rows = [[v.reshape((t.n_devices,) + v.shape[2:])[r] for v in per_node]
                    for r in range(t.n_devices)]
        else:
            rows = [[np.empty(np.shape(v), np.asarray(v).dtype) for v in values]] * t.n_devices
        # rank by rank: a slot of the shared-memory step holds one rank's values
        rows = [self._from_leader(row) for row in rows]
        return [jnp.stack([row[i] for row in rows]) for i in range(len(values))]

    def broadcast(self, values: Sequence[Any], root: int) -> list[Any]:
        t = self.topology
        root_node, root_local = t.node_of(root), t.local_of(root)
        if t.node_rank == root_node and root_local != self.leader_local and self.local is not None:
            values = self.local.broadcast(values, root_local)       # to the root node's leader
        if self.across is not None:
            values = self.across.broadcast(values, root_node)
        return self._from_leader(values)

    # --- buffers: the shared-memory step's ----------------------------------------------------
    def reserve(self, reservation: Reservation) -> None:
        if self.local is not None:
            self.local.reserve(reservation)

    def refresh(self) -> None:
        if self.local is not None:
            self.local.refresh()

    def release(self) -> None:
        if self.local is not None:
            self.local.release()
        if self.across is not None:
            self.across.release()
