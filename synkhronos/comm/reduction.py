"""Output and update modes: accumulating over slices in a rank, reducing across ranks.

``"avg"`` is weighted by the rows each slice and each rank really computed,
so the mean over an uneven split equals the mean over the whole batch.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["owned", "Reduce", "GATHER", "OUTPUT_MODES", "UPDATE_MODES", "COMBINE", "check_output_mode",
           "check_update_mode", "Accumulator", "reduce_ranks", "reduce_outputs"]


class Reduce(enum.StrEnum):
    """The reductions: one vocabulary for outputs, updates, collectives and every ``Comm``.

    A member is its name as a string (``Reduce.AVG == "avg"``), so users pass
    plain strings; :attr:`code` is how it travels in the control block.

    Examples
    --------
    >>> Reduce("max"), Reduce.of_code(Reduce.SUM.code)
    (<Reduce.MAX: 'max'>, <Reduce.SUM: 'sum'>)
    >>> Reduce.named("mean")
    Traceback (most recent call last):
    ...
    ValueError: op must be one of ['avg', 'sum', 'prod', 'min', 'max'], got 'mean'
    """
    AVG = "avg"
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"

    @property
    def code(self) -> int:
        return _CODES[self]

    @classmethod
    def of_code(cls, code: int) -> Reduce:
        return list(cls)[code]

    @classmethod
    def named(cls, op: str, what: str = "op") -> Reduce:
        """The member named ``op``, or a ValueError listing them (``what`` names the argument)."""
        try:
            return cls(op)
        except ValueError:
            raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {op!r}") from None


_CODES = {member: code for code, member in enumerate(Reduce)}
#: what an output may do besides reducing: concatenate the slices' rows in order
GATHER = "gather"
OUTPUT_MODES = (*(m.value for m in Reduce), GATHER, None)
UPDATE_MODES = (*(m.value for m in Reduce), None)


def _is_integer(dtype: npt.DTypeLike) -> bool:
    return np.issubdtype(np.dtype(dtype), np.integer) or np.dtype(dtype) == np.bool_


def check_output_mode(var: Any, mode: str | None) -> str | None:
    """Validate ``mode`` for output ``var``; return it."""
    if mode not in OUTPUT_MODES:
        raise ValueError(f"output mode {mode!r} for {var} is not one of {list(OUTPUT_MODES)}")
    if mode == "avg" and _is_integer(var.type.dtype):
        raise TypeError(f"output {var} has integer dtype {var.type.dtype}, which 'avg' cannot "
                        f"average exactly: give it as ({var}, 'gather') for each row's value (predictions), "
                        f"({var}, None) for the master's own, ({var}, 'sum') to add the devices' (and "
                        f"divide yourself), or cast it to float")
    if mode == GATHER and var.type.ndim == 0:
        raise TypeError(f"output {var} is 0-d; 'gather' concatenates along axis 0, so give it "
                        f"at least one dimension (e.g. pt.shape_padleft) or choose another mode")
    return mode


def check_update_mode(shared: Any, mode: str | None) -> str | None:
    if mode not in UPDATE_MODES:
        raise ValueError(f"update mode {mode!r} for {shared} is not one of {list(UPDATE_MODES)}")
    return mode


class Accumulator:
    """Accumulates one value over the slices a rank computes.

    Works on device arrays (jax) or numpy alike: only ``+``, ``-``, ``*`` and
    the ``xp`` module's minimum/maximum/concatenate are used. ``"gather"``
    concatenates along ``axis``. With an ``origin`` (an update's value before
    the call, under ``"sum"``), the slices' changes from it are summed onto it.

    Examples
    --------
    >>> counter = Accumulator("sum", np, origin=np.array(100))
    >>> for value in (102, 103, 105):        # each slice: 100 + its rows
    ...     counter.add(np.array(value), 1)
    >>> int(counter.result())
    110
    """

    def __init__(self, mode: str | None, xp: ModuleType, axis: int = 0, origin: Any = None) -> None:
        self.mode = mode
        self.xp = xp
        self.axis = axis
        self.origin = origin
        self.value: Any = None
        self.parts: list[Any] = []
        self.rows = 0

    def add(self, value: Any, rows: int) -> None:
        mode, xp = self.mode, self.xp
        if self.origin is not None:
            value = value - self.origin
        if mode == GATHER:
            self.parts.append(value)
        elif self.value is None:
            self.value = value * rows if mode == "avg" else value
        elif mode == "avg":
            self.value = self.value + value * rows
        elif mode == "sum":
            self.value = self.value + value
        elif mode == "prod":
            self.value = self.value * value
        elif mode == "min":
            self.value = xp.minimum(self.value, value)
        elif mode == "max":
            self.value = xp.maximum(self.value, value)
        else:  # None: the last slice's value
            self.value = value
        self.rows += rows

    def result(self) -> Any:
        if self.mode == GATHER:
            return self.parts[0] if len(self.parts) == 1 else concatenated(self.parts, self.axis, self.xp)
        if self.mode == "avg":
            return self.value / self.rows
        return self.value if self.origin is None else self.origin + self.value


def concatenated(parts: Collection[Any], axis: int, xp: ModuleType = np) -> Any:
    """``parts`` (each device's or slice's share of a "gather" output) concatenated along ``axis``.

    Shares that differ on another axis than ``axis`` were split along another
    axis than the output's rows (time-major inputs whose output keeps the
    time axis first): the message names ``split_axes``.
    """
    shapes = [tuple(p.shape) for p in parts]
    others = {s[:axis] + s[axis + 1:] for s in shapes}
    if len(others) > 1 or any(len(s) <= axis for s in shapes):
        raise ValueError(
            f"a 'gather' output's shares have the shapes {shapes}, which do not join along axis "
            f"{axis}: its rows lie along another axis (an output of inputs split along axis 1 may "
            f"keep the split axis second); name it in split_axes with the axis its rows lie along, "
            f"e.g. synk.function(..., split_axes={{x: 1, output: 1}})")
    return xp.concatenate(parts, axis=axis)


#: the numpy ufunc of each elementwise reduction
COMBINE: dict[str, np.ufunc] = {Reduce.SUM: np.add, Reduce.PROD: np.multiply, Reduce.MIN: np.minimum,
                                Reduce.MAX: np.maximum}


def reduce_ranks(mode: str, values: np.ndarray | Sequence[np.ndarray], rows: Sequence[int],
                 axis: int = 0) -> np.ndarray | np.generic:
    """Reduce per-rank results in rank order; ``rows`` (a list of int) weights ``"avg"``;
    ``"gather"`` concatenates along ``axis``.

    ``values`` holds only the ranks that computed something (mode None is
    resolved by the caller, which knows which rank is the master): a list of
    numpy arrays, or, for a scalar output, one 1-D array over those ranks
    (reduced in one ufunc call).
    """
    if mode == GATHER:
        return concatenated(values, axis, np)
    if isinstance(values, np.ndarray):
        if mode == "avg":
            return np.dot(values, rows) / sum(rows)
        return COMBINE[mode].reduce(values)
    shapes = {np.shape(v) for v in values}
    if len(shapes) > 1:
        # (numpy would broadcast a (3, 1) part into a (3, 2) one: a number, and a wrong one)
        raise ValueError(f"the devices' parts of an output have the shapes {sorted(shapes)}, which mode "
                         f"{mode!r} cannot combine element by element; an output that keeps rows (or "
                         f"columns made of them, like x.T) needs mode 'gather' (with split_axes for "
                         f"another axis) or None")
    if mode == "avg":
        total = sum(rows)
        out = sum(v * (r / total) for v, r in zip(values, rows))
        return np.asarray(out, dtype=np.result_type(values[0]))
    combine = COMBINE[mode]
    out = values[0]
    for v in values[1:]:
        out = combine(out, v)
    return np.asarray(out)


def reduce_outputs(columns: Sequence[np.ndarray | Sequence[np.ndarray]], subset: Sequence[int],
                   rows: Sequence[int], master_rank: int,
                   reductions: Sequence[tuple[str | None, npt.DTypeLike, int]]) -> list[np.ndarray]:
    """Reduce each selected output of a call across ranks.

    ``columns[j]`` holds every rank's result of output ``subset[j]``,
    ``rows[r]`` the rows rank ``r`` computed, ``reductions[i]`` output ``i``'s
    (mode, declared dtype, gather axis). Ranks that computed no rows are left
    out. Mode None takes the master's result, or the lowest computing rank's
    if the master had no rows. Each output has the dtype of its symbolic
    variable.
    """
    if not columns:
        return []
    everyone = 0 not in rows
    ranks = [rank for rank, n in enumerate(rows) if n]
    own = master_rank if rows[master_rank] else ranks[0]
    weights = rows if everyone else [rows[rank] for rank in ranks]
    reduced: list[np.ndarray] = []
    for column, i in zip(columns, subset):
        mode, dtype, axis = reductions[i]
        if mode is None:
            value = column[own]
        else:
            if not everyone:
                column = column[ranks] if isinstance(column, np.ndarray) else [column[r] for r in ranks]
            value = reduce_ranks(mode, column, weights, axis)
        # JAX may compute some reductions wider than the graph declares; return the declared dtype.
        reduced.append(owned(value, dtype))
    return reduced


def owned(value: Any, dtype: npt.DTypeLike) -> np.ndarray:
    """``value`` as a writeable numpy array of ``dtype`` that the caller owns (a device array's
    read-only host view, or the master's own result, is copied).

    Examples
    --------
    >>> view = np.arange(3.0)
    >>> view.flags.writeable = False
    >>> out = owned(view, "float64")
    >>> out.flags.writeable, out is view
    (True, False)
    """
    out = np.asarray(value, dtype=dtype)
    return out if out.flags.writeable and out.flags.owndata else np.array(out)
