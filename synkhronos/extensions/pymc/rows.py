"""Which arrays of a likelihood hold rows, decided from its graph.

A likelihood splits over the devices by rows when each row's term is
computed from that row alone: every path from an array of rows to the
elementwise log-likelihood keeps rows apart (elementwise and broadcast ops,
products with a parameter, a reduction over other axes, indexing a parameter
by a per-row index). Two steps make that so or refuse the model:

- :func:`fold_data` replaces each largest sub-expression that reads data and
  no parameter (``x - x.mean()``, a lagged copy ``concatenate([0], z[:-1])``,
  a group table read through a group index ``a[g]``) by its value computed on
  all rows, once. Each such value is then an array like any other: a row
  array if it has one entry per row, else broadcast whole to every device.
- :func:`check_rows_kept_apart` follows each array of rows through the
  rest of the graph and refuses, naming the array and the operation, a path
  that mixes rows: a reduction over the rows, a shift or a slice of them, a
  concatenation, a sort or cumulative op, a transpose, or reading rows
  through an index that is not the row position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors, io_toposort
from pytensor.raise_op import CheckAndRaise
from pytensor.tensor.basic import Join
from pytensor.tensor.elemwise import CAReduce, DimShuffle, Elemwise
from pytensor.tensor.extra_ops import CumOp
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.shape import Reshape, Shape, Shape_i, SpecifyShape
from pytensor.tensor.sort import ArgSortOp, SortOp
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor
from pytensor.tensor.type import TensorType
from pytensor.tensor.variable import TensorConstant

__all__ = ["fold_data", "check_rows_kept_apart", "RowsMixed", "inline_op_from_graphs"]


class RowsMixed(ValueError):
    """A path from an array of rows to the likelihood that mixes rows (the message names both).

    ``source`` is the array of rows; ``as_table`` is True when it reached the likelihood as a table
    read at indices (a group-level array as long as the rows by coincidence: not rows).
    """

    def __init__(self, message: str, source: Variable | None = None, as_table: bool = False) -> None:
        super().__init__(message)
        self.source, self.as_table = source, as_table


def inline_op_from_graphs(terms: list) -> list:
    """``terms`` with every ``OpFromGraph`` (PyMC's ``LogSumExp`` in a mixture, say) replaced by
    its inner graph: such an op keeps its inputs' types, row count included, so a device's rows
    could not go through it; inlined, every op sees the rows it is given."""
    while True:
        nodes = [v.owner for v in ancestors(terms) if v.owner is not None and isinstance(v.owner.op, OpFromGraph)]
        if not nodes:
            return list(terms)
        replace: dict = {}
        for node in nodes:
            replace.update(zip(node.outputs, _inner_graph_on(node.op, node.inputs)))
        terms = clone_replace(list(terms), replace=replace, rebuild_strict=False)


def _inner_graph_on(op: Any, inputs: list) -> list:
    """The outputs of ``op``'s inner graph rebuilt on ``inputs``, node by node (each node's own
    ``make_node``: types follow the inputs)."""
    mapped = dict(zip(op.inner_inputs, inputs))
    for inner in io_toposort(op.inner_inputs, op.inner_outputs):
        made = inner.op.make_node(*[mapped.get(v, v) for v in inner.inputs])
        mapped.update(zip(inner.outputs, made.outputs))
    return [mapped.get(v, v) for v in op.inner_outputs]


def _is_data_leaf(var: Variable) -> bool:
    if var.owner is not None:
        return False
    if isinstance(var, SharedVariable):
        return not isinstance(var.type, RandomType)
    return isinstance(var, Constant)


def fold_data(terms: list) -> tuple[list, list]:
    """``terms`` with each largest sub-expression that reads data values and no parameter replaced
    by its value (see the module notes); returns ``(terms, folded constants)``.

    Computations that read only the shapes of data (a size, a row count) stay symbolic: on a
    device they count that device's rows.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x, b = pt.as_tensor(np.arange(4.0)), pt.scalar("b")
    >>> (term,), folded = fold_data([b * (x - x.mean())])
    >>> [c.data.tolist() for c in folded]
    [[-1.5, -0.5, 0.5, 1.5]]
    """
    order = io_toposort([], terms) if terms else []
    data_only: dict = {}
    reads_values: dict = {}

    def leaf_status(var: Variable) -> tuple[bool, bool]:
        if var.owner is None:
            leaf = _is_data_leaf(var)
            return leaf, leaf and getattr(var.type, "ndim", 0) > 0
        return data_only.get(var, False), reads_values.get(var, False)

    for node in order:
        statuses = [leaf_status(v) for v in node.inputs]
        only = all(s[0] for s in statuses)
        values = not isinstance(node.op, Shape | Shape_i) and any(s[1] for s in statuses)
        for out in node.outputs:
            data_only[out], reads_values[out] = only, only and values
    frontier: list = []
    seen: set = set()
    for node in order:
        if data_only[node.outputs[0]]:
            continue
        for var in node.inputs:
            if var.owner is not None and reads_values.get(var) and var not in seen and _tensor(var):
                seen.add(var)
                frontier.append(var)
    for var in terms:
        if var.owner is not None and reads_values.get(var) and var not in seen and _tensor(var):
            seen.add(var)
            frontier.append(var)
    if not frontier:
        return list(terms), []
    values = pytensor.function([], frontier, mode="FAST_COMPILE", on_unused_input="ignore")()
    # (each of the type it replaces: the graph is rebuilt as it was, around the values)
    constants = [TensorConstant(var.type, var.type.filter(np.asarray(v, dtype=var.type.dtype)), name=var.name)
                 for var, v in zip(frontier, values)]
    return clone_replace(list(terms), replace=dict(zip(frontier, constants))), constants


def _tensor(var: Variable) -> bool:
    """A tensor worth folding: not an integer scalar (a size or a count, which stays symbolic to
    become each device's own where it counts the rows)."""
    return isinstance(var.type, TensorType) and not (var.type.ndim == 0 and "int" in var.type.dtype)


def check_rows_kept_apart(terms: list, names: list, row_data: list) -> None:
    """Refuse a path from an array of ``row_data`` (axis 0: the rows) to ``terms`` (the observed
    variables' elementwise log-likelihoods, named ``names``) that mixes rows.

    Raises
    ------
    RowsMixed
        Naming the array of rows, the operation and the observed variable.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x = pt.as_tensor(np.arange(4.0), name="x")
    >>> check_rows_kept_apart([pt.scalar("b") * x], ["obs"], [x])        # elementwise: kept apart
    >>> try:
    ...     check_rows_kept_apart([pt.sort(pt.scalar("b") * x)], ["obs"], [x])
    ... except RowsMixed as e:
    ...     print(e)
    the log-likelihood of 'obs' reads the rows of x through a sort, which mixes rows: each device would see only its own
    """
    for term, name in zip(terms, names):
        rows: dict = {var: var for var in row_data}       # what follows the rows -> whose rows
        valued = _value_ancestors(term)
        for node in io_toposort([], [term]):
            if not any(out in valued for out in node.outputs):
                continue              # computes only a check's condition (every row's own check)
            source = next((rows[v] for v in _value_inputs(node) if v in rows), None)
            if source is None:
                continue
            mixed = _mixes_rows(node, rows)
            if mixed is not None:
                if _is_matrix_product(node.op):        # the rows on its right-hand side are the cause
                    source = next(rows[v] for v in node.inputs[1:] if v in rows)
                table = isinstance(node.op, AdvancedSubtensor) and node.inputs[0] in rows
                raise RowsMixed(f"the log-likelihood of {name!r} reads the rows of "
                                f"{source.name or 'an array of the observed rows'} through {mixed}, "
                                f"which mixes rows: each device would see only its own", source, table)
            if not isinstance(node.op, Shape | Shape_i):
                for out in node.outputs:
                    rows[out] = source


def _value_inputs(node: Any) -> list:
    """The inputs ``node``'s value is computed from: a check's first input only (the others are
    conditions, which each device checks on its own rows: -inf on any device is -inf in all)."""
    return node.inputs[:1] if isinstance(node.op, CheckAndRaise) else node.inputs


def _value_ancestors(term: Variable) -> set:
    """The variables ``term``'s value is computed from, conditions of checks left out."""
    found: set = set()
    stack = [term]
    while stack:
        var = stack.pop()
        if var in found:
            continue
        found.add(var)
        if var.owner is not None:
            stack.extend(_value_inputs(var.owner))
    return found


def _mixes_rows(node: Any, rows: dict) -> str | None:
    """What in ``node`` mixes the rows of its row inputs (axis 0), or None if it keeps them apart."""
    op, inputs = node.op, node.inputs
    if isinstance(op, Elemwise | Shape | Shape_i | SpecifyShape):
        return None
    if isinstance(op, CheckAndRaise):          # its value is its first input's
        return None
    if isinstance(op, DimShuffle):
        order = list(op.new_order)
        return None if order and order[0] == 0 else "a transpose (the rows moved off the first axis)"
    if isinstance(op, CAReduce):
        axes = op.axis if op.axis is not None else tuple(range(inputs[0].type.ndim))
        return f"a reduction ({op}) over the rows" if 0 in axes else None
    if isinstance(op, Subtensor):
        first = op.idx_list[0] if op.idx_list else slice(None)
        return None if first == slice(None) else "a slice, shift or pick of rows"
    if isinstance(op, AdvancedSubtensor):
        if inputs[0] not in rows:
            return None                       # a parameter (a group table) read at each row's index
        first = op.idx_list[0] if op.idx_list else slice(None)
        if first == slice(None) or (not isinstance(first, slice) and _is_row_position(inputs[1])):
            return None                       # rows kept in place, other axes indexed per row
        return "an index that is not the row position"
    if isinstance(op, Join):
        axis = op.axis if hasattr(op, "axis") else None
        if isinstance(axis, int) and axis % node.outputs[0].type.ndim != 0:
            return None                       # (each row's entries side by side: a mixture's)
        return "a concatenation"
    if isinstance(op, SortOp | ArgSortOp):
        return "a sort"
    if isinstance(op, CumOp):
        return "a cumulative sum or product"
    if isinstance(op, Reshape):
        return "a reshape"
    if _is_matrix_product(op):
        return None if inputs[0] in rows and not any(v in rows for v in inputs[1:]) else \
            "a product over the rows (the rows on its right-hand side)"
    if getattr(op, "name", None) == "Scan" or type(op).__name__ == "Scan":
        return "a scan"
    return None


def _is_row_position(index: Variable) -> bool:
    """Whether ``index`` is ``arange(rows)``, maybe reshaped: each row reads its own position."""
    while index.owner is not None and isinstance(index.owner.op, Reshape | DimShuffle):
        index = index.owner.inputs[0]
    if index.owner is None or type(index.owner.op).__name__ != "ARange":
        return False
    start, _, step = index.owner.inputs
    return _constant_is(start, 0) and _constant_is(step, 1)


def _constant_is(var: Variable, value: int) -> bool:
    return isinstance(var, Constant) and np.ndim(var.data) == 0 and int(var.data) == value


def _is_matrix_product(op: Any) -> bool:
    name = type(op).__name__
    core = getattr(op, "core_op", None)
    return name in ("Dot", "Dot22", "Dot22Scalar", "Gemv", "Gemm") or \
        (core is not None and type(core).__name__ in ("Dot", "MatMul", "Dot22"))
