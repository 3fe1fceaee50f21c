"""A :class:`~synkhronos.wire.spec.FunctionSpec` compiled for this process's device.

Every process (the master too) compiles each function with PyTensor's JAX
backend. Graphs on free rows that JAX can only trace with concrete shapes are
compiled per argument shape instead (:func:`~.graphs.rebuild_on`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pytensor
from pytensor.graph.replace import clone_replace

from ..compile.randomness import is_generator
from ..compile.rewrites import compile_mode, raise_deferred_interrupt
from ..errors import warn
from ..ipc.buffers import aligned_empty
from ..platform.device_arrays import place_on_device, wait_until_computed
from ..platform.internals import check_function_graph, jit_parts
from ..platform.jax_init import platform
from ..platform.threads import start_thread
from ..platform.values import faces_held, store, stored
from ..tracing import trace
from .graphs import Pair, SpecGraph, needs_static_shapes, shaped_shared_cells, spec_graph
from .jitted import Runner, abstract_value, face_updates, jitted_call

if TYPE_CHECKING:
    from pytensor.compile.executor import Function
    from pytensor.graph.basic import Variable

    from ..wire.spec import FunctionSpec
    from .undo import UndoLog

#: the shapes of a call's arguments that pick its graph (see CompiledFunction)
type Shapes = tuple[tuple[int, ...], ...]

__all__ = ["CompiledFunction", "GatherBuffer", "compile_ahead", "generator_cells", "MANY_SHAPES"]


class GatherBuffer:
    """The one host buffer a scattered input's gathered rows go to, call after call.

    Called as ``buffer(shape, dtype)``, it returns a 64-byte aligned array of
    that shape in the same memory each time (grown when too small). The rows
    gathered for a call then land in memory the previous call warmed, in the
    cache and the TLB; a fresh or pooled buffer per call gathers slower (JAX
    lets go of a host buffer it adopted only some time after the call
    returns, so a pool rarely has the last one free again).

    Reusing the memory is safe because a call given arguments returns only
    once its computation has finished (see :func:`~.jitted.jitted_call`), and no output
    or update value is a view of an input: PyTensor copies an output that
    would be one (``DeepCopyOp``), so nothing outlives the call with a view of
    this buffer.
    """

    def __init__(self) -> None:
        self._owner = np.empty(0, np.uint8)

    def __call__(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._owner.nbytes:
            self._owner = aligned_empty((nbytes,), np.uint8)
        return self._owner[:nbytes].view(dtype).reshape(shape)


#: a function that has compiled this many argument shapes says so once (see CompiledFunction)
MANY_SHAPES = 16


def generator_cells(fn: Function) -> dict[Variable, list[Any]]:
    """Where ``fn`` keeps the state of each random generator it draws from: {the user's generator: the
    storage cell of ``fn``'s private copy} (empty if ``fn`` is not one jitted graph)."""
    parts = jit_parts(fn)
    if parts is None:
        return {}
    return {inp.variable: parts.cells[j] for j, inp in enumerate(fn.maker.inputs)
            if is_generator(inp.variable)}


def compile_ahead(runner: Runner) -> threading.Thread | None:
    """Have XLA compile the program ``runner`` will run, on another thread, if its shapes are known
    before its first call (a graph without arguments: an update function). Returns the thread, or None.

    The thread spends time the process would otherwise wait: for the other
    ranks' reports, or its own next command. XLA releases Python's lock while
    it compiles, so the process goes on meanwhile; the first call waits for
    the thread and then finds its program compiled. A failure there is left
    for the call to meet and report.
    """
    ahead = getattr(runner, "compile_ahead", None)
    compile_ = ahead() if ahead is not None else None
    if compile_ is None:
        return None

    def run() -> None:
        with contextlib.suppress(Exception):
            compile_()
    return start_thread(run, "synkhronos-compile-ahead", daemon=False)


class CompiledFunction:
    """A FunctionSpec compiled for this process's device (lazily for the slice variant).

    Sliceable shared variables are replaced (through ``givens``) by extra
    symbolic inputs, so each call can feed them the rows ``batch_s`` selects
    from the device-resident value.

    Rows are free in the graph (``synk.function`` refuses a scattered input
    with a static row count). JAX traces some graphs only with concrete shapes
    (``arange`` over the batch in a cross-entropy, pytensor-ml's convolutions, a
    ``flatten`` before a layer), so a process's first call builds the graph for
    the shapes it is given, rows and all (:func:`~.graphs.rebuild_on`; static shapes only
    get added, so nothing in the graph can contradict them), which always
    traces. A call with other shapes then builds the graph on free rows: if it
    runs, it serves every later shape (``by_rows`` False); if it fails, each new
    shape gets a graph of its own (``by_rows`` True; the last
    ``spec.shapes_kept`` are kept). Either way XLA compiles each argument shape
    once; a function that has met :data:`MANY_SHAPES` shapes warns once. Whenever both fail (a first call's graph
    for its shapes is retried on free rows), the free-rows failure, JAX's
    account with the graph's line, is the call's error. Every graph run
    continues the function's random streams (:meth:`_invoke`).
    ``spec.by_rows`` brings what an earlier run
    found (None: nothing), and ``on_finding(by_rows)`` hears what this one finds.
    A graph without row-carrying arguments is built at once, on free rows.

    Parameters
    ----------
    spec : FunctionSpec
    reference : bool
        Compile the plain single-process PyTensor function instead (PyTensor's
        own JAX mode and input checks, sliceable shareds used whole): what
        ``Function.as_pytensor`` runs.
    on_finding : callable, optional
        Called with ``by_rows`` once a call has found whether the graph traces
        on free rows (the master records it in the compile cache).
    check : bool
        Raise at once what PyTensor refuses in the graph before rewriting it,
        where nothing is built yet (the master checks; the workers get checked
        graphs). The master also says when the function has met many shapes
        (every rank meets as many: one warning is enough).
    """

    def __init__(self, spec: FunctionSpec, reference: bool = False,
                 on_finding: Callable[[bool], None] | None = None, check: bool = False) -> None:
        self.spec = spec
        self.reference = reference
        self.output_modes = [m for _, m in spec.outputs]
        # named as the user's variables, so that PyTensor's messages name what the user wrote
        self.sliced_inputs = [] if reference else [s.type(name=s.name) for s in spec.sliceable_shareds]
        #: which of a call's arguments pick the graph rebuilt for their shapes: those that carry its
        #: rows (the scattered and the sliced inputs), and the broadcast arrays (a sequence a scan
        #: runs over has its length as a constant then)
        n_in, n_all = len(spec.inputs), len(spec.all_inputs)
        self._row_args = list(range(n_in)) + \
            [i for i in range(n_in, n_all) if spec.all_inputs[i].type.ndim] + \
            list(range(n_all, n_all + len(self.sliced_inputs)))
        self._run_no_updates: Runner | None = None
        #: the storage cell of each shared variable a graph rebuilt per shape may read at its present
        #: shape (see spec_graph), and whether it does: only once a graph rebuilt on the arguments'
        #: shapes alone failed to trace (a slice of a flat parameter vector reshaped); its shape is
        #: then part of what a rebuilt graph was built for. (Fixed always, a scan's rewrites can turn
        #: a length JAX traces into one it cannot.)
        self._shape_cells = shaped_shared_cells(spec)
        self._shareds_fixed = False
        #: ((row shapes, shared shapes), updates applied) -> runner of the graph rebuilt on them, the most recent kept
        self._row_variant = functools.lru_cache(maxsize=spec.shapes_kept)(
            lambda shapes, updates: self._runner(self._compile(updates, *shapes)))
        #: the argument shapes met, until there were MANY_SHAPES of them (None after the warning)
        self._shapes_met: set[Shapes] | None = set() if check and self._row_args else None
        #: the PyTensor function on free rows (updates applied), or None while not built
        self.function: Function | None = None
        #: True: compiled per row count; False: on free rows; None: not known yet (see the class notes)
        self.by_rows: bool | None = False if reference or not self._row_args else spec.by_rows
        self._on_finding = on_finding
        #: the row shapes compiled per shape while ``by_rows`` was not known (they keep their graphs)
        self._shapes_first: set[Shapes] = set()
        #: whether the graph on free rows ran once (a later failure is then the call's own)
        self._free_rows_ran = False
        #: the generator cells of the graph that ran last: where the random streams are (see _invoke)
        self._streams_at: dict[Variable, list[Any]] | None = None
        if self.by_rows is None and check:
            self._check()                # what PyTensor refuses before rewriting is raised here
        elif self.by_rows is False:
            try:
                self.function = self._compile(updates=True)
            except Exception as e:
                if not self._row_args or not needs_static_shapes(e):
                    raise
                self._settle(True)
        self._run: Runner | None = self._runner(self.function) if self.function is not None else None
        if not reference:
            place_on_device(spec.shared_variables())     # compiled once, for device values
        #: XLA compiling the program ahead of its first call, on another thread (see compile_ahead)
        self._compiling: threading.Thread | None = None if reference else compile_ahead(self._run)
        #: per scattered input, where its explicitly indexed rows are gathered call after call
        self.gather_buffers = [GatherBuffer() for _ in spec.inputs]

    def _compiled_ahead(self) -> None:
        """Wait for the compile ahead, if one is running: the call then finds its program compiled."""
        if self._compiling is not None:
            self._compiling.join()
            self._compiling = None

    def _settle(self, by_rows: bool) -> None:
        """Record what was found: the graph needs concrete shapes (True) or traces on free rows."""
        changed = self.by_rows is not by_rows
        self.by_rows = by_rows
        if changed and self._on_finding is not None:
            self._on_finding(by_rows)

    @property
    def calls_jit_directly(self) -> bool:
        """True if calls skip PyTensor's per-call bookkeeping (see :func:`~.jitted.jitted_call`)."""
        return self._run is not None and getattr(self._run, "fn", None) is self.function

    def _givens(self) -> list[Pair]:
        if not self.sliced_inputs:
            return self.spec.givens
        replace = dict(zip(self.spec.sliceable_shareds, self.sliced_inputs))
        user = [(k, clone_replace(v, replace=replace)) for k, v in self.spec.givens]
        return user + list(replace.items())

    def _graph(self, shapes: Shapes | None = None, shared_shapes: Shapes = ()) -> SpecGraph:
        """(inputs, outputs, updates, generator updates, givens), rebuilt on ``shapes`` if given
        (and on the shared variables of ``_shape_cells`` at ``shared_shapes``)."""
        fixed = dict(zip(self._shape_cells, shared_shapes))
        arguments = self.spec.all_inputs + self.sliced_inputs
        return spec_graph(self.spec, arguments, self._givens(), [arguments[i] for i in self._row_args],
                          shapes, fixed)

    def _check(self) -> None:
        """Raise what building the graph would raise before PyTensor's rewrites (a missing input...)."""
        inputs, outputs, upd, generators, givens = self._graph()
        check_function_graph(inputs, outputs, updates=upd + generators, givens=givens,
                             **self.spec.pytensor_kwargs())

    def _compile(self, updates: bool, shapes: Shapes | None = None, shared_shapes: Shapes = ()) -> Function:
        spec = self.spec
        inputs, outputs, upd, generators, givens = self._graph(shapes, shared_shapes)
        if not updates:      # their values come back as outputs, to accumulate over slices
            outputs, upd = outputs + [v for _, v in upd], []
        with warnings.catch_warnings():
            # the JAX linker says it compiles a copy of each generator's state: as documented
            warnings.filterwarnings("ignore", message="The RandomType SharedVariables")
            # and that it drops shape assertions under tracing, once per graph and process
            warnings.filterwarnings("ignore", message="Skipping Assert", category=UserWarning)
            mode = spec.pytensor_kwargs() if self.reference else \
                spec.pytensor_kwargs(compile_mode(platform()))
            if trace.on:
                trace.begin("compile", f"build {spec.name}")     # PyTensor's rewrites and linking
            try:
                fn = pytensor.function(inputs, outputs, updates=upd + generators, givens=givens, **mode)
            finally:
                if trace.on:
                    trace.end(shapes=str(shapes) if shapes else "any rows")
        # The master validated every argument (dtype, ndim, rows) before any process was woken;
        # PyTensor's per-call input checks would only repeat that in every process.
        fn.trust_input = not self.reference
        return fn

    def _runner(self, fn: Function) -> Runner:
        """How this process calls ``fn``: its jitted graph directly, else ``fn`` itself.

        Either returns only once a computation given arguments has finished (see
        :func:`~.jitted.jitted_call`).
        """
        if self.reference:
            return fn
        direct = jitted_call(fn)
        if direct is not None:
            direct.streams = generator_cells(fn)
            return direct
        shareds = [s for s, _, _ in self.spec.updates]
        update_cells = [s.container.storage for s in shareds]

        def call(*args: Any, undo: UndoLog | None = None) -> list[Any]:
            if undo is not None:
                undo.keep(update_cells)
            try:
                outputs = fn(*args)
                if args:
                    wait_until_computed((outputs, [stored(s) for s in shareds]))
                if faces_held():
                    face_updates(update_cells)
            except Exception as e:
                raise_deferred_interrupt(e)
                raise
            raise_deferred_interrupt()
            return outputs
        call.fn = fn  # type: ignore[attr-defined]  # a function with its program attached
        call.streams = {}  # type: ignore[attr-defined]  # not linked for JAX: the generators' own containers, shared by all
        return call

    def _invoke(self, runner: Runner, args: Sequence[Any], undo: UndoLog | None = None) -> list[Any]:
        """``runner(*args)``, its random generators first brought to where the last graph run left them.

        PyTensor's JAX linker gives every compiled graph a private copy of its
        generators' state (see :mod:`synkhronos.compile.randomness`), and this
        function may run several graphs (one per row count, one on free rows,
        one that defers its updates): each continues the one stream, never
        starts it again. ``undo``, an :class:`~.undo.UndoLog`, goes to the runner.
        """
        self.continue_streams(runner)
        return runner(*args) if undo is None or self.reference else runner(*args, undo=undo)

    def continue_streams(self, runner: Runner) -> None:
        """Bring ``runner``'s random generators to where the last graph run left them (see
        :meth:`_invoke`): what a program built from ``runner``'s graph does first too."""
        streams = getattr(runner, "streams", None)      # (the reference runs PyTensor's function)
        if streams and self._streams_at is not None and self._streams_at is not streams:
            for generator, cell in streams.items():
                if generator in self._streams_at:
                    cell[0] = self._streams_at[generator][0]
        if streams:
            self._streams_at = streams

    def settled_runner(self, row_shapes: Iterable[tuple[int, ...]]) -> Runner | None:
        """The runner a call whose row-carrying arguments have ``row_shapes`` runs (updates
        applied), once a call has found which graph serves them; else None.

        A fused step (:mod:`.fused`) builds its program from that runner's graph,
        the graph the careful first run of these shapes ran.
        """
        if self.reference:
            return None
        row_shapes = tuple(row_shapes)
        if self.by_rows or row_shapes in self._shapes_first:
            return self._for_shapes(row_shapes, True)
        if self.by_rows is False and self._run is not None and (self._free_rows_ran or not self._row_args):
            return self._run
        return None

    def _for_shapes(self, shapes: Iterable[tuple[int, ...]], updates: bool) -> Runner:
        """The runner of the graph rebuilt on inputs of ``shapes`` (see the class notes)."""
        shapes = tuple(shapes)
        if self.by_rows is None:
            self._shapes_first.add(shapes)
        fixed = tuple(c[0].shape for c in self._shape_cells.values()) if self._shareds_fixed else ()
        return self._row_variant((shapes, fixed), updates)

    def _invoke_for_shapes(self, shapes: Shapes, args: Sequence[Any], updates: bool,
                           undo: UndoLog | None) -> list[Any]:
        """Run the graph rebuilt on ``shapes``; if JAX cannot trace it, rebuilt on the shared variables'
        present shapes too (from then on, see ``_shareds_fixed``). A trace fails before anything runs."""
        try:
            return self._invoke(self._for_shapes(shapes, updates), args, undo)
        except Exception as e:
            if self._shareds_fixed or not self._shape_cells or not needs_static_shapes(e):
                raise
        self._shareds_fixed = True
        return self._invoke(self._for_shapes(shapes, updates), args, undo)

    def _call(self, args: Sequence[Any], updates: bool, undo: UndoLog | None = None) -> list[Any]:
        """Run the graph for ``args``: per shape, or on free rows (finding out which, see the class notes)."""
        shapes = tuple(args[i].shape for i in self._row_args)
        if self._shapes_met is not None:
            self._count_shape(shapes)
        if self.by_rows is None and not self._shapes_first:
            return self._first_call(shapes, args, updates, undo)
        if self.by_rows or shapes in self._shapes_first:
            return self._invoke_for_shapes(shapes, args, updates, undo)
        return self._free_or_by_rows(args, updates, undo)

    def _count_shape(self, shapes: Shapes) -> None:
        """Warn once when this function has met MANY_SHAPES argument shapes: each compiles anew."""
        met = self._shapes_met
        if met is None:
            return
        met.add(shapes)
        if len(met) >= MANY_SHAPES:
            self._shapes_met = None
            warn(
                f"{self.spec.name} has been called with {MANY_SHAPES} different argument shapes, and "
                f"each device compiles every new shape (XLA, and PyTensor too for a graph that needs "
                f"concrete shapes); pad varying lengths to a few bucket lengths (user guide, "
                f"'Varying shapes'); each device keeps {self.spec.shapes_kept} shapes compiled "
                f"(synk.function(shapes_kept=...))")

    def _first_call(self, shapes: Shapes, args: Sequence[Any], updates: bool, undo: UndoLog | None) -> list[Any]:
        """Run the graph built for ``shapes``; if that fails, the graph on free rows, whose failure
        (JAX's account, with the graph's line) is then the call's error."""
        try:
            return self._invoke_for_shapes(shapes, args, updates, undo)
        except Exception:
            self._shapes_first.discard(shapes)
        try:
            result = self._invoke(self._free_runner(updates), args, undo)
        except Exception as failure:
            raise failure from None
        self._free_rows_ran = True
        self._settle(False)
        return result

    def _free_runner(self, updates: bool) -> Runner:
        """The runner of the graph on free rows (built at its first use)."""
        if updates:
            if self._run is None:
                self.function = self._compile(updates=True)
                self._run = self._runner(self.function)
            return self._run
        if self._run_no_updates is None:
            self._run_no_updates = self._runner(self._compile(updates=False))
        return self._run_no_updates

    def _free_or_by_rows(self, args: Sequence[Any], updates: bool, undo: UndoLog | None) -> list[Any]:
        """Run the graph compiled for any rows; switch to per-row-count graphs if JAX needs them."""
        try:
            result = self._invoke(self._free_runner(updates), args, undo)
        except Exception as e:
            if not (self._row_args or self._shape_cells) or self._free_rows_ran:
                raise
            failure = e
        else:
            self._free_rows_ran = True
            self._settle(False)
            return result
        try:          # tracing on free rows failed: the graph rebuilt on these shapes may not
            result = self._invoke_for_shapes(tuple(args[i].shape for i in self._row_args), args, updates, undo)
        except Exception:
            raise failure from None
        self._settle(True)
        return result

    def function_for(self, row_shapes: Iterable[tuple[int, ...]]) -> Function | None:
        """The PyTensor function a call whose row-carrying arguments have ``row_shapes`` runs
        (updates applied), built if it is not yet: what a test reads to see what was compiled."""
        if self.by_rows is False:
            return self.function
        return self._for_shapes(row_shapes, True).fn

    def check_traces(self, arg_shapes: Sequence[tuple[int, ...]]) -> None:
        """Trace the graph for arguments of ``arg_shapes`` without computing; raise what tracing raises.

        What a call with arguments of those shapes would raise at its first
        step (a width that does not fit a weight, say), found in this process
        before any rank starts (``train.run`` checks the master's first share
        so). A graph that needs concrete shapes is checked as it would run:
        rebuilt for these shapes.
        """
        free_rows = None
        if self.by_rows is False and self.function is not None:
            try:
                return self._trace(self.function, arg_shapes)
            except Exception as e:
                if not self._row_args:
                    raise
                free_rows = e
        runner = self._for_shapes([arg_shapes[i] for i in self._row_args], True)
        try:
            self._trace(runner.fn, arg_shapes)
        except Exception:
            if free_rows is not None:
                raise free_rows from None
            raise

    @staticmethod
    def _trace(fn: Function, arg_shapes: Sequence[Sequence[int]]) -> None:
        import jax
        parts = jit_parts(fn) if fn is not None else None
        if parts is None:
            return
        types = [inp.variable.type for inp in fn.maker.inputs if not inp.implicit]

        # in the precision JAX computes (no truncation warning)
        avals = [jax.ShapeDtypeStruct(tuple(shape), jax.dtypes.canonicalize_dtype(t.dtype))
                 for shape, t in zip(arg_shapes, types)]
        avals += [jax.tree_util.tree_map(abstract_value, cell[0]) for cell in parts.cells[parts.n_args:]]
        jax.eval_shape(parts.jit, *avals)

    def run(self, args: Sequence[Any], undo: UndoLog | None = None) -> list[Any]:
        """Run once, applying updates; an :class:`~.undo.UndoLog` keeps what they replace if the call
        could fail (see :func:`~.jitted.jitted_call`)."""
        self._compiled_ahead()
        return self._call(args, True, undo)

    def run_deferred(self, args: Sequence[Any], undo: UndoLog | None = None) -> tuple[list[Any], list[Any]]:
        """Run once without applying updates; return (outputs, new update values)."""
        self._compiled_ahead()
        out = self._call(args, False, undo)
        n = len(self.spec.outputs)
        return out[:n], out[n:]

    def apply(self, values: Sequence[Any], undo: UndoLog | None = None) -> None:
        """Store accumulated update values into the shared variables, on the device."""
        if undo is not None:
            undo.keep([shared.container.storage for shared, _, _ in self.spec.updates])
        for (shared, _, _), value in zip(self.spec.updates, values):
            store(shared, value.astype(shared.type.dtype))


def release_programs(compiled: CompiledFunction) -> None:
    """Drop ``compiled``'s programs, which hold the JAX backend: the runtime closes, and a backend
    (a GPU's memory) must be able to go with it though the user keeps the function."""
    compiled._compiled_ahead()
    compiled.function = compiled._run = compiled._run_no_updates = None
    compiled._row_variant.cache_clear()
