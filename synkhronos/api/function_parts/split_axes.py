"""Which axis of a scattered input carries its rows: ``split_axes`` and ``synk.data(..., split_axis=)``.

A call splits its scattered inputs by rows over the devices, and the rows
are axis 0 unless declared otherwise. Time-major data, the Theano
tutorials' ``lstm.py`` layout of (time, samples), carries its samples on
axis 1: ``synk.function(..., split_axes={x: 1, mask: 1})`` splits those
inputs along axis 1, ``batch=`` selects along it and a row-weighted
``"avg"`` counts it. An output in ``split_axes`` is a ``"gather"`` output
concatenated along that axis (axis 0 otherwise). A :class:`Data` may
declare its own axis (``synk.data(value, split_axis=1)``) for an input the
function leaves undeclared.

Undeclared, a scan that carries a state from step to step over axis 0 of a
scattered input would be cut into one piece per device: a call refuses it
(:func:`check_rows_not_scanned`) and names ``split_axes``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors, io_toposort
from pytensor.scan.op import Scan
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.shape import Reshape, SpecifyShape
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor

from ...comm.reduction import GATHER

if TYPE_CHECKING:
    from pytensor.graph.basic import Apply

    from ...wire.spec import FunctionSpec

__all__ = ["RowAxes", "declared_axes", "call_axis", "check_data_axis", "rows_scanned",
           "check_rows_not_scanned", "time_major_example", "SplitsAlong"]


class SplitsAlong(Protocol):
    """What declares its own split axis: a :class:`~synkhronos.api.data.Data`."""

    @property
    def split_axis(self) -> int | None: ...


def _axis(value: Any, var: Variable, what: str, ndim: int) -> int:
    """``value`` as an axis of a ``ndim``-d ``var`` (negative counts from the end)."""
    try:
        axis = operator.index(value)
    except TypeError:
        raise TypeError(f"split_axes gives {what} {var} the axis {value!r}; an axis is an int") from None
    if not -ndim <= axis < ndim:
        axes = f"axes 0 to {ndim - 1}" if ndim else "no axes"
        raise ValueError(f"split axis {axis} is out of range for {what} {str(var)!r} with {ndim} "
                         f"dimensions ({axes}); give split_axes the axis that holds one entry per "
                         f"example")
    return axis % ndim


def declared_axes(split_axes: Any, inputs: Sequence[Variable], bcast_inputs: Sequence[Variable],
                  outputs: Sequence[tuple[Variable, str | None]]) -> tuple[list[int | None], list[int]]:
    """The split axis each scattered input declares (None: undeclared) and each output's gather axis.

    Parameters
    ----------
    split_axes : dict or None
        ``{variable: axis}`` as ``synk.function`` takes it.
    inputs, bcast_inputs : list of Variable
    outputs : list of (Variable, mode)

    Returns
    -------
    list, list
        Per scattered input its axis or None; per output the axis a ``"gather"`` concatenates along.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> h = x.cumsum(0)
    >>> declared_axes({x: 1, h: -1}, [x, y], [], [(h, "gather"), (y.sum(), "sum")])
    ([1, None], [1, 0])
    """
    input_axes: list[int | None] = [None] * len(inputs)
    gather_axes = [0] * len(outputs)
    if not split_axes:
        if split_axes is not None and not isinstance(split_axes, dict):
            raise TypeError(f"split_axes must be a dict {{variable: axis}}, got {split_axes!r}")
        return input_axes, gather_axes
    if not isinstance(split_axes, dict):
        raise TypeError(f"split_axes must be a dict {{variable: axis}}, got {type(split_axes).__name__}")
    for var, value in split_axes.items():
        found = False
        for i, inp in enumerate(inputs):
            if inp is var:
                input_axes[i], found = _axis(value, var, "scattered input", var.type.ndim), True
        for i, (out, mode) in enumerate(outputs):
            if out is var:
                if mode != GATHER:
                    raise ValueError(f"split_axes gives output {var} axis {value}, but its mode is "
                                     f"{mode!r}: only a 'gather' output is concatenated along an "
                                     f"axis; leave it out of split_axes or make it a 'gather' output")
                gather_axes[i], found = _axis(value, var, "output", var.type.ndim), True
        if any(b is var for b in bcast_inputs):
            raise ValueError(f"split_axes names {var}, one of the bcast_inputs, which every device "
                             f"gets whole: nothing of it is split; leave it out of split_axes, or "
                             f"list it in inputs to split it")
        if not found:
            raise ValueError(f"split_axes names {var!r}, which is neither a scattered input nor an "
                             f"output of the function; name the variables given in inputs (or "
                             f"'gather' outputs)")
    return input_axes, gather_axes


def call_axis(declared: int | None, data_axis: int | None, name: str, function: str = "the function") -> int:
    """The axis a call splits input ``name`` along: ``function``'s declaration, else the Data's, else 0.

    Examples
    --------
    >>> call_axis(None, 1, "x"), call_axis(1, None, "x"), call_axis(None, None, "x")
    (1, 1, 0)
    """
    if declared is None:
        return 0 if data_axis is None else data_axis
    if data_axis is not None and data_axis != declared:
        raise ValueError(f"the Data for input {name!r} declares split_axis={data_axis}, but "
                         f"{function} splits {name} along axis {declared} (its split_axes); make the "
                         f"Data with split_axis={declared} (or none), or declare the function's "
                         f"split_axes={{{name}: {data_axis}}} (make_train_function takes it too)")
    return declared


def check_data_axis(split_axis: Any, ndim: int) -> int | None:
    """``split_axis`` of ``synk.data`` checked against the Data's ``ndim``; None stays None."""
    if split_axis is None:
        return None
    try:
        axis = operator.index(split_axis)
    except TypeError:
        raise TypeError(f"split_axis must be an int or None, got {split_axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"split_axis {axis} is out of range for a Data with {ndim} dimensions; "
                         f"give the axis that holds one entry per example")
    return axis % ndim


def _keeps_axis0(node: Apply, row_var: Variable) -> bool:
    """True if ``node``'s first output has ``row_var``'s axis 0 as its own axis 0."""
    op, out = node.op, node.outputs[0]
    if isinstance(op, Elemwise):
        return out.type.ndim == row_var.type.ndim and row_var.type.shape[0] != 1
    if isinstance(op, DimShuffle):
        return bool(op.new_order) and op.new_order[0] == 0
    if isinstance(op, Subtensor):          # a slice of the rows (reversed, or stepped) keeps axis 0
        return node.inputs[0] is row_var and (not op.idx_list or isinstance(op.idx_list[0], slice))
    if isinstance(op, AdvancedSubtensor):
        # a table read at each row's index (an embedding: ``emb[idxs]``) has one row per index
        return len(node.inputs) > 1 and node.inputs[1] is row_var and node.inputs[0] is not row_var
    if isinstance(op, Reshape):            # (whatever the new axis 0 holds, it runs over the rows)
        return node.inputs[0] is row_var and out.type.ndim > 0
    return isinstance(op, SpecifyShape) and node.inputs[0] is row_var


def _carries_state(op: Scan, j: int) -> bool:
    """True if the scan's ``j``-th sequence feeds a state carried from step to step."""
    inner_seq = op.inner_seqs(op.inner_inputs)[j]
    outs = op.inner_outputs
    carried = (op.inner_mitmot_outs(outs) + op.inner_mitsot_outs(outs) + op.inner_sitsot_outs(outs)
               + op.inner_untraced_sit_sot_outs(outs))
    return bool(carried) and inner_seq in set(ancestors(carried))


def rows_scanned(inputs: Sequence[Variable], graph_vars: Iterable[Variable]) -> list[int]:
    """Indices of the ``inputs`` whose axis 0 a scan in the graph runs over while carrying a state.

    Followed from each input through what keeps its axis 0 in place
    (elementwise ops, slices of the rows, transpositions that leave axis 0
    first), a table read at each row's index (an embedding), and reshapes.
    Split along axis 0, such an input would give every device only its own
    steps, each starting the state anew.

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> x, y = pt.matrix("x"), pt.matrix("y")
    >>> h = pytensor.scan(lambda x_t, h: h + x_t, sequences=[x], outputs_info=pt.zeros_like(x[0]),
    ...                   return_updates=False)
    >>> rows_scanned([x, y], [h[-1] + y.sum()]), rows_scanned([x, y], [x.T.cumsum(0)])
    ([0], [])
    """
    rows = {var: i for i, var in enumerate(inputs) if var.type.ndim}
    found: set[int] = set()
    for node in io_toposort(list(inputs), list(graph_vars)):
        if isinstance(node.op, Scan):
            for j, seq in enumerate(node.op.outer_seqs(node.inputs)):
                if seq in rows and _carries_state(node.op, j):
                    found.add(rows[seq])
            continue
        if not node.outputs or not isinstance(node.outputs[0], Variable):
            continue
        for inp in node.inputs:
            if inp in rows and _keeps_axis0(node, inp):
                rows[node.outputs[0]] = rows[inp]
                break
    return sorted(found)


def time_major_example(names: Iterable[str], axis: int = 1) -> str:
    """``split_axes={x: 1, mask: 1}`` as a user writes it, for the inputs ``names``.

    Examples
    --------
    >>> time_major_example(["x", "mask"])
    'split_axes={x: 1, mask: 1}'
    """
    return "split_axes={" + ", ".join(f"{n}: {axis}" for n in names) + "}"


def check_rows_not_scanned(function_name: str, scanned: Sequence[int], names: Sequence[str]) -> None:
    """Refuse a call that would split the inputs ``scanned`` (indices into ``names``) along axis 0,
    undeclared, where a scan carries a state over that axis."""
    if not scanned:
        return
    which = [names[i] for i in scanned]
    listed = " and ".join(repr(n) for n in which)
    raise ValueError(
        f"{function_name}: a scan runs over axis 0 of scattered input{'s' * (len(which) > 1)} {listed}, "
        f"carrying a state "
        f"from step to step, and the call splits the rows along axis 0 over the devices: each device "
        f"would scan only its own steps, each starting the state anew. For time-major data "
        f"(time, samples) declare the axis of the samples: synk.function(..., "
        f"{time_major_example(which)}) (a training step: make_train_function(..., "
        f"{time_major_example(which)})), or synk.data(value, split_axis=1); for one sequence per "
        f"call (a sentence's word indices), give it as a bcast_input, which every device reads "
        f"whole; to split the steps on purpose, declare {time_major_example(which, 0)}")


class RowAxes:
    """The axes a function's calls split its scattered inputs along, checked in the master.

    Parameters
    ----------
    spec : FunctionSpec
    names : list of str
        The inputs' names, for messages.
    scans_checked : bool
        Refuse to split undeclared along axis 0 what a scan runs over (not
        for the givens' row slices: their rows are axis 0 by construction).
    """

    def __init__(self, spec: FunctionSpec, names: Sequence[str], scans_checked: bool = True) -> None:
        self.spec, self.names, self.scans_checked = spec, names, scans_checked
        #: the scattered inputs a scan runs over along axis 0, found at the first call that needs it
        self._scanned: list[int] | None = None

    def of(self, i: int, d: SplitsAlong | None = None) -> int:
        """The axis a call splits scattered input ``i`` along, given as ``d`` (a Data; None: numpy)."""
        return call_axis(self.spec.input_axis(i), None if d is None else d.split_axis, self.names[i],
                         self.spec.name)

    def of_call(self, datas: Sequence[SplitsAlong]) -> list[int]:
        """Each scattered input's axis in a call on ``datas``; refuses to cut a scan's steps."""
        axes = [self.of(i, d) for i, d in enumerate(datas)]
        undeclared = {i for i, (d, axis) in enumerate(zip(datas, axes))
                      if axis == 0 and d.split_axis is None and self.spec.input_axis(i) is None}
        if undeclared and self.scans_checked:
            if self._scanned is None:
                self._scanned = rows_scanned(self.spec.inputs, self.spec.graph_vars())
            check_rows_not_scanned(self.spec.name, [i for i in self._scanned if i in undeclared], self.names)
        return axes

    def check_loop(self, datas: Sequence[SplitsAlong]) -> None:
        """Refuse ``datas`` split along another axis than 0: a device-driven loop gathers axis 0."""
        across = [f"{self.names[i]} (axis {axis})" for i, axis in
                  enumerate(d.split_axis or self.spec.input_axis(i) for i, d in enumerate(datas)) if axis]
        if across:
            raise ValueError(f"a device-driven loop (train.run) gathers every step's rows along axis "
                             f"0, but {', '.join(across)} splits along another axis: give it one row "
                             f"per example (np.swapaxes(value, 0, 1)), or call the step on the "
                             f"time-major Data with batch= yourself")
