"""A training step as one compiled program per rank: gather, gradient, all-reduce, update.

``make_train_function``'s step is two PyTensor functions (the gradient into a
flat shared vector, the optimizer's update) with an all-reduce of the flat
vector between them. Run apart, they are three programs on each device with
the host in between. :class:`StepProgram` joins the JAX graphs PyTensor made
of the two functions into one ``jax.jit`` program: the rows of device-resident
data are gathered by their indices inside it, the flat gradient is reduced by
a collective inside it (the runtime's mesh: NCCL on GPUs, Gloo on CPU; nothing
on one device), and every updated value comes out of it, computed into the
buffers of the old ones (donated). :class:`BlockProgram` runs many such steps
in one program (``lax.scan`` over the steps' index rows): a device-driven
loop's steps up to its next check.

What goes in is each value where it already is; what comes out is stored into
the shared variables' cells. Nothing is copied to the host, and no JAX
operation runs outside the program. A program is built for one set of
argument shapes and kept (:class:`StepPrograms`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pytensor.tensor.type import TensorType

from ..comm import ProgramReducer as Reducer
from ..comm.reduction import Reduce
from ..compile.rewrites import raise_deferred_interrupt
from ..platform.internals import jit_parts
from ..platform.interrupt_hold import can_hold, held
from ..platform.values import nbytes_of
from .jitted import DONATE_MIN_BYTES

__all__ = ["Graph", "StepProgram", "BlockProgram", "StepPrograms", "FUSED_MODES", "fused_graph"]

#: the output modes a fused step reduces inside its program
FUSED_MODES = (Reduce.AVG, Reduce.SUM, Reduce.MAX, Reduce.MIN, None)


@dataclass(frozen=True)
class Graph:
    """One PyTensor function's JAX graph and where its values live.

    Attributes
    ----------
    traced : callable
        The JAX function PyTensor's linker jits: every input cell's value in,
        every output (returned ones, then the updates' new values) out.
    cells : list
        The storage cell of each implicit input (shared variables, generators).
    n_args : int
        Explicit arguments before them.
    updates : list of (int, list)
        Per update: the output index and the cell it is stored into.
    n_outputs : int
        The outputs the function returns.
    tensor_cells : frozenset
        ``id`` of the cells holding tensors (what may be donated).
    """

    traced: Callable[..., Any]
    cells: list
    n_args: int
    updates: list
    n_outputs: int
    tensor_cells: frozenset


def fused_graph(fn: Any) -> Graph | None:
    """The :class:`Graph` of a PyTensor function linked for JAX, or None if it is not one plain
    jitted graph (it then cannot take part in a fused program)."""
    parts = jit_parts(fn)
    if parts is None or parts.traced is None:
        return None
    types = [v.type for v in fn.maker.fgraph.inputs]
    tensors = frozenset(id(cell) for cell, t in zip(parts.cells, types) if isinstance(t, TensorType))
    return Graph(parts.traced, list(parts.cells[parts.n_args:]), parts.n_args, list(parts.updates),
                 parts.n_outputs, tensors)


class _Joint:
    """The cells of several graphs, each once, in the order they are met."""

    def __init__(self, graphs: Sequence[Graph]):
        self.cells: list = []
        self._at: dict = {}
        for graph in graphs:
            for cell in graph.cells:
                self.position(cell)
            for _, cell in graph.updates:
                self.position(cell)

    def position(self, cell: list) -> int:
        at = self._at.get(id(cell))
        if at is None:
            at = self._at[id(cell)] = len(self.cells)
            self.cells.append(cell)
        return at


@dataclass(frozen=True)
class _Layout:
    """Where a step's values are: the joint cells, those updated, those donated, the reduced one."""

    joint: _Joint
    grad_at: tuple
    update_at: tuple
    grad_out_at: tuple        # (output index, joint position) per update of the gradient function
    update_out_at: tuple      # the same for the update function
    reduced_at: int
    written: tuple            # joint positions written by the step, in order
    donated: tuple            # the written positions holding tensors (their buffers are reused)


def _layout(grad: Graph, update: Graph, reduced_cell: list) -> _Layout:
    joint = _Joint([grad, update])
    pos = joint.position
    grad_out = tuple((i, pos(c)) for i, c in grad.updates)
    update_out = tuple((i, pos(c)) for i, c in update.updates)
    written = tuple(dict.fromkeys([p for _, p in grad_out] + [p for _, p in update_out]))
    tensors = grad.tensor_cells | update.tensor_cells
    donated = tuple(p for p in written if id(joint.cells[p]) in tensors)
    return _Layout(joint, tuple(pos(c) for c in grad.cells), tuple(pos(c) for c in update.cells),
                   grad_out, update_out, pos(reduced_cell), written, donated)


def _same_type(new: Any, old: Any) -> Any:
    """``new`` with ``old``'s dtype, leaf by leaf (a loop carries each value unchanged in type)."""
    import jax
    return jax.tree_util.tree_map(lambda a, b: a.astype(b.dtype) if a.dtype != b.dtype else a, new, old)


def _one_step(grad: Graph, update: Graph, layout: _Layout, reducer: Reducer, op: str | None,
              args: list, values: list) -> tuple[tuple, list]:
    """Trace one step: the gradient function on ``args``, the reduction, the update function.

    ``values`` holds the joint cells' values and is updated in place; returns the gradient
    function's outputs.
    """
    outs = grad.traced(*args, *[values[p] for p in layout.grad_at])
    # (each written value keeps its variable's dtype, whatever dtype PyTensor's JAX backend computed)
    for i, p in layout.grad_out_at:
        values[p] = _same_type(outs[i], values[p])
    values[layout.reduced_at] = reducer.reduce(values[layout.reduced_at], op)
    new = update.traced(*[values[p] for p in layout.update_at])
    for i, p in layout.update_out_at:
        values[p] = _same_type(new[i], values[p])
    return outs, values


def _gathered(args: list, gathers: tuple) -> list:
    """``args`` with each gathered position's (table, indices) pair replaced by the rows."""
    import jax.numpy as jnp
    out = list(args)
    for k in gathers:
        table, indices = out[k]
        out[k] = jnp.take(table, indices, axis=0, mode="clip")
    return out


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under ``name``: what the program is called in profiles and launch counts."""
    def program(*args: Any) -> Any:
        return fn(*args)
    program.__name__ = program.__qualname__ = name
    return program


class _Program:
    """What :class:`StepProgram` and :class:`BlockProgram` share: the layout, donation, storing."""

    #: the program's name (in profiles, :func:`~synkhronos.tracing.launches.count_launches`)
    name = "synk_program"

    def __init__(self, grad: Graph, update: Graph, reduced_cell: list, op: str | None, reducer: Reducer,
                 may_fail: bool = False):
        self.grad, self.update, self.op, self.reducer = grad, update, op, reducer
        self.layout = _layout(grad, update, reduced_cell)
        #: the program calls host code, which can fail while it runs: it donates nothing
        self.may_fail = may_fail
        self._jitted: dict = {}
        #: per program key, whether it donates (decided at its first call)
        self._donate: dict = {}
        #: (gradient CompiledFunction, its runner, update CompiledFunction, its runner): whose
        #: random streams the program continues (set by whoever builds it)
        self.runners: tuple = ()

    @property
    def written_cells(self) -> list:
        """The cells the program writes (what a rank keeps to undo it)."""
        cells = self.layout.joint.cells
        return [cells[p] for p in self.layout.written]

    def values(self) -> tuple[list, list]:
        """(donated values, the other values) of the joint cells, as the cells hold them now."""
        return self._split([c[0] for c in self.layout.joint.cells])

    def _donating(self, donated_values: list) -> bool:
        return not self.may_fail and sum(nbytes_of(v) for v in donated_values) >= DONATE_MIN_BYTES

    def _program(self, key: Any, body: Callable[..., Any], donate: bool) -> Callable[..., Any]:
        import jax
        fn = self._jitted.get((key, donate))
        if fn is None:
            fn = self._jitted[(key, donate)] = jax.jit(_named(self.reducer.wrap(body), self.name),
                                                       donate_argnums=(0,) if donate else ())
        return fn

    def _merge(self, donated_values: list, others: list) -> list:
        values = list(others)
        for p, v in zip(self.layout.donated, donated_values):
            values[p] = v
        return values

    def _split(self, values: list) -> tuple[list, list]:
        donated = set(self.layout.donated)
        return [values[p] for p in self.layout.donated], [None if p in donated else v
                                                           for p, v in enumerate(values)]

    def _store(self, written: list) -> None:
        cells = self.layout.joint.cells
        for p, value in zip(self.layout.written, written):
            cells[p][0] = value

    def _run(self, key: Any, body: Callable[..., Any], args: Any) -> Any:
        """Run the program of ``key`` on the cells' values and ``args`` (a pytree); store what it
        wrote."""
        donated, others = self.values()
        donate = self._donate.get(key)
        if donate is None:                   # (the sizes are the same at every call of ``key``)
            donate = self._donate[key] = self._donating(donated)
        # a Ctrl-C between the dispatch and the store would lose both the donated values and the
        # new ones: where it cannot be held off (a thread of the master), nothing is donated
        donate = donate and can_hold()
        if donate:
            donated = [_unshared(v) for v in donated]
        program = self._program(key, body, donate)
        glob = self.reducer.globals_of((donated, others, args))
        del donated
        with held(), self.reducer.running():
            try:
                written, results = self.reducer.locals_of(program(*glob))
            except Exception as e:
                raise_deferred_interrupt(e)
                raise
            self._store(written)
        raise_deferred_interrupt()
        return results


#: references to a value held only by its cell, as :func:`_unshared` counts them: the cell, the
#: list of donated values, the comprehension's variable, the parameter and getrefcount's argument
_ONLY_IN_ITS_CELL = 5


def _unshared(value: Any) -> Any:
    """``value``, or a device copy of it if anything besides its cell holds it (a donated value is
    gone after the program: the user's ``get_value(borrow=True)`` must still see it)."""
    import jax
    if not isinstance(value, jax.Array) or sys.getrefcount(value) > _ONLY_IN_ITS_CELL:
        return jax.device_put(value, may_alias=False)
    return value


class StepProgram(_Program):
    """One training step as one program on this rank (see the module notes).

    Launched as ``synk_step``.

    Parameters
    ----------
    grad, update : Graph
        The gradient function (explicit arguments: its inputs) and the update
        function (no arguments).
    reduced_cell : list
        The cell of the flat vector reduced between them.
    op : str
        Its reduction (``"avg"``).
    subset : list of int
        The gradient function's outputs the step returns.
    modes, dtypes : list
        Per returned output: its reduction across ranks and declared dtype.
    reducer : Reducer
    gathers : tuple of int
        Argument positions given as ``(table, indices)``: the rows are gathered inside.
    may_fail : bool
        The graphs call host code, which can fail while the program runs: nothing is donated.
    """

    name = "synk_step"

    def __init__(self, grad: Graph, update: Graph, reduced_cell: list, op: str, subset: Sequence[int],
                 modes: Sequence[str | None], dtypes: Sequence[Any], reducer: Reducer,
                 gathers: tuple = (), may_fail: bool = False):
        super().__init__(grad, update, reduced_cell, op, reducer, may_fail)
        self.subset, self.modes, self.dtypes, self.gathers = tuple(subset), tuple(modes), tuple(dtypes), gathers

    def _body(self, donated: list, others: list, args: list) -> tuple[list, list]:
        values = self._merge(donated, others)
        outs, values = _one_step(self.grad, self.update, self.layout, self.reducer, self.op,
                                 _gathered(args, self.gathers), values)
        results = [self.reducer.reduce(outs[i], mode).astype(dtype)
                   for i, mode, dtype in zip(self.subset, self.modes, self.dtypes)]
        return [values[p] for p in self.layout.written], results

    def __call__(self, args: list) -> list:
        """Run the step on ``args`` (device arrays; ``(table, indices)`` at the gathered
        positions); the shared variables take their new values; return the reduced outputs
        (device arrays, computed asynchronously)."""
        return self._run("step", self._body, args)


class BlockProgram(_Program):
    """Many steps as one program on this rank: ``lax.scan`` over the steps' index rows.

    Every step gathers its rows of the device-resident ``tables`` by one row of
    indices, computes the gradient with ``weight_rows`` as the step's batch
    rows, reduces it and updates. The program returns the sum of the steps'
    losses (the gradient function's first output) on this rank, and the
    longest of the ranks' times of their previous blocks (what the ranks
    agree on to choose their next blocks' length alike).

    Parameters
    ----------
    grad, update, reduced_cell, op, reducer
        As for :class:`StepProgram`.

    Launched as ``synk_steps``.
    """

    name = "synk_steps"

    def _body(self, donated: list, others: list, args: tuple) -> tuple[list, Any]:
        import jax
        import jax.numpy as jnp
        tables, index_rows, weight_rows, seconds = args
        written_at = self.layout.written
        merged = self._merge(donated, others)
        start = [merged[p] for p in written_at]
        fixed = others            # (what the steps write comes from the carry, step by step)

        def step(carry: list, indices: Any) -> tuple[list, Any]:
            values = list(fixed)
            for p, v in zip(written_at, carry):
                values[p] = v
            rows = [jnp.take(t, indices, axis=0, mode="clip") for t in tables]
            outs, values = _one_step(self.grad, self.update, self.layout, self.reducer, self.op,
                                     rows + [weight_rows], values)
            new = [_same_type(values[p], old) for p, old in zip(written_at, carry)]
            return new, outs[0].astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)

        written, losses = jax.lax.scan(step, start, index_rows)
        return written, (jnp.sum(losses), self.reducer.reduce(seconds, "max"))

    def __call__(self, tables: list, index_rows: Any, weight_rows: Any, seconds: Any) -> tuple[Any, Any]:
        """Run ``len(index_rows)`` steps; return the sum of this rank's step losses and the most
        ``seconds`` (this rank's time of its previous block) of any rank (device scalars)."""
        shapes = (tuple(np.shape(index_rows)), tuple(t.shape for t in tables))
        return self._run(("block", shapes), self._body, (tables, index_rows, weight_rows, seconds))


class StepPrograms:
    """The fused programs of one rank, built at first use and kept (per shapes)."""

    def __init__(self, limit: int = 64):
        self._kept: dict = {}
        self._limit = limit

    def get[P: _Program](self, key: Any, build: Callable[[], P | None]) -> P | None:
        if key in self._kept:
            return self._kept[key]
        if len(self._kept) >= self._limit:
            self._kept.pop(next(iter(self._kept)))
        made = self._kept[key] = build()
        return made
