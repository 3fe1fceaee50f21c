"""Which node this script runs on: from ``python -m synkhronos.launch``, or from the cluster.

A script started by :mod:`synkhronos.launch` finds its node in the variables
the launcher sets (:data:`LAUNCH_VARS`). Under Slurm (``srun``), Open MPI
(``mpirun``) and the other schedulers JAX knows, JAX's own cluster detection
(the one ``jax.distributed.initialize()`` uses) says how many tasks run, which
one this is and where the coordinator listens; synkhronos runs one task per
node, so its tasks are the nodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from . import internals

__all__ = ["NodePlace", "LAUNCH_VARS", "find_node"]

#: the variables ``python -m synkhronos.launch`` sets for the script
LAUNCH_VARS = ("SYNK_NNODES", "SYNK_NODE_RANK", "SYNK_COORDINATOR", "SYNK_DEVICES_PER_NODE")


@dataclass(frozen=True)
class NodePlace:
    """How many nodes there are, which one this is, where the coordinator listens and how it was found.

    ``devices_per_node`` is what the launcher was given (None: ``fork()``
    decides); ``source`` is ``"launcher"``, the name of JAX's cluster
    environment (``"SlurmCluster"``, ...) or ``"single node"``.
    """

    n_nodes: int
    node_rank: int
    coordinator: str | None
    devices_per_node: int | None = None
    source: str = "single node"


def find_node(environ: Mapping[str, str] | None = None) -> NodePlace:
    """This node's :class:`NodePlace`: the launcher's variables first, then the cluster's.

    Examples
    --------
    >>> place = find_node({"SYNK_NNODES": "2", "SYNK_NODE_RANK": "1",
    ...                    "SYNK_COORDINATOR": "10.0.0.1:7777"})
    >>> place.n_nodes, place.node_rank, place.coordinator, place.source
    (2, 1, '10.0.0.1:7777', 'launcher')
    >>> find_node({}).n_nodes
    1
    """
    environ = os.environ if environ is None else environ
    if "SYNK_NNODES" in environ:
        return _from_launcher(environ)
    if environ is os.environ:
        detected = _from_jax_cluster_detection()
        if detected is not None:
            return detected
    return NodePlace(1, 0, None)


def _from_launcher(environ: Mapping[str, str]) -> NodePlace:
    try:
        n_nodes, node_rank = int(environ["SYNK_NNODES"]), int(environ.get("SYNK_NODE_RANK", 0))
        given = environ.get("SYNK_DEVICES_PER_NODE")
        devices = int(given) if given else None
    except ValueError as e:
        raise ValueError(f"the launcher's variables must be integers ({e}); start the script with "
                         f"python -m synkhronos.launch --nnodes N --node-rank R --coordinator "
                         f"HOST:PORT script.py") from None
    coordinator = environ.get("SYNK_COORDINATOR")
    if n_nodes > 1 and not coordinator:
        raise ValueError("SYNK_COORDINATOR is not set: several nodes need the coordinator's "
                         "HOST:PORT (python -m synkhronos.launch --coordinator HOST:PORT)")
    if coordinator:
        check_coordinator(coordinator)
    return NodePlace(n_nodes, node_rank, coordinator, devices, "launcher")


def check_coordinator(address: str) -> str:
    """Raise ValueError unless ``address`` is ``HOST:PORT`` with a port from 1 to 65535.

    Examples
    --------
    >>> check_coordinator("127.0.0.1:99999")
    Traceback (most recent call last):
    ...
    ValueError: the coordinator must be HOST:PORT with a port from 1 to 65535, got '127.0.0.1:99999'
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"the coordinator must be HOST:PORT with a port from 1 to 65535, got "
                         f"{address!r}")
    return address


#: prefixes of the variables the schedulers JAX detects set; without one, JAX is not imported to look
#: (an import before ``fork()`` configures the environment would let XLA's start-up lines through)
#: (Slurm, Open MPI, Kubernetes; not JAX's TPU-only environments, and not a variable JAX sets itself)
SCHEDULER_VARIABLE_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "KUBERNETES_SERVICE_HOST")


def _from_jax_cluster_detection() -> NodePlace | None:
    """JAX's cluster detection (Slurm, Open MPI, ...): tasks are nodes; None outside a cluster."""
    if not any(name.startswith(SCHEDULER_VARIABLE_PREFIXES) for name in os.environ):
        return None
    detected = internals.detect_jax_cluster()
    if detected is None:
        return None
    name, address, n_tasks, task = detected
    if not n_tasks or n_tasks <= 1:
        return None
    assert task is not None, "JAX's cluster detection names the task of every process it counts"
    return NodePlace(int(n_tasks), int(task), address, None, name)
