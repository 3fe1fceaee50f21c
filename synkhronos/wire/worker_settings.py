"""The start-up settings a master hands each worker it launches (as JSON, in ``SYNK_WORKER``)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = ["WorkerSettings"]


class WorkerSettings(TypedDict):
    """What a worker needs to join its runtime, from its master.

    Examples
    --------
    >>> s = WorkerSettings(prefix="synk_1", rank=1, n_ranks=2, coordinator="127.0.0.1:1234",
    ...                    topology={}, platform="cpu", timeout=60.0, spin=0.001, comm="shm",
    ...                    float_x="float64", threads=1, profile=False, compile_cache=None,
    ...                    host_faces=True)
    >>> s["rank"], "master_pid" in s
    (1, False)
    """

    #: the names of the runtime's shared-memory segments start with it
    prefix: str
    #: the worker's rank on its node, and the node's number of ranks
    rank: int
    n_ranks: int
    #: host:port of JAX's coordination service
    coordinator: str
    #: :meth:`synkhronos.wire.topology.Topology.to_dict`
    topology: dict
    platform: str
    timeout: float
    spin: float
    #: the collectives class, as "module:qualified name"
    comm: str
    float_x: str
    threads: int
    profile: bool
    compile_cache: str | None
    host_faces: bool
    #: added when the worker is launched: its master's pid, where its native crash stacks go, and
    #: whether it asks for the parent-death signal
    master_pid: NotRequired[int]
    fault_fd: NotRequired[int | None]
    die_with_parent: NotRequired[bool]
