"""``synk.function``: record a PyTensor graph, ship it, compile it everywhere, call it.

A :class:`Function` lives in the master. Its :class:`FunctionSpec` (the
symbolic graph and modes) is cloudpickled to the workers by ``distribute()``;
every process compiles it with PyTensor's JAX backend into a
:class:`CompiledFunction`. A call is validated in the master, encoded as
integers into the control block (:class:`CallPlan`), and run by every process
with :func:`run_share` on its own rows; the master reduces the results.
"""

import copy
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import get_mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.replace import clone_replace
from pytensor.compile.builders import OpFromGraph, SymbolicOp
from pytensor.graph.traversal import ancestors, toposort
from pytensor.link.jax.linker import JAXLinker
from pytensor.tensor.type import TensorType

from . import devices, lifecycle, randomness, shipping
from .control import RECORD_BYTES, Words
from .data import Data, condition_value, release_large_staging
from .modes import Accumulator, check_output_mode, check_update_mode, reduce_ranks
from .rewrites import compile_mode, raise_deferred_interrupt
from .scatter import Batch, check_num_slices, chunk, gather_rows, parse_batch, parse_batch_s
from .transport import aligned_empty, dtype_code

__all__ = ["function", "Function", "FunctionSpec", "CompiledFunction", "CallPlan", "run_share",
           "result_record"]

JAX_MODE = "JAX"

# PyTensor's JAX backend warns once per compiled graph that it drops shape assertions under
# tracing; synkhronos compiles every graph in every process, which would repeat it n times.
warnings.filterwarnings("ignore", message="Skipping Assert", category=UserWarning)


# ------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------

def _normalize_outputs(outputs):
    """Return ([(var, mode)], bare) from the user's ``outputs``."""
    if outputs is None:
        return [], False
    bare = isinstance(outputs, Variable) or (isinstance(outputs, tuple) and len(outputs) == 2
                                             and isinstance(outputs[0], Variable)
                                             and not isinstance(outputs[1], Variable))
    items = [outputs] if bare else list(outputs)
    pairs = []
    for item in items:
        if isinstance(item, Variable):
            var, mode = item, "avg"
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Variable):
            var, mode = item
        else:
            raise TypeError(f"each output must be a variable or a (variable, mode) pair, got {item!r}")
        pairs.append((var, check_output_mode(var, mode)))
    return pairs, bare


def _normalize_updates(updates):
    """Return ([(shared, new_value, mode)], [(generator, next_state)]) from pairs/triples or a dict.

    A random generator's update is its next state: it has no mode and is
    applied on every slice (each slice draws anew).
    """
    if updates is None:
        return [], []
    items = list(updates.items()) if isinstance(updates, dict) else list(updates)
    triples, generators = [], []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise TypeError(f"each update must be (shared, new_value) or (shared, new_value, mode), "
                            f"got {item!r}")
        shared, value = item[0], item[1]
        mode = item[2] if len(item) == 3 else "avg"
        if not isinstance(shared, SharedVariable):
            raise TypeError(f"update target {shared!r} is not a shared variable")
        if randomness.is_generator(shared):
            generators.append((shared, value))
            continue
        triples.append((shared, pt.as_tensor_variable(value), check_update_mode(shared, mode)))
    return triples, generators


def _shape_text(shape):
    """A static shape as one writes it in ``pt.tensor(shape=...)``, ``None`` for a free length.

    Examples
    --------
    >>> _shape_text((None, 3)), _shape_text((None,))
    ('(None, 3)', '(None,)')
    """
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + \
        ("," if len(shape) == 1 else "") + ")"


def _declared(var):
    """``var``'s static shape as PyTensor declares it."""
    return _shape_text(var.type.shape)


def _check_declared_shape(var, name, shape, scattered):
    """Raise TypeError if ``shape`` contradicts the static shape input ``var`` declares.

    A scattered input's rows are free (:func:`_check_free_rows`): the
    argument may hold more rows than a call uses.
    """
    axes = range(1 if scattered else 0, var.type.ndim)
    if any(var.type.shape[a] is not None and var.type.shape[a] != shape[a] for a in axes):
        raise TypeError(f"input {name!r} is declared with shape {_declared(var)} but the argument "
                        f"has shape {tuple(shape)}; give an argument of that shape or declare the "
                        f"axis free (None) in its pt.tensor(..., shape=...)")


def _check_inputs(inputs, what):
    inputs = [] if inputs is None else list(inputs)
    for var in inputs:
        if not isinstance(var, Variable) or isinstance(var, SharedVariable) or var.owner is not None:
            raise TypeError(f"{what} must be symbolic input variables (e.g. pt.matrix('x')), "
                            f"got {var!r}")
    return inputs


def _check_free_rows(inputs):
    """Refuse scattered inputs declared with a static row count.

    Each device computes its own share of a call's rows, and a graph built
    for a fixed row count may hold that count anywhere (a reshape, a
    divisor): it cannot be split correctly. Graphs on free rows that need
    concrete shapes are compiled per row count instead (see CompiledFunction).
    """
    for var in inputs:
        rows = declared_rows(var)
        if rows is not None:
            free = _shape_text((None,) + tuple(var.type.shape[1:]))
            raise TypeError(
                f"scattered input {var} is declared with a static row count, shape "
                f"{_declared(var)}, but each device computes its own share of a call's rows, and a "
                f"graph built for {rows} rows may hold that number anywhere; declare the rows free, "
                f"pt.tensor({(var.name or 'x')!r}, shape={free}, ...): synkhronos compiles each "
                f"device's graph for the rows it gets when JAX needs static shapes "
                f"(pytensor-ml's convolutions work so)")


def _check_mode(kwargs):
    """Refuse a compilation ``mode`` whose functions do not run on a JAX device.

    Every process keeps its shared variables on its own JAX device between
    calls, and the collectives exchange those device arrays; a function linked
    for another backend (``"FAST_RUN"``, ``"NUMBA"``, ...) computes on numpy
    arrays outside that device.
    """
    mode = kwargs.get("mode")
    if mode is None:
        return
    try:
        linker = get_mode(mode).linker
    except Exception as e:
        raise ValueError(f"mode={mode!r} is not a PyTensor compilation mode: {e}") from None
    if not isinstance(linker, JAXLinker):
        raise ValueError(f"mode={mode!r} does not compile for JAX, and synkhronos runs every "
                         f"function on each process's JAX device (CPU or GPU alike); leave mode "
                         f"unset (synkhronos's JAX mode), or pass mode=\"JAX\" or a "
                         f"pytensor Mode whose linker is \"jax\"")


def shared_variables(graph_vars):
    """All shared variables the graph of ``graph_vars`` depends on, in a stable order."""
    return [v for v in ancestors(graph_vars) if isinstance(v, SharedVariable)]


@dataclass
class FunctionSpec:
    """Everything a process needs to compile a Function; this is what gets shipped."""

    fid: int
    name: str
    inputs: list
    bcast_inputs: list
    outputs: list          # [(var, mode)]
    updates: list          # [(shared, value, mode)]
    givens: list
    sliceable_shareds: list
    kwargs: dict = field(default_factory=dict)
    #: (generator, next state): every random generator the graphs draw from (see .randomness)
    generator_updates: list = field(default_factory=list)

    @property
    def all_inputs(self):
        return self.inputs + self.bcast_inputs

    def pytensor_kwargs(self, platform=None):
        """Keyword arguments for a ``pytensor.function`` built from this spec.

        With ``platform`` (compiling for this process's device), the default mode
        carries synkhronos's rewrites for that platform (:mod:`.rewrites`);
        without, it is PyTensor's own JAX mode (the single-process reference).
        A ``mode`` the user gave is used as it is.
        """
        kwargs = dict(self.kwargs)
        kwargs.setdefault("mode", compile_mode(platform) if platform else JAX_MODE)
        kwargs.setdefault("on_unused_input", "ignore")
        return kwargs

    def graph_vars(self):
        return ([v for v, _ in self.outputs] + [u[1] for u in self.updates]
                + [g[1] for g in self.givens] + [nxt for _, nxt in self.generator_updates])

    def shared_variables(self):
        """Every shared variable the function reads or updates (the workers must hold them)."""
        return shared_variables(self.graph_vars()) + [s for s, _, _ in self.updates]



def jitted_call(fn):
    """Call ``fn``'s jitted JAX graph directly, or None if ``fn`` was not linked by PyTensor's JAX linker.

    A PyTensor function linked for JAX is one ``jax.jit`` function behind
    per-call bookkeeping (profiling checks, an output storage round trip,
    garbage-collection loops): a good part of a tiny graph's call, paid by
    every process in every call. The returned callable
    does what that bookkeeping does for a function whose inputs are trusted:
    it fills the explicit input cells, runs the jitted graph on every input
    cell (shared variables included), stores the update values into their
    shared variables and empties the input cells again (they hold views of
    shared memory that must not outlive the call). A call with arguments
    returns once the computation has finished, so no argument is read after
    the call (JAX dispatches asynchronously; PyTensor's other backends compute
    before they return). An error is re-raised through ``fn`` itself, with
    PyTensor's account of the failing node.

    Parameters
    ----------
    fn : pytensor.compile.Function
        Compiled with ``trust_input`` and list outputs.

    Returns
    -------
    callable or None
        ``call(*args)`` returning the list of ``fn``'s outputs.
    """
    jit, cells = getattr(fn.vm, "jit_fn", None), getattr(fn.vm, "inputs", None)
    explicit = getattr(fn, "_input_storage_data", None)
    updates = getattr(fn, "_update_input_storage", None)
    n_outputs = getattr(fn, "_n_returned_outputs", None)
    if None in (jit, cells, explicit, updates, n_outputs) or fn.profile or not fn.maker.fgraph.outputs or \
            any(cell is not own for cell, own in zip(cells, explicit)):
        return None
    n_args = sum(1 for inp in fn.maker.inputs if not inp.implicit)
    arg_cells = cells[:n_args]
    updates = [(i, container.storage) for i, container in updates]
    # all outputs of one execution become ready together: wait on one array (a random generator's
    # next state is a dict of arrays, which has no block_until_ready)
    arrays = [i for i, v in enumerate(fn.maker.fgraph.outputs) if isinstance(v.type, TensorType)]
    wait = (lambda outputs: outputs[arrays[-1]].block_until_ready()) if arrays else \
        devices.wait_until_computed

    def call(*args):
        for cell, arg in zip(arg_cells, args):
            cell[0] = arg
        try:
            outputs = jit(*[cell[0] for cell in cells])
        except Exception as e:
            raise_deferred_interrupt(e)
            return fn(*args)
        finally:
            for cell in arg_cells:
                cell[0] = None
        for i, storage in updates:
            storage[0] = outputs[i]
        # JAX returns before the computation has run, and the arguments are views of shared memory
        # that the caller may rewrite as soon as the call returns (the next batch into the same
        # Data): wait for it. Without arguments nothing can change under the computation, and it
        # may run on past the call.
        if arg_cells:
            wait(outputs)
        raise_deferred_interrupt()
        return list(outputs[:n_outputs])

    call.fn = fn
    return call


class GatherBuffer:
    """The one host buffer a scattered input's gathered rows go to, call after call.

    Called as ``buffer(shape, dtype)``, it returns a 64-byte aligned array of
    that shape in the same memory each time (grown when too small). The rows
    gathered for a call then land in memory the previous call warmed, in the
    cache and the TLB; a fresh or pooled buffer per call gathers slower (JAX
    lets go of a host buffer it adopted a little after the call returns, so
    back-to-back calls never found the last buffer free and alternated
    between two).

    Reusing the memory is safe because a call given arguments returns only
    once its computation has finished (see :func:`jitted_call`), and no output
    or update value is a view of an input: PyTensor copies an output that
    would be one (``DeepCopyOp``), so nothing outlives the call with a view of
    this buffer.
    """

    def __init__(self):
        self._owner = np.empty(0, np.uint8)

    def __call__(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._owner.nbytes:
            self._owner = aligned_empty((nbytes,), np.uint8)
        return self._owner[:nbytes].view(dtype).reshape(shape)


def rebuild_on(variables, replace):
    """``variables`` rebuilt with the inputs in ``replace`` swapped for variables of other static shapes.

    Every node downstream of a replaced input is rebuilt (``make_node`` on
    the new inputs), so static shapes propagate; the given graph is not
    changed. An op that builds its inner graph from its input types (a
    pytensor-ml layer: PyTensor's ``SymbolicOp``) is applied anew, building
    that inner graph for the new shapes; any other ``OpFromGraph`` is
    inlined (its inner graph keeps the shapes it was built for).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x = pt.tensor("x", shape=(8, 3))
    >>> x4 = pt.tensor("x", shape=(4, 3))
    >>> mean, = rebuild_on([x.mean(0) + x.shape[0]], {x: x4})
    >>> mean.eval({x4: np.ones((4, 3), x4.dtype)}).tolist()
    [5.0, 5.0, 5.0]
    """
    memo = dict(replace)
    for node in list(toposort(variables, blockers=list(replace))):
        inputs = [memo.get(i, i) for i in node.inputs]
        if all(new is old for new, old in zip(inputs, node.inputs)):
            continue
        if isinstance(node.op, SymbolicOp):
            outs = node.op(*inputs)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
        elif isinstance(node.op, OpFromGraph):
            inner = node.op.fgraph.bind(dict(zip(node.op.fgraph.inputs, node.inputs)))
            outs = rebuild_on(inner, {old: new for old, new in zip(node.inputs, inputs) if new is not old})
        else:
            outs = node.clone_with_new_inputs(inputs, strict=False).outputs
        memo.update(zip(node.outputs, outs))
    return [memo.get(v, v) for v in variables]


#: graphs a function keeps compiled for the row counts it is called with (see CompiledFunction)
ROW_VARIANTS_KEPT = 8


def declared_rows(var):
    """The static row count of input ``var`` (``pt.tensor(shape=(8, 3))``: 8), or None."""
    return var.type.shape[0] if var.type.ndim else None


def needs_static_shapes(e):
    """True if ``e`` says JAX could not trace a graph without concrete shapes.

    (``jax.numpy.arange`` of a symbolic length, a slice with symbolic bounds, a
    shape used as a Python int.)
    """
    import jax
    concretization = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                      jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError)
    text = str(e)
    return isinstance(e, concretization) or \
        (isinstance(e, IndexError) and "static" in text) or \
        (isinstance(e, NotImplementedError) and ("constant" in text or "concrete" in text))


def spec_graph(spec, inputs, givens, row_inputs, shapes=None):
    """The graphs of ``spec`` as (inputs, outputs, updates, generator updates, givens).

    With ``shapes`` (one per ``row_inputs``), each of ``row_inputs`` is
    replaced by an input of that static shape and the graphs are rebuilt on
    it (:func:`rebuild_on`); the givens are applied in that rebuild
    (PyTensor's own substitution would not carry the new static shapes on),
    so none are left to give.
    """
    outputs = [v for v, _ in spec.outputs]
    updates = [(s, v) for s, v, _ in spec.updates]
    generators = list(spec.generator_updates)
    if shapes is None:
        return inputs, outputs, updates, generators, givens
    replace = {v: v.type.clone(shape=shape)(name=v.name) for v, shape in zip(row_inputs, shapes)}
    given = rebuild_on([v for _, v in givens], replace)
    substitute = {**replace, **{k: v for (k, _), v in zip(givens, given)}}
    pieces = [outputs, [v for _, v in updates], [v for _, v in generators]]
    flat = rebuild_on(sum(pieces, []), substitute)
    new = []
    for piece in pieces:
        new.append(flat[:len(piece)])
        flat = flat[len(piece):]
    return ([replace.get(v, v) for v in inputs], new[0],
            [(s, v) for (s, _), v in zip(updates, new[1])],
            [(g, v) for (g, _), v in zip(generators, new[2])], [])


class CompiledFunction:
    """A FunctionSpec compiled for this process's device (lazily for the slice variant).

    Sliceable shared variables are replaced (through ``givens``) by extra
    symbolic inputs, so each call can feed them the rows ``batch_s`` selects
    from the device-resident value.

    Rows are free in the graph (``synk.function`` refuses a scattered input
    with a static row count). A graph that JAX can only trace with concrete
    shapes (``arange`` over the batch in a cross-entropy, pytensor-ml's
    convolutions) is compiled per shape instead: rebuilt on inputs of the
    shapes this process is given, rows and all (:func:`rebuild_on`; static
    shapes only get added, so nothing in the graph can contradict them),
    keeping the last ``ROW_VARIANTS_KEPT`` shapes. ``by_rows`` says which.

    Parameters
    ----------
    spec : FunctionSpec
    """

    def __init__(self, spec):
        self.spec = spec
        self.output_modes = [m for _, m in spec.outputs]
        # named as the user's variables, so that PyTensor's messages name what the user wrote
        self.sliced_inputs = [s.type(name=s.name) for s in spec.sliceable_shareds]
        #: which of a call's arguments carry its rows: the scattered and the sliced inputs
        n_all = len(spec.all_inputs)
        self._row_args = list(range(len(spec.inputs))) + \
            list(range(n_all, n_all + len(self.sliced_inputs)))
        self._run_no_updates = None
        self._row_variants = {}       # (rows, updates applied) -> runner, least recently used first
        #: the PyTensor function (updates applied), or None when compiled per row count
        self.function = None
        self.by_rows = False
        try:
            self.function = self._compile(updates=True)
        except Exception as e:
            if not self._row_args or not needs_static_shapes(e):
                raise
            self.by_rows = True        # compiled at the first call, for its shapes
        self._run = self._runner(self.function) if self.function is not None else None
        devices.place_on_device(spec.shared_variables())     # compiled once, for device values
        #: per scattered input, where its explicitly indexed rows are gathered call after call
        self.gather_buffers = [GatherBuffer() for _ in spec.inputs]

    def _givens(self):
        if not self.sliced_inputs:
            return self.spec.givens
        replace = dict(zip(self.spec.sliceable_shareds, self.sliced_inputs))
        user = [(k, clone_replace(v, replace=replace)) for k, v in self.spec.givens]
        return user + list(replace.items())

    def _graph(self, shapes=None):
        """(inputs, outputs, updates, generator updates, givens), rebuilt on ``shapes`` if given."""
        return spec_graph(self.spec, self.spec.all_inputs + self.sliced_inputs, self._givens(),
                          self.spec.inputs + self.sliced_inputs, shapes)

    def _compile(self, updates, shapes=None):
        spec = self.spec
        inputs, outputs, upd, generators, givens = self._graph(shapes)
        if not updates:      # their values come back as outputs, to accumulate over slices
            outputs, upd = outputs + [v for _, v in upd], []
        with warnings.catch_warnings():
            # the JAX linker says it compiles a copy of each generator's state: as documented
            warnings.filterwarnings("ignore", message="The RandomType SharedVariables")
            fn = pytensor.function(inputs, outputs, updates=upd + generators,
                                   givens=givens, **spec.pytensor_kwargs(devices.platform()))
        # The master validated every argument (dtype, ndim, rows) before any process was woken;
        # PyTensor's per-call input checks would only repeat that in every process.
        fn.trust_input = True
        return fn

    def _runner(self, fn):
        """How this process calls ``fn``: its jitted graph directly, else ``fn`` itself.

        Either returns only once a computation given arguments has finished (see
        :func:`jitted_call`).
        """
        direct = jitted_call(fn)
        if direct is not None:
            return direct
        shareds = [s for s, _, _ in self.spec.updates]

        def call(*args):
            try:
                outputs = fn(*args)
                if args:
                    devices.wait_until_computed((outputs, [s.container.storage[0] for s in shareds]))
            except Exception as e:
                raise_deferred_interrupt(e)
                raise
            raise_deferred_interrupt()
            return outputs
        return call

    def _for_shapes(self, shapes, updates):
        """The runner of the graph rebuilt on inputs of ``shapes`` (see the class notes)."""
        key = (tuple(shapes), updates)
        run = self._row_variants.pop(key, None)
        if run is None:
            if len(self._row_variants) >= ROW_VARIANTS_KEPT:
                del self._row_variants[next(iter(self._row_variants))]     # least recently used
            run = self._runner(self._compile(updates, shapes))
        self._row_variants[key] = run
        return run

    def _for_args(self, args, updates):
        return self._for_shapes([args[i].shape for i in self._row_args], updates)

    def _generic_or_by_rows(self, args, updates):
        """Run the graph compiled for any rows; switch to per-row-count graphs if JAX needs them."""
        try:
            if updates:
                return self._run(*args)
            if self._run_no_updates is None:
                self._run_no_updates = self._runner(self._compile(updates=False))
            return self._run_no_updates(*args)
        except Exception as e:
            if not self._row_args or not needs_static_shapes(e):
                raise
            self.by_rows = True
        return self._for_args(args, updates)(*args)

    def run(self, args):
        """Run once, applying updates."""
        if self.by_rows:
            return self._for_args(args, True)(*args)
        return self._generic_or_by_rows(args, True)

    def run_deferred(self, args):
        """Run once without applying updates; return (outputs, new update values)."""
        if self.by_rows:
            out = self._for_args(args, False)(*args)
        else:
            out = self._generic_or_by_rows(args, False)
        n = len(self.spec.outputs)
        return out[:n], out[n:]

    def apply(self, values):
        """Store accumulated update values into the shared variables, on the device."""
        for (shared, _, _), value in zip(self.spec.updates, values):
            shared.container.storage[0] = value.astype(shared.type.dtype)


# ------------------------------------------------------------------------------------------------
# One call: the plan, its encoding, and the per-rank computation
# ------------------------------------------------------------------------------------------------

@dataclass
class InputRef:
    """Where one input's rows live: a Data segment generation, shape and row offset."""

    data_id: int
    gen: int
    code: int
    offset: int
    shape: tuple


def put_batch(words, batch):
    """Encode a Batch (its indices live in the index segment at ``batch.index_offset``)."""
    words.put(*_batch_words([], batch))


def _batch_words(words, batch):
    words += [batch.total, int(batch.is_range), batch.start, batch.stop, batch.index_offset]
    return words


def get_batch(words, index_lookup, index_gen):
    total, is_range, start, stop, offset = (words.get() for _ in range(5))
    if is_range:
        return Batch(total, start, stop)
    return Batch(total, indices=index_lookup(index_gen, offset, total), index_offset=offset)


@dataclass
class CallPlan:
    """A validated call, as every process needs it.

    ``sliced`` holds, per rank, the Batch of rows of the sliceable shared
    variables that rank uses (empty when the function has none).
    """

    fid: int
    num_slices: int
    batch: Batch
    subset: list
    scattered: list        # [InputRef]
    bcast: list            # [InputRef]
    sliced: list = field(default_factory=list)
    index_gen: int = 0
    _words: tuple = field(default=None, repr=False, compare=False)
    _shares: dict = field(default_factory=dict, repr=False, compare=False)    # see share_of
    _record: object = field(default=False, repr=False, compare=False)        # see result_record

    def with_batch(self, batch):
        """This plan with another ``batch`` of as many rows (the same shares, the same record).

        Examples
        --------
        >>> plan = CallPlan(0, 1, Batch(2, indices=np.array([3, 1])), [0], [], [])
        >>> plan.with_batch(Batch(2, indices=np.array([0, 5]))).batch.indices
        array([0, 5])
        """
        plan = copy.copy(self)
        plan.batch, plan._words = batch, None
        return plan

    def index_arrays(self):
        """Batches whose explicit indices must be written to the index segment."""
        if self.batch.is_range and not self.sliced:
            return []
        return [b for b in [self.batch] + self.sliced if not b.is_range]

    def encode(self):
        """The plan as a tuple of ints (for :meth:`decode` from the control block's args).

        A plan with explicit indices is encoded afresh (its ``index_gen`` and
        offsets change from call to call); any other plan once.
        """
        words = self._words
        if words is None:
            words = tuple(self._encode())
            if not self.index_arrays():
                self._words = words
        return words

    def _encode(self):
        words = [self.fid, self.num_slices, self.index_gen, len(self.subset), *self.subset]
        _batch_words(words, self.batch)
        words += [len(self.scattered), len(self.bcast)]
        for ref in self.scattered + self.bcast:
            words += [ref.data_id, ref.gen, ref.code, ref.offset, len(ref.shape), *ref.shape]
        words.append(len(self.sliced))
        for b in self.sliced:
            _batch_words(words, b)
        return words

    @classmethod
    def decode(cls, args, index_lookup):
        """Read a plan written by :meth:`encode`; ``index_lookup(gen, start, n)`` returns indices."""
        w = Words(args)
        fid, k, index_gen = w.get(), w.get(), w.get()
        subset = w.get_list()
        batch = get_batch(w, index_lookup, index_gen)
        n_scat, n_bcast = w.get(), w.get()
        refs = []
        for _ in range(n_scat + n_bcast):
            data_id, gen, code, offset = (w.get() for _ in range(4))
            refs.append(InputRef(data_id, gen, code, offset, tuple(w.get_list())))
        sliced = [get_batch(w, index_lookup, index_gen) for _ in range(w.get())]
        return cls(fid, k, batch, subset, refs[:n_scat], refs[n_scat:], sliced, index_gen)


def _rows(view, batch, a, b, offset, into=devices.private_empty):
    """Rows at batch positions [a, b) of a numpy or device array: a view for ranges.

    Explicit indices of a host array are gathered straight into
    ``into(shape, dtype)``, a 64-byte aligned buffer, which the CPU device
    adopts as it is; numpy's own fancy indexing result would be copied once
    more on its way to the device.
    """
    if batch.is_range:
        return view[batch.start + a - offset:batch.start + b - offset]
    indices = batch.indices[a:b] - offset if offset else batch.indices[a:b]
    if not isinstance(view, np.ndarray):
        return view[indices]
    return gather_rows(view, indices, into(indices.shape + view.shape[1:], view.dtype))


@dataclass(frozen=True)
class Share:
    """What one rank computes of a plan: batch positions ``[lo, hi)`` in ``n_slices`` slices.

    ``rows`` is what the rank's results are weighted by (its row count, or 1 for
    a function with no scattered inputs; 0 if it computes nothing). ``cuts``
    is set when the share is one range of rows and nothing else is sliced:
    per scattered input ``(InputRef, start, stop)`` in its Data's own rows, so
    a call needs nothing but the views.
    """

    lo: int
    hi: int
    n_slices: int
    rows: int
    counts_rows: bool
    cuts: tuple = None


def share_of(plan, rank, n_ranks):
    """The :class:`Share` of ``rank`` in ``plan`` (computed once per plan and rank)."""
    share = plan._shares.get(rank)
    if share is None:
        share = plan._shares[rank] = _share(plan, rank, n_ranks)
    return share


def _share(plan, rank, n_ranks):
    sliced = plan.sliced[rank] if plan.sliced else None
    if plan.scattered:
        lo, hi = chunk(0, plan.batch.total, n_ranks, rank)
        n_slices = plan.num_slices
    elif sliced is not None:
        lo, hi, n_slices = 0, sliced.total, plan.num_slices
    else:
        lo, hi, n_slices = 0, 1, 1
    counts_rows = bool(plan.scattered) or sliced is not None
    rows = 0 if hi == lo else (hi - lo) if counts_rows else 1
    one_range = plan.batch.is_range and sliced is None and min(n_slices, hi - lo) == 1
    cuts = tuple((ref, plan.batch.start + lo - ref.offset, plan.batch.start + hi - ref.offset)
                 for ref in plan.scattered) if one_range else None
    return Share(lo, hi, n_slices, rows, counts_rows, cuts)


def result_record(spec, plan):
    """The structured dtype in which ranks return this call's results, or None.

    When every selected output is a scalar (0-d in the graph) and together they
    fit a rank's record in the control block, each rank writes them there, in
    the outputs' declared dtypes (see :meth:`ControlBlock.records`); any other
    call packs its arrays into the rank's result segment.
    """
    record = plan._record
    if record is False:
        fields = [spec.outputs[i][0].type for i in plan.subset]
        record = None
        if fields and all(t.ndim == 0 for t in fields):
            dtype = np.dtype([(f"o{j}", t.dtype) for j, t in enumerate(fields)])
            record = dtype if dtype.itemsize <= RECORD_BYTES else None
        plan._record = record
    return record


def run_share(compiled, plan, rank, n_ranks, view_of):
    """Compute this rank's share of a call.

    Parameters
    ----------
    compiled : CompiledFunction
    plan : CallPlan
    rank, n_ranks : int
    view_of : callable
        ``view_of(InputRef)`` returns the numpy view of that input's Data.

    Returns
    -------
    rows : int
        Rows this rank computed (1 for a function with no scattered inputs; 0 if
        its share was empty, in which case nothing ran).
    outputs : list
        Per selected output, the rank's accumulation over its slices (device arrays).
    """
    share = share_of(plan, rank, n_ranks)
    if share.rows == 0:
        return 0, []
    if share.cuts is not None:
        # the common call (a range of rows, one slice): views in, nothing to decide or accumulate;
        # this path is shorter per process than the general one below
        values = compiled.run([view_of(ref)[a:b] for ref, a, b in share.cuts]
                              + [view_of(ref) for ref in plan.bcast])
        return share.rows, [values[i] for i in plan.subset]
    scattered = [view_of(ref) for ref in plan.scattered]
    bcast = [view_of(ref) for ref in plan.bcast]
    spec = compiled.spec
    sliceables = [s.container.storage[0] for s in spec.sliceable_shareds]
    sliced = plan.sliced[rank] if plan.sliced else None
    lo, hi = share.lo, share.hi
    pieces = [(a, b) for a, b in (chunk(lo, hi, share.n_slices, s) for s in range(share.n_slices))
              if b > a]

    def args_for(a, b):
        args = [_rows(v, plan.batch, a, b, ref.offset, compiled.gather_buffers[j])
                for j, (v, ref) in enumerate(zip(scattered, plan.scattered))]
        args += bcast
        args += [_rows(v, sliced, a - lo, b - lo, 0) for v in sliceables]
        return args

    if len(pieces) == 1:
        values = compiled.run(args_for(lo, hi))
        return share.rows, [values[i] for i in plan.subset]
    import jax.numpy as jnp
    outs = [Accumulator(compiled.output_modes[i], jnp) for i in plan.subset]
    upds = [Accumulator(mode, jnp) for _, _, mode in spec.updates]
    for a, b in pieces:
        n = (b - a) if share.counts_rows else 1
        values, new = compiled.run_deferred(args_for(a, b)) if upds else (compiled.run(args_for(a, b)), [])
        for acc, v in zip(upds, new):
            acc.add(v, n)
        for acc, i in zip(outs, plan.subset):
            acc.add(values[i], n)
    if upds:
        compiled.apply([acc.result() for acc in upds])
    return share.rows, [acc.result() for acc in outs]


# ------------------------------------------------------------------------------------------------
# The user's Function
# ------------------------------------------------------------------------------------------------

_MISSING = object()
#: validated plans a Function keeps for repeated calls (see Function._plan_key)
_PLANS_KEPT = 16
#: marks a plan key of explicit indices (see Function._plan_key)
_INDICES = object()


class Function:
    """A data-parallel PyTensor function, made by :func:`function`.

    Call it like the PyTensor function it wraps, with :class:`Data` or numpy
    arguments; see :meth:`__call__`.
    """

    def __init__(self, runtime, spec, bare):
        self._rt = runtime
        self.spec = spec
        self._bare = bare
        self._scratch = {}
        self._references = {}     # input shapes (None: any) -> the plain PyTensor function
        #: numpy arguments are cast to their inputs' dtypes as pytensor.function's option does
        self._downcast = bool(spec.kwargs.get("allow_input_downcast"))
        self.compiled = None
        self.shipped = False
        self._input_names = [var.name if var.name else f"input {i}"
                             for i, var in enumerate(spec.all_inputs)]
        self._n_inputs = len(spec.all_inputs)
        # per output: its mode and declared dtype (the reduction of every call looks them up)
        self._reductions = [(mode, np.dtype(var.type.dtype)) for var, mode in spec.outputs]
        self._plans = {}          # see _plan_key

    def run_share(self, plan, rank, n_ranks, view_of):
        """This process's share of a call (see :func:`run_share`)."""
        return run_share(self.compiled, plan, rank, n_ranks, view_of)

    def result_record(self, plan):
        """How ranks return ``plan``'s results (see :func:`result_record`)."""
        return result_record(self.spec, plan)

    @property
    def name(self):
        """The function's name (given, or ``synk_function_<id>``)."""
        return self.spec.name

    def get_shared(self):
        """The shared variables this function reads or updates (as PyTensor's ``Function.get_shared``)."""
        return list(dict.fromkeys(self.spec.shared_variables()))

    @property
    def output_modes(self):
        """The reduction mode of each output, in order."""
        return [m for _, m in self.spec.outputs]

    @property
    def update_modes(self):
        """The accumulation mode of each update (used with ``num_slices > 1``)."""
        return [m for _, _, m in self.spec.updates]

    def __repr__(self):
        return f"synk.Function({self.name!r})"

    # --- single process reference ---------------------------------------------------------
    def as_pytensor(self, *args):
        """Run the plain single-process PyTensor function in the master on numpy inputs.

        Updates apply to the master's copies of the shared variables only.
        """
        out = [np.asarray(o) for o in self._run_reference(args)]
        return out[0] if self._bare else out

    as_theano = as_pytensor

    def _run_reference(self, args):
        """Run the reference: compiled for any rows, or for these rows if JAX needs static shapes."""
        by_rows = self.compiled.by_rows and self.spec.inputs
        if not by_rows:
            try:
                if None not in self._references:
                    self._references[None] = self._reference_function(None)
                return self._references[None](*args)
            except Exception as e:
                if not (self.spec.inputs and needs_static_shapes(e)):
                    raise
        shapes = tuple(np.shape(a) for a in args[:len(self.spec.inputs)])
        if shapes not in self._references:
            self._references[shapes] = self._reference_function(shapes)
        return self._references[shapes](*args)

    def _reference_function(self, shapes):
        """The plain PyTensor function (JAX mode), on scattered inputs of ``shapes`` if given."""
        spec = self.spec
        inputs, outputs, updates, generators, givens = spec_graph(
            spec, spec.all_inputs, spec.givens, spec.inputs, shapes)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The RandomType SharedVariables")
            return pytensor.function(inputs, outputs, updates=updates + generators, givens=givens,
                                     **spec.pytensor_kwargs())

    def build_inputs(self, *values, force_cast=False, oversize=1., minibatch=False):
        """Make one :class:`Data` per input (scattered, then broadcast) from ``values``."""
        from .data import data
        all_inputs = self.spec.all_inputs
        if len(values) != len(all_inputs):
            raise TypeError(f"{self.name} has {len(all_inputs)} inputs, got {len(values)} values")
        return [data(value=v, var=var, force_cast=force_cast, oversize=oversize,
                     minibatch=minibatch and i < len(self.spec.inputs))
                for i, (var, v) in enumerate(zip(all_inputs, values))]

    # --- calling ---------------------------------------------------------------------------
    @lifecycle.serialized
    def __call__(self, *args, batch=None, batch_s=None, num_slices=1, output_subset=None, **kwargs):
        """Run on every device and return the reduced outputs.

        Parameters
        ----------
        *args : Data or numpy arrays
            One per input (scattered inputs first, then ``bcast_inputs``), or by
            input name as keywords.
        batch : int, slice, or sequence of int, optional
            Rows of the scattered inputs to use: ``n`` means ``[0, n)``.
        batch_s : optional
            Rows of the sliceable shared variables (see ``sliceable_shareds``).
        num_slices : int
            Each rank computes its share in this many slices and accumulates.
        output_subset : list of int, optional
            Indices of the outputs to compute and return.
        """
        rt = lifecycle.current()
        if rt is not self._rt:
            raise RuntimeError(f"{self} was built before the runtime it belonged to was closed; "
                               f"build it again after fork()")
        key = self._plan_key(args, kwargs, batch, batch_s, num_slices, output_subset)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            plan = self._plan(args, kwargs, batch, batch_s, num_slices, output_subset)
            if key is not None:
                if len(self._plans) >= _PLANS_KEPT:
                    self._plans.clear()
                self._plans[key] = plan
        elif not plan.batch.is_range:
            # the kept plan of an earlier call with as many indices: only the indices are new
            n_scat = len(self.spec.inputs)
            plan = plan.with_batch(parse_batch(batch, args[:n_scat], self._input_names[:n_scat])[0])
        rt.ensure_shipped()
        if not self.shipped:
            raise TypeError(f"{self.name} could not be sent to the workers and was unregistered; "
                            f"build it again from picklable ops")
        outputs = self._reduce(plan, *rt.run_call(self, plan))
        if self._scratch:
            release_large_staging(self._scratch)
        return outputs[0] if (self._bare and output_subset is None) else outputs

    def _plan_key(self, args, kwargs, batch, batch_s, num_slices, output_subset):
        """What makes a validated plan reusable, or None for calls that are validated every time.

        A training loop repeats one call shape: the same Data (same segment
        generation and shape, so the same rows are valid), a fixed ``batch``
        size and ``num_slices``. Such a call reuses its plan and skips its
        validation. A ``batch`` of explicit indices (a numpy array) into Data
        that are not ``minibatch`` reuses the plan of the last call with as many
        indices, and only the new indices are validated. ``batch_s`` (rows
        checked against every rank),
        numpy arguments and keywords always take the full path.
        """
        if kwargs or batch_s is not None or output_subset is not None or self.spec.sliceable_shareds:
            return None
        indexed = type(batch) is np.ndarray
        if not (batch is None or type(batch) is int or indexed) or type(num_slices) is not int \
                or len(args) != self._n_inputs:
            return None
        key = [(_INDICES, batch.shape) if indexed else batch, num_slices]
        for d in args:
            if type(d) is not Data or d._rt is not self._rt or d.shape is None or \
                    (indexed and d.minibatch):    # a minibatch Data's offset follows the indices
                return None
            key += (d.id, d.gen, d.shape, d.minibatch)
        return tuple(key)

    def _plan(self, args, kwargs, batch, batch_s, num_slices, output_subset):
        spec = self.spec
        num_slices = check_num_slices(num_slices)
        if batch_s is not None and not spec.sliceable_shareds:
            raise TypeError(f"batch_s was given but {self.name} has no sliceable_shareds; "
                            f"pass sliceable_shareds= to synk.function to slice shared variables")
        subset = self._subset(output_subset)
        datas = [self._as_data(i, v) for i, v in enumerate(self._collect_args(args, kwargs))]
        n_scat = len(spec.inputs)
        names = self._input_names[:n_scat]
        batch_plan, offsets = parse_batch(batch, datas[:n_scat], names)
        if n_scat and batch_plan.total == 0:
            raise ValueError(f"the batch selects no rows of {self.name}'s scattered inputs; "
                             f"give at least one row")
        sliced = self._plan_batch_s(batch_s, batch_plan if n_scat else None)
        rows = ([b.total for b in sliced] if sliced else
                [hi - lo for lo, hi in (chunk(0, batch_plan.total, self._rt.n_parallel, r)
                                        for r in range(self._rt.n_parallel))] if n_scat else [])
        if spec.updates and rows and min(rows) == 0:
            raise ValueError(f"{self.name} has updates but a device would get no rows (rows per "
                             f"device: {rows}): it would skip its updates and its state would drift; "
                             f"give at least one row per device")

        def ref(d, offset):
            return InputRef(d.id, d.gen, dtype_code(d.dtype), offset, d.shape)

        return CallPlan(spec.fid, num_slices, batch_plan, subset,
                        [ref(d, o) for d, o in zip(datas[:n_scat], offsets)],
                        [ref(d, 0) for d in datas[n_scat:]], sliced)

    def _plan_batch_s(self, batch_s, batch_plan):
        """Per-rank rows of the sliceable shareds (validated against every rank's lengths)."""
        sliceables = self.spec.sliceable_shareds
        if not sliceables:
            return []
        from .collectives import _all_shapes
        shapes = _all_shapes(self._rt, sliceables)
        names = [str(s) for s in sliceables]
        for name, per_rank in zip(names, shapes):
            if any(len(shape) == 0 for shape in per_rank):
                raise TypeError(f"sliceable shared {name} is 0-d on some rank; it needs rows")
        sliced = parse_batch_s(batch_s, [[shape[0] for shape in per_rank] for per_rank in shapes],
                               names)
        if batch_plan is not None:
            for rank, b in enumerate(sliced):
                lo, hi = chunk(0, batch_plan.total, self._rt.n_parallel, rank)
                if hi - lo != b.total:
                    raise ValueError(f"rank {rank} gets {hi - lo} rows of the scattered inputs but "
                                     f"{b.total} rows of the sliceable shareds; they must match")
        return sliced

    def _subset(self, output_subset):
        n = len(self.spec.outputs)
        if output_subset is None:
            return list(range(n))
        subset = list(output_subset)
        for i in subset:
            if not isinstance(i, (int, np.integer)) or not 0 <= i < n:
                raise ValueError(f"output_subset entry {i!r} is not an output index in [0, {n})")
        return [int(i) for i in subset]

    def _input_name(self, i):
        return self._input_names[i]

    def _collect_args(self, args, kwargs):
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

    def _as_data(self, i, value):
        var = self.spec.all_inputs[i]
        name = self._input_name(i)
        scattered = i < len(self.spec.inputs)
        if isinstance(value, Data):
            if value._rt is not self._rt:
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
            _check_declared_shape(var, name, value.shape, scattered)
            return value
        arr = condition_value(value, var.type.dtype, var.type.ndim, what=f"argument for input {name!r}",
                              force_cast=self._downcast,
                              cast_hint="build the function with synk.function(..., "
                                        "allow_input_downcast=True)")
        _check_declared_shape(var, name, arr.shape, scattered)
        scratch = self._scratch.get(i)
        if scratch is None:
            scratch = self._scratch[i] = self._rt.new_data(var.type.dtype, var.type.ndim,
                                                           name=f"{self.name}:{name}")
        scratch.set_value(arr, oversize=1 if scratch.alloc_size >= arr.size else 1.25)
        return scratch

    def _reduce(self, plan, rows, columns):
        """Reduce each selected output across ranks (see :meth:`Runtime.run_call`).

        Ranks that computed no rows are left out. Mode None takes the master's
        result, or the lowest computing rank's if the master had no rows. Each
        output has the dtype of its symbolic variable.
        """
        if not columns:
            return []
        everyone = 0 not in rows
        ranks = None if everyone else [rank for rank, n in enumerate(rows) if n]
        own = self._rt.master_rank if rows[self._rt.master_rank] else ranks[0]
        weights = rows if everyone else [rows[rank] for rank in ranks]
        reduced = []
        for column, i in zip(columns, plan.subset):
            mode, dtype = self._reductions[i]
            if mode is None:
                value = column[own]
            else:
                if not everyone:
                    column = column[ranks] if isinstance(column, np.ndarray) else \
                        [column[r] for r in ranks]
                value = reduce_ranks(mode, column, weights)
            # JAX may compute some reductions wider than the graph declares; return the declared dtype.
            reduced.append(np.asarray(value, dtype=dtype))
        return reduced


@lifecycle.serialized
def function(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
             sliceable_shareds=None, name=None, **kwargs):
    """Build a data-parallel function over every device of the runtime.

    Parameters
    ----------
    inputs : list of Variable
        Scattered inputs: split along axis 0 across devices.
    outputs : Variable, (Variable, mode), or a list of those
        Modes: ``"avg"`` (default, weighted by rows), ``"sum"``, ``"prod"``,
        ``"min"``, ``"max"``, ``"gather"`` (concatenate in rank order), ``None``
        (the master's own result).
    bcast_inputs : list of Variable, optional
        Inputs given whole to every device.
    updates : list of (shared, value[, mode]) or dict
        Applied locally on every device; the mode matters with ``num_slices > 1``.
    givens : optional
        As in :func:`pytensor.function`.
    sliceable_shareds : list of SharedVariable, optional
        Shared variables holding per-device data that ``batch_s`` indexes.
    name : str, optional
    **kwargs
        Passed to every underlying :func:`pytensor.function` (``mode`` defaults to ``"JAX"``).

    Returns
    -------
    Function

    Examples
    --------
    >>> f = synk.function([x, y], [(loss, "avg"), (err, "sum")])     # doctest: +SKIP
    >>> loss, err = f(x_dat, y_dat, batch=idx, num_slices=4)         # doctest: +SKIP
    """
    rt = lifecycle.current()
    _check_mode(kwargs)
    inputs = _check_inputs(inputs, "inputs")
    _check_free_rows(inputs)
    bcast_inputs = _check_inputs(bcast_inputs, "bcast_inputs")
    seen = set()
    for var in inputs + bcast_inputs:
        if id(var) in seen:
            raise ValueError(f"input {var} appears more than once in inputs/bcast_inputs")
        seen.add(id(var))
    pairs, bare = _normalize_outputs(outputs)
    triples, generators = _normalize_updates(updates)
    givens = list(givens.items()) if isinstance(givens, dict) else list(givens or [])
    sliceable = list(sliceable_shareds or [])
    spec = FunctionSpec(rt.next_function_id(), "", inputs, bcast_inputs, pairs, triples, givens,
                        sliceable, kwargs)
    spec.name = name or f"synk_function_{spec.fid}"
    spec.generator_updates = generators + randomness.generator_updates(
        inputs + bcast_inputs, spec.graph_vars(), written={g for g, _ in generators})
    used = set(spec.shared_variables() + [g[0] for g in givens])
    for var in sliceable:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"sliceable_shareds must be shared variables, got {var!r}")
        if var not in used:
            raise ValueError(f"sliceable shared {var} is not used by {spec.name}")
    for key, value in givens:
        if value in sliceable and (key.type.dtype, key.type.ndim) != (value.type.dtype, value.type.ndim):
            raise TypeError(f"givens replaces {key} (dtype {key.type.dtype}, ndim {key.type.ndim}) with "
                            f"sliceable shared {value} (dtype {value.type.dtype}, ndim "
                            f"{value.type.ndim}); make {value} of that dtype and ndim")
    f = Function(rt, spec, bare)
    shipping.check_shippable(spec)       # a graph that cannot travel fails here, unregistered
    devices.set_precision(lifecycle.Runtime.float_x())   # the same rule every rank applies
    f.compiled = CompiledFunction(spec)  # compile errors surface here, in the master
    rt.register_function(f)
    return f
