"""The ``batch``, ``batch_s`` and ``num_slices`` arguments of a call, validated in the master.

The master validates a batch completely before any process is woken; every
process then gathers its own rows of it from shared memory.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...wire.batch import Batch, batch_from_spec
from .split_axes import time_major_example

if TYPE_CHECKING:
    from ...wire.plan import CallPlan
    from ..data import Data

__all__ = ["parse_batch", "parse_batch_s", "check_num_slices", "node_local"]


def check_num_slices(num_slices: Any) -> int:
    """Validate ``num_slices`` (an int >= 1)."""
    try:
        k = operator.index(num_slices)
    except TypeError:
        raise TypeError(f"num_slices must be an int >= 1, got {num_slices!r}") from None
    if k < 1:
        raise ValueError(f"num_slices must be >= 1, got {k}")
    return k


def parse_batch(batch: Any, datas: Sequence[Data], names: Sequence[str],
                axes: Sequence[int] | None = None) -> tuple[Batch, list[int]]:
    """Validate ``batch`` against the scattered inputs' Data; return (Batch, offsets).

    Parameters
    ----------
    batch : None, int, slice, or sequence of int
    datas : list of Data
        The scattered inputs.
    names : list of str
        Their names, for messages.
    axes : list of int, optional
        The axis each input's rows lie along (default: axis 0 of every one).

    Returns
    -------
    Batch, list of int
        The batch and, per input, the row number that its row 0 stands for
        (non-zero only for ``minibatch=True`` Data).
    """
    axes = [0] * len(datas) if axes is None else axes
    lengths = [_shape(d)[axis] if d.ndim else 1 for d, axis in zip(datas, axes)]
    if batch is None:
        if len(set(lengths)) > 1:
            raise ValueError(_lengths_differ(datas, names, axes, lengths))
        total = lengths[0] if lengths else 0
        return Batch(total=total, start=0, stop=total), [0] * len(datas)
    spec = batch_from_spec(batch, min(lengths) if lengths else 0)
    low, high = spec.lowest(), spec.highest()
    offsets: list[int] = []
    # a range is checked by its stop even when empty: slice(5, 5) of 3 rows is out of range
    high = spec.stop - 1 if spec.is_range else high
    for d, name, length, axis in zip(datas, names, lengths, axes):
        offset = low if d.minibatch else 0
        if high - offset >= length:
            where = f"{high}" + (f" (row {high - offset} of minibatch Data starting at {offset})"
                                  if d.minibatch else "")
            along = f" along axis {axis}" if axis else ""
            raise IndexError(f"batch index {where} is out of range for input {name!r} "
                             f"with {length} rows{along}")
        offsets.append(offset)
    return spec, offsets


def _shape(d: Data) -> tuple[int, ...]:
    """The shape of a call's scattered input ``d`` (its caller checked that it holds a value)."""
    assert d.shape is not None, "a call's Data hold values"
    return d.shape


def _lengths_differ(datas: Sequence[Data], names: Sequence[str], axes: Sequence[int],
                    lengths: Sequence[int]) -> str:
    """What a call says when its scattered inputs have different numbers of rows."""
    listing = ", ".join(f"{n}: {L} along axis {a}" for n, L, a in zip(names, lengths, axes))
    text = (f"scattered inputs have different lengths along their row axes ({listing}); make them "
            f"equal or pass batch= to choose rows")
    if any(axes):
        return text
    # time-major inputs (time, samples) whose samples match the other inputs' rows
    others = set(lengths)
    time_major = [n for d, n, L in zip(datas, names, lengths)
                  if d.ndim >= 2 and _shape(d)[1] in others - {L}] or names[:1]
    return (f"{text}. Rows are axis 0 unless declared: for inputs whose examples lie along another "
            f"axis (time-major sequences, (time, samples)) declare it, synk.function(..., "
            f"{time_major_example(time_major)}), or synk.data(value, split_axis=1)")


def _is_per_rank(batch_s: Any, n_ranks: int) -> bool:
    """True if ``batch_s`` is a list with one slice / index list per rank."""
    if not isinstance(batch_s, (list, tuple)) or not batch_s:
        return False
    forms = [isinstance(b, (slice, list, tuple, np.ndarray)) for b in batch_s]
    if any(forms) and not all(forms):
        raise TypeError("batch_s mixes slices/lists with plain ints; give one slice or index "
                        "list for every device, or one index list for all")
    if all(forms) and len(batch_s) != n_ranks:
        raise ValueError(f"batch_s has {len(batch_s)} entries but there are {n_ranks} devices; "
                         f"give exactly one slice or index list per device")
    return all(forms)


def parse_batch_s(batch_s: Any, lengths: Sequence[Sequence[int]], names: Sequence[str]) -> list[Batch]:
    """Validate ``batch_s`` against the sliceable shareds' lengths on every rank.

    Parameters
    ----------
    batch_s : None, slice, sequence of int, or a list of one of those per rank
    lengths : list of list of int
        ``lengths[v][r]``: length of sliceable shared ``v`` on rank ``r``.
    names : list of str

    Returns
    -------
    list of Batch
        The rows each rank uses.
    """
    n_ranks = len(lengths[0])
    per_rank = batch_s if _is_per_rank(batch_s, n_ranks) else [batch_s] * n_ranks
    batches: list[Batch] = []
    for rank, spec in enumerate(per_rank):
        rank_lengths = [per_var[rank] for per_var in lengths]
        if spec is None:
            if len(set(rank_lengths)) > 1:
                listing = ", ".join(f"{n}: {L}" for n, L in zip(names, rank_lengths))
                raise ValueError(f"sliceable shareds have different lengths on rank {rank} "
                                 f"({listing}); make them equal or pass batch_s=")
            batches.append(Batch(total=rank_lengths[0], start=0, stop=rank_lengths[0]))
            continue
        b = batch_from_spec(spec, min(rank_lengths))
        for name, length in zip(names, rank_lengths):
            if b.highest() >= length:
                raise IndexError(f"batch_s index {b.highest()} is out of range for sliceable "
                                 f"shared {name!r} with {length} rows on rank {rank}")
        batches.append(b)
    if not any(b.total for b in batches):
        raise ValueError(f"batch_s selects no rows of the sliceable shareds {names} on any device; "
                         f"give at least one row")
    return batches


def node_local(datas: Sequence[Data], names: Sequence[str]) -> bool:
    """Whether a call's scattered inputs are every node's own shard (all of them, or none)."""
    sharded = [d.sharded for d in datas]
    if any(sharded) and not all(sharded):
        mixed = ", ".join(f"{n} ({'sharded' if s else 'a full copy'})" for n, s in zip(names, sharded))
        raise ValueError(f"the scattered inputs mix node shards and full copies: {mixed}; make "
                         f"every one synk.data(..., sharded=True) or none")
    return bool(sharded) and all(sharded)


def with_new_indices(plan: CallPlan, batch: Any, datas: Sequence[Data], names: Sequence[str]) -> CallPlan:
    """A kept ``plan`` of explicit indices for a call with as many indices, ``batch`` (validated
    against the scattered inputs ``datas`` named ``names``, along the plan's row axes)."""
    return plan.with_batch(parse_batch(batch, datas, names, [ref.axis for ref in plan.scattered])[0])
