"""The common causes of a rank's error in a call, recognised from its message, and their fixes.

A :class:`~synkhronos.WorkerError` from a call gets the first hint whose
pattern its message matches (:func:`add_hint`). Each hint knows what the call
was: the rows each device got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CallRows", "add_hint"]


@dataclass(frozen=True)
class CallRows:
    """The rows of a call: every device's share of ``total`` (0 for a call without scattered inputs)."""

    per_device: tuple
    total: int


def _batch_in_a_reshape(match, rows):
    if not rows.total or len(set(rows.per_device)) == 0:
        return None
    shares = sorted(set(rows.per_device))
    share = str(shares[0]) if len(shares) == 1 else f"{shares[0]} to {shares[-1]}"
    return (f"each device gets {share} of the call's {rows.total} rows: write -1 or x.shape[0] for "
            f"the batch axis of the reshape instead of a batch size")


def _static_shapes(match, rows):
    return ("the graph needs a concrete shape that synkhronos could not give it by compiling per "
            "row count; declare the input's other axes in its type (pt.tensor(shape=(None, 28, 28)))")


#: (pattern of the message, hint maker) in the order they are tried
HINTS = [
    (re.compile(r"cannot reshape array of shape \((\d+)"), _batch_in_a_reshape),
    (re.compile(r"Shapes must be 1D sequences of concrete values|Tracer"), _static_shapes),
]


def add_hint(error, rows: CallRows):
    """Give ``error`` (a WorkerError) the hint of the first pattern its message matches, if any."""
    for pattern, make in HINTS:
        match = pattern.search(error.message)
        if match:
            error.hint = make(match, rows)
            if error.hint:
                return
