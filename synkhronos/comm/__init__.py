"""Collective implementations behind one interface (:class:`~synkhronos.comm.base.Comm`).

:class:`~synkhronos.comm.jax_runtime.JaxComm` runs them as jitted ``shard_map``
programs over the JAX multi-process runtime (Gloo on CPU, NCCL on NVIDIA
GPUs). It is the path accelerators use and the test suite runs it on CPU.
:class:`~synkhronos.comm.shm.ShmComm` is the CPU-only path through shared
memory, the default on CPU because it runs near memory bandwidth.

``fork(collectives=...)`` takes a name in :data:`KINDS` or a :class:`Comm`
subclass of one's own (importable by the workers under the same module path).
"""

from __future__ import annotations

import importlib

from .base import Comm, CommContext, ProgramReducer, Reservation
from .jax_runtime import JaxComm
from .shm import ShmComm

__all__ = ["Comm", "CommContext", "ProgramReducer", "Reservation", "JaxComm", "ShmComm", "KINDS", "default_kind",
           "comm_class", "class_path"]

#: the implementations ``fork(collectives=...)`` knows by name
KINDS: dict[str, type[Comm]] = {"jax": JaxComm, "shm": ShmComm}


def default_kind(platform: str) -> str:
    """Shared memory on CPU, the JAX runtime (NCCL on NVIDIA GPUs) elsewhere."""
    return "shm" if platform == "cpu" else "jax"


def class_path(cls: type) -> str:
    """``module:qualname`` of a Comm class, how a worker finds it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def comm_class(kind: str | type[Comm]) -> type[Comm]:
    """The Comm class named ``kind``: a name in :data:`KINDS`, a class, or its ``module:qualname``.

    Examples
    --------
    >>> comm_class("shm").__name__, comm_class("synkhronos.comm:JaxComm").__name__
    ('ShmComm', 'JaxComm')
    """
    if isinstance(kind, type) and issubclass(kind, Comm):
        return kind
    if isinstance(kind, str) and kind in KINDS:
        return KINDS[kind]
    if isinstance(kind, str) and ":" in kind:
        module, _, name = kind.partition(":")
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, type) and issubclass(obj, Comm):
            return obj
    raise ValueError(f"collectives must be one of {list(KINDS)} or a subclass of "
                     f"synkhronos.comm.Comm, got {kind!r}")
