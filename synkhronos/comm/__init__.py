"""Collective implementations behind one interface.

Every implementation works on one flat array per rank, of equal length on
every rank, and is called by every rank at once:

- ``all_reduce(x, op)`` with op in ``sum``, ``prod``, ``min``, ``max``: every
  rank gets the element-wise reduction;
- ``all_gather(x)``: every rank gets the ``(n_ranks, len(x))`` stack, in rank order;
- ``broadcast(x, root)``: every rank gets root's ``x``.

:class:`~synkhronos.comm.jax_runtime.JaxComm` runs them as jitted ``shard_map``
programs over the JAX multi-process runtime (Gloo on CPU, NCCL on NVIDIA
GPUs). It is the path accelerators use and the test suite runs it on CPU.
"""

from .jax_runtime import JaxComm

__all__ = ["JaxComm", "make_comm"]

_KINDS = {"jax": JaxComm}


def make_comm(kind="jax"):
    """Return the collective implementation named ``kind``."""
    try:
        return _KINDS[kind]()
    except KeyError:
        raise ValueError(f"unknown collective implementation {kind!r}; choose from {sorted(_KINDS)}") from None
