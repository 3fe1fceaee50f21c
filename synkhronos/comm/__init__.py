"""Collective implementations behind one interface.

Every implementation takes a list of arrays of one dtype (the same shapes on
every rank), is called by every rank at once, and returns a list of device
arrays, one per input, in one launch for the whole list:

- ``all_reduce(values, op)`` with op in ``sum``, ``avg``, ``prod``, ``min``, ``max``:
  the element-wise reduction across ranks (``avg``: the sum divided by the number of ranks);
- ``all_gather(values)``: each value stacked across ranks, shape ``(n_ranks, *shape)``;
- ``broadcast(values, root)``: root's values.

:class:`~synkhronos.comm.jax_runtime.JaxComm` runs them as jitted ``shard_map``
programs over the JAX multi-process runtime (Gloo on CPU, NCCL on NVIDIA
GPUs). It is the path accelerators use and the test suite runs it on CPU.
:class:`~synkhronos.comm.shm.ShmComm` is the CPU-only path through shared
memory, the default on CPU because it runs near memory bandwidth.

Either may also define ``reserve(nbytes, result_bytes, reduce_bytes)``, which the
master calls before a collective so that buffers of ``nbytes`` per rank fit (and,
for ``ShmComm``, to pick the shared region of a single all-reduce result and the
path of a large all-reduce: :mod:`synkhronos.comm.paths`), and ``refresh()``,
which every rank calls after a collective.
"""

from .jax_runtime import JaxComm
from .shm import ShmComm

__all__ = ["JaxComm", "ShmComm", "make_comm", "KINDS", "default_kind"]

KINDS = ("jax", "shm")


def default_kind(platform):
    """Shared memory on CPU, the JAX runtime (NCCL on NVIDIA GPUs) elsewhere."""
    return "shm" if platform == "cpu" else "jax"


def make_comm(kind, **shm_context):
    """Return the collective implementation named ``kind`` ("jax" or "shm").

    ``shm_context`` holds what :class:`ShmComm` needs (control block, prefix,
    ranks, liveness check); the JAX runtime needs nothing.
    """
    if kind == "jax":
        return JaxComm()
    if kind == "shm":
        return ShmComm(**shm_context)
    raise ValueError(f"unknown collective implementation {kind!r}; choose from {list(KINDS)}")
