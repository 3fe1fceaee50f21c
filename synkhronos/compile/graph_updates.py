"""What a function advances by itself besides its given updates, as pytensor-ml threads it in.

``pytensor_ml.pytensorf.function`` threads three kinds of updates into every
function it compiles, and :func:`synkhronos.function` does the same:

- the next state of every random generator the graphs draw from
  (:func:`synkhronos.compile.randomness.generator_updates`), so each call draws anew;
- the advance of every training clock the outputs or updates read
  (:func:`pytensor_ml.pytensorf.collect_clock_updates`), so a schedule moves;
- the write-backs that stateful layers reached by the update expressions
  declare (:func:`pytensor_ml.pytensorf.collect_non_trainable_updates`):
  batch norm's running statistics follow the batches a step trains on. An
  op reached only by an output is observed, not advanced (a validation pass).

A training step's gradient function, one that writes a flat gradient
(:mod:`synkhronos.extensions.updates`), threads only the generators: its flat
vector carries the statistics to the step's update function, which writes them
combined over the devices and advances the clocks once per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from pytensor_ml.pytensorf import collect_clock_updates, collect_non_trainable_updates

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

__all__ = ["model_updates", "writes_flat_gradient"]


def writes_flat_gradient(targets: Iterable[SharedVariable]) -> bool:
    """True if one of the shared ``targets`` is a training step's flat gradient."""
    return any(getattr(t.tag, "synk_gradient", False) for t in targets)


def model_updates(outputs: Sequence[Variable],
                  updates: Mapping[SharedVariable, Variable]) -> list[tuple[SharedVariable, Variable, str]]:
    """The clock advances and stateful write-backs a function with ``outputs`` and ``updates`` threads in.

    Parameters
    ----------
    outputs : list of Variable
    updates : dict
        The function's given updates (shared variable -> new value); what they
        write is left as given.

    Returns
    -------
    list of (SharedVariable, Variable, str)
        Each threaded update with its accumulation mode over ``num_slices``:
        ``"avg"`` for a statistic, ``"max"`` for a clock (every slice advances it alike).

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> from pytensor_ml.pytensorf import collect_trainable_params
    >>> from pytensor_ml.layers import BatchNorm, Linear, Sequential
    >>> x = pt.matrix("x")
    >>> out = Sequential(Linear("fc", n_in=3, n_out=2), BatchNorm("bn", n_in=2))(x)
    >>> model_updates([out], {})          # a validation pass: observed, not advanced
    []
    >>> w = collect_trainable_params(out)[0]          # a step that trains on the output
    >>> sorted(s.name for s, _, _ in model_updates([], {w: w - out.sum()}))
    ['bn_running_mean', 'bn_running_var']
    """
    if writes_flat_gradient(updates):
        return []
    statistics = collect_non_trainable_updates(list(updates.values()), already_written=updates)
    written = {**updates, **statistics}
    clocks = collect_clock_updates([*outputs, *written.values()], already_written=written)
    return [(s, v, "avg") for s, v in statistics.items()] + [(c, v, "max") for c, v in clocks.items()]
