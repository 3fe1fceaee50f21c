"""``synk.function``: record a PyTensor graph, ship it, compile it everywhere, call it.

A :class:`Function` lives in the master. Its
:class:`~synkhronos.wire.spec.FunctionSpec` (the symbolic graph and modes)
is cloudpickled to the workers by ``distribute()``; every process compiles it
with PyTensor's JAX backend (:class:`~synkhronos.rank.compiled.CompiledFunction`).
A call is validated here, in the master, before any process wakes; it travels
as a :class:`~synkhronos.wire.plan.CallPlan`, every rank computes its share of
the rows (:func:`synkhronos.rank.executor.run_share`), and the master reduces
the results.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Sequence, Union

import numpy as np
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.tensor.type import TensorType

from ..comm.reduction import owned, reduce_outputs
from ..errors import Failure, WorkerError
from ..ipc.packing import dtype_code
from ..platform.jax_init import backend_exists, drop_backend, set_precision
from ..platform.values import store, stored
from ..rank.compiled import CompiledFunction
from ..runtime.session import State, active, current, serialized
from ..tracing import trace
from ..wire.digests import values_text
from ..wire.plan import CallPlan, InputRef, result_record
from ..wire.spec import SHAPES_KEPT
from .data import Data, as_pytensor_takes, condition_value, data, release_large_staging
from .function_parts.batch import check_num_slices, node_local, parse_batch, parse_batch_s, with_new_indices
from .function_parts.batch_shaped import BatchShapedState
from .function_parts.hints import CallRows, add_hint
from .function_parts.kept_plans import KeptPlans
from .function_parts.recording import compile_on_master, record, written_from_rows
from .function_parts.shapes import check_argument_shape
from .function_parts.split_axes import RowAxes

if TYPE_CHECKING:
    from ..wire.batch import Batch
    from ..wire.spec import FunctionSpec
    from .function_parts.givens import RowsFromGivens

__all__ = ["function", "Function"]

#: what ``outputs`` takes: a variable, a (variable, mode) pair, or a list of those
Outputs = Union[Variable, tuple, Sequence]
#: what ``updates`` takes: (shared, new value[, mode]) items, or a dict shared -> new value
Updates = Union[Sequence[tuple], dict]


# ------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# The user's Function
# ------------------------------------------------------------------------------------------------

_MISSING = object()


def _input_ref(d: Data, offset: int = 0, axis: int = 0) -> InputRef:
    """Where a call reads the Data ``d`` (its rows from ``offset`` on, along ``axis``)."""
    assert d.shape is not None, "a call's Data hold values"
    return InputRef(d.id, d.gen, dtype_code(d.dtype), offset, d.shape, axis)


class Function:
    """A data-parallel PyTensor function, made by :func:`function`.

    Call it like the PyTensor function it wraps, with :class:`Data` or numpy
    arguments; see :meth:`__call__`.
    """

    def __init__(self, state: State, spec: FunctionSpec, bare: bool, compiled: CompiledFunction,
                 rows: RowsFromGivens | None = None, local_updates: bool = False) -> None:
        self._state = state
        self._batch_shaped = BatchShapedState(spec, local_updates,
                                              [s.key for s in rows.slices] if rows is not None else [])
        #: the tutorials' givens idiom: the row slices a call's scalars select (see .givens)
        self._rows = rows
        self.spec = spec
        self._bare = bare
        self._scratch: dict[int, Data] = {}
        #: the plain PyTensor function, compiled at the first as_pytensor
        self._reference: CompiledFunction | None = None
        #: numpy arguments are cast to their inputs' dtypes as pytensor.function's option does
        self._downcast = bool(spec.kwargs.get("allow_input_downcast"))
        #: this process's compiled function (the master computes its own share of every call)
        self.compiled = compiled
        self._input_names = [var.name if var.name else f"input {i}"
                             for i, var in enumerate(spec.all_inputs)]
        self._n_inputs = len(spec.all_inputs)
        self._axes = RowAxes(spec, self._input_names, scans_checked=rows is None)
        # per output: its mode, declared dtype and gather axis (the reduction of every call looks them up)
        self._reductions = [(mode, np.dtype(var.type.dtype), spec.gather_axis(i))
                            for i, (var, mode) in enumerate(spec.outputs)]
        #: the validated plans of repeated calls
        self._kept = KeptPlans(state, spec, self._scratch)
        #: the shared tensors a call reads or writes: only those go to the devices and back
        self.touched = [var for var in dict.fromkeys(spec.shared_variables())
                        if isinstance(var.type, TensorType)]
        #: what its updates compute from the call's rows: an average of it weighs each device by
        #: its rows (a function that weighs them itself, as a training step's, sets it empty)
        self.row_written = written_from_rows(spec, [s.key for s in rows.slices] if rows is not None else [])
        self._graph_compared: str | None = None

    def graph_compared(self) -> str:
        """What the masters of several nodes compare of this function's graphs
        (:meth:`~synkhronos.wire.spec.FunctionSpec.compared_text`), made at its first use."""
        if self._graph_compared is None:
            self._graph_compared = self.spec.compared_text(self._state.registry.uid_of)
        return self._graph_compared

    def touched_now(self, *_: object) -> list[SharedVariable] | None:
        """The shared variables a call hands to the devices and back (None, every one, for a
        function of a closed runtime, whose call raises)."""
        return self.touched if self._state is active() else None

    @property
    def name(self) -> str:
        """The function's name (given, or ``synk_function_<id>``)."""
        return self.spec.name

    def get_shared(self) -> list[SharedVariable]:
        """The shared variables this function reads or updates (as PyTensor's ``Function.get_shared``)."""
        return list(dict.fromkeys(self.spec.shared_variables()))

    @property
    def output_modes(self) -> list[str | None]:
        """The reduction mode of each output, in order."""
        return [m for _, m in self.spec.outputs]

    @property
    def update_modes(self) -> list[str]:
        """The accumulation mode of each update (used with ``num_slices > 1``)."""
        return [m for _, _, m in self.spec.updates]

    def __repr__(self) -> str:
        return f"synk.Function({self.name!r})"

    def __deepcopy__(self, memo: dict) -> Function:
        """A new handle on the same compiled function, as ``copy.copy`` makes: what a
        ``copy.deepcopy`` of a model that holds functions gets (a runtime's function is not data
        to duplicate).

        Examples
        --------
        >>> import copy
        >>> import pytensor.tensor as pt
        >>> import synkhronos as synk
        >>> x = pt.vector("x")
        >>> f = synk.function([x], (x.sum(), "sum"))
        >>> g = copy.deepcopy({"f": f})["f"]
        >>> g is not f, float(g([1.0, 2.0]))
        (True, 3.0)
        """
        clone = copy.copy(self)
        memo[id(self)] = clone
        return clone

    # --- single process reference ---------------------------------------------------------
    @serialized
    def as_pytensor(self, *args: np.ndarray) -> np.ndarray | list[np.ndarray]:
        """Run the plain single-process PyTensor function in the master on numpy inputs.

        Updates apply to the master's copies of the shared variables only. Each
        output has its variable's declared dtype, as the distributed call's
        (PyTensor's JAX backend computes some reductions wider).
        """
        if self._rows is not None:         # the rows the scalars select, as pytensor.function takes them
            args = tuple(self._rows.reference_arguments(args))
        out = [owned(o, dtype) for o, (_, dtype, _) in zip(self._run_reference(args), self._reductions)]
        return out[0] if self._bare else out

    as_theano = as_pytensor

    def _run_reference(self, args: Iterable[np.ndarray]) -> list[Any]:
        """Run the plain PyTensor function, compiled for any rows (or per shape if JAX needs it)."""
        # no runtime runs and JAX has no backend: one made here would keep fork() from running
        # again, so it goes once the results are the caller's
        backend_made_here = active() is None and not backend_exists()
        try:
            if self._reference is None:
                self._reference = CompiledFunction(self.spec, reference=True)
            outputs = self._reference.run(list(args))
            return [np.asarray(out) for out in outputs] if backend_made_here else outputs
        finally:
            if backend_made_here:
                for shared, _, _ in self.spec.updates:      # the master's copies, updated here
                    store(shared, np.asarray(stored(shared)))
                # (the reference keeps its programs: they hold its random streams' private state)
                drop_backend()

    def build_inputs(self, *values: Any, force_cast: bool = False, oversize: float = 1.,
                     minibatch: bool = False) -> list[Data]:
        """Make one :class:`Data` per input (scattered, then broadcast) from ``values``."""
        all_inputs = self.spec.all_inputs
        if len(values) != len(all_inputs):
            raise TypeError(f"{self.name} has {len(all_inputs)} inputs, got {len(values)} values")
        return [data(value=v, var=var, force_cast=force_cast, oversize=oversize,
                     minibatch=minibatch and i < len(self.spec.inputs))
                for i, (var, v) in enumerate(zip(all_inputs, values))]

    def input_refs(self, *values: Data | np.ndarray) -> list[InputRef]:
        """Where each scattered input's rows live, as a call would read them.

        ``values`` (one per scattered input, :class:`Data` or numpy) are
        checked as a call checks its arguments; numpy values are copied into
        shared memory as a call copies them. Returns one
        :class:`~synkhronos.wire.plan.InputRef` per value (what a
        device-driven loop reads its rows from). A device-driven loop gathers
        rows along axis 0: a value split along another axis is refused.
        """
        self._state.check_open()
        n = len(self.spec.inputs)
        if len(values) != n:
            raise TypeError(f"{self.name} takes {n} scattered inputs, got {len(values)} values")
        datas = [self._as_data(i, value) for i, value in enumerate(values)]
        self._axes.check_loop(datas)
        return [_input_ref(d) for d in datas]

    # --- calling ---------------------------------------------------------------------------
    @serialized(touches=touched_now)
    def __call__(self, *args: Data | np.ndarray, batch: int | slice | Sequence[int] | None = None,
                 batch_s: Any = None, num_slices: int = 1, output_subset: Sequence[int] | None = None,
                 **kwargs: Any) -> np.ndarray | list[np.ndarray] | None:
        """Run on every device and return the reduced outputs.

        Parameters
        ----------
        *args : Data or numpy arrays
            One per input (those of ``inputs``, then ``bcast_inputs``), or by
            input name as keywords.
        batch : int, slice, or sequence of int, optional
            Rows of the scattered inputs to use: ``n`` means ``[0, n)``.
        batch_s : optional
            Rows of the sliceable shared variables (see ``sliceable_shareds``).
        num_slices : int
            Each rank computes its share in this many slices and accumulates
            (at most one slice per row: a larger number means one row a slice).
        output_subset : list of int, optional
            Indices of the outputs to compute and return.
        """
        return self.call_with_tail(args, kwargs, batch, batch_s, num_slices, output_subset)

    def given_rows(self, *args: Any) -> slice:
        """The rows a call with ``args`` selects through the givens' row slices (see :mod:`.givens`)."""
        if self._rows is None:
            raise TypeError(f"{self.name} selects no rows through its givens")
        return self._rows.rows(self._rows.user_arguments(args, {}, self.name))

    def call_with_tail(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any = None, batch_s: Any = None,
                       num_slices: Any = 1, output_subset: Iterable[Any] | None = None, tail: Any = None) -> Any:
        """:meth:`__call__` with its arguments as a tuple and a dict; ``tail``, a
        :class:`~synkhronos.api.step.StepTail`, runs on every device after its share of
        the call, in the same command (see :class:`synkhronos.api.step.Step`)."""
        since = trace.now() if trace.on else None
        state = current()
        if state is not self._state:
            raise RuntimeError(f"{self} was built before the runtime it belonged to was closed; "
                               f"build it again after fork()")
        try:
            args, kwargs, plan = self._planned(args, kwargs, batch, batch_s, num_slices, output_subset)
        except Exception as e:
            state.tell_nodes_refused(f"a call of {self.name}", e)
            raise
        state.registry.ensure_shipped()
        if not state.registry.is_registered(self.spec.fid):
            raise TypeError(f"{self.name} could not be sent to the workers and was unregistered; "
                            f"build it again from picklable ops")
        if since is not None:          # recording a timeline: this call's phases on this rank
            trace.begin("call", self.name, since)
            trace.mark("plan")
        try:
            # (a fused step's outputs are reduced inside its program: device arrays, not waited for)
            outputs = state.calls.run(plan, result_record(self.spec, plan), tail,
                                      reduce=lambda rows, columns: self._reduce(plan, rows, columns),
                                      values=self._values_compared(state, args, kwargs))
            if since is not None:
                trace.mark("wait for devices")
        except WorkerError as e:
            if e.how is Failure.RAISED:
                add_hint(e, CallRows.of(plan, self._state.n_parallel, bool(self.spec.inputs)), self.spec)
            raise
        finally:
            if since is not None:
                trace.end("reduce")
        if self.row_written and tail is None:
            self._note_rows_behind(state, plan)
        if self._scratch:
            release_large_staging(self._scratch)
        return outputs[0] if (self._bare and output_subset is None) else outputs

    def _planned(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any, batch_s: Any,
                 num_slices: Any, output_subset: Iterable[Any] | None
                 ) -> tuple[Sequence[Any], Mapping[str, Any], CallPlan]:
        """``(args, kwargs, plan)`` of a call: its arguments (those of the rewritten function, with
        givens' row slices) and its checked plan, a kept one where it fits."""
        if self._rows is not None:
            args, batch = self._rows.call_arguments(args, kwargs, batch, self.name)
            kwargs = {}
        kept, plan = self._kept.find(args, kwargs, batch, batch_s, num_slices, output_subset)
        if plan is None:
            plan = self._plan(args, kwargs, batch, batch_s, num_slices, output_subset)
            kept.append(plan)
            return args, kwargs, plan
        if not plan.batch.is_range:
            # the kept plan of an earlier call with as many indices: only the indices are new
            n_scat = len(self.spec.inputs)
            plan = with_new_indices(plan, batch, args[:n_scat], self._input_names[:n_scat])
        if plan.sliced:           # and as many rows of the sliceable shareds on every rank
            plan = plan.with_sliced(self._plan_batch_s(batch_s, plan if plan.scattered else None))
        return args, kwargs, plan

    def _values_compared(self, state: State, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """On several nodes, what they compare of a call beyond its plan: its arguments given as
        values, not as Data (:func:`~synkhronos.wire.plan.values_text`), each in its input's order
        and dtype, as the devices take it (``2`` and ``2.0`` for a float input alike), and the
        function's graphs (:meth:`graph_compared`); "" on one node."""
        if state.nodes is None:
            return ""
        given = zip(self.spec.all_inputs, self._collect_args(args, kwargs))
        values = values_text(_as_its_input(var, v) for var, v in given if not isinstance(v, Data))
        return f"{values}, {self.graph_compared()}"

    def _note_rows_behind(self, state: State, plan: CallPlan) -> None:
        """Keep the rows behind each device's value of what the call wrote from its rows."""
        if plan.local and state.nodes is not None:      # (each node split its own shard)
            state.rows_behind.forget(self.row_written)
            return
        rows = [b.total for b in plan.sliced] if plan.sliced else \
            CallRows.of(plan, state.n_parallel, bool(plan.scattered)).per_device
        state.rows_behind.note(self.row_written, rows)

    def _plan(self, args: Sequence[Any], kwargs: Mapping[str, Any], batch: Any, batch_s: Any, num_slices: Any,
              output_subset: Iterable[Any] | None) -> CallPlan:
        spec = self.spec
        num_slices = check_num_slices(num_slices)
        if batch_s is not None and not spec.sliceable_shareds:
            raise TypeError(f"batch_s was given but {self.name} has no sliceable_shareds; "
                            f"pass sliceable_shareds= to synk.function to slice shared variables")
        subset = self._subset(output_subset)
        datas = [self._as_data(i, v) for i, v in enumerate(self._collect_args(args, kwargs))]
        n_scat = len(spec.inputs)
        names = self._input_names[:n_scat]
        axes = self._axes.of_call(datas[:n_scat])
        batch_plan, offsets = parse_batch(batch, datas[:n_scat], names, axes)
        if n_scat and batch_plan.total == 0:
            raise ValueError(f"the batch selects no rows of {self.name}'s scattered inputs; "
                             f"give at least one row")
        local = node_local(datas[:n_scat], names)
        plan = CallPlan(spec.fid, num_slices, batch_plan, subset,
                        [_input_ref(d, o, a) for d, o, a in zip(datas[:n_scat], offsets, axes)],
                        [_input_ref(d) for d in datas[n_scat:]], local=local)
        plan.sliced = sliced = self._plan_batch_s(batch_s, plan if n_scat else None)
        bounds = plan.split(self._state.topology.n_local if local else self._state.n_parallel)
        rows = [b.total for b in sliced] if sliced else [hi - lo for lo, hi in bounds] if n_scat else []
        if spec.updates and rows and min(rows) == 0:
            raise ValueError(f"{self.name} has updates but a device would get no rows (rows per "
                             f"device: {rows}): it would skip its updates and its state would drift; "
                             f"give at least one row per device ({len(rows)} rows or more), e.g. drop "
                             f"a last batch shorter than that, as train.run does")
        if n_scat:
            self._batch_shaped.check(batch_plan.total, rows)
        return plan

    def _plan_batch_s(self, batch_s: Any, plan: CallPlan | None) -> list[Batch]:
        """Per-rank rows of the sliceable shareds (validated against every rank's lengths)."""
        sliceables = self.spec.sliceable_shareds
        if not sliceables:
            return []
        shapes = self._state.collectives.all_shapes(sliceables)
        names = [str(s) for s in sliceables]
        for name, per_rank in zip(names, shapes):
            if any(len(shape) == 0 for shape in per_rank):
                raise TypeError(f"sliceable shared {name} is 0-d on some rank; it needs rows")
        sliced = parse_batch_s(batch_s, [[shape[0] for shape in per_rank] for per_rank in shapes],
                               names)
        if plan is not None:
            for rank, (b, (lo, hi)) in enumerate(zip(sliced, plan.split(self._state.n_parallel))):
                if hi - lo != b.total:
                    raise ValueError(f"rank {rank} gets {hi - lo} rows of the scattered inputs but "
                                     f"{b.total} rows of the sliceable shareds; they must match")
        return sliced

    def _subset(self, output_subset: Iterable[Any] | None) -> list[int]:
        n = len(self.spec.outputs)
        if output_subset is None:
            return list(range(n))
        subset = list(output_subset)
        for i in subset:
            if not isinstance(i, (int, np.integer)) or not 0 <= i < n:
                raise ValueError(f"output_subset entry {i!r} is not an output index in [0, {n})")
        return [int(i) for i in subset]

    def _collect_args(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Sequence[Any]:
        all_inputs = self.spec.all_inputs
        if not kwargs and len(args) == len(all_inputs):
            return args
        names = self._input_names
        if len(args) > len(all_inputs):
            raise TypeError(f"{self.name} takes {len(all_inputs)} inputs {names}, got {len(args)} "
                            f"positional arguments")
        values = list(args) + [_MISSING] * (len(all_inputs) - len(args))
        for key, value in kwargs.items():
            matches = [i for i, v in enumerate(all_inputs) if v.name == key]
            if not matches:
                raise TypeError(f"{self.name} has no input named {key!r}; its inputs are {names}")
            if values[matches[0]] is not _MISSING:
                raise TypeError(f"input {key!r} of {self.name} was given twice")
            values[matches[0]] = value
        missing = [names[i] for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise TypeError(f"{self.name} is missing inputs {missing}")
        return values

    def _as_data(self, i: int, value: Any) -> Data:
        var = self.spec.all_inputs[i]
        name = self._input_names[i]
        scattered = i < len(self.spec.inputs)
        if isinstance(value, Data):
            if not value.belongs_to(self._state):
                raise ValueError(f"Data for input {name!r} belongs to a closed runtime; "
                                 f"make it again with synk.data() after fork()")
            if value.dtype != var.type.dtype or value.ndim != var.type.ndim:
                raise TypeError(f"input {name!r} expects dtype {var.type.dtype} and ndim "
                                f"{var.type.ndim}, got Data with dtype {value.dtype} and ndim "
                                f"{value.ndim}; make the Data for this input with "
                                f"synk.data(value, var={name}, force_cast=True)")
            if value.shape is None:
                raise TypeError(f"Data for input {name!r} holds no value; set_value() it first")
            if scattered and value.ndim == 0:
                raise TypeError(f"scattered input {name!r} is 0-d and cannot be split by rows; "
                                f"make it a bcast_input")
            check_argument_shape(var, name, value.shape, self._axes.of(i, value) if scattered else None)
            return value
        if not isinstance(value, np.ndarray):
            value = as_pytensor_takes(var, value, f"argument for input {name!r}", self._downcast)
        arr = condition_value(value, var.type.dtype, var.type.ndim, what=f"argument for input {name!r}",
                              force_cast=self._downcast,
                              cast_hint="build the function with synk.function(..., "
                                        "allow_input_downcast=True)")
        check_argument_shape(var, name, arr.shape, self._axes.of(i) if scattered else None)
        scratch = self._scratch.get(i)
        if scratch is None:
            scratch = self._scratch[i] = Data(self._state, var.type.dtype, var.type.ndim,
                                              name=f"{self.name}:{name}")
        scratch.set_value(arr, oversize=1 if scratch.alloc_size >= arr.size else 1.25)
        return scratch

    def _reduce(self, plan: CallPlan, rows: list[int], columns: list[Any]) -> list[Any]:
        """Reduce each selected output across ranks (see :func:`~synkhronos.comm.reduction.reduce_outputs`)."""
        return reduce_outputs(columns, plan.subset, rows, self._state.master_rank, self._reductions)


@serialized
def function(inputs: Sequence[Variable], outputs: Outputs | None = None,
             bcast_inputs: Sequence[Variable] | None = None, updates: Updates | None = None,
             givens: Any = None, sliceable_shareds: Sequence[SharedVariable] | None = None,
             name: str | None = None, local_updates: bool = False, shapes_kept: int = SHAPES_KEPT,
             split_axes: dict | None = None, **kwargs: Any) -> Function:
    """Build a data-parallel function over every device of the runtime.

    Parameters
    ----------
    inputs : list of Variable
        Scattered inputs: split along axis 0 (or their ``split_axes``) across devices.
    outputs : Variable, (Variable, mode), or a list of those
        Modes: ``"avg"`` (default, weighted by rows), ``"sum"``, ``"prod"``,
        ``"min"``, ``"max"``, ``"gather"`` (concatenate in rank order, along
        axis 0 or the output's ``split_axes``), ``None`` (the master's own result).
    bcast_inputs : list of Variable, optional
        Inputs given whole to every device (as is every 0-d input of ``inputs``).
    updates : list of (shared, value[, mode]) or dict
        Applied locally on every device; the mode matters with ``num_slices > 1``.
    givens : dict or list of (Variable, Variable), optional
        As in :func:`pytensor.function`. A given that replaces a variable by a
        row slice of a shared variable (or of a cast of one) whose bounds are
        computed from scalar inputs, ``{x: X_sh[i * bs:(i + 1) * bs]}``, is the
        Theano tutorials' idiom: every call splits those rows over the devices
        and equals ``pytensor.function`` over the same scalars (see
        :mod:`synkhronos.api.function_parts.givens`); each call reads the rows from the
        variable's value as it is then. A given that reads shared variables and
        scalars but selects no rows (``{s: table[i]}``) is computed whole on
        every device. A given that would select rows in another way is
        refused with the recipe (``synk.data`` and ``batch=``).
    sliceable_shareds : list of SharedVariable, optional
        Shared variables holding per-device data that ``batch_s`` indexes.
    name : str, optional
    local_updates : bool
        Updates computed from the scattered rows are meant to stay per device
        (no :class:`~synkhronos.LocalUpdatesWarning`; see the notes).
    shapes_kept : int
        Graphs built for concrete argument shapes (a graph JAX traces only with
        concrete shapes is built per shape) that each device keeps, the most
        recently used. XLA compiles each argument shape once either way; a
        function called with many shapes warns once (:class:`~synkhronos.SynkWarning`).
    split_axes : dict, optional
        ``{variable: axis}``: the axis holding one entry per example of scattered
        inputs (time-major sequences: ``{x: 1, mask: 1}``), which ``batch=``,
        the split and ``"avg"``'s weights follow, or that a ``"gather"`` output
        is concatenated along (see :mod:`synkhronos.api.function_parts.split_axes`).
    **kwargs
        Passed to every underlying :func:`pytensor.function` (``mode`` defaults to ``"JAX"``).

    Returns
    -------
    Function

    Notes
    -----
    What ``pytensor_ml.pytensorf.function`` threads into a function is
    threaded in here: the next state of every random generator the graphs
    draw from, the advance of every training clock the outputs or updates
    read, and the write-backs of stateful layers (batch norm's running
    statistics) reached by the update expressions. A training step's gradient
    function leaves the last two to the step's update function
    (:mod:`synkhronos.compile.graph_updates`). Updates computed from the scattered rows
    warn (:class:`~synkhronos.LocalUpdatesWarning`) unless ``local_updates=True``.

    Examples
    --------
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.array([1.0, 0.0]), name="w")
    >>> loss = ((x.dot(w) - y) ** 2).mean()
    >>> err = pt.neq(pt.sign(x.dot(w)), pt.sign(y)).sum()
    >>> f = synk.function([x, y], [(loss, "avg"), (err, "sum")])
    >>> x_dat = synk.data(np.array([[1.0, 0], [2, 0], [3, 0], [4, 0]]))
    >>> y_dat = synk.data(np.array([1.0, 2, -3, -4]))
    >>> loss, err = f(x_dat, y_dat, batch=np.arange(4), num_slices=2)
    >>> float(loss), int(err)
    (25.0, 2)
    >>> seqs = pt.matrix("seqs")                                  # (time, samples)
    >>> synk.function([seqs], (seqs.sum(0), "gather"), split_axes={seqs: 1})(np.arange(6.0).reshape(2, 3)).tolist()
    [3.0, 5.0, 7.0]
    """
    state = current()
    if isinstance(shapes_kept, bool) or not isinstance(shapes_kept, (int, np.integer)) or shapes_kept < 1:
        raise ValueError(f"shapes_kept must be a whole number of at least 1, got {shapes_kept!r}")
    spec, bare, rows = record(state.registry.next_function_id(), inputs, outputs, bcast_inputs,
                              updates, givens, sliceable_shareds, name, local_updates, kwargs,
                              split_axes=split_axes)
    spec.shapes_kept = int(shapes_kept)
    set_precision(State.float_x())       # the same rule every rank applies
    state.registry.own_streams(spec.shared_variables())
    compiled = compile_on_master(spec, state.settings.compile_cache)     # compile errors surface here
    state.registry.register_function(spec, compiled)
    return Function(state, spec, bare, compiled, rows, local_updates)


def _as_its_input(var: Any, value: Any) -> Any:
    """``value`` in the dtype of the input ``var`` (a value the call already took)."""
    try:
        return np.asarray(value, dtype=var.type.dtype)
    except (TypeError, ValueError):
        return value
