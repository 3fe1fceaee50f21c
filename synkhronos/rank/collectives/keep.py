"""A collective's result kept as a variable's value on this rank's device."""

import numpy as np

from ...platform.values import store

__all__ = ["keep_on_device"]


def keep_on_device(var, value):
    """Keep ``value`` (a device array) as ``var``'s value, in ``var``'s dtype."""
    if value.dtype != np.dtype(var.type.dtype):
        value = value.astype(var.type.dtype)
    store(var, value)
