"""Where a process sits among the nodes: its node, the node's devices, global ranks.

Every node runs the same script with the same number of devices; global rank
``node_rank * n_local + local_rank`` numbers every device of every node, node
after node. The master sends its :class:`Topology` to its workers with their
start-up settings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """The nodes of a runtime and this node's place among them.

    Attributes
    ----------
    n_nodes, node_rank : int
        How many nodes run the script, and which one this is.
    n_local : int
        Devices (processes) on every node.
    coordinator : str or None
        ``host:port`` of the JAX coordination service (a process node 0's
        master starts serves it); None on one node (a loopback port of its own).

    Examples
    --------
    >>> t = Topology(n_nodes=2, node_rank=1, n_local=3, coordinator="10.0.0.1:7777")
    >>> t.n_devices, t.offset, t.global_rank(2), t.node_of(4), t.local_of(4)
    (6, 3, 5, 1, 1)
    """

    n_nodes: int = 1
    node_rank: int = 0
    n_local: int = 1
    coordinator: str | None = None

    @property
    def n_devices(self) -> int:
        """Devices of every node together."""
        return self.n_nodes * self.n_local

    @property
    def offset(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.n_local

    @property
    def several_nodes(self) -> bool:
        return self.n_nodes > 1

    def global_rank(self, local_rank: int) -> int:
        return self.offset + local_rank

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank``."""
        return rank // self.n_local

    def local_of(self, rank: int) -> int:
        """The local rank, on its own node, of global rank ``rank``."""
        return rank % self.n_local

    def ranks_of(self, node: int) -> range:
        """The global ranks of ``node``."""
        return range(node * self.n_local, (node + 1) * self.n_local)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
