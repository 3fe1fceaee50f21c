"""Static shapes a user declared, checked against the values a call or a collective would use.

Every rank compiles its functions for the declared static shapes, so the
master refuses, before any process wakes, a value that contradicts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

__all__ = ["shape_text", "declared_rows", "contradicts", "check_argument_shape",
           "check_shared_shape"]


def shape_text(shape: Sequence[int | None]) -> str:
    """A static shape as one writes it in ``pt.tensor(shape=...)``, ``None`` for a free length.

    Examples
    --------
    >>> shape_text((None, 3)), shape_text((None,))
    ('(None, 3)', '(None,)')
    """
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + \
        ("," if len(shape) == 1 else "") + ")"


def declared_rows(var: Variable, axis: int = 0) -> int | None:
    """The static row count of ``var`` along its row ``axis`` (``pt.tensor(shape=(8, 3))``: 8), or None.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> declared_rows(pt.tensor("x", shape=(8, 3))), declared_rows(pt.matrix("y"))
    (8, None)
    >>> declared_rows(pt.tensor("x", shape=(8, None)), axis=1)
    """
    return var.type.shape[axis] if var.type.ndim else None


def contradicts(declared: Sequence[int | None], shape: Sequence[int], free_axis: int | None = None) -> bool:
    """True if ``shape`` differs from ``declared`` on a fixed axis (but ``free_axis``) or in length.

    Examples
    --------
    >>> contradicts((None, 3), (5, 3)), contradicts((None, 3), (5, 4)), contradicts((2, 3), (5, 3), 0)
    (False, True, False)
    >>> contradicts((2, 3), (2, 7), 1), contradicts((2, 3), (5, 7), 1)
    (False, True)
    """
    return len(declared) != len(shape) or \
        any(d is not None and d != n for a, (d, n) in enumerate(zip(declared, shape)) if a != free_axis)


def check_argument_shape(var: Variable, name: str, shape: Sequence[int], row_axis: int | None = None) -> None:
    """Raise TypeError if argument ``shape`` contradicts the static shape input ``var`` declares.

    A scattered input's rows (along its ``row_axis``; None for an input given
    whole) are free: the argument may hold more rows than a call uses. A
    static length declared along them is refused (the split axis a Data
    declares is known only at the call).
    """
    if row_axis is not None and declared_rows(var, row_axis) is not None:
        raise TypeError(f"input {name!r} is split along axis {row_axis}, but it is declared with "
                        f"static shape {shape_text(var.type.shape)} there, and each device computes "
                        f"its own share of the rows; declare that axis free (None) in its "
                        f"pt.tensor(..., shape=...)")
    if contradicts(var.type.shape, tuple(shape), row_axis):
        raise TypeError(f"input {name!r} is declared with shape {shape_text(var.type.shape)} but "
                        f"the argument has shape {tuple(shape)}; give an argument of that shape or "
                        f"declare the axis free (None) in its pt.tensor(..., shape=...)")


def check_shared_shape(var: Variable, shape: Sequence[int], what: str) -> None:
    """Raise ValueError if ``what`` would give shared ``var`` a ``shape`` its static shape forbids.

    Every rank compiles its functions for the declared shape, so a value of
    another shape would be computed on wrongly.
    """
    if contradicts(var.type.shape, tuple(shape)):
        raise ValueError(f"{what} would give {var} shape {tuple(shape)} on some rank, but it is "
                         f"declared with static shape {shape_text(var.type.shape)}; make it with "
                         f"pytensor.shared(value, shape=(None, ...)) to let that axis change")
