"""Every collective, one module each: how the master writes it and what every rank runs of it.

A collective travels through the control block as its :class:`~synkhronos.wire.collective.Kind`,
the uids of its shared variables, then what its own module writes. Each module
holds both sides, so a new collective is one module here (``KIND``,
``encode``, ``prepare``), its entry in :data:`PREPARE`, and a
:class:`~synkhronos.comm.Comm` method:

- ``encode(words, uids, ...)``: the master writes the command (the api layer
  calls it with what it checked);
- ``prepare(context, vars_, words)``: every rank reads it back and builds its
  local buffers (anything that can fail on one rank only happens here), then
  returns ``execute()``, which enters the device collective.

Every rank reports "prepared" before any rank executes, so a rank that fails to
prepare makes the others skip the collective instead of waiting in it forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...platform.values import stored
from . import all_reduce, broadcast, gather, read_data

if TYPE_CHECKING:
    from ...wire.control import Words
    from .contract import CollectiveContext, Prepare

__all__ = ["prepare_collective", "all_reduce", "broadcast", "gather", "read_data", "PREPARE"]

#: what each kind of collective prepares on a rank
PREPARE: dict[int, Prepare] = {module.KIND: module.prepare for module in (all_reduce, broadcast, gather, read_data)}


def prepare_collective(context: CollectiveContext, words: Words) -> Callable[[], list[Any]]:
    """Prepare this rank's part of the collective encoded in ``words``; return its ``execute()``.

    ``context`` is this rank's :class:`~synkhronos.rank.context.RankContext`: its node's master
    keeps or returns the results; a broadcast sends from the root rank (node 0's master).

    ``execute()`` runs the collective, waits until it is finished on this
    rank's device, and returns the results the master keeps (empty elsewhere).
    """
    import jax
    kind = words.get()
    vars_ = [context.variable(uid) for uid in words.get_list()]
    prepare = PREPARE.get(kind)
    if prepare is None:
        raise ValueError(f"unknown collective kind {kind}")
    execute = prepare(context, vars_, words)

    def execute_and_wait() -> list[Any]:
        out = execute()
        # JAX dispatches asynchronously; a collective is finished (its errors raised) on return.
        jax.block_until_ready([stored(v) for v in vars_])
        if context.comm_made:
            context.comm.refresh()
        return out
    return execute_and_wait
