"""What one node's launcher runs: :class:`LaunchSpec`."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchSpec"]


@dataclass(frozen=True)
class LaunchSpec:
    """One node's launch: the script, this node, the run's nodes and how often it may restart.

    Attributes
    ----------
    script : str
    args : tuple of str
        The script's command line after its name.
    node_rank : int
        This node (its launcher's ``--node-rank``).
    coordinator : str
        ``HOST:PORT`` of node 0: its coordination service, or its rendezvous (elastic).
    min_nodes, max_nodes : int
        The run's nodes: on as few as ``min_nodes`` (elastic), at most ``max_nodes``.
    max_restarts : int
        Elastic: how often the script may start again after a failure.
    devices_per_node : int or None
        Devices (processes) per node; None: what ``fork()`` finds.
    join_timeout : float
        Elastic: seconds a launcher waits for a round to start.

    Examples
    --------
    >>> spec = LaunchSpec("train.py", ("--epochs", "3"), node_rank=1, coordinator="10.0.0.1:7777",
    ...                   min_nodes=2, max_nodes=4)
    >>> spec.elastic, spec.job
    (True, 'train.py --nnodes 2:4')
    >>> spec.environment(nnodes=3, node_rank=1, coordinator="10.0.0.1:7778", restarts=1)["SYNK_NNODES"]
    '3'
    """

    script: str
    args: tuple[str, ...] = ()
    node_rank: int = 0
    coordinator: str = ""
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int = 0
    devices_per_node: int | None = None
    join_timeout: float = 300.0

    @property
    def elastic(self) -> bool:
        """Whether the launcher is an agent: fewer nodes may run, or the script may restart."""
        return self.min_nodes < self.max_nodes or self.max_restarts > 0

    @property
    def job(self) -> str:
        """What every launcher of one run runs (a launcher of another run is refused); the
        script's arguments may differ between nodes."""
        return f"{os.path.basename(self.script)} --nnodes {self.min_nodes}:{self.max_nodes}"

    def environment(self, nnodes: int, node_rank: int, coordinator: str,
                    restarts: int | None = None) -> dict[str, str]:
        """The variables :func:`synkhronos.fork` reads, for a script on ``node_rank`` of ``nnodes``
        (``restarts``: the rounds of an elastic run before this one)."""
        env = {"SYNK_NNODES": str(nnodes), "SYNK_NODE_RANK": str(node_rank),
               "SYNK_COORDINATOR": coordinator}
        if restarts is not None:
            env["SYNK_RESTART_COUNT"] = str(restarts)
        if self.devices_per_node is not None:
            env["SYNK_DEVICES_PER_NODE"] = str(self.devices_per_node)
        return env
