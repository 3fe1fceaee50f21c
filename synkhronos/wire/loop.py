"""A device-driven training loop as it travels: what to run, on which data, in which order.

The master pickles a :class:`LoopSpec` into the payload of every ``LOOP``
command, with the phase (``run`` steps ``[first, last)``, or ``finish``);
every rank runs it in :class:`synkhronos.rank.loop.DeviceLoop`. The order of
the rows is a pure function of (rows, epoch, seed), so every rank computes
the same order without anything else travelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..ipc.buffers import ceil_div
from ..seams.rule import Rule

if TYPE_CHECKING:
    from .plan import InputRef

__all__ = ["LoopSpec", "LoopStats", "epoch_order", "steps_per_epoch", "STAT_FIELDS"]


@dataclass(frozen=True)
class LoopSpec:
    """What every rank needs to run a loop (see ``synkhronos.extensions.train.run``).

    Attributes
    ----------
    loop_id : int
        Unique within the runtime (names the center's segment).
    grad_fid, update_fid : int
        The training step's gradient and update functions.
    grad_uid : int
        The flat gradient's shared variable.
    param_uids, stat_uids, state_uids : tuple of int
        The parameters, the model's statistics (batch norm's running mean and
        variance), and the optimizer's other state the update function changes.
        The rules keep the statistics with the parameters.
    inputs : tuple of InputRef
        The step's scattered inputs (inputs, then targets), one row each per example.
    batch_size : int
        Rows in one global step (split over the devices as in a call).
    shuffle : bool
    seed : int
    rule : Rule
        The sync rule (:mod:`synkhronos.rank.sync`).
    center : str or None
        The segment of the central parameters (asynchronous rules).
    rule_state : tuple of numpy.ndarray or None
        A resumed run's rule state, as a checkpoint kept it (see ``Rule.saved_state``); None
        starts the rule afresh.
    """

    loop_id: int
    grad_fid: int
    update_fid: int
    grad_uid: int
    param_uids: tuple[int, ...]
    stat_uids: tuple[int, ...]
    state_uids: tuple[int, ...]
    inputs: tuple[InputRef, ...]
    batch_size: int
    shuffle: bool
    seed: int
    rule: Rule
    center: str | None = None
    rule_state: tuple[np.ndarray, ...] | None = None

    @property
    def synced_uids(self) -> tuple[int, ...]:
        """What the rule keeps together: the parameters, then the model's statistics."""
        return self.param_uids + self.stat_uids

    @property
    def n_rows(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.n_rows, self.batch_size)


#: what each rank reports after a phase, in this order (one float64 array)
STAT_FIELDS = ("steps", "rows", "loss_sum", "sync_seconds", "busy_seconds", "syncs", "skipped")


class LoopStats:
    """One rank's counters over one phase, as the float64 array it reports (``STAT_FIELDS``)."""

    STEPS, ROWS, LOSS_SUM, SYNC_SECONDS, BUSY_SECONDS, SYNCS, SKIPPED = range(len(STAT_FIELDS))

    def __init__(self) -> None:
        self.values = np.zeros(len(STAT_FIELDS))


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    """Global steps in one pass over ``n_rows`` (the last one takes what is left).

    Examples
    --------
    >>> steps_per_epoch(10, 4)
    3
    """
    return ceil_div(n_rows, batch_size)


def epoch_order(n_rows: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the rows: a seeded permutation, or 0..n-1.

    Global step ``i`` of the epoch takes positions ``[i * B, (i + 1) * B)`` of
    it. The master-driven loop that a run with ``AllReduce()`` equals is::

        for epoch in range(epochs):
            order = epoch_order(len(x), epoch, seed)
            for i in range(steps_per_epoch(len(x), B)):
                train_fn(x, y, batch=order[i * B:(i + 1) * B])

    Examples
    --------
    >>> epoch_order(5, 0, 0, shuffle=False).tolist()
    [0, 1, 2, 3, 4]
    >>> sorted(epoch_order(5, 3, 7).tolist())
    [0, 1, 2, 3, 4]
    """
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_rows).astype(np.int64)
