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
``start:stop`` the scalars give, as ``batch=slice(start, stop)`` over a
:class:`~synkhronos.Data` holding the variable's value would: the rows are
split over the devices, and the result equals ``pytensor.function`` over the
same scalars. The scalar inputs reach every device whole. The shared
variable's value is copied into shared memory at the first call, and again
whenever the variable was given a new value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import applys_between, graph_inputs
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.subtensor import Subtensor

from ..platform.internals import stored

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


def _row_slice(key, value):
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


def _rowwise_base(expression):
    """The one shared variable ``expression`` is an elementwise function of, row by row, or None."""
    leaves = [v for v in graph_inputs([expression]) if not isinstance(v, Constant)]
    if len(leaves) != 1 or not isinstance(leaves[0], SharedVariable) or leaves[0].ndim < 1:
        return None
    base = leaves[0]
    for node in applys_between([base], [expression]):
        if not isinstance(node.op, Elemwise):
            return None
        for other in node.inputs:          # a constant must not vary along the rows
            if isinstance(other, Constant) and other.ndim == node.outputs[0].ndim and \
                    not other.type.broadcastable[0]:
                return None
    return base


def _reads_shared_through(value, scalars):
    """True if given ``value`` indexes a shared variable by some of the function's ``scalars``."""
    leaves = set(graph_inputs([value]))
    return any(isinstance(v, SharedVariable) for v in leaves) and any(s in leaves for s in scalars)


class RowsFromGivens:
    """The row slices of one function's ``givens``, and what a call of it selects.

    Built by :meth:`find`; ``inputs``, ``bcast_inputs`` and ``givens`` are the
    function's after the rewrite (the row inputs scattered, the scalars
    broadcast).
    """

    def __init__(self, slices, inputs, bcast_inputs, givens):
        self.slices = slices
        self.scalars = list(inputs)              # what the user calls the function with, first
        bases = list(dict.fromkeys(s.base for s in slices))
        self.row_inputs = {b: pt.tensor(f"{b.name or 'data'}_rows", dtype=b.type.dtype,
                                        shape=(None,) + tuple(b.type.shape[1:])) for b in bases}
        replaced = [(s.key, clone_replace(s.expression, {s.base: self.row_inputs[s.base]}))
                    for s in slices]
        self.inputs = list(self.row_inputs.values())
        self.bcast_inputs = self.scalars + list(bcast_inputs)
        self.givens = replaced + givens
        bounds = [b for s in slices for b in (s.start, s.stop)]
        present = [b for b in bounds if b is not None]
        read = list(dict.fromkeys(v for v in graph_inputs(present) if not isinstance(v, Constant)))
        fn = pytensor.function(read, present, mode="FAST_COMPILE") if present else None
        #: the bounds' function, which user inputs it reads, and which bounds are given
        self._bounds = (fn, [self.bcast_inputs.index(v) for v in read], [b is not None for b in bounds])
        self._data = {}                            # base -> (Data, the value it was made from)

    @classmethod
    def find(cls, inputs, bcast_inputs, givens, name):
        """The rewrite of a function whose ``givens`` slice shared data by scalar inputs, or None.

        Raises
        ------
        TypeError
            For givens that would need splitting but cannot be: the message
            gives the recipe (:data:`RECIPE`).
        """
        scalars = [v for v in list(inputs) + list(bcast_inputs) if v.ndim == 0]
        slices, rest = [], []
        for key, value in givens:
            found = _row_slice(key, value)
            if found is not None and _bounds_read_only(found, scalars):
                slices.append(found)
            elif _reads_shared_through(value, scalars):
                raise TypeError(
                    f"{name}: givens replaces {key} by {value}, which selects rows of a shared "
                    f"variable in a way synkhronos cannot split over the devices (it splits "
                    f"shared[start:stop] and casts or other elementwise functions of it, with "
                    f"start and stop computed from scalar inputs); {RECIPE}")
            else:
                rest.append((key, value))
        if not slices:
            return None
        rows = [v for v in inputs if v.ndim > 0]
        if rows:
            raise TypeError(
                f"{name}: its givens select rows of shared data by scalar inputs, and it also "
                f"scatters the inputs {[str(v) for v in rows]}: a call's rows come one way or the "
                f"other; make those bcast_inputs, or {RECIPE}")
        return cls(slices, inputs, bcast_inputs, rest)

    def user_inputs(self):
        """The inputs a call of the function takes, in the user's order."""
        return self.bcast_inputs

    def user_arguments(self, args, kwargs, name):
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

    def call_arguments(self, args, kwargs, batch, name, make_data):
        """A call in the idiom as a call of the rewritten function: ``(arguments, batch)``.

        ``make_data(value, shared)`` makes the Data of a shared variable's value.
        """
        if batch is not None:
            raise TypeError(f"{name} takes its rows from its givens' slices; batch= does not "
                            f"apply (the scalars of the call select the rows)")
        values = self.user_arguments(args, kwargs, name)
        window = self.rows(values)
        return self.data(make_data) + values, window

    def rows(self, arguments):
        """``slice(start, stop)`` of the rows a call with ``arguments`` selects (checked).

        Parameters
        ----------
        arguments : list
            One value per :meth:`user_inputs`.
        """
        fn, reads, present = self._bounds
        values = iter(fn(*[np.asarray(getattr(arguments[i], "data", arguments[i])) for i in reads])
                      if fn is not None else [])
        bounds = [int(next(values)) if p else None for p in present]
        ranges = []
        for s, start, stop in zip(self.slices, bounds[0::2], bounds[1::2]):
            n = len(s.base.get_value(borrow=True))
            lo, hi, _ = slice(start, stop).indices(n)
            ranges.append((s, lo, max(lo, hi)))
        first = ranges[0]
        for s, lo, hi in ranges[1:]:
            if (lo, hi) != first[1:]:
                raise ValueError(f"the givens select different rows for {first[0].key} "
                                 f"({first[1]}:{first[2]}) and {s.key} ({lo}:{hi}); synkhronos "
                                 f"splits one range of rows over the devices: give every slice "
                                 f"the same bounds")
        if first[2] <= first[1]:
            raise ValueError(f"the givens select no rows ({first[0].key}: rows {first[1]}:{first[2]} "
                             f"of {first[0].base}); give a range with at least one row")
        return slice(first[1], first[2])

    def data(self, make_data):
        """One :class:`~synkhronos.Data` per row input, holding its shared variable's current value."""
        out = []
        for base in self.row_inputs:
            value = stored(base)
            held = self._data.get(base)
            if held is None or held[1] is not value:
                held = self._data[base] = (make_data(base.get_value(borrow=True), base), value)
            out.append(held[0])
        return out


def _bounds_read_only(found, scalars):
    """True if the slice's bounds are computed from the function's scalar inputs and constants."""
    for bound in (found.start, found.stop):
        if bound is None:
            continue
        leaves = [v for v in graph_inputs([bound]) if not isinstance(v, Constant)]
        if any(v not in scalars for v in leaves):
            return False
    return True
