"""Updated shared variables shaped like a call's rows: each device keeps one of its own, said once.

The RBM tutorial's persistent chain holds one row per example. Updated by a
call split over the devices, it becomes one chain of the whole batch per
device (and its update reads no scattered rows, so the
:class:`~synkhronos.LocalUpdatesWarning` of :mod:`.recording` does not fire).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import LocalUpdatesWarning, warn
from ...platform.values import stored

if TYPE_CHECKING:
    from ...wire.spec import FunctionSpec

__all__ = ["BatchShapedState"]


class BatchShapedState:
    """The updated shared variables of one function not yet said to be shaped like its rows.

    Nothing is said with ``local_updates`` (one each is meant), of a sliceable
    shared variable (per-device data by design), or of an update computed from
    the scattered rows (see :class:`~synkhronos.LocalUpdatesWarning`).
    """

    def __init__(self, spec: FunctionSpec, local_updates: bool, given_rows: Sequence[Any] = ()) -> None:
        """``given_rows``: the variables the givens' row slices replace (scattered rows too)."""
        from pytensor.graph.traversal import ancestors
        self._name = spec.name
        rows = set(spec.inputs) | set(given_rows)
        # an update computed from the rows is LocalUpdatesWarning's (or a step's own gradient)
        self._updates = [s for s, value, _ in spec.updates if not rows.intersection(ancestors([value]))]
        self._unsaid = set() if local_updates else {
            id(s) for s in self._updates if all(s is not t for t in spec.sliceable_shareds)}

    def check(self, total: int, rows: list[int]) -> None:
        """Warn once per variable whose first dimension is ``total``, a call's rows split as ``rows``."""
        if not self._unsaid or len(rows) < 2:
            return
        for s in self._updates:
            shape = np.shape(stored(s))
            if id(s) in self._unsaid and shape and shape[0] == total:
                self._unsaid.discard(id(s))
                warn(
                    f"{self._name} updates {s}, whose first dimension ({total}) is the call's rows: "
                    f"each device keeps a {s} of its own ({len(rows)} of them), computed from its own "
                    f"{min(rows)} to {max(rows)} rows; if it holds one row per example (a persistent "
                    f"chain), size it to a device's share, or pass local_updates=True to "
                    f"synk.function if one each is meant", LocalUpdatesWarning)
