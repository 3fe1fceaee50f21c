"""Sums over the rows scaled by a constant: where a mean over the rows was meant.

Each device computes a function on its own rows. An output averaged over the
devices (``"avg"``, weighted by rows), and a training step's loss (the step
weighs the devices by their rows), equal one process exactly when they are
means over the rows. A sum over the rows scaled by a constant, the Theano idiom
``cost = ((out - y) ** 2).sum() / (2 * batch_size)``, gives on ``n`` devices
about ``1/n`` of one process's value, and of its gradient, without a word:
:func:`sum_over_rows` finds it in a graph, for the callers to say so.

Found: a sum that reduces an axis whose length is the rows' count, reached
from the output through additions, sums over other axes and factors that do
not depend on the rows (constants, shared variables, scalar inputs), and whose
terms are not divided by a quantity of the whole batch. A division by anything
that depends on the rows (``x.shape[0]``, ``mask.sum()``, a ``mean``), above
the sum or inside it (``(cost / x.shape[0]).sum()``), makes a mean, and every
other operation ends the search: what is found is a sum over the rows for
certain. Not found, so not said: a sum written another way (``err.dot(err)``,
``pt.tensordot``, a ``cumsum``), or passed through a nonlinear function
(``pt.sqrt(cost.sum() / 64)``), and one divided by another length of the rows'
arrays (``cost.sum() / x.shape[1]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any, cast

from pytensor.graph.basic import Constant, Variable, clone_get_equiv
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.traversal import graph_inputs, io_toposort
from pytensor.scalar import basic as ps
from pytensor.tensor.basic import get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.rewriting.shape import ShapeFeature
from pytensor.tensor.shape import Shape, Shape_i

__all__ = ["sum_over_rows", "is_zero"]

#: the elementwise operations a scaled sum passes through unchanged in kind
_PASS_THROUGH = (ps.Add, ps.Sub, ps.Neg, ps.Cast, ps.Identity)


def sum_over_rows(loss: Variable, row_axes: Mapping[Variable, int]) -> Variable | None:
    """The sum over the rows that ``loss`` is, scaled by a constant (see the module), or None.

    ``row_axes``: each input that holds rows, and its axis of rows.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> sum_over_rows(((x.dot(w) - y) ** 2).mean(), {x: 0, y: 0}) is None
    True
    >>> sum_over_rows(((x.dot(w) - y) ** 2).sum() / x.shape[0], {x: 0, y: 0}) is None
    True
    >>> print(sum_over_rows(((x.dot(w) - y) ** 2).sum() / 100, {x: 0, y: 0}).owner.op)
    Sum{axes=None}
    """
    if not row_axes:
        return None
    try:
        return _Search(loss, row_axes).scaled_sum(loss)
    except RecursionError:     # a chain of additions deeper than Python's stack: nothing is said
        return None


class _Search:
    """The search of :func:`sum_over_rows` in the graph of ``loss``."""

    def __init__(self, loss: Variable, rows: Mapping[Variable, int]) -> None:
        self.loss, self.rows = loss, rows
        self._reading: set[Variable] | None = None
        # (once per variable: a graph that reuses a term, a = a + a, is walked in linear time)
        self.scaled_sum = cache(self._scaled_sum)
        self.normalized = cache(self._normalized)
        self._shapes: tuple[dict, ShapeFeature] | None = None
        self._rows_in_graph: dict[Variable, int] = {}

    def _scaled_sum(self, var: Variable) -> Variable | None:
        """The sum over the rows ``var`` is, up to additions, sums over other axes and row-free
        factors; or None."""
        node = var.owner
        if node is None or not self.reads_rows(var):
            return None
        op = node.op
        if isinstance(op, CAReduce) and isinstance(op.scalar_op, ps.Add):
            summand = node.inputs[0]
            if not self._reduces_rows(summand, op.axis):
                return self.scaled_sum(summand)
            return None if self.normalized(summand) else var
        if isinstance(op, DimShuffle):
            return self.scaled_sum(node.inputs[0])
        if not isinstance(op, Elemwise):
            return None
        scalar = op.scalar_op
        if isinstance(scalar, _PASS_THROUGH):
            return self._first(node.inputs)
        if isinstance(scalar, ps.TrueDiv):
            numerator, denominator = node.inputs
            # (divided by what depends on the rows in any way, their count among others: a mean)
            return None if self.reads_rows(denominator) else self.scaled_sum(numerator)
        if isinstance(scalar, ps.Mul):
            reading = [v for v in node.inputs if self.reads_rows(v)]
            if len(reading) != 1 or any(is_zero(v) for v in node.inputs):
                return None        # (0 * y.sum(): an input read for its name alone, counting nothing)
            return self.scaled_sum(reading[0])
        return None

    def _normalized(self, var: Variable) -> bool:
        """Whether the terms ``var`` that a sum over the rows adds are already divided by (or
        weighed with) a quantity of the whole batch: a mean written inside the sum
        (``(cost / x.shape[0]).sum()``, ``(cost * (m / m.sum())).sum()``)."""
        node = var.owner
        if node is None or not self.reads_rows(var):
            return False
        op = node.op
        if isinstance(op, DimShuffle) or (isinstance(op, CAReduce) and isinstance(op.scalar_op, ps.Add)):
            return self.normalized(node.inputs[0])
        if not isinstance(op, Elemwise):
            return False
        scalar = op.scalar_op
        if isinstance(scalar, _PASS_THROUGH):
            return any(self.normalized(v) for v in node.inputs)
        if isinstance(scalar, ps.TrueDiv):
            numerator, denominator = node.inputs
            return self._of_the_batch(denominator) or self.normalized(numerator)
        if isinstance(scalar, ps.Mul):
            return any(self._of_the_batch(v) or self.normalized(v) for v in node.inputs)
        return False

    def _of_the_batch(self, var: Variable) -> bool:
        """Whether ``var`` reads the rows and holds no axis of them: a quantity of the whole batch
        (the rows' count, a sum of weights). Where its shape is unknown it is taken for one: nothing
        is refused on a guess."""
        if not self.reads_rows(var):
            return False
        dims = self._shape(var)
        return dims is None or not any(self._counts_rows(d, set()) for d in dims)

    def _first(self, variables: list[Variable]) -> Variable | None:
        for v in variables:
            if (found := self.scaled_sum(v)) is not None:
                return found
        return None

    def _reduces_rows(self, var: Variable, axes: tuple[int, ...] | None) -> bool:
        """Whether reducing ``var`` over ``axes`` (None: all) reduces an axis as long as the rows."""
        dims = self._shape(var)
        if dims is None:
            return False
        reduced = range(len(dims)) if axes is None else axes
        return any(self._counts_rows(dims[axis], set()) for axis in reduced)

    def _shape(self, var: Variable) -> tuple[Any, ...] | None:
        """``var``'s shape as the shape analysis of the whole graph infers it (made at the first
        question: a graph without a candidate sum never pays for it), or None."""
        if self._shapes is None:
            inputs = [v for v in graph_inputs([self.loss]) if not isinstance(v, Constant)]
            # (a copy: the analysis annotates what it sees)
            equiv = cast(dict[Variable, Variable], clone_get_equiv(inputs, [self.loss]))
            graph = FunctionGraph([equiv[v] for v in inputs], [equiv[self.loss]], clone=False,
                                  features=[ShapeFeature()])
            self._shapes = equiv, graph.shape_feature
            self._rows_in_graph = {equiv[v]: axis for v, axis in self.rows.items() if v in equiv}
        equiv, feature = self._shapes
        shape_tuple = getattr(feature, "shape_tuple", None)
        try:
            clone = equiv[var]
            return tuple(shape_tuple(clone) if shape_tuple is not None else feature.shape_of[clone])
        except (KeyError, AttributeError, TypeError):
            return None

    def reads_rows(self, var: Variable) -> bool:
        """Whether ``var`` depends on the rows in any way (their values, or their count)."""
        if self._reading is None:         # (one pass over the graph, in order: no recursion)
            self._reading = set(self.rows)
            for node in io_toposort(list(graph_inputs([self.loss])), [self.loss]):
                if any(v in self._reading for v in node.inputs):
                    self._reading.update(node.outputs)
        return var in self._reading

    def _counts_rows(self, dim: Any, seen: set[int]) -> bool:
        """Whether the length ``dim`` (of the inferred shapes) is known to be the rows' count, or to
        depend on it."""
        if not isinstance(dim, Variable) or dim.owner is None or id(dim) in seen:
            return False
        seen.add(id(dim))
        node = dim.owner
        if isinstance(node.op, Shape | Shape_i):
            return isinstance(node.op, Shape_i) and self._rows_in_graph.get(node.inputs[0]) == node.op.i
        return any(self._counts_rows(v, seen) for v in node.inputs)


def is_zero(var: Variable) -> bool:
    """Whether ``var`` is a constant zero (broadcast or cast as it may be)."""
    try:
        return float(get_underlying_scalar_constant_value(var)) == 0.0
    except NotScalarConstantError:
        return False
