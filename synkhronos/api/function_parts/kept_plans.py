"""The validated plans of a function's repeated calls: a loop's call is validated once.

A training loop repeats one call shape: the same Data (same segment
generation and shape, so the same rows are valid), or numpy arguments of the
same shapes and of their inputs' own dtypes (staged into the same Data), a
fixed ``batch`` size and ``num_slices``. Such a call reuses its plan and skips
its validation. A ``batch`` of explicit indices (a numpy array) into Data that
are not ``minibatch`` reuses the plan of the last call with as many indices,
and only the new indices are validated (by the caller). So does a ``batch_s``
of one index array per rank (its rows are checked against every rank's
lengths, which are kept until a command may change them). Other forms of
``batch_s``, keywords and numpy arguments that need a cast always take the
full path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data import Data

if TYPE_CHECKING:
    from ...runtime.state import State
    from ...wire.plan import CallPlan
    from ...wire.spec import FunctionSpec

#: numpy arguments a call stages through its function's Data: ``(input index, array)`` pairs
Staged = Sequence[tuple[int, np.ndarray]]

__all__ = ["KeptPlans", "PLANS_KEPT"]

#: validated plans a function keeps for repeated calls
PLANS_KEPT = 16
#: marks a plan key of explicit indices, and a numpy argument's shape in one
_INDICES, _STAGED = object(), object()


class KeptPlans:
    """The plans one function keeps, by what makes a plan reusable (see the module notes).

    ``scratch`` is the function's staging Data by input index (filled by its
    full path): a kept plan of numpy arguments reads them, and
    :meth:`find` writes a repeated call's values into them.
    """

    def __init__(self, state: State, spec: FunctionSpec, scratch: Mapping[int, Data]) -> None:
        self._state, self._spec, self._scratch = state, spec, scratch
        self._n_inputs = len(spec.all_inputs)
        self._input_types = [(np.dtype(var.type.dtype), var.type.ndim) for var in spec.all_inputs]
        #: per key, a box the first call with it fills with its validated plan
        self._boxes: Callable[[Hashable], list[CallPlan]] = functools.lru_cache(maxsize=PLANS_KEPT)(lambda key: [])

    def find(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any, batch_s: Any, num_slices: Any,
             output_subset: Any) -> tuple[list[CallPlan], CallPlan | None]:
        """``(box, plan)``: the kept plan of such a call (its numpy arguments staged), or None,
        and the box (a list) to put the call's validated plan in."""
        key, staged = self._key(args, kwargs, batch, batch_s, num_slices, output_subset)
        if key is None:
            return [], None
        box = self._boxes(key)
        plan = box[0] if box else None
        if plan is not None and staged and not self._restage(plan, staged):
            del box[:]           # its staging Data were given other shapes since: plan anew
            plan = None
        return box, plan

    def _key(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any, batch_s: Any, num_slices: Any,
             output_subset: Any) -> tuple[tuple[Any, ...] | None, Staged]:
        """``(key, staged)``: what makes a validated plan reusable (None for calls validated every
        time), and the numpy arguments the call stages, as ``(input index, array)`` pairs."""
        refused: tuple[None, Staged] = None, ()
        if kwargs or output_subset is not None:
            return refused
        sliced = _per_rank_indices(batch_s) if self._spec.sliceable_shareds else None
        if sliced is None and (batch_s is not None or self._spec.sliceable_shareds):
            return refused
        indexed = type(batch) is np.ndarray
        if not (batch is None or type(batch) is int or indexed) or type(num_slices) is not int \
                or len(args) != self._n_inputs:
            return refused
        key: list[Any] = [(_INDICES, batch.shape) if indexed else batch, num_slices, sliced]
        staged: list[tuple[int, np.ndarray]] = []
        for i, d in enumerate(args):
            if type(d) is not Data:
                value = _as_own_dtype(d, self._input_types[i])
                if value is None or indexed:
                    return refused
                staged.append((i, value))
                key.append((_STAGED, value.shape))
                continue
            if not d.belongs_to(self._state) or d.shape is None or \
                    (indexed and d.minibatch):    # a minibatch Data's offset follows the indices
                return refused
            key.append((d.id, d.gen, d.shape, d.minibatch))
        return tuple(key), staged

    def _restage(self, plan: CallPlan, staged: Staged) -> bool:
        """Write the numpy arguments ``staged`` into the staging Data ``plan`` reads; False if
        one of those Data has another shape or segment now (the plan no longer fits)."""
        refs = plan.scattered + plan.bcast
        for i, value in staged:
            scratch, ref = self._scratch.get(i), refs[i]
            if scratch is None or scratch.id != ref.data_id or scratch.gen != ref.gen or \
                    scratch.shape != value.shape:
                return False
            scratch.data[...] = value
        return True


def _per_rank_indices(batch_s: Any) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of ``batch_s`` given as one index array per rank (a list or tuple of numpy
    arrays, what a device-data training loop passes), or None for any other form.

    Examples
    --------
    >>> _per_rank_indices([np.arange(3), np.arange(2)]), _per_rank_indices(None)
    (((3,), (2,)), None)
    """
    if type(batch_s) not in (list, tuple) or not batch_s or \
            any(type(b) is not np.ndarray for b in batch_s):
        return None
    return tuple(b.shape for b in batch_s)


def _as_own_dtype(value: Any, dtype_ndim: tuple[np.dtype, int]) -> np.ndarray | None:
    """``value`` as a numpy array if it already has the input's dtype and ndim (a Python scalar
    for a 0-d input of its kind included), else None.

    Examples
    --------
    >>> _as_own_dtype(3, (np.dtype("int64"), 0)), _as_own_dtype(3, (np.dtype("int32"), 0))
    (array(3), None)
    """
    dtype, ndim = dtype_ndim
    if type(value) is not np.ndarray:
        if type(value) not in (int, float) or ndim:
            return None
        value = np.asarray(value)
    return value if value.dtype == dtype and value.ndim == ndim else None
