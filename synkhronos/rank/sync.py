r"""How the devices of a device-driven loop keep their parameters together: the sync rules.

A rule is a small picklable object the user builds (``sync=EASGD(0.5, every=4)``);
every rank runs its hooks inside :class:`~synkhronos.rank.loop.DeviceLoop`:
``start`` once, ``after_update`` after each local step (the rule decides when
to synchronise, and says whether it did), ``finish`` once at the end, leaving
every device with the same final parameters.

Synchronous rules (every device steps at once, through the collective
implementation): :class:`AllReduce`, :class:`Average`, :class:`DiLoCo`, :class:`EASGD`.
Asynchronous rules (each device at its own pace, through central parameters in
node 0's shared memory, :class:`~synkhronos.runtime.centers.shared.Center`, which node 0
serves to the devices of other nodes,
:mod:`~synkhronos.runtime.centers.server`): :class:`EASGD` with
``asynchronous=True``, :class:`Downpour`, :class:`RateLimited`. Each says in
:meth:`Downpour.merge` how a device's push changes a center block.

The maths, with :math:`x_r` the parameters of device :math:`r`, :math:`c` the
center and :math:`n` devices:

- AllReduce: :math:`g = \sum_r \frac{b_r}{B} g_r` every step (synchronous SGD).
- Average(every=k): every :math:`k` steps :math:`x_r \leftarrow \sum_q w_q x_q`,
  :math:`w_q` device :math:`q`'s share of the rows since the last average.
- DiLoCo(every=H, outer_lr, outer_momentum): every :math:`H` steps
  :math:`\Delta = \theta - \sum_r w_r x_r`, :math:`v \leftarrow \mu v + \Delta`,
  :math:`\theta \leftarrow \theta - \eta (\Delta + \mu v)`, :math:`x_r \leftarrow \theta`.
- EASGD(alpha, every=tau): every :math:`\tau` steps :math:`d_r = \alpha (x_r - c)`,
  :math:`x_r \leftarrow x_r - d_r`, :math:`c \leftarrow c + \sum_r d_r` (asynchronous:
  :math:`c \leftarrow c + d_r` by device :math:`r` alone, at its own pace).
- Downpour(every=k): every :math:`k` steps :math:`c \leftarrow c + (x_r - x_r^{pulled})`,
  :math:`x_r \leftarrow c` (a statistic's change divided by :math:`n`).

Every rule keeps the model's statistics (batch norm's running mean and
variance) with the parameters: averaged, elastic or central alike. Under
:class:`AllReduce` they travel in the flat vector and every device holds the
statistics of the whole global batch after every step
(:mod:`synkhronos.extensions.statistics`). Downpour pushes a statistic's
change divided by the number of devices: summed, the devices' moving averages
would move the central one :math:`n` times as fast.
- RateLimited(every_n_batches, alpha, beta, max_rate): every ``every_n_batches``
  steps, unless syncing would take more than ``max_rate`` of the device's time,
  :math:`c \leftarrow \alpha c + \beta x_r`, :math:`x_r \leftarrow c`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..platform.values import stored
from ..seams.loop import RuleLoop
from ..seams.rule import Rule, RuleState, flag, fraction, positive_int, positive_number, settle
from ..wire.batch import chunk

__all__ = ["Rule", "RuleState", "AllReduce", "Average", "DiLoCo", "EASGD", "Downpour", "RateLimited"]


@dataclass(frozen=True)
class AllReduce(Rule):
    """Synchronous SGD: the row-weighted flat gradient is all-reduced every step.

    The parameters equal, step for step, those of the master-driven loop
    calling ``train_fn(x, y, batch=order[i * B:(i + 1) * B])``.

    Examples
    --------
    >>> AllReduce()
    AllReduce()
    """

    reduces_gradient = True


@dataclass
class _Rows(RuleState):
    """Steps and rows since the last average: this rank's, and the global batches'."""

    mine: int = 0
    all: int = 0


@dataclass(frozen=True)
class Average(Rule):
    """BSP weight averaging, or local SGD (Theano-MPI's ``avg_freq``).

    Each device steps on its own gradient; every ``every`` steps the
    parameters (and, with ``state=True``, the optimizer's state) are
    averaged, each device weighted by the rows it trained on since the last
    average. ``Average(every=1)`` with plain SGD is :class:`AllReduce`.

    Parameters
    ----------
    every : int
        Local steps between averages.
    state : bool
        Average the optimizer's state (momenta, moments) too.

    Examples
    --------
    >>> Average(every=4)
    Average(every=4, state=False)
    """

    every: int = 1
    state: bool = False

    def __post_init__(self) -> None:
        settle(self, "every", positive_int(self.every, "every", "Average"))
        settle(self, "state", flag(self.state, "state", "Average"))

    def start(self, loop: RuleLoop) -> _Rows:
        return _Rows()

    def steps_to_sync(self, state: _Rows) -> int:
        return self.every - state.steps

    def after_update(self, state: _Rows, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps += 1
        state.mine += rows
        state.all += batch_rows
        if state.steps < self.every:
            return False
        self._average(state, loop)
        return True

    def _average(self, state: _Rows, loop: RuleLoop) -> None:
        weight = state.mine / state.all
        variables = loop.params + (loop.state_vars if self.state else [])
        values = [np.asarray(stored(v)) * weight for v in variables]
        averaged = loop.all_reduce(variables, values, "sum")
        # an integer variable (Adam's step count) takes the nearest integer: a weighted sum of
        # equal counts is the count give or take a rounding error, which a cast would truncate
        loop.set_values(variables, [np.rint(a) if np.dtype(v.type.dtype).kind in "iub" else a
                                    for v, a in zip(variables, averaged)])
        state.steps = state.mine = state.all = 0

    def finish(self, state: _Rows, loop: RuleLoop) -> None:
        if state.steps:
            self._average(state, loop)


@dataclass
class _Round(RuleState):
    """DiLoCo on one rank: every rank's rows of the round so far, the outer parameters and momentum."""

    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    outer: list = field(default_factory=list)
    velocity: list = field(default_factory=list)


@dataclass(frozen=True)
class DiLoCo(Rule):
    r"""DiLoCo (Douillard et al. 2023): local steps, then one outer Nesterov step on the devices' mean change.

    Every device runs ``every`` (:math:`H`) steps with the train function's
    own rule, the inner optimizer. Then, with :math:`\theta` the parameters
    every device held when the round began and :math:`w_r` device :math:`r`'s
    share of the round's rows, the outer gradient
    :math:`\Delta = \theta - \sum_r w_r x_r` is all-reduced once, and an outer
    SGD with momentum moves :math:`\theta` on every device alike:
    :math:`v \leftarrow \mu v + \Delta`, then
    :math:`\theta \leftarrow \theta - \eta (\Delta + \mu v)` (Nesterov) or
    :math:`\theta \leftarrow \theta - \eta v`. Every device goes on from
    :math:`\theta`. The model's statistics are averaged, row-weighted, as
    :class:`Average` averages them. A run whose steps end inside a round takes
    the outer step on that round's rows. With ``outer_lr=1`` and
    ``outer_momentum=0`` it is :class:`Average` ``(every=H)``. A checkpoint
    keeps the round, the outer parameters and the momentum.

    Parameters
    ----------
    every : int
        Inner steps per round (:math:`H`).
    outer_lr : float
        The outer learning rate :math:`\eta` (positive).
    outer_momentum : float
        The outer momentum :math:`\mu`, in [0, 1).
    nesterov : bool

    Examples
    --------
    >>> DiLoCo(every=50)
    DiLoCo(every=50, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    """

    every: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        settle(self, "every", positive_int(self.every, "every", "DiLoCo"))
        settle(self, "outer_lr", positive_number(self.outer_lr, "outer_lr", "DiLoCo"))
        settle(self, "outer_momentum", fraction(self.outer_momentum, "outer_momentum", "DiLoCo"))
        if self.outer_momentum == 1:
            raise ValueError("DiLoCo: outer_momentum must be below 1, got 1.0")
        settle(self, "nesterov", flag(self.nesterov, "nesterov", "DiLoCo"))

    def start(self, loop: RuleLoop) -> _Round:
        n = len(loop.params) - loop.n_statistics
        outer = [np.array(v) for v in loop.broadcast_from_master(loop.param_values()[:n])]
        return _Round(0, np.zeros(loop.n_ranks, np.int64), outer, [np.zeros_like(v) for v in outer])

    def resume(self, loop: RuleLoop, saved: list) -> _Round:
        if not saved:
            return self.start(loop)
        half = (len(saved) - 2) // 2
        rows = np.array(saved[1], np.int64)
        if len(rows) != loop.n_ranks:       # at a round's end (check_saved): no rows counted yet
            rows = np.zeros(loop.n_ranks, np.int64)
        return _Round(int(saved[0][0]), rows,
                      [np.array(a) for a in saved[2:2 + half]], [np.array(a) for a in saved[2 + half:]])

    def check_saved(self, saved: list, n_ranks: int, n_params: int) -> None:
        if not saved:
            return
        if len(saved) != 2 + 2 * n_params:
            raise ValueError(f"the checkpoint holds {len(saved)} arrays of DiLoCo's state, where a model "
                             f"of {n_params} parameters needs {2 + 2 * n_params}; it was written for "
                             f"another model: use another checkpoint_dir")
        steps, written_on = int(np.asarray(saved[0]).reshape(-1)[0]), len(np.asarray(saved[1]))
        if steps and written_on != n_ranks:
            devices = f"{written_on} device{'s' if written_on != 1 else ''}"
            raise ValueError(f"the checkpoint was written {steps} steps into a DiLoCo round on "
                             f"{devices}, and each device's share of the round's rows weighs its outer "
                             f"step: resume it on {devices}, or resume on {n_ranks} from a checkpoint "
                             f"saved at a round's end (checkpoint_every a multiple of "
                             f"every={self.every})")

    def saved_state(self, state: _Round, loop: RuleLoop) -> list:
        # every rank's rows of the round so far, so that each resumes with its own weight
        return ([np.array([state.steps], np.int64), state.rows.copy()]
                + [t.copy() for t in state.outer] + [v.copy() for v in state.velocity])

    def steps_to_sync(self, state: _Round) -> int:
        return self.every - state.steps

    def after_update(self, state: _Round, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps += 1
        state.rows += [b - a for a, b in (chunk(0, batch_rows, loop.n_ranks, r) for r in range(loop.n_ranks))]
        if state.steps < self.every:
            return False
        self._outer_step(state, loop)
        return True

    def _outer_step(self, state: _Round, loop: RuleLoop) -> None:
        weight = state.rows[loop.rank] / state.rows.sum()
        local = loop.param_values()
        mean = loop.all_reduce(loop.params, [x * weight for x in local], "sum")
        n = len(state.outer)
        for theta, v, m in zip(state.outer, state.velocity, mean[:n]):
            delta = theta - np.asarray(m, theta.dtype)
            v *= self.outer_momentum
            v += delta
            theta -= self.outer_lr * (delta + self.outer_momentum * v if self.nesterov else v)
        loop.set_values(loop.params, [t.copy() for t in state.outer] + list(mean[n:]))
        state.steps, state.rows = 0, np.zeros_like(state.rows)

    def finish(self, state: _Round, loop: RuleLoop) -> None:
        if state.steps:
            self._outer_step(state, loop)


@dataclass
class _Elastic(RuleState):
    """EASGD on one rank: the center every rank keeps alike (synchronous; None: node 0 holds it)."""

    center: list | None = None


@dataclass(frozen=True)
class EASGD(Rule):
    """Elastic averaging SGD (Zhang, Choromanska, LeCun 2015; Platoon, Theano-MPI).

    A center variable :math:`c` starts at the master's parameters. Every
    ``every`` local steps each device moves toward it by
    :math:`d = \\alpha (x - c)` and the center moves by the devices' pulls:
    all at once through the collective implementation (synchronous), or each
    device on its own with the center in shared memory (``asynchronous=True``).
    At the end every device holds the center.

    Parameters
    ----------
    alpha : float
        The elastic pull in [0, 1] (0: the devices train independently).
    every : int
        Local steps between exchanges (:math:`\\tau`).
    asynchronous : bool

    Examples
    --------
    >>> EASGD(0.5, every=4, asynchronous=True)
    EASGD(alpha=0.5, every=4, asynchronous=True)
    """

    saves_center = True

    alpha: float = 0.5
    every: int = 1
    asynchronous: bool = False

    def __post_init__(self) -> None:
        settle(self, "alpha", fraction(self.alpha, "alpha", "EASGD"))
        settle(self, "every", positive_int(self.every, "every", "EASGD"))
        settle(self, "asynchronous", flag(self.asynchronous, "asynchronous", "EASGD"))

    def start(self, loop: RuleLoop) -> _Elastic:
        if self.asynchronous:
            return _Elastic()
        # every rank keeps the same center, from the master's values
        return _Elastic(center=[np.array(v) for v in loop.broadcast_from_master(loop.param_values())])

    def steps_to_sync(self, state: _Elastic) -> int:
        return self.every - state.steps % self.every

    def after_update(self, state: _Elastic, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps += 1
        if state.steps % self.every:
            return False
        local = loop.param_values()
        if state.center is None:
            pulls = loop.center.exchange(local, np.asarray)
        else:
            pulls = [self.alpha * (x - c) for x, c in zip(local, state.center)]
        loop.set_values(loop.params, [x - d for x, d in zip(local, pulls)])
        if state.center is not None:
            for c, total in zip(state.center, loop.all_reduce(loop.params, pulls, "sum")):
                c += np.asarray(total, c.dtype)
        return True

    def merge(self, center: np.ndarray, pushed: np.ndarray) -> np.ndarray:
        """Asynchronous: the device values ``pushed`` meet the center (in place); returns the device's pull."""
        pull = self.alpha * (pushed - center)
        center += pull
        return pull

    def center_values(self, state: _Elastic, loop: RuleLoop) -> list:
        return loop.center.values() if state.center is None else [c.copy() for c in state.center]


@dataclass(frozen=True)
class _CentralRule(Rule):
    """An asynchronous rule whose devices push to and pull from central parameters."""

    asynchronous = True
    saves_center = True

    def center_values(self, state: Any, loop: RuleLoop) -> list:
        return loop.center.values()

    @staticmethod
    def _push_and_pull(loop: RuleLoop, pushes: Sequence[Any]) -> list:
        """Every parameter block: the rule's :meth:`merge` of ``pushes[i]`` into the center, then the
        device takes the center. Returns the pulled device arrays."""
        pulled = loop.center.exchange(pushes, loop.device_copy)
        loop.set_values(loop.params, pulled)
        return pulled


@dataclass
class _Pulled(RuleState):
    """Downpour on one rank: the values it last pulled from the center."""

    pulled: list = field(default_factory=list)


@dataclass(frozen=True)
class Downpour(_CentralRule):
    """Downpour SGD / ASGD with a parameter server (Dean et al. 2012; Legion, Platoon).

    Every ``every`` local steps a device adds the update it accumulated since
    its last pull to the central parameters and pulls them back, without
    waiting for any other device.

    Parameters
    ----------
    every : int
        Local steps between pushes.

    Examples
    --------
    >>> Downpour(every=2)
    Downpour(every=2)
    """

    every: int = 1

    def __post_init__(self) -> None:
        settle(self, "every", positive_int(self.every, "every", "Downpour"))

    def start(self, loop: RuleLoop) -> _Pulled:
        return _Pulled(pulled=[stored(v) for v in loop.params])

    def after_update(self, state: _Pulled, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps += 1
        if state.steps % self.every:
            return False
        updates = [x - np.asarray(last) for x, last in zip(loop.param_values(), state.pulled)]
        first_statistic = len(updates) - loop.n_statistics
        for i in range(first_statistic, len(updates)):
            updates[i] /= loop.n_ranks
        state.pulled = self._push_and_pull(loop, updates)
        return True

    def merge(self, center: np.ndarray, pushed: np.ndarray) -> np.ndarray:
        center += pushed
        return center


@dataclass
class _Costed(RuleState):
    """RateLimited on one rank: how long its last sync took."""

    last_cost: float = 0.0


@dataclass(frozen=True)
class RateLimited(_CentralRule):
    """Legion's ``SharedParamsRateLimited``: blend into the central parameters, at a capped rate.

    Every ``every_n_batches`` local steps a device pushes
    ``central = alpha * central + beta * local`` and pulls the result, unless
    that sync would bring the time it spent syncing above ``max_rate`` of its
    time in the run (it then skips this one).

    Parameters
    ----------
    every_n_batches : int
    alpha, beta : float
        Weights of the central and the local values.
    max_rate : float
        The largest fraction of a device's time spent syncing, in (0, 1].

    Examples
    --------
    >>> RateLimited(every_n_batches=2, max_rate=0.1)
    RateLimited(every_n_batches=2, alpha=0.5, beta=0.5, max_rate=0.1)
    """

    every_n_batches: int = 1
    alpha: float = 0.5
    beta: float = 0.5
    max_rate: float = 0.25

    def __post_init__(self) -> None:
        settle(self, "every_n_batches", positive_int(self.every_n_batches, "every_n_batches", "RateLimited"))
        settle(self, "alpha", fraction(self.alpha, "alpha", "RateLimited"))
        settle(self, "beta", fraction(self.beta, "beta", "RateLimited"))
        settle(self, "max_rate", fraction(self.max_rate, "max_rate", "RateLimited", low_open=True))

    def start(self, loop: RuleLoop) -> _Costed:
        return _Costed()

    def after_update(self, state: _Costed, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        state.steps += 1
        if state.steps % self.every_n_batches:
            return False
        cost = state.last_cost
        if loop.sync_seconds + cost > self.max_rate * (loop.elapsed() + cost):
            loop.skipped += 1
            return False
        start = time.perf_counter()
        self._push_and_pull(loop, [self.beta * x for x in loop.param_values()])
        state.last_cost = time.perf_counter() - start
        return True

    def merge(self, center: np.ndarray, pushed: np.ndarray) -> np.ndarray:
        center *= self.alpha
        center += pushed
        return center
