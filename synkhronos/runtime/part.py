"""The base of the parts a runtime's :class:`~.state.State` owns, one per job."""

from __future__ import annotations

from typing import Any

__all__ = ["Part"]


class Part:
    """One job of a runtime: its registry, calls, collectives, loops or timeline.

    Parameters
    ----------
    state : State
        The runtime it belongs to (its channel, Data store, topology, the other parts).
    """

    def __init__(self, state: Any) -> None:
        self._state = state
