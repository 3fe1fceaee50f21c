"""A collective's result kept as a variable's value on this rank's device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...platform.values import store

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["keep_on_device"]


def keep_on_device(var: SharedVariable, value: Any) -> None:
    """Keep ``value`` (a device array) as ``var``'s value, in ``var``'s dtype."""
    if value.dtype != np.dtype(var.type.dtype):
        value = value.astype(var.type.dtype)
    store(var, value)
