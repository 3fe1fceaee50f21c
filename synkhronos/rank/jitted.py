"""A PyTensor function's jitted graph called directly, skipping PyTensor's per-call bookkeeping.

A PyTensor function linked for JAX is one jitted function behind bookkeeping
that every call pays (:func:`synkhronos.platform.internals.jit_parts` hands out
its pieces). :func:`jitted_call` calls the jitted graph itself, donating large
update buffers when that pays (:func:`donating_variant`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pytensor.tensor.type import TensorType

from ..compile.rewrites import raise_deferred_interrupt
from ..platform.device_arrays import arguments_on_device, wait_until_computed
from ..platform.internals import calls_host_code, jit_parts
from ..platform.interrupt_hold import can_hold, held
from ..platform.values import device_face, faces_held, host_face, host_faces_on

if TYPE_CHECKING:
    import jax
    from pytensor.compile.executor import Function

    from ..platform.internals import JitParts
    from .undo import UndoLog

__all__ = ["jitted_call", "abstract_value", "face_updates", "donating_variant", "worth_donating",
           "copy_values_held_elsewhere", "DONATE_MIN_BYTES"]

#: how a rank calls a compiled graph, ``runner(*args, undo=None)``: a function with attributes
#: attached (``fn``, the PyTensor function; ``streams``, its random generators' cells), or the
#: PyTensor function itself
type Runner = Any


def jitted_call(fn: Function) -> Runner | None:
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
    before they return). Large updated values are computed into their old
    buffers (:func:`donating_variant`). An error is re-raised through ``fn``
    itself, with PyTensor's account of the failing node.

    Given an :class:`~.undo.UndoLog` (``call(*args, undo=log)``), a call keeps
    the values its updates replace there first if the graph calls host code
    (it can fail while computing) or the log asks to keep everything; a
    graph calling host code never donates. While other threads may read the
    shared variables (:func:`~synkhronos.platform.internals.hold_faces`), the
    cells keep numpy faces: the graph reads their device arrays, donates
    nothing and stores its updates as faces.

    Parameters
    ----------
    fn : pytensor.compile.Function
        Compiled with ``trust_input`` and list outputs.

    Returns
    -------
    callable or None
        ``call(*args, undo=None)`` returning the list of ``fn``'s outputs.
    """
    parts = jit_parts(fn)
    if parts is None or fn.profile or not fn.maker.fgraph.outputs:
        return None
    jit, cells, updates, n_outputs = parts.jit, parts.cells, parts.updates, parts.n_outputs
    n_args = parts.n_args
    arg_cells = cells[:n_args]
    update_cells = [storage for _, storage in updates]
    donating, donated = donating_variant(parts, [v.type for v in fn.maker.fgraph.inputs])
    #: the graph this function runs, and whether it calls host code: chosen at its first call
    chosen: list = []
    #: per update, the dtype its variable holds in JAX's precision (set at the first call, once
    #: JAX's precision is set): PyTensor's JAX backend may compute another (float64 for a float32
    #: variable under floatX float64), which the variable's type does not admit
    update_dtypes: list = []
    # all outputs of one execution become ready together: wait on one array (a random generator's
    # next state is a dict of arrays, which has no block_until_ready)
    arrays = [i for i, v in enumerate(fn.maker.fgraph.outputs) if isinstance(v.type, TensorType)]
    wait = (lambda outputs: outputs[arrays[-1]].block_until_ready()) if arrays else \
        wait_until_computed

    def choose(values: list[Any]) -> None:
        """Run the donating graph if its updates are large enough and it calls no host code; find
        out whether the graph run calls host code (only where it has updates to keep)."""
        graph = donating if donated and worth_donating(values, donated) else jit
        host = bool(update_cells)         # unknown: as careful as host code
        if update_cells and hasattr(graph, "trace"):
            # jax.jit keeps the trace: the call does not trace again
            host = calls_host_code(graph.trace(*values))
            if host and graph is donating:
                graph = jit
        chosen[:] = [graph, host]
        update_dtypes[:] = [_jax_dtype(fn.maker.fgraph.outputs[i].type) for i, _ in updates]

    def call(*args: Any, undo: UndoLog | None = None) -> list[Any]:
        for cell, arg in zip(arg_cells, args):
            cell[0] = arg
        faces = faces_held()
        try:
            values = [cell[0] for cell in cells]
            if arg_cells and not host_faces_on():
                # as on a GPU, every transfer explicit (with host faces, the CPU call takes its
                # numpy views without a copy either way, and sooner)
                values[:n_args] = arguments_on_device(values[:n_args])
            if faces:             # other threads read the variables: numpy faces stay in the cells
                values[n_args:] = [device_face(v) for v in values[n_args:]]
            if not chosen:
                choose(values)
            graph, host = chosen
            if undo is not None and (host or undo.keep_all):
                undo.keep(update_cells)       # before the copy below: a kept value is not donated
            if graph is donating:
                # a reader may hold the old value's face: never overwrite it; and a Ctrl-C between
                # the dispatch and the store below would lose both the old values and the new:
                # where it cannot be held off (a thread of the master), nothing is donated
                if faces or not can_hold():
                    graph = jit
                else:
                    copy_values_held_elsewhere(values, donated)
            with held() if graph is donating else contextlib.nullcontext():
                outputs = graph(*values)
                del values
                for (i, storage), dtype in zip(updates, update_dtypes):
                    value = outputs[i]
                    if dtype is not None and value.dtype != dtype:
                        value = value.astype(dtype)
                    storage[0] = host_face(value) if faces else value
        except Exception as e:
            raise_deferred_interrupt(e)
            outputs = fn(*args)       # raises again, with PyTensor's account of the failing node
            if faces:
                face_updates(update_cells)
            return outputs
        finally:
            for cell in arg_cells:
                cell[0] = None
        # JAX returns before the computation has run, and the arguments are views of shared memory
        # that the caller may rewrite as soon as the call returns (the next batch into the same
        # Data): wait for it. Without arguments nothing can change under the computation, and it
        # may run on past the call.
        if arg_cells:
            wait(outputs)
        raise_deferred_interrupt()
        return list(outputs[:n_outputs])

    def compile_ahead() -> Callable[[], None] | None:
        """What the first call will compile, as a callable for another thread (None if the graph
        takes arguments: their shapes come with the call). The thread chooses the graph to run, on
        the values the cells hold now, as the first call would; the first call waits for it."""
        if arg_cells:
            return None
        import jax
        values = [cell[0] for cell in cells]
        faces = faces_held()           # as the first call will most likely find it (see call)
        if faces:
            values[n_args:] = [device_face(v) for v in values[n_args:]]
        avals = jax.tree_util.tree_map(abstract_value, values)

        def compile_() -> None:
            if not chosen:
                choose(values)
            graph: Any = jit if faces else chosen[0]        # a jax.jit function
            graph.lower(*avals).compile()
        return compile_

    def runs_host_code() -> bool:
        """Whether the graph this function runs calls host code (True until its first call)."""
        return chosen[1] if chosen else True

    call.fn = fn  # type: ignore[attr-defined]  # a function with its program attached
    call.runs_host_code = runs_host_code  # type: ignore[attr-defined]  # known after the first call
    call.compile_ahead = compile_ahead  # type: ignore[attr-defined]  # a function with its program attached
    return call


def face_updates(cells: Iterable[list[Any]]) -> None:
    """Turn the device arrays PyTensor stored into ``cells`` into their host faces."""
    for cell in cells:
        cell[0] = host_face(cell[0])


def abstract_value(value: Any) -> jax.ShapeDtypeStruct:
    """The abstract value a jitted call would see for ``value`` (its device and weak type too)."""
    import jax
    if isinstance(value, jax.Array):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding,
                                    weak_type=value.weak_type)
    return jax.ShapeDtypeStruct(np.shape(value), jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))


def donating_variant(parts: JitParts, input_types: Sequence[Any]) -> tuple[Any, tuple[int, ...]]:
    """``(jit, cells)``: ``parts``' graph jitted to update its shared variables in place, and the
    input cells it donates; ``(None, ())`` if it updates no tensor it reads.

    XLA then computes a shared variable's new value into the buffer of its old
    one (``donate_argnums``) instead of a fresh allocation, so an update pass
    over the parameters and the optimizer's state touches no new memory.
    :func:`jitted_call` runs it if, at its first call, the donated values hold
    :data:`DONATE_MIN_BYTES` or more (:func:`worth_donating`). A donated value
    is gone after the call: :func:`copy_values_held_elsewhere`
    first hands the graph a copy of any value something else still refers to.
    XLA writes only into buffers it allocated itself: a value adopted from
    memory it does not own (a shared-memory result) is released, never
    overwritten, and the new value gets a buffer of its own.

    Parameters
    ----------
    parts : JitParts
    input_types : list of Type
        The type of each of ``parts.cells``' inputs.
    """
    import jax
    updated = [storage for _, storage in parts.updates]
    donated = tuple(j for j, (cell, t) in enumerate(zip(parts.cells, input_types))
                    if j >= parts.n_args and isinstance(t, TensorType)
                    and any(cell is storage for storage in updated))
    if parts.traced is None or not donated:
        return None, ()
    return jax.jit(parts.traced, donate_argnums=donated), donated


#: a function donates its updated values only if they hold this many bytes together: a small
#: fresh result costs nothing (the allocator hands out memory still warm), a donation's bookkeeping
#: does, and a tiny step would notice
DONATE_MIN_BYTES = 1 << 20


def worth_donating(values: Sequence[Any], donated: Iterable[int]) -> bool:
    """True if the values at ``donated`` are large enough for donation to pay (DONATE_MIN_BYTES)."""
    return sum(getattr(values[j], "nbytes", 0) for j in donated) >= DONATE_MIN_BYTES


#: references to a value held only by its input cell, as :func:`copy_values_held_elsewhere` counts
#: them: the cell, the call's list of values and getrefcount's argument
_ONLY_IN_ITS_CELL = 3


def copy_values_held_elsewhere(values: list[Any], donated: Iterable[int]) -> None:
    """Replace each value at ``donated`` that anything but its input cell refers to by a device copy.

    Such a reference (the user's ``get_value(borrow=True)``, a sync rule
    keeping the last pulled parameters, PyTensor's record of a shared
    variable's first value, one array in two shared variables) must still see
    the value after the call that donates it. The copy is XLA's own, so the
    call after it updates in place again.
    """
    import jax
    for j in donated:
        if not isinstance(values[j], jax.Array) or sys.getrefcount(values[j]) > _ONLY_IN_ITS_CELL:
            values[j] = jax.device_put(values[j], may_alias=False)


def _jax_dtype(type_: Any) -> Any:
    """The dtype a value of PyTensor type ``type_`` has in JAX's precision (None: not a tensor)."""
    import jax
    return jax.dtypes.canonicalize_dtype(type_.dtype) if isinstance(type_, TensorType) else None
