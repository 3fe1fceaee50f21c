"""Turning ``synk.function``'s arguments into a checked :class:`~synkhronos.wire.spec.FunctionSpec`.

Everything a function's recording can refuse is refused here, in the master,
before the function is registered: inputs that are not symbolic inputs (or
declare a static row count), output and update modes, a compilation mode that
does not compile for JAX, random variables JAX cannot sample, graphs that
cannot travel. The tutorials' ``givens`` idiom is rewritten here
(:mod:`.givens`), and what the function threads in is added
(:mod:`synkhronos.compile.graph_updates`). The master then compiles the spec
(:func:`compile_on_master`), with what the compile cache recalls of its graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import pytensor.tensor as pt
from pytensor.compile.mode import get_mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors

from ...comm.reduction import check_output_mode, check_update_mode
from ...compile import graph_updates, randomness, shipping
from ...errors import LocalUpdatesWarning, warn
from ...platform import compile_cache
from ...platform.internals import unsampleable_in_jax
from ...rank.compiled import CompiledFunction
from ...wire.spec import FunctionSpec
from .givens import RECIPE, RowsFromGivens
from .row_sums import is_zero, sum_over_rows
from .shapes import declared_rows, shape_text
from .sliced_updates import added_terms, sums_its_changes
from .split_axes import declared_axes

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

__all__ = ["record", "written_from_rows", "compile_on_master", "TRACES_BY_SHAPE", "TRACES_ON_FREE_ROWS"]


def record(fid: int, inputs: Iterable[Variable] | None, outputs: Any, bcast_inputs: Iterable[Variable] | None,
           updates: Any, givens: Any, sliceable_shareds: Iterable[SharedVariable] | None, name: str | None,
           local_updates: bool, kwargs: dict[str, Any], split_axes: Any = None
           ) -> tuple[FunctionSpec, bool, RowsFromGivens | None]:
    """The checked spec of a function, whether its one output comes back bare, and its givens' rows.

    Returns ``(spec, bare, rows)``; see :func:`synkhronos.function` for the arguments.
    """
    _check_mode(kwargs)
    inputs = _check_inputs(inputs, "inputs")
    bcast_inputs = _check_inputs(bcast_inputs, "bcast_inputs")
    pairs, bare, averaged_by_default = _normalize_outputs(outputs)
    input_axes, gather_axes = declared_axes(split_axes, inputs, bcast_inputs, pairs)
    _check_free_rows(inputs, input_axes)
    givens = list(givens.items()) if isinstance(givens, dict) else list(givens or [])
    rows = RowsFromGivens.find(inputs, bcast_inputs, givens, name or "synk.function")
    scattered_rows: list[Variable] = list(inputs)
    row_axes: dict[Variable, int] = {var: axis or 0 for var, axis in zip(inputs, input_axes)}
    if rows is not None and rows.slices and split_axes:
        raise TypeError("split_axes does not combine with givens that select rows of shared "
                        "variables (those rows are axis 0); " + RECIPE)
    if rows is not None:       # the tutorials' idiom: the givens' row slices become scattered inputs
        scattered_rows = rows.inputs + [s.key for s in rows.slices]
        row_axes.update({s.key: 0 for s in rows.slices})
        inputs, bcast_inputs, givens = rows.inputs, rows.bcast_inputs, rows.givens
    _say_if_an_average_sums_rows([pairs[i][0] for i in averaged_by_default], row_axes,
                                 name or "synk.function")
    seen: set[int] = set()
    for var in inputs + bcast_inputs:
        if id(var) in seen:
            raise ValueError(f"input {var} appears more than once in inputs/bcast_inputs")
        seen.add(id(var))
    triples, generators = _normalize_updates(updates)
    if not local_updates:
        _warn_if_updates_are_local(triples, scattered_rows, name or "synk.function")
    triples += graph_updates.model_updates([v for v, _ in pairs], {s: v for s, v, _ in triples})
    sliceable = list(sliceable_shareds or [])
    spec = FunctionSpec(fid, "", inputs, bcast_inputs, pairs, triples, givens, sliceable, kwargs)
    spec.name = name or f"synk_function_{spec.fid}"
    spec.input_axes = input_axes if rows is None else rows.scattered_axes(input_axes)
    spec.gather_axes = gather_axes
    spec.generator_updates = generators + randomness.generator_updates(
        inputs + bcast_inputs, spec.graph_vars(), written={g for g, _ in generators})
    _check_sliceables(spec, sliceable, givens)
    reads_rows = _row_reader([*scattered_rows, *sliceable], givens)
    _say_if_a_sum_adds_what_reads_no_rows(pairs, reads_rows, name or "synk.function")
    spec.sums_changes = [sums_its_changes(shared, value, mode, reads_rows) for shared, value, mode in triples]
    _check_jax_can_sample(spec)
    _say_once_if_a_float64_cast_computes_in_32_bits(spec)
    _say_if_assertions_go_unchecked(spec)
    shipping.check_shippable(spec)       # a graph that cannot travel fails here, unregistered
    return spec, bare, rows


def _check_sliceables(spec: FunctionSpec, sliceable: Sequence[SharedVariable],
                      givens: Sequence[tuple[Variable, Variable]]) -> None:
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


def _say_if_an_average_sums_rows(averaged: Sequence[Variable], row_axes: dict[Variable, int], name: str) -> None:
    """Warn of an output averaged by default (``"avg"``) that sums over the rows and scales the sum
    by a constant (:mod:`.row_sums`): the call would return about ``1/n_devices`` of its value."""
    rows = {var: axis for var, axis in row_axes.items() if getattr(var.type, "ndim", 0) > 0}
    for var in averaged:
        found = sum_over_rows(var, rows)
        if found is not None:
            warn(f"{name}'s output {var} is a sum over the rows ({found.owner.op}), scaled by "
                 f"constants at most, reduced with 'avg', the default: each device sums its own "
                 f"rows, and the call returns their average, weighted by rows, not the batch's "
                 f"value; give ({var}, 'sum') for the batch's, or divide by the rows' count "
                 f"(x.shape[0]) for a mean (a gradient of it, all-reduced by rows, needs 'sum' "
                 f"as well)")


def _row_variables(rows: Sequence[Variable], givens: Sequence[tuple[Variable, Variable]]) -> set[Variable]:
    """``rows`` and what ``givens`` replace with values read from them: every variable that stands
    for the call's rows in the function's graphs."""
    row_set = set(rows)
    row_set |= {key for key, value in givens if row_set.intersection(ancestors([value]))}
    return row_set


def _row_reader(rows: Sequence[Variable], givens: Sequence[tuple[Variable, Variable]]
                ) -> Callable[[Variable], bool] | None:
    """Whether a variable reads any of :func:`_row_variables`; None if there are no rows."""
    if not rows:
        return None
    row_set = _row_variables(rows, givens)
    return lambda var: bool(row_set.intersection(ancestors([var])))


def _say_if_a_sum_adds_what_reads_no_rows(pairs: Sequence[tuple[Variable, str | None]],
                                          reads_rows: Callable[[Variable], bool] | None, name: str) -> None:
    """Warn of an output reduced with ``"sum"`` that adds a term reading none of the rows to terms
    that read them (a penalty on the weights beside a summed loss): every device and every slice
    adds it.

    ``reads_rows``: :func:`_row_reader`'s. A zero (Python's ``sum()`` starts from one) is no
    term. An output that reads no rows at all is not said: the devices' own values of a variable
    their updates keep apart (``local_updates``) are summed so."""
    if reads_rows is None:          # (no rows: every device computes the whole function, as asked)
        return
    for var, mode in pairs:
        if mode != "sum":
            continue
        terms = added_terms(var)
        rowless = [term for term in terms if not reads_rows(term) and not is_zero(term)]
        if rowless and len(rowless) < len(terms):
            warn(f"{name}'s output {var} is reduced with 'sum' and adds {rowless[0]}"
                 f"{f' (and {len(rowless) - 1} more)' if len(rowless) > 1 else ''}, which reads none "
                 f"of the call's rows: every device, and every slice of num_slices, adds it, so the "
                 f"call counts it once per device and slice where one process counts it once; add "
                 f"it to the call's result yourself (an output of its own, with mode None)")


def _normalize_outputs(outputs: Any) -> tuple[list[tuple[Variable, str | None]], bool, list[int]]:
    """Return ([(var, mode)], bare, [which are averaged by default]) from the user's ``outputs``."""
    if outputs is None:
        return [], False, []
    bare = isinstance(outputs, Variable) or (isinstance(outputs, tuple) and len(outputs) == 2
                                             and isinstance(outputs[0], Variable)
                                             and not isinstance(outputs[1], Variable))
    items = [outputs] if bare else list(outputs)
    pairs: list[tuple[Variable, str | None]] = []
    by_default = []
    for item in items:
        if isinstance(item, Variable):
            var, mode = item, "avg"
            by_default.append(len(pairs))
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Variable):
            var, mode = item
        else:
            raise TypeError(f"each output must be a variable or a (variable, mode) pair, got {item!r}")
        pairs.append((var, check_output_mode(var, mode)))
    return pairs, bare, by_default


def _normalize_updates(updates: Any) -> tuple[list[tuple[SharedVariable, Variable, str | None]],
                                              list[tuple[SharedVariable, Variable]]]:
    """Return ([(shared, new_value, mode)], [(generator, next_state)]) from pairs/triples or a dict.

    A random generator's update is its next state: it has no mode and is
    applied on every slice (each slice draws anew).
    """
    if updates is None:
        return [], []
    items = list(updates.items()) if isinstance(updates, dict) else list(updates)
    triples: list[tuple[SharedVariable, Variable, str | None]] = []
    generators: list[tuple[SharedVariable, Variable]] = []
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


def written_from_rows(spec: FunctionSpec, given_rows: Sequence[Variable] = ()) -> frozenset[SharedVariable]:
    """The shared variables ``spec``'s updates compute from the call's rows alone: each device's
    value comes from its own rows of this call (see :mod:`synkhronos.runtime.rows_behind`).

    The rows are the scattered inputs, ``given_rows`` (the givens' row slices of
    the tutorials' idiom), the sliceable shared variables, and what the givens
    replace with them. An update that reads its own variable (a sum over
    several calls, a moving average) holds more than this call's rows: it is
    not one.
    """
    rows = _row_variables([*spec.inputs, *given_rows, *spec.sliceable_shareds], spec.givens)
    if not rows:
        return frozenset()
    written = set()
    for shared, value, _ in spec.updates:
        read = set(ancestors([value]))
        if rows.intersection(read) and shared not in read:
            written.add(shared)
    return frozenset(written)


def _warn_if_updates_are_local(triples: Sequence[tuple[SharedVariable, Variable, str | None]],
                               scattered: Sequence[Variable], name: str) -> None:
    """Warn (:class:`~synkhronos.errors.LocalUpdatesWarning`) if updates depend on scattered rows.

    Each device then updates its own copy from its own rows, and nothing
    combines them: the literal port of a single-process training function.
    """
    if not triples or not scattered or graph_updates.writes_flat_gradient([s for s, _, _ in triples]):
        return
    rows = set(scattered)
    local = [s for s, value, _ in triples if rows.intersection(ancestors([value]))]
    if local:
        names = ", ".join(_update_names(local[:4], triples)) + (" ..." if len(local) > 4 else "")
        warn(
            f"{name}: the updates of {names} are computed from each device's own rows, so every "
            f"device steps on its own gradient and the copies drift apart (one model per device). "
            f"For data-parallel training all-reduce the gradient between computing and applying "
            f"it: synkhronos.extensions.train.make_train_function(loss, params, x, y, "
            f"updates.sgd, learning_rate=...), or the three parts of extensions.updates. Pass "
            f"local_updates=True if per-device updates are meant.", LocalUpdatesWarning)


def _update_names(targets: Iterable[SharedVariable], triples: Sequence[tuple[SharedVariable, Any, Any]]) -> list[str]:
    """The names of update ``targets``, each with its place in the updates where a name repeats
    (the tutorials name every layer's weights ``W``).

    Examples
    --------
    >>> import pytensor
    >>> W1, W2 = pytensor.shared(0.0, name="W"), pytensor.shared(0.0, name="W")
    >>> b = pytensor.shared(0.0, name="b")
    >>> triples = [(W1, None, None), (b, None, None), (W2, None, None)]
    >>> _update_names([W1, W2, b], triples)
    ['W (update 1)', 'W (update 3)', 'b']
    >>> import numpy as np
    >>> _update_names([kernel := pytensor.shared(np.zeros((2, 3)))], [(kernel, None, None)])
    ['the unnamed 2-d shared variable of shape (2, 3) (update 1)']
    """
    names = [str(s) for s, _, _ in triples]
    place = {id(s): i for i, (s, _, _) in enumerate(triples)}

    def named(s: SharedVariable) -> str:
        if s.name is None:     # PyTensor's own text would be its type, as <Tensor4(float32, ...)>
            return f"the unnamed {s.type.ndim}-d shared variable of shape {s.get_value(borrow=True).shape} " \
                f"(update {place[id(s)] + 1})"
        return f"{s} (update {place[id(s)] + 1})" if names.count(str(s)) > 1 else str(s)
    return [named(s) for s in targets]


#: whether this process has said that a float64 cast computes in float32 (see below)
_SAID_64_BITS = [False]


def _say_once_if_a_float64_cast_computes_in_32_bits(spec: FunctionSpec) -> None:
    """Under floatX float32 JAX computes without 64-bit types: say once, naming it, when a function
    reads a float64 input or shared variable, or casts a float to float64 (the user wrote it, to
    compute wider; PyTensor's own casts of counts and index arithmetic go unsaid)."""
    import pytensor
    from pytensor.graph.traversal import apply_ancestors
    from pytensor.scalar.basic import Cast
    from pytensor.tensor.elemwise import Elemwise
    if _SAID_64_BITS[0] or pytensor.config.floatX == "float64":
        return
    wide = [v for v in list(spec.all_inputs) + spec.shared_variables()
            if getattr(v.type, "dtype", None) == "float64"]
    if wide:
        _SAID_64_BITS[0] = True
        warn(f"{spec.name}: {wide[0]} is float64, and on the devices it computes and is kept in "
             f"float32: floatX is float32, which turns JAX's 64-bit types off (said once); "
             f"declare it float32, or set floatX to float64")
        return
    for node in apply_ancestors(spec.graph_vars()):
        if isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, Cast) and \
                node.outputs[0].type.dtype == "float64" and node.inputs[0].type.dtype in ("float16", "float32"):
            _SAID_64_BITS[0] = True
            warn(f"{spec.name}: {node.op} of {node.inputs[0]} computes in float32 on the "
                 f"devices: floatX is float32, which turns JAX's 64-bit types off (said once)")
            return


def _say_if_assertions_go_unchecked(spec: FunctionSpec) -> None:
    """Say, in one line naming the first, that the assertions of the user's graph (``Assert``,
    ``assert_op``, any ``CheckAndRaise``) are not checked on the devices: a compiled JAX program
    cannot raise, and PyTensor's JAX backend drops them. (The shape assertions PyTensor's rewrites
    add later are its own, and go unsaid.)"""
    from pytensor.graph.traversal import apply_ancestors
    from pytensor.raise_op import CheckAndRaise
    # (one assertion may stand in the graph twice: its value and its gradient both pass through it)
    checks = list(dict.fromkeys((str(node.op), node.op.msg) for node in apply_ancestors(spec.graph_vars())
                                if isinstance(node.op, CheckAndRaise)))
    if checks:
        more = f" (and {len(checks) - 1} more)" if len(checks) > 1 else ""
        warn(f"{spec.name}: the assertion {checks[0][1]!r} of {checks[0][0]}{more} is not "
             f"checked on the devices: a compiled JAX program cannot raise, so PyTensor's JAX "
             f"backend skips it; check the values before the call")


def _check_jax_can_sample(spec: FunctionSpec) -> None:
    """Refuse, when the function is built, a random variable PyTensor's JAX backend cannot sample.

    JAX would find out only at the first call, on every rank.
    """
    missing = unsampleable_in_jax(spec.graph_vars())
    if missing:
        node, message = missing[0]
        hint = (" A Bernoulli mask (binomial with n=1) needs none: (rng.uniform(size=shape) < p)."
                if "binomial" in message else "")
        raise NotImplementedError(
            f"{spec.name}: {node.op} cannot run on the devices: {message} Every device runs the "
            f"function with PyTensor's JAX backend; draw from a distribution it samples, or "
            f"install what the message names.{hint}")


def _check_inputs(inputs: Iterable[Variable] | None, what: str) -> list[TensorVariable]:
    inputs = [] if inputs is None else list(inputs)
    for var in inputs:
        if not isinstance(var, Variable) or isinstance(var, SharedVariable) or var.owner is not None:
            raise TypeError(f"{what} must be symbolic input variables (e.g. pt.matrix('x')), "
                            f"got {var!r}")
    return cast("list[TensorVariable]", inputs)


def _check_free_rows(inputs: Sequence[Variable], axes: Sequence[int | None]) -> None:
    """Refuse scattered inputs declared with a static row count (along their split ``axes``).

    Each device computes its own share of a call's rows, and a graph built
    for a fixed row count may hold that count anywhere (a reshape, a
    divisor): it cannot be split correctly. Graphs on free rows that need
    concrete shapes are compiled per row count instead (see CompiledFunction).
    """
    for var, axis in zip(inputs, axes):
        axis = axis or 0
        rows = declared_rows(var, axis)
        if rows is not None:
            free = shape_text(var.type.shape[:axis] + (None,) + tuple(var.type.shape[axis + 1:]))
            raise TypeError(
                f"scattered input {var} is declared with a static row count, shape "
                f"{shape_text(var.type.shape)}, but each device computes its own share of a call's rows, and a "
                f"graph built for {rows} rows may hold that number anywhere; declare the rows free, "
                f"pt.tensor({(var.name or 'x')!r}, shape={free}, ...): synkhronos compiles each "
                f"device's graph for the rows it gets when JAX needs static shapes "
                f"(pytensor-ml's convolutions work so)")


def _check_mode(kwargs: dict[str, Any]) -> None:
    """Refuse a compilation ``mode`` whose functions do not run on a JAX device.

    Every process keeps its shared variables on its own JAX device between
    calls, and the collectives exchange those device arrays; a function linked
    for another backend (``"FAST_RUN"``, ``"NUMBA"``, ...) computes on numpy
    arrays outside that device.
    """
    mode = kwargs.get("mode")
    if mode is None:
        return
    from pytensor.link.jax.linker import (
        JAXLinker,  # imports JAX: not when synkhronos is imported
    )
    try:
        linker = get_mode(mode).linker
    except Exception as e:
        raise ValueError(f"mode={mode!r} is not a PyTensor compilation mode: {e}") from None
    if not isinstance(linker, JAXLinker):
        raise ValueError(f"mode={mode!r} does not compile for JAX, and synkhronos runs every "
                         f"function on each process's JAX device (CPU or GPU alike); leave mode "
                         f"unset (synkhronos's JAX mode), or pass mode=\"JAX\" or a "
                         f"pytensor Mode whose linker is \"jax\"")


#: the compile cache's findings about a graph: it traces only on concrete shapes, or on free rows
TRACES_BY_SHAPE, TRACES_ON_FREE_ROWS = "traces-by-shape", "traces-on-free-rows"


def compile_on_master(spec: FunctionSpec, cache: str | None) -> CompiledFunction:
    """The master's CompiledFunction of ``spec``, and ``spec.by_rows`` set for the workers.

    Whether the graph traces only on concrete shapes is recalled from an
    earlier run through the compile cache (``spec.by_rows``, for every rank),
    else found out by the calls (see :class:`~synkhronos.rank.compiled.CompiledFunction`)
    and recorded there for the next run.
    """
    key = spec.digest() if cache is not None else None
    spec.by_rows = (True if compile_cache.recalls(cache, TRACES_BY_SHAPE, key) else
                    False if compile_cache.recalls(cache, TRACES_ON_FREE_ROWS, key) else None)

    def remember(by_rows: bool) -> None:
        compile_cache.record(cache, TRACES_BY_SHAPE if by_rows else TRACES_ON_FREE_ROWS, key)
    return CompiledFunction(spec, on_finding=remember if key is not None else None, check=True)
