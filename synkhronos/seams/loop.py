"""The contracts a rank's extension points are written against, checked by mypy.

- :class:`RuleLoop`: what a sync rule (:mod:`synkhronos.rank.sync`) may use of
  the device loop it runs in. :class:`~synkhronos.rank.loop.DeviceLoop`
  implements it; a new rule subclasses :class:`~synkhronos.rank.sync.Rule` and
  uses nothing else of the loop.
- :class:`CenterClient`: a device's handle on the central parameters of an
  asynchronous rule. :class:`~synkhronos.runtime.centers.shared.Center` (node 0's shared
  memory) and :class:`~synkhronos.runtime.centers.server.RemoteCenter` (node 0's
  server, from another node) implement it; a new transport implements these
  four methods.

The collectives' contract is :class:`synkhronos.comm.Comm` (an abstract base
class).

Examples
--------
>>> import numpy as np
>>> class OneBlock:                     # a center held in this process, for one device
...     def __init__(self, start):
...         self.block, self.claimed = np.array(start, float), 0
...     def claim(self, limit):
...         self.claimed += 1
...         return self.claimed - 1 if self.claimed <= limit else None
...     def exchange(self, pushes, take=np.array):
...         self.block += pushes[0]
...         return [take(self.block)]
...     def values(self):
...         return [self.block.copy()]
...     def close(self):
...         pass
>>> isinstance(OneBlock([0.0]), CenterClient)
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["RuleLoop", "CenterClient"]


@runtime_checkable
class CenterClient(Protocol):
    """A device's handle on an asynchronous rule's central parameters (one block per parameter)."""

    def claim(self, limit: int) -> int | None:
        """The next unit of work below ``limit`` (a counter every device shares), or None."""

    def exchange(self, pushes: Sequence[Any], take: Callable[[Any], Any] = np.array) -> list:
        """One device's exchange: per block, ``take`` of what the rule's merge of ``pushes[i]``
        into block ``i`` answers (under that block's lock)."""
        ...

    def values(self) -> list:
        """A copy of every block."""
        ...

    def close(self) -> None:
        """Let go of the center."""


@runtime_checkable
class RuleLoop(Protocol):
    """What a sync rule may use of the device loop it runs in, on one rank.

    ``params`` are what the rule keeps together: the parameters, then the
    model's ``n_statistics`` statistics (batch norm's running averages);
    ``state_vars`` the optimizer's state. ``center`` is the asynchronous rules'
    central parameters (an error under a synchronous rule). A rule adds the seconds
    it spends syncing to nothing itself: the loop counts the step's time as
    syncing when ``after_update`` says it synchronised; a rate-limited rule
    counts the syncs it skips in ``skipped``.
    """

    rank: int
    n_ranks: int
    params: list
    state_vars: list
    n_statistics: int
    sync_seconds: float
    skipped: int

    @property
    def center(self) -> CenterClient:
        """The central parameters (asynchronous rules only)."""
        ...

    def elapsed(self) -> float:
        """This rank's seconds inside the run's phases so far."""
        ...

    def param_values(self) -> list:
        """The values of ``params`` as host arrays (views on CPU)."""
        ...

    def device_copy(self, host: Any) -> Any:
        """A device array with the values ``host`` has now."""
        ...

    def set_values(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        """Make ``values`` (host or device arrays) the values of ``variables`` on this device."""

    def all_reduce(self, variables: Sequence[Any], values: Sequence[Any], op: str) -> list:
        """``values`` (one per variable of ``variables``) reduced over every rank (``"sum"``,
        ``"avg"``, ...); synchronous rules only."""
        ...

    def broadcast_from_master(self, values: Sequence[Any]) -> list:
        """``values`` as node 0's master holds them, on every rank; synchronous rules only."""
        ...
