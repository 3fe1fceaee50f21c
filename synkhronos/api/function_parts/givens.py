"""The Theano tutorials' idiom: ``givens`` that replace an input by a row slice of shared data.

A large share of Theano code feeds its data so::

    index = T.lscalar()
    train = theano.function([index], cost, updates=updates, givens={
        x: train_set_x[index * batch_size:(index + 1) * batch_size],
        y: T.cast(shared_y, "int32")[index * batch_size:(index + 1) * batch_size]})

:func:`synkhronos.function` takes it as it stands. Each such given (a slice
along the rows of a shared variable, or of an elementwise expression of one,
such as a cast, whose bounds depend only on scalar inputs) becomes a scattered
input of the shared variable's rows, and every call selects the rows
``start:stop`` the scalars give: the rows are split over the devices, and the
result equals ``pytensor.function`` over the same scalars. The scalar inputs
reach every device whole. Each call copies the rows it selects, and only
those, from the variable's value as it is at the call: a ``set_value`` (a
refilled buffer given again included) or an edit of the borrowed value in
place is what the next call reads.

A given that reads shared variables and scalars but selects no rows
(``{s: base * (i + 1)}``, ``{s: table[i]}``) is computed whole on every
device, as ``pytensor.function`` computes it. A 0-d input listed in
``inputs`` (a scalar of the bounds, a learning rate) reaches every device
whole, with givens or without, and a call still takes it in its place. A
given that picks rows of a shared variable by scalars in any other way (a
step, indices computed from a scalar, a slice of a slice, a sum over a
slice) is refused with :data:`RECIPE`: the number of rows would depend on a
value, which no device's JAX function can compile.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import applys_between, graph_inputs, io_toposort
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor, indices_from_subtensor

from ..data import Data, as_pytensor_takes

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

__all__ = ["RowsFromGivens", "RECIPE"]

_MISSING = object()

#: what to write instead of a given synkhronos cannot split
RECIPE = ("keep the data in shared memory and pass the rows per call: x_dat = synk.data(X); "
          "f = synk.function([x, y], ...); f(x_dat, y_dat, batch=slice(start, stop)) (or a list of "
          "row indices)")


@dataclass(frozen=True)
class RowSlice:
    """One given ``key: rows_of(base)[start:stop]`` (``rows_of`` elementwise, e.g. a cast)."""

    key: Variable
    base: SharedVariable
    expression: Variable       # rows_of(base): the sliced expression
    start: Variable | None
    stop: Variable | None


def _bounds_text(start: int | None, stop: int | None) -> str:
    """A slice's bounds as the call's scalars gave them (``-20:0``, ``5:``).

    Examples
    --------
    >>> _bounds_text(-20, 0), _bounds_text(5, None)
    ('-20:0', '5:')
    """
    return f"{'' if start is None else start}:{'' if stop is None else stop}"


def _row_slice(key: Variable, value: Variable) -> RowSlice | None:
    """The :class:`RowSlice` of given ``key: value``, or None if ``value`` is not such a slice."""
    node = value.owner
    if node is None or type(node.op) is not Subtensor or len(node.op.idx_list) != 1:
        return None
    index = node.op.idx_list[0]
    if not isinstance(index, slice) or index.step is not None:
        return None
    bounds = iter(node.inputs[1:])
    start = next(bounds) if index.start is not None else None
    stop = next(bounds) if index.stop is not None else None
    expression = node.inputs[0]
    base = _rowwise_base(expression)
    if base is None:
        return None
    return RowSlice(key, base, expression, start, stop)


def _rowwise_base(expression: Variable) -> SharedVariable | None:
    """The one shared variable ``expression`` is an elementwise function of, row by row, or None."""
    leaves = [v for v in graph_inputs([expression]) if not isinstance(v, Constant)]
    if len(leaves) != 1 or not isinstance(leaves[0], SharedVariable) or leaves[0].ndim < 1:  # type: ignore[attr-defined]
        return None
    base = leaves[0]
    for node in applys_between([base], [expression]):
        if not isinstance(node.op, Elemwise):
            return None
        for other in node.inputs:          # a constant must not vary along the rows
            if (isinstance(other, Constant)
                    and other.ndim == node.outputs[0].ndim  # type: ignore[attr-defined]
                    and not other.type.broadcastable[0]):
                return None
    return base


def _picks_rows(value: Variable, scalars: Iterable[Variable]) -> bool:
    """True if given ``value`` picks rows of shared data by ``scalars`` (see :func:`_axis_picked`)."""
    return _axis_picked(value, scalars) is not None


def _axis_picked(value: Variable, scalars: Iterable[Variable]) -> int | None:
    """The first axis along which given ``value`` picks entries of shared data by ``scalars``, or None.

    ``x[i:i + 3]``, ``x[i::2]``, ``x[arange(i, i + 3)]`` pick rows (of ``x``
    read from a shared variable, ``i`` one of the function's scalars),
    whatever is done with them after: their number depends on a value, which
    no device's JAX function can compile, so only the tutorials' row slice
    can take them. ``x[:, :, :, i:i + 3]`` picks along axis 3 so, and no
    device can compile it either. An integer index (``x[i]``) picks one
    entry and keeps none.
    """
    scalars = set(scalars)
    leaves = list(graph_inputs([value]))
    reads_shared = {v: isinstance(v, SharedVariable) for v in leaves}
    reads_scalar = {v: v in scalars for v in leaves}
    for node in io_toposort(leaves, [value]):
        if isinstance(node.op, (Subtensor, AdvancedSubtensor)) and reads_shared[node.inputs[0]]:
            for axis, index in enumerate(indices_from_subtensor(node.inputs[1:], node.op.idx_list)):
                parts = [index.start, index.stop, index.step] if isinstance(index, slice) else \
                    [index] if getattr(index, "ndim", 0) > 0 else []
                if any(p is not None and reads_scalar.get(p, False) for p in parts):
                    return axis
        for out in node.outputs:
            reads_shared[out] = any(reads_shared[v] for v in node.inputs)
            reads_scalar[out] = any(reads_scalar[v] for v in node.inputs)
    return None


#: the sets of scalar values whose slice bounds a function keeps
BOUNDS_KEPT = 65536
#: the integer types a call's row-selecting scalars are most often given as: given as one of
#: them, a value alone fixes the bounds, found again without converting it to the scalar's type
_PLAIN_INTS = (int, np.int64, np.int32)


class RowsFromGivens:
    """What one function's ``givens`` and 0-d inputs make of its inputs, and what a call selects.

    Built by :meth:`find`; ``inputs``, ``bcast_inputs`` and ``givens`` are the
    function's after the rewrite: the row slices' shared variables become
    scattered inputs of their rows, and every 0-d input of ``inputs`` is
    broadcast (the one rule for scalar inputs, with givens or without: a
    0-d value has no rows to split). A call names its inputs in the user's order
    (:meth:`user_inputs`) and is turned into a call of the rewritten function
    by :meth:`call_arguments`.
    """

    def __init__(self, slices: list[RowSlice], inputs: Sequence[TensorVariable],
                 bcast_inputs: Sequence[TensorVariable], givens: list[tuple[Variable, Variable]]) -> None:
        self.slices = slices
        self._user: list[Variable] = list(inputs) + list(bcast_inputs)
        bases = list(dict.fromkeys(s.base for s in slices))
        self.row_inputs = {b: pt.tensor(f"{b.name or 'data'}_rows", dtype=b.type.dtype,
                                        shape=(None,) + tuple(b.type.shape[1:])) for b in bases}
        replaced = [(s.key, clone_replace(s.expression, [(s.base, self.row_inputs[s.base])]))
                    for s in slices]
        scattered = [v for v in inputs if v.ndim > 0]           # none beside row slices (see find)
        self.inputs = list(self.row_inputs.values()) + scattered
        self.bcast_inputs = [v for v in inputs if v.ndim == 0] + list(bcast_inputs)
        self.givens = replaced + givens
        #: per input of the rewritten function after the row inputs, its place in the user's order
        self._order = [self._user.index(v) for v in scattered + self.bcast_inputs]
        bounds = [b for s in slices for b in (s.start, s.stop)]
        present = [b for b in bounds if b is not None]
        read = list(dict.fromkeys(v for v in graph_inputs(present) if not isinstance(v, Constant)))
        fn = pytensor.function(read, present, mode="FAST_COMPILE") if present else None
        #: the bounds' function, which user inputs it reads, and which bounds are given
        self._bounds = (fn, [self._user.index(v) for v in read], [b is not None for b in bounds])
        #: the bounds computed for the scalar values seen (they depend on nothing else)
        self._bounds_of: dict[Hashable, list[int | None]] = {}
        # the same, by the call's own integers as given (no conversion to the scalars' types)
        self._bounds_of_given: dict[Hashable, list[int | None]] = {}

    @classmethod
    def find(cls, inputs: Sequence[TensorVariable], bcast_inputs: Sequence[TensorVariable],
             givens: Iterable[tuple[Variable, Variable]], name: str) -> RowsFromGivens | None:
        """The rewrite of a function whose ``givens`` read shared data by scalar inputs, or
        whose ``inputs`` hold a 0-d input; else None (the function is recorded as it is).

        Raises
        ------
        TypeError
            For givens that would need splitting but cannot be: the message
            gives the recipe (:data:`RECIPE`).
        """
        scalars = [v for v in list(inputs) + list(bcast_inputs) if v.ndim == 0]
        slices: list[RowSlice] = []
        rest: list[tuple[Variable, Variable]] = []
        for key, value in givens:
            found = _row_slice(key, value)
            # a 0-d shared variable in the bounds is a value too: the number of rows would follow it
            shared_scalars = [v for v in graph_inputs([value])
                              if isinstance(v, SharedVariable) and v.ndim == 0]  # type: ignore[attr-defined]
            if found is not None and _bounds_read_only(found, scalars):
                slices.append(found)
            elif (axis := _axis_picked(value, [*scalars, *shared_scalars])) is not None:
                read = [str(v) for v in shared_scalars if _picks_rows(value, [v])]
                hint = (f" (it reads the bounds from the shared variables {read}: pass them as "
                        f"scalar inputs of the function instead)") if read else ""
                if axis:
                    raise TypeError(
                        f"{name}: givens replaces {key} by {value}, which selects along axis {axis} "
                        f"of a shared variable by scalar inputs: the length it keeps would depend on a "
                        f"value, which no device can compile, and synkhronos splits only rows "
                        f"(shared[start:stop]){hint}; lay the data out with that axis first, or "
                        f"{RECIPE}")
                raise TypeError(
                    f"{name}: givens replaces {key} by {value}, which selects rows of a shared "
                    f"variable in a way synkhronos cannot split over the devices (it splits "
                    f"shared[start:stop] and casts or other elementwise functions of it, with "
                    f"start and stop computed from scalar inputs){hint}; {RECIPE}")
            else:
                rest.append((key, value))
        if not slices:       # a 0-d input has no rows to split: every device gets it whole
            whole = any(v.ndim == 0 for v in inputs)
            return cls([], inputs, bcast_inputs, rest) if whole else None
        rows = [v for v in inputs if v.ndim > 0]
        if rows:
            raise TypeError(
                f"{name}: its givens select rows of shared data by scalar inputs, and it also "
                f"scatters the inputs {[str(v) for v in rows]}: a call's rows come one way or the "
                f"other; make those bcast_inputs, or {RECIPE}")
        return cls(slices, inputs, bcast_inputs, rest)

    def scattered_axes(self, axes: Sequence[int | None]) -> list[int | None]:
        """The split axis of each scattered input after the rewrite, from ``axes``, one per ``inputs``
        given to :meth:`find` (the row slices' inputs split along axis 0: None)."""
        declared = dict(zip(map(id, self._user), axes))
        return [None] * len(self.row_inputs) + [declared[id(v)] for v in self.inputs[len(self.row_inputs):]]

    def user_inputs(self) -> list[Variable]:
        """The inputs a call of the function takes, in the user's order."""
        return self._user

    def user_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> list[Any]:
        """The arguments of a call, one per :meth:`user_inputs` (given by position or by name)."""
        names = [v.name for v in self.user_inputs()]
        if len(args) > len(names):
            raise TypeError(f"{name} takes {len(names)} inputs {names}, got {len(args)}")
        values = list(args) + [_MISSING] * (len(names) - len(args))
        for key, value in kwargs.items():
            if key not in names or values[names.index(key)] is not _MISSING:
                raise TypeError(f"{name} has no input {key!r} left to give; its inputs are {names}")
            values[names.index(key)] = value
        missing = [n for n, v in zip(names, values) if v is _MISSING]
        if missing:
            raise TypeError(f"{name} is missing inputs {missing}")
        return values

    def call_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any, name: str
                       ) -> tuple[list[Any], Any]:
        """A call as a call of the rewritten function: ``(arguments, batch)``.

        With row slices, the arguments start with the rows the call's scalars
        select, read from each shared variable's value now (numpy arrays,
        which the call stages through shared memory), and ``batch`` is None.
        """
        values = self.user_arguments(args, kwargs, name)
        if not self.slices:
            return self._ordered(values), batch
        if batch is not None:
            raise TypeError(f"{name} takes its rows from its givens' slices; batch= does not "
                            f"apply (the scalars of the call select the rows)")
        return self.selected_rows(self.rows(values)) + self._ordered(values), None

    def reference_arguments(self, args: Sequence[Any]) -> list[Any]:
        """The arguments of the single-process function for a call with positional ``args``."""
        values = list(args)
        rows = self.selected_rows(self.rows(values)) if self.slices else []
        return rows + self._ordered(values)

    def _ordered(self, values: Sequence[Any]) -> list[Any]:
        return [values[i] for i in self._order]

    def rows(self, arguments: Sequence[Any]) -> slice:
        """``slice(start, stop)`` of the rows a call with ``arguments`` selects (checked).

        Parameters
        ----------
        arguments : list
            One value per :meth:`user_inputs`.
        """
        if not self.slices:
            raise TypeError("the function's givens select no rows (they are computed whole on "
                            "every device)")
        bounds = self._bounds_for(arguments)
        ranges = []
        for s, start, stop in zip(self.slices, bounds[0::2], bounds[1::2]):
            n = len(s.base.get_value(borrow=True))
            lo, hi, _ = slice(start, stop).indices(n)
            ranges.append((s, lo, max(lo, hi)))
            if hi <= lo:
                raise ValueError(f"the givens select no rows: {s.key} is rows {_bounds_text(start, stop)} "
                                 f"of {s.base}, which has {n}; give a range with at least one row "
                                 f"(PyTensor would compute on an empty slice)")
        first = ranges[0]
        for s, lo, hi in ranges[1:]:
            if (lo, hi) != first[1:]:
                raise ValueError(f"the givens select different rows for {first[0].key} "
                                 f"({first[1]}:{first[2]}) and {s.key} ({lo}:{hi}); synkhronos "
                                 f"splits one range of rows over the devices: give every slice "
                                 f"the same bounds")
        return slice(first[1], first[2])

    def _bounds_for(self, arguments: Sequence[Any]) -> list[int | None]:
        """The slices' bounds (None where a slice gives none) for the scalars in ``arguments``,
        computed once per distinct set of values (the tutorials' minibatch index: one per batch)."""
        fn, reads, present = self._bounds
        given = tuple((type(arguments[i]), arguments[i]) for i in reads)
        plain = all(kind in _PLAIN_INTS for kind, _ in given)
        if plain:
            known = self._bounds_of_given.get(given)
            if known is not None:
                return known
        # (a Data or a constant given for a scalar: its value; a numpy scalar's .data is its bytes)
        scalars = [self._scalar(i, arguments[i].data if isinstance(arguments[i], Constant | Data) else arguments[i])
                   for i in reads]
        for i, value in zip(reads, scalars):
            if value.dtype.kind not in "biuf":
                raise TypeError(f"input {self._user[i].name or i!r} selects the rows of the givens' "
                                f"slices and takes a number, got {arguments[i]!r}")
        key = tuple((a.dtype.str, a.item()) if a.ndim == 0 else None for a in scalars)
        bounds = self._bounds_of.get(key) if None not in key else None
        if bounds is None:
            values = iter(fn(*scalars) if fn is not None else [])
            bounds = [int(next(values)) if p else None for p in present]
            if None not in key and len(self._bounds_of) < BOUNDS_KEPT:
                self._bounds_of[key] = bounds
        if plain and len(self._bounds_of_given) < BOUNDS_KEPT:
            self._bounds_of_given[given] = bounds
        return bounds

    def _scalar(self, i: int, value: Any) -> np.ndarray:
        """Argument ``i`` of a call as a numpy array, a Python number typed as pytensor.function
        types it (``index = pt.iscalar()`` called as ``f(1)``)."""
        if isinstance(value, np.ndarray) or not isinstance(value, (int, float, np.generic)):
            return np.asarray(value)
        return as_pytensor_takes(self._user[i], value, f"input {self._user[i].name or i!r}")

    def selected_rows(self, window: slice) -> list[np.ndarray]:
        """Rows ``window`` of each row input's shared variable, from its value as it is now.

        Read at every call, never kept: a new value, a refilled buffer given
        again, and an edit of the borrowed value in place are all seen.
        """
        return [base.get_value(borrow=True)[window] for base in self.row_inputs]


def _bounds_read_only(found: RowSlice, scalars: Sequence[Variable]) -> bool:
    """True if the slice's bounds are computed from the function's scalar inputs and constants."""
    for bound in (found.start, found.stop):
        if bound is None:
            continue
        leaves = [v for v in graph_inputs([bound]) if not isinstance(v, Constant)]
        if any(v not in scalars for v in leaves):
            return False
    return True
