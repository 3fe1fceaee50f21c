"""The common causes of a rank's error in a call, recognised from the function's graph and the error.

A :class:`~synkhronos.WorkerError` from a call gets the first hint that
recognises it (:func:`add_hint`). Each hint knows what the call was: the rows
each device got, and the function's graph.

The commonest cause is a batch size written into the graph: a reshape,
``specify_shape``, ``zeros``/``alloc``/``broadcast_to`` or a random draw whose
shape holds the call's row count as a constant, where each device holds only
its share of the rows. It is recognised from the graph (such a shape, and an
error about shapes), whichever operation the error surfaced in: the reshape
itself, a ``SpecifyShape`` a rewrite put after it, or the product that
received the wrong shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytensor.graph.basic import Apply, Variable

    from ...errors import WorkerError
    from ...wire.plan import CallPlan
    from ...wire.spec import FunctionSpec

__all__ = ["CallRows", "add_hint", "batch_size_written"]


@dataclass(frozen=True)
class CallRows:
    """The rows of a call: every device's share of ``total`` (0 for a call without scattered inputs)."""

    per_device: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, plan: CallPlan, n_parallel: int, scatters: bool) -> CallRows:
        """The rows each of ``n_parallel`` devices got in ``plan`` (none without scattered inputs)."""
        if not scatters:
            return cls((), 0)
        return cls(tuple(hi - lo for lo, hi in plan.split(n_parallel)), plan.batch.total)


#: an error about shapes (its first line says so): the only kind a batch size in the graph causes
_SHAPE_ERROR = re.compile(r"shape|broadcast|dimension|\bsize\b", re.IGNORECASE)
#: a shape that a trace could not make concrete (not a matter of rows)
_STATIC_SHAPES = re.compile(r"Shapes must be 1D sequences of concrete values|Tracer|"
                            r"JAX requires the arguments of .* to be constants")


def _share_of(rows: CallRows) -> str:
    shares = sorted(set(rows.per_device))
    return str(shares[0]) if len(shares) == 1 else f"{shares[0]} to {shares[-1]}"


def _rows_hint(error: WorkerError, rows: CallRows, spec: FunctionSpec | None) -> str | None:
    if not rows.total or set(rows.per_device) <= {rows.total} or spec is None:
        return None
    if not _SHAPE_ERROR.search(error.message.split("\n", 1)[0]):
        return None
    where = batch_size_written(spec, rows.total)
    if where is None:
        return None
    return (f"each device gets {_share_of(rows)} of the call's {rows.total} rows: write -1 or "
            f"x.shape[0] for the batch axis of {where} instead of a batch size")


def _static_shapes_hint(error: WorkerError, rows: CallRows, spec: FunctionSpec | None) -> str | None:
    if not _STATIC_SHAPES.search(error.message):
        return None
    sliced = _slice_at_computed_bounds(spec) if spec is not None else None
    if sliced is not None:
        return (f"the slice {sliced} has bounds computed from values (an input, a random draw), so "
                f"the length it keeps is not a constant JAX can compile; index by a range of constant "
                f"length instead (x[:, :, i + pt.arange(24)], a crop of 24 from offset i), or crop "
                f"on the host before the call")
    # every argument's and parameter's shape is a constant in the graph compiled per shape: what
    # JAX could not make concrete was computed from a value
    return ("the graph needs a shape (a length, a range, a reshape) computed from a value: an input's, "
            "a parameter's or a draw's, not their shapes, and JAX compiles only shapes it knows; "
            "compute it from constants and shapes (x.shape[0]), or pass what is computed on the host")


def _slice_at_computed_bounds(spec: FunctionSpec) -> str | None:
    """A slice in the function's graph whose bounds depend on a value, not only on shapes and
    constants (as text), or None."""
    from pytensor.graph.traversal import apply_ancestors
    from pytensor.tensor.subtensor import IncSubtensor, Subtensor, indices_from_subtensor
    for node in apply_ancestors(spec.graph_vars()):
        if isinstance(node.op, (Subtensor, IncSubtensor)):
            first = 2 if isinstance(node.op, IncSubtensor) else 1
            entries = indices_from_subtensor(node.inputs[first:], node.op.idx_list)
            bounds = [b for e in entries if isinstance(e, slice) for b in (e.start, e.stop, e.step)
                      if b is not None]
            if any(_value_dependent(b) for b in bounds):    # (an integer index keeps no length)
                return f"{node.op} of {node.inputs[0]}"
    return None


def _value_dependent(var: Variable) -> bool:
    """True if ``var`` is computed from an input's or a parameter's value, not only from shapes."""
    from pytensor.graph.basic import Constant
    from pytensor.tensor.shape import Shape, Shape_i
    stack, seen = [var], set()
    while stack:
        v = stack.pop()
        if v in seen or isinstance(v, Constant):
            continue
        seen.add(v)
        if v.owner is None:
            return True
        if not isinstance(v.owner.op, (Shape, Shape_i)):
            stack.extend(v.owner.inputs)
    return False


def _conversion_hint(error: WorkerError, rows: CallRows, spec: FunctionSpec | None) -> str | None:
    if "No JAX conversion for the given" not in error.message:
        return None
    return ("every process finds an op's JAX conversion by importing the module that registers it "
            "(@jax_funcify.register): define the op and its conversion in a module every process "
            "can import, not in the script run as __main__")


#: the hints in the order they are tried: each returns its text, or None when it does not apply
HINTS: list[Callable[[WorkerError, CallRows, FunctionSpec | None], str | None]] = [
    _static_shapes_hint, _conversion_hint, _rows_hint]


def add_hint(error: WorkerError, rows: CallRows, spec: FunctionSpec | None = None) -> None:
    """Give ``error`` (a WorkerError) the first hint that recognises it, if any.

    ``spec`` is the function's :class:`~synkhronos.wire.spec.FunctionSpec`
    (its graph); without it only the hints read from the message apply.
    """
    for make in HINTS:
        hint = make(error, rows, spec)
        if hint:
            error.hint = hint
            return


def batch_size_written(spec: FunctionSpec, total: int) -> str | None:
    """What in the function's graph holds ``total`` (the call's rows) as a constant in a shape, or None.

    A reshape or ``specify_shape`` counts when what it shapes depends on the
    scattered inputs; ``alloc`` (``zeros``, ``ones``, ``broadcast_to``),
    ``empty`` and a random draw's ``size`` count when they broadcast what
    depends on the scattered inputs, or what they make meets it (through
    elementwise operations only: a slice of it makes other rows).
    """
    from pytensor.graph.traversal import ancestors, apply_ancestors
    from pytensor.tensor.basic import Alloc, AllocEmpty
    from pytensor.tensor.random.op import RandomVariable
    from pytensor.tensor.shape import Reshape, SpecifyShape

    row_inputs = set(spec.inputs) | {target for target, _ in spec.givens}
    nodes = list(apply_ancestors(spec.graph_vars()))
    from_rows = _computed_from(row_inputs, nodes)
    for node in nodes:
        op = node.op
        if isinstance(op, (Reshape, SpecifyShape)):
            shapes, what = node.inputs[1:], ("the reshape" if isinstance(op, Reshape) else "specify_shape")
            if not any(v in row_inputs for v in ancestors([node.inputs[0]])):
                continue
        elif isinstance(op, (Alloc, AllocEmpty, RandomVariable)):
            shapes, what = (node.inputs[1:], "the alloc (zeros, ones, broadcast_to)") if isinstance(op, Alloc) \
                else (node.inputs, "the empty array") if isinstance(op, AllocEmpty) \
                else ([op.size_param(node)], "the random draw's size")
            if not (node.inputs[0] in from_rows and isinstance(op, Alloc)) and \
                    not _meets(node.outputs[-1], from_rows, nodes):
                continue
        else:
            continue
        if any(total in _constants_of(shape) for shape in shapes):
            return what
    return None


def _computed_from(sources: Iterable[Variable], nodes: Sequence[Apply]) -> set[Variable]:
    """The variables of ``nodes`` computed from any of ``sources``."""
    from pytensor.graph.traversal import toposort
    found = set(sources)
    for node in toposort([o for n in nodes for o in n.outputs]):
        if any(i in found for i in node.inputs):
            found.update(node.outputs)
    return found


def _meets(var: Variable, from_rows: set[Variable], nodes: Sequence[Apply]) -> bool:
    """True if ``var``, through elementwise operations and dimshuffles only, enters an operation beside
    a variable computed from the rows."""
    from pytensor.tensor.elemwise import DimShuffle, Elemwise
    clients: dict[Variable, list[Apply]] = {}
    for node in nodes:
        for i in node.inputs:
            clients.setdefault(i, []).append(node)
    frontier, seen = [var], set()
    while frontier:
        v = frontier.pop()
        for node in clients.get(v, ()):
            if any(i in from_rows for i in node.inputs if i is not v):
                return True
            if isinstance(node.op, (Elemwise, DimShuffle)) and node not in seen:
                seen.add(node)
                frontier.extend(node.outputs)
    return False


def _constants_of(shape: Variable, depth: int = 4) -> set[Any]:
    """The integers a shape argument holds as constants: its own value, or the constant entries of
    the vector it is made of (through casts), as ``x.reshape((20, x.shape[1]))`` makes it."""
    import numpy as np
    from pytensor.graph.basic import Constant
    from pytensor.scalar.basic import Cast
    from pytensor.tensor.basic import MakeVector, ScalarFromTensor, TensorFromScalar
    from pytensor.tensor.elemwise import Elemwise

    if isinstance(shape, Constant):
        values = np.asarray(shape.data)
        return set(values.ravel().tolist()) if values.dtype.kind in "iu" else set()
    node = shape.owner
    if node is None or not depth:
        return set()
    op = node.op
    if isinstance(op, (MakeVector, ScalarFromTensor, TensorFromScalar)) or \
            (isinstance(op, Elemwise) and isinstance(op.scalar_op, Cast)):
        return set().union(*(_constants_of(v, depth - 1) for v in node.inputs))
    return set()
