"""A PyMC model's log-density, split into terms over rows and terms counted once.

The log-likelihood of the observed variables is a sum over the rows of their
data. :func:`split_model` rebuilds it on symbolic row inputs (one per array
that holds rows) so that each device computes it on its own rows, and keeps
the priors, their Jacobian terms and the potentials that read no rows apart,
to be counted once. What does not split by rows is refused here, before any
device runs, by :class:`UnsplittableModel` naming the variable and the reason.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors, graph_inputs
from pytensor.tensor.basic import Alloc
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.variable import TensorVariable

from .rows import RowsMixed, check_rows_kept_apart, fold_data, inline_op_from_graphs

__all__ = ["UnsplittableModel", "SplitModel", "split_model", "CHECKED_ROWS"]

#: rows of each half that the row check evaluates (see _check_rows_are_independent)
CHECKED_ROWS = 3


class UnsplittableModel(ValueError):
    """A model whose likelihood does not split over the devices by rows (the message says why)."""


@dataclass
class SplitModel:
    """A model's log-density as terms over rows and terms counted once.

    Attributes
    ----------
    row_inputs : list of TensorVariable
        Symbolic stand-ins for the arrays that hold rows (first axis: the rows).
    row_values : list of numpy.ndarray
        Their values, all rows, in the same order.
    row_terms : list of TensorVariable
        The observed variables' elementwise log-likelihoods over ``row_inputs``.
    once_terms : list of TensorVariable
        The priors with their Jacobian terms, and the potentials that read no rows.
    n_rows : int
        The rows of the data.
    shared_data : list of SharedVariable
        Every shared array the log-density reads (``pm.Data``, or a plain
        ``pytensor.shared``): a function built on the split holds a copy of
        those it no longer reads, stale once their values change.
    """

    row_inputs: list
    row_values: list
    row_terms: list
    once_terms: list
    n_rows: int
    shared_data: list = field(default_factory=list)


def split_model(model: Any, jacobian: bool = True) -> SplitModel:
    """Split ``model``'s log-density into terms over rows and terms counted once.

    ``jacobian``: whether the priors of transformed variables hold their
    Jacobian terms (as ``model.logp(jacobian=...)``).

    Raises
    ------
    UnsplittableModel
        Naming the variable: a model without observed variables, an observed
        variable without a row axis or with another row count than the others,
        a potential that reads the rows, a prior that reads them, or a
        likelihood whose rows depend on one another.

    Examples
    --------
    >>> import pymc as pm
    >>> with pm.Model() as model:
    ...     mu = pm.Normal("mu")
    ...     obs = pm.Normal("obs", mu, 1.0, observed=np.arange(6.0))
    >>> split = split_model(model)
    >>> split.n_rows, [v.shape for v in split.row_values], len(split.once_terms)
    (6, [(6,)], 1)
    """
    observed = list(model.observed_RVs)
    if not observed:
        raise UnsplittableModel("the model has no observed variables: there are no rows to split over "
                                "the devices; use PyMC's own functions for it")
    _refuse_imputed(model, observed)
    n_rows = _row_count(model, observed)
    row_terms = model.logp(vars=observed, jacobian=True, sum=False)
    for rv, term in zip(observed, row_terms):
        if term.ndim == 0:
            raise UnsplittableModel(f"observed variable {rv.name!r} has no row axis: its log-likelihood is "
                                    f"one number over all its rows (a multivariate distribution over the "
                                    f"rows?), which cannot be split over the devices")
    row_terms = inline_op_from_graphs(row_terms)
    read = list(graph_inputs(row_terms))
    given = _row_data(row_terms, n_rows)         # (what the priors must not read)
    # what reads data and no parameter is computed once, on all rows; what is left must keep rows apart
    row_terms, _ = fold_data(row_terms)
    row_data = _row_data(row_terms, n_rows)
    if not row_data:
        names = ", ".join(rv.name for rv in observed)
        raise UnsplittableModel(f"the likelihood of {names} reads no array of {n_rows} rows: nothing to "
                                f"split over the devices")
    row_data, mixed = _rows_kept_apart(row_terms, [rv.name for rv in observed], row_data,
                                       {model.rvs_to_values[rv] for rv in observed})
    once_terms = _once_terms(model, given + [v for v in row_data if v not in given], jacobian)
    row_inputs = [_row_input(var, i) for i, var in enumerate(row_data)]
    local_rows = row_inputs[0].shape[0]
    replace: dict[Variable, Variable] = dict(zip(row_data, row_inputs))
    replace.update(_row_counts(model, row_terms, n_rows, local_rows, set(row_data)))
    rebuilt = clone_replace(row_terms, replace=replace, rebuild_strict=False)
    read += [var for var in graph_inputs(once_terms) if var not in read]
    shared_data = [var for var in read if isinstance(var, SharedVariable) and _is_data(var)]
    split = SplitModel(row_inputs, [_value_of(var) for var in row_data], rebuilt, once_terms, n_rows,
                       shared_data)
    try:
        _check_rows_are_independent(model, observed, split, jacobian)
    except UnsplittableModel:
        if mixed is None:
            raise
        # taken whole, the array was not as long as the rows by coincidence: it holds rows
        raise UnsplittableModel(f"{mixed}; such a likelihood cannot be split over the devices") from None
    return split


# --- rows ------------------------------------------------------------------------------------------

def _refuse_imputed(model: Any, observed: list[Variable]) -> None:
    """Refuse PyMC's automatic imputation: an observed variable with missing values becomes
    ``<name>_observed`` beside a free ``<name>_unobserved`` holding one value per missing row."""
    for rv in observed:
        name = rv.name or ""
        if name.endswith("_observed") and f"{name[:-len('_observed')]}_unobserved" in model.named_vars:
            base = name[:-len("_observed")]
            raise UnsplittableModel(
                f"observed variable {base!r} has missing values (NaN or masked), which PyMC imputes as "
                f"a free variable {base + '_unobserved'!r} with one value per missing row: the rows "
                f"cannot be split over the devices while a parameter belongs to some of them; leave "
                f"the rows with missing values out of the observed data (and the matching rows of "
                f"the other data), or fill them in before building the model")


def _value_of(var: Any) -> np.ndarray:
    """The numpy value of a constant or shared variable."""
    if isinstance(var, Constant):
        return np.asarray(var.data)
    return np.asarray(var.get_value(borrow=True))


def _row_count(model: Any, observed: list[Variable]) -> int:
    """The rows of the observed data (every observed variable must have as many)."""
    counts = {}
    for rv in observed:
        value = model.rvs_to_values[rv]
        shape = value.data.shape if isinstance(value, Constant) else tuple(value.shape.eval(mode="FAST_COMPILE"))
        if len(shape) == 0:
            raise UnsplittableModel(f"observed variable {rv.name!r} has no row axis (its data is a "
                                    f"scalar): its log-likelihood cannot be split over the devices")
        counts[rv.name] = int(shape[0])
    if len(set(counts.values())) > 1:
        raise UnsplittableModel(f"the observed variables have different row counts {counts}: the rows "
                                f"are split over the devices one way for all of them")
    return next(iter(counts.values()))


def _is_data(var: Variable) -> bool:
    """Whether ``var`` is a constant or shared array (not a random generator)."""
    if isinstance(var, SharedVariable):
        return not isinstance(var.type, RandomType)
    return isinstance(var, Constant) and getattr(var.type, "ndim", 0) > 0


def _row_data(row_terms: list, n_rows: int) -> list[Variable]:
    """The constant and shared arrays the likelihood reads whose first axis has ``n_rows``."""
    found = []
    for var in graph_inputs(row_terms):
        if _is_data(var) and var.type.ndim > 0 and _value_of(var).shape[0] == n_rows:
            found.append(var)
    return found


def _row_input(var: Variable, i: int) -> TensorVariable:
    """A symbolic input of ``var``'s type with any number of rows."""
    name = var.name or f"rows_{i}"
    return pt.tensor(dtype=var.type.dtype, shape=(None, *var.type.shape[1:]), name=name)


def _rows_kept_apart(row_terms: list, names: list[str], row_data: Sequence[Variable],
                     observed_data: Collection[Variable]) -> tuple[list[Variable], str | None]:
    """``(row_data less the arrays as long as the rows by coincidence, why the first of them that
    is not a table was taken whole)``.

    An array that mixes rows on its way to the likelihood goes whole to every
    device: a group table read at indices, or one value per covariate
    contracted with the covariates. Refused if the observed data
    (``observed_data``) mix rows. The split is then checked against PyMC's own
    log-density (:func:`_check_rows_are_independent`): an array taken whole
    that holds rows fails there, and the refusal is the reason given here.
    """
    row_data, mixed = list(row_data), None
    while True:
        try:
            check_rows_kept_apart(row_terms, names, row_data)
            return row_data, mixed
        except RowsMixed as e:
            if e.source not in row_data or e.source in observed_data:
                raise UnsplittableModel(f"{e}; such a likelihood cannot be split over the devices") from None
            row_data.remove(e.source)
            if not e.as_table:
                mixed = mixed or str(e)


def _row_counts(model: Any, row_terms: list, n_rows: int, local_rows: Variable,
                row_data: Collection[Variable]) -> dict[Variable, Variable]:
    """Replacements of the row count where the likelihood holds it: a size vector, a dim length."""
    dim_lengths = {id(v) for v in model.dim_lengths.values()}
    replace: dict[Variable, Variable] = {}
    for var in graph_inputs(row_terms):
        if var in row_data or not hasattr(var.type, "dtype") or "int" not in var.type.dtype:
            continue
        if isinstance(var, Constant) and var.type.ndim == 1 and var.data.size and var.data[0] == n_rows:
            rest = pt.as_tensor(var.data[1:].astype(var.type.dtype))
            replace[var] = pt.concatenate([pt.cast(local_rows, var.type.dtype)[None], rest])
        elif id(var) in dim_lengths and var.type.ndim == 0 and int(_value_of(var)) == n_rows:
            replace[var] = pt.cast(local_rows, var.type.dtype)  # type: ignore[index]
    # the rows' length an array is broadcast to (PyMC's mixtures broadcast each component's terms)
    for var in ancestors(row_terms):
        node = var.owner
        if node is not None and isinstance(node.op, Alloc) and len(node.inputs) > 1:
            length = node.inputs[1]
            if isinstance(length, Constant) and np.ndim(length.data) == 0 and int(length.data) == n_rows:
                replace[length] = pt.cast(local_rows, length.type.dtype)
    return replace


# --- terms counted once ------------------------------------------------------------------------------

def _once_terms(model: Any, row_data: list[Variable], jacobian: bool) -> list:
    """The priors (Jacobians included) and the potentials that read no rows."""
    free = list(model.free_RVs)
    terms = model.logp(vars=free, jacobian=jacobian, sum=False) if free else []
    names = [rv.name for rv in free]
    for potential in model.potentials:
        if _reads_rows(potential, row_data):
            raise UnsplittableModel(f"potential {potential.name!r} reads the observed rows: a potential is "
                                    f"counted once, not split over the devices; write it as an observed "
                                    f"variable (pm.CustomDist with observed=) so that it splits by rows")
        terms += model.logp(vars=[potential], sum=False)
        names.append(potential.name)
    return [_without_data_shapes(term, name, row_data) for term, name in zip(terms, names)]


def _reads_rows(term: Variable, row_data: Collection[Variable]) -> list[Variable]:
    """The arrays of rows that ``term`` reads: the likelihood's own, or a constant equal to one."""
    return [var for var in graph_inputs([term]) if _is_row_data(var, row_data)]


def _is_row_data(var: Variable, row_data: Collection[Variable]) -> bool:
    if var in row_data:
        return True
    if not isinstance(var, Constant) or getattr(var.type, "ndim", 0) == 0:
        return False
    return any(isinstance(d, Constant) and d.type == var.type and np.array_equal(d.data, var.data)
               for d in row_data)


def _without_data_shapes(term: Variable, name: str, row_data: Collection[Variable]) -> Variable:
    """``term`` with the shapes it reads of row arrays made constant; refused if it reads their values."""
    used = set(_reads_rows(term, row_data))
    if not used:
        return term
    replace = {}
    for node in _apply_nodes(term):
        for var in set(node.inputs) & used:
            if not isinstance(node.op, Shape | Shape_i):
                raise UnsplittableModel(f"{name!r} reads the values of {var.name or 'an array'} of the "
                                        f"observed rows, and so does the likelihood: data shared between "
                                        f"observed and prior terms cannot be split over the devices; give "
                                        f"the prior its own copy of what it needs")
            replace[node.outputs[0]] = pt.as_tensor(np.asarray(node.outputs[0].eval(mode="FAST_COMPILE")))
    return clone_replace(term, replace=replace)


def _apply_nodes(term: Variable) -> list:
    return [var.owner for var in ancestors([term]) if var.owner is not None]


# --- the row check -----------------------------------------------------------------------------------

def _check_rows_are_independent(model: Any, observed: list[Variable], split: SplitModel,
                                jacobian: bool = True) -> None:
    """Each row's log-likelihood must depend on that row alone, and the split must be PyMC's model.

    At the initial point and at random points around it: the terms computed on the first rows and
    on the halves of them must agree (a mean over the rows, a shape fixed to the row count or a
    variable with one value per row would not), and the log-density and its gradient summed over
    two halves of all the rows, plus the terms counted once, must equal PyMC's.
    """
    n = min(CHECKED_ROWS, split.n_rows // 2)
    if n == 0:
        return
    value_vars = list(model.value_vars)
    fn = pytensor.function([*split.row_inputs, *value_vars], split.row_terms, mode="FAST_COMPILE",
                           on_unused_input="ignore")
    rows = {part: [value[part] for value in split.row_values]
            for part in (slice(0, 2 * n), slice(0, n), slice(n, 2 * n))}
    points = _check_points(model)
    for point in points:
        args = [point[v.name] for v in value_vars]
        results = {}
        for part, values in rows.items():
            try:
                results[part] = fn(*values, *args)
            except Exception as err:        # what PyTensor raises on shapes varies by op
                raise UnsplittableModel(_unsplit_shapes(model, observed, split.n_rows, err)) from None
        whole, first, second = (results[p] for p in rows)
        for rv, w, a, b in zip(observed, whole, first, second):
            if np.ndim(w) == 0 or np.shape(w)[0] != 2 * n:
                raise UnsplittableModel(f"observed variable {rv.name!r} has no row axis: its log-likelihood "
                                        f"is one number over all its rows, which cannot be split over the devices")
            if not np.allclose(np.concatenate([a, b]), w, rtol=1e-9, atol=0, equal_nan=True):
                raise UnsplittableModel(f"the log-likelihood of {rv.name!r} is not a sum over rows: a row's "
                                        f"term changes with the other rows (a mean or a sum over the data in "
                                        f"the model?); such a likelihood cannot be split over the devices")
    _check_against_pymc(model, split, points, jacobian)


#: random points (besides the initial one) the split is checked at, and their spread
CHECK_POINTS, CHECK_SPREAD = 2, 0.5


def _check_points(model: Any) -> list[dict[str, np.ndarray]]:
    """The initial point and :data:`CHECK_POINTS` random points around it (unconstrained values)."""
    start = model.initial_point()
    rng = np.random.default_rng(0)
    points = [start]
    for _ in range(CHECK_POINTS):
        points.append({name: (value + CHECK_SPREAD * rng.normal(size=np.shape(value))).astype(value.dtype)
                       if np.issubdtype(np.asarray(value).dtype, np.floating) else value
                       for name, value in start.items()})
    return points


def _check_against_pymc(model: Any, split: SplitModel, points: Sequence[dict[str, np.ndarray]],
                        jacobian: bool) -> None:
    """The split log-density and gradient, summed over two halves of the rows, equal PyMC's."""
    value_vars = list(model.value_vars)
    floats = [v for v in value_vars if v.type.dtype.startswith("float")]
    rows_total = pt.add(*[t.sum() for t in split.row_terms])
    once_total = pt.add(*[t.sum() for t in split.once_terms]) if split.once_terms else pt.constant(0.0)
    def with_gradient(total: Variable) -> list[Variable]:
        return [total, *_gradients(total, floats)]
    ours = pytensor.function([*split.row_inputs, *value_vars], with_gradient(rows_total),
                             mode="FAST_COMPILE", on_unused_input="ignore")
    once = pytensor.function(value_vars, with_gradient(once_total), mode="FAST_COMPILE",
                             on_unused_input="ignore")
    theirs = pytensor.function(value_vars, with_gradient(model.logp(jacobian=jacobian)),
                               mode="FAST_COMPILE", on_unused_input="ignore")
    half = split.n_rows // 2
    for point in points:
        args = [point[v.name] for v in value_vars]
        got = [np.asarray(a, dtype=float) for a in once(*args)]
        for part in (slice(0, half), slice(half, None)):
            got = [g + np.asarray(a, dtype=float) for g, a in
                   zip(got, ours(*[value[part] for value in split.row_values], *args))]
        want = [np.asarray(a, dtype=float) for a in theirs(*args)]
        if not all(np.allclose(g, w, rtol=1e-6, atol=1e-8, equal_nan=True) for g, w in zip(got, want)):
            raise UnsplittableModel(f"the model's log-density split over the rows does not equal PyMC's "
                                    f"(at a random point: {float(got[0])!r} against {float(want[0])!r}): a "
                                    f"row's term depends on other rows in a way synkhronos cannot follow; "
                                    f"such a model cannot be split over the devices")


def _gradients(total: Variable, wrt: list[Variable]) -> list:
    """The gradient of ``total`` with respect to each of ``wrt`` (zero where it does not depend)."""
    grads = pytensor.grad(total, wrt, disconnected_inputs="ignore") if wrt else []
    return list(grads)  # type: ignore[arg-type]


def _unsplit_shapes(model: Any, observed: list[Variable], n_rows: int, err: Exception) -> str:
    """Why the likelihood failed on a share of the rows, naming what holds the row count."""
    names = ", ".join(repr(rv.name) for rv in observed)
    point = model.initial_point()
    per_row = [v.name for v in model.value_vars if np.ndim(point[v.name]) and np.shape(point[v.name])[0] == n_rows]
    if per_row:
        return (f"free variable {per_row[0]!r} has one value per row ({n_rows}): the likelihood of {names} "
                f"cannot be split over the devices by rows while a parameter has a row axis (if it has one "
                f"value per group and {n_rows} groups over {n_rows} rows is a coincidence, give the group "
                f"index as pm.Data, whose rows the split follows)")
    reason = str(err).strip().rstrip(".")
    return (f"the log-likelihood of {names} cannot be computed on a share of the rows ({reason}): a size or "
            f"shape fixed to the row count ({n_rows}) does not split; give sizes as data.shape[0]")
