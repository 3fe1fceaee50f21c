"""A function spec's graphs, and graphs rebuilt on inputs of static shapes.

JAX traces some graphs only with concrete shapes; such a graph is rebuilt on
inputs of the shapes a call brings (:func:`rebuild_on`), which always traces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph, SymbolicOp
from pytensor.graph.traversal import toposort

from ..compile.randomness import is_generator
from ..platform.internals import storage_cell

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    from ..wire.spec import FunctionSpec

__all__ = ["rebuild_on", "spec_graph", "needs_static_shapes", "shaped_shared_cells"]

#: a pair (variable, what replaces it): an update, a generator's next state, a given
type Pair = tuple[Variable, Variable]
#: a function's graphs: (inputs, outputs, updates, generator updates, givens)
type SpecGraph = tuple[list[Variable], list[Variable], list[Pair], list[Pair], list[Pair]]


def rebuild_on(variables: Sequence[Variable], replace: Mapping[Variable, Variable]) -> list[Variable]:
    """``variables`` rebuilt with the inputs in ``replace`` swapped for variables of other static shapes.

    Every node downstream of a replaced input is rebuilt (``make_node`` on
    the new inputs), so static shapes propagate; the given graph is not
    changed. An op that builds its inner graph from its input types (a
    pytensor-ml layer: PyTensor's ``SymbolicOp``) is applied anew, building
    that inner graph for the new shapes; any other ``OpFromGraph`` is
    inlined (its inner graph keeps the shapes it was built for).

    Examples
    --------
    >>> import numpy as np
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


def shaped_shared_cells(spec: FunctionSpec) -> dict[SharedVariable, list[Any]]:
    """{shared variable: its storage cell}, for each of ``spec``'s shared variables with axes that
    its graphs read whole (not a random generator, not one sliced per call): a graph rebuilt per
    shape reads each at its present shape (see :func:`spec_graph`)."""
    sliced = set(spec.sliceable_shareds)
    return {s: storage_cell(s) for s in spec.shared_variables()
            if getattr(s.type, "ndim", 0) and not is_generator(s) and s not in sliced}


def needs_static_shapes(e: BaseException) -> bool:
    """True if ``e`` says JAX could not trace a graph without concrete shapes.

    (``jax.numpy.arange`` of a symbolic length, a slice with symbolic bounds, a
    shape used as a Python int.) Used only where nothing can be retried;
    a call retries any failure of a graph on free rows with the graph rebuilt
    on the call's shapes (see :class:`CompiledFunction`).
    """
    import jax
    concretization = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                      jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError)
    text = str(e)
    return isinstance(e, concretization) or "Tracer" in text or \
        (isinstance(e, IndexError) and "static" in text) or \
        (isinstance(e, NotImplementedError) and ("constant" in text or "concrete" in text))


def spec_graph(spec: FunctionSpec, inputs: list[Variable], givens: list[Pair], row_inputs: Sequence[Variable],
               shapes: Sequence[Sequence[int | None]] | None = None,
               shared_shapes: Mapping[SharedVariable, tuple[int, ...]] | None = None) -> SpecGraph:
    """The graphs of ``spec`` as (inputs, outputs, updates, generator updates, givens).

    With ``shapes`` (one per ``row_inputs``), each of ``row_inputs`` is
    replaced by an input of that static shape and the graphs are rebuilt on
    it (:func:`rebuild_on`); each shared variable in ``shared_shapes`` (a
    dict: shared variable -> shape) is read through ``specify_shape`` at that
    shape, so that shape arithmetic on a parameter (the length of a slice of
    a flat parameter vector, which a reshape takes) folds to constants JAX
    can trace. The givens are applied in that rebuild
    (PyTensor's own substitution would not carry the new static shapes on),
    so none are left to give. A node that refuses an axis of length 1 (a
    scan whose inner graph was built on a free axis refuses a broadcastable
    outer one) is rebuilt with such axes left free.
    """
    outputs = [v for v, _ in spec.outputs]
    updates = [(s, v) for s, v, _ in spec.updates]
    generators = list(spec.generator_updates)
    if shapes is None:
        return inputs, outputs, updates, generators, givens
    shared_shapes = shared_shapes or {}
    try:
        return _rebuilt(inputs, givens, row_inputs, shapes, shared_shapes, outputs, updates, generators)
    except TypeError:
        loose = [_ones_free(v.type.shape, shape) for v, shape in zip(row_inputs, shapes)]
        if loose == [tuple(shape) for shape in shapes]:
            raise
        return _rebuilt(inputs, givens, row_inputs, loose, shared_shapes, outputs, updates, generators)


def _ones_free(declared: Sequence[int | None], shape: Sequence[int | None]) -> tuple[int | None, ...]:
    """``shape``, but free (None) where it has a length of 1 that ``declared`` leaves free.

    Examples
    --------
    >>> _ones_free((None, 3), (1, 3)), _ones_free((None, None), (4, 1)), _ones_free((1, None), (1, 5))
    ((None, 3), (4, None), (1, 5))
    """
    return tuple(None if n == 1 and d is None else n for d, n in zip(declared, shape))


def _rebuilt(inputs: list[Variable], givens: list[Pair], row_inputs: Sequence[Variable],
             shapes: Sequence[Sequence[int | None]], shared_shapes: Mapping[SharedVariable, tuple[int, ...]],
             outputs: list[Variable], updates: list[Pair], generators: list[Pair]) -> SpecGraph:
    """:func:`spec_graph`'s graphs rebuilt on ``row_inputs`` of static ``shapes``, and on the shared
    variables of ``shared_shapes`` at theirs."""
    replace: dict[Variable, Variable] = {v: v.type.clone(shape=shape)(name=v.name)
                                         for v, shape in zip(row_inputs, shapes)}
    fixed: dict[Variable, Variable] = {s: pt.specify_shape(s, shape) for s, shape in shared_shapes.items()}
    given = rebuild_on([v for _, v in givens], {**replace, **fixed})
    substitute = {**replace, **fixed, **{k: v for (k, _), v in zip(givens, given)}}
    pieces = [outputs, [v for _, v in updates], [v for _, v in generators]]
    flat = rebuild_on(sum(pieces, []), substitute)
    new = []
    for piece in pieces:
        new.append(flat[:len(piece)])
        flat = flat[len(piece):]
    return ([replace.get(v, v) for v in inputs], new[0],
            [(s, v) for (s, _), v in zip(updates, new[1])],
            [(g, v) for (g, _), v in zip(generators, new[2])], [])
