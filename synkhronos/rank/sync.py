r"""How the devices of a device-driven loop keep their parameters together: the sync rules.

A rule is a small picklable object the user builds (``sync=EASGD(0.5, every=4)``);
every rank runs its hooks inside :class:`~synkhronos.rank.loop.DeviceLoop`:
``start`` once, ``after_update`` after each local step (the rule decides when
to synchronise, and says whether it did), ``finish`` once at the end, leaving
every device with the same final parameters.

Synchronous rules (every device steps at once, through the collective
implementation): :class:`AllReduce`, :class:`Average`, :class:`DiLoCo`, :class:`EASGD`.
Asynchronous rules (each device at its own pace, through central parameters in
node 0's shared memory, :class:`~synkhronos.rank.center.Center`, which node 0
serves to the devices of other nodes,
:mod:`~synkhronos.rank.center_server`): :class:`EASGD` with
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

import copy
import time

import numpy as np

from ..errors import is_whole
from ..platform.values import stored
from ..wire.batch import chunk
from .seams import RuleLoop

__all__ = ["Rule", "AllReduce", "Average", "DiLoCo", "EASGD", "Downpour", "RateLimited"]


def _positive_int(value, name, rule):
    if not is_whole(value, at_least=1):
        raise ValueError(f"{rule}: {name} must be a positive whole number of steps, got {value!r}")
    return int(value)


def _number(value, name, rule):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{rule}: {name} must be a number, got {value!r}") from None


def _positive_number(value, name, rule):
    value = _number(value, name, rule)
    if not value > 0 or not np.isfinite(value):
        raise ValueError(f"{rule}: {name} must be a positive number, got {value!r}")
    return value


def _fraction(value, name, rule, low_open=False):
    value = _number(value, name, rule)
    if not (0 < value <= 1 if low_open else 0 <= value <= 1):
        bounds = "in (0, 1]" if low_open else "in [0, 1]"
        raise ValueError(f"{rule}: {name} must be {bounds}, got {value!r}")
    return value


class Rule:
    """Base of the sync rules: what a device does around its local steps.

    Attributes
    ----------
    asynchronous : bool
        Devices step at their own pace and exchange with central parameters
        (in node 0's shared memory, served to the other nodes); else they step
        together.
    reduces_gradient : bool
        The flat gradient is all-reduced (row-weighted) before every update;
        else every device steps on its own gradient.
    """

    asynchronous = False
    reduces_gradient = False

    def start(self, loop: RuleLoop):
        """Every rank, before its first step of a run."""

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        """Every rank, after each local step of ``rows`` of a global batch of ``batch_rows``.

        Returns True if the rank synchronised (the time is counted as syncing).
        """
        return False

    def finish(self, loop: RuleLoop):
        """Every rank, once every rank's last step is done: leave the final parameters.

        A centred rule's devices all take the center.
        """
        center = self.center_values(loop)
        if center is not None:
            loop.set_values(loop.params, center)

    def center_values(self, loop: RuleLoop):
        """The center's values now (copies), or None for a rule without one."""
        return None

    def saved_state(self, loop: RuleLoop):
        """What a checkpoint keeps of this rule beside the variables (arrays, the same on every device)."""
        return []

    def resumed(self, arrays):
        """This rule, to start from ``arrays`` (what :meth:`saved_state` gave) instead of afresh."""
        return self

    def _settings(self):
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self._settings() == other._settings()

    __hash__ = None  # type: ignore[assignment]  # rules compare by settings: unhashable


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

    def __init__(self, every=1, state=False):
        self.every = _positive_int(every, "every", "Average")
        self.state = bool(state)

    def start(self, loop: RuleLoop):
        self._steps = self._mine = self._all = 0

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        self._steps += 1
        self._mine += rows
        self._all += batch_rows
        if self._steps < self.every:
            return False
        self._average(loop)
        return True

    def _average(self, loop: RuleLoop):
        weight = self._mine / self._all
        variables = loop.params + (loop.state_vars if self.state else [])
        values = [np.asarray(stored(v)) * weight for v in variables]
        loop.set_values(variables, loop.all_reduce(variables, values, "sum"))
        self._steps = self._mine = self._all = 0

    def finish(self, loop: RuleLoop):
        if self._steps:
            self._average(loop)


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
    ``outer_momentum=0`` it is :class:`Average` ``(every=H)``.

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

    def __init__(self, every=500, outer_lr=0.7, outer_momentum=0.9, nesterov=True):
        self.every = _positive_int(every, "every", "DiLoCo")
        self.outer_lr = _positive_number(outer_lr, "outer_lr", "DiLoCo")
        self.outer_momentum = _fraction(outer_momentum, "outer_momentum", "DiLoCo")
        if self.outer_momentum == 1:
            raise ValueError("DiLoCo: outer_momentum must be below 1, got 1.0")
        self.nesterov = bool(nesterov)

    #: a resumed rule's state, as :meth:`state_arrays` gave it (None: a fresh start)
    _saved: list | None = None

    def start(self, loop: RuleLoop):
        saved = self._saved
        if saved is not None:        # resumed: the round so far, the outer parameters and momentum
            self._steps, self._rows = int(saved[0][0]), np.array(saved[1], np.int64)
            half = (len(saved) - 2) // 2
            self._outer = [np.array(a) for a in saved[2:2 + half]]
            self._velocity = [np.array(a) for a in saved[2 + half:]]
            return
        self._steps, self._rows = 0, np.zeros(loop.n_ranks, np.int64)
        n = len(loop.params) - loop.n_statistics
        self._outer = [np.array(v) for v in loop.broadcast_from_master(loop.param_values()[:n])]
        self._velocity = [np.zeros_like(v) for v in self._outer]

    def saved_state(self, loop: RuleLoop):
        # every rank's rows of the round so far, so that each resumes with its own weight
        return ([np.array([self._steps], np.int64), self._rows.copy()]
                + [t.copy() for t in self._outer] + [v.copy() for v in self._velocity])

    def resumed(self, arrays):
        rule = copy.copy(self)
        rule._saved = [np.array(a) for a in arrays]
        return rule

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        self._steps += 1
        self._rows += [b - a for a, b in (chunk(0, batch_rows, loop.n_ranks, r) for r in range(loop.n_ranks))]
        if self._steps < self.every:
            return False
        self._outer_step(loop)
        return True

    def _outer_step(self, loop: RuleLoop):
        weight = self._rows[loop.rank] / self._rows.sum()
        local = loop.param_values()
        mean = loop.all_reduce(loop.params, [x * weight for x in local], "sum")
        n = len(self._outer)
        for theta, v, m in zip(self._outer, self._velocity, mean[:n]):
            delta = theta - np.asarray(m, theta.dtype)
            v *= self.outer_momentum
            v += delta
            theta -= self.outer_lr * (delta + self.outer_momentum * v if self.nesterov else v)
        loop.set_values(loop.params, [t.copy() for t in self._outer] + list(mean[n:]))
        self._steps, self._rows = 0, np.zeros_like(self._rows)

    def finish(self, loop: RuleLoop):
        if self._steps:
            self._outer_step(loop)


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

    def __init__(self, alpha=0.5, every=1, asynchronous=False):
        self.alpha = _fraction(alpha, "alpha", "EASGD")
        self.every = _positive_int(every, "every", "EASGD")
        self.asynchronous = bool(asynchronous)

    def start(self, loop: RuleLoop):
        self._steps = 0
        if not self.asynchronous:     # every rank keeps the same center, from the master's values
            self._center = [np.array(v) for v in loop.broadcast_from_master(loop.param_values())]

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        self._steps += 1
        if self._steps % self.every:
            return False
        if self.asynchronous:
            self._exchange_with_center(loop)
        else:
            self._exchange_together(loop)
        return True

    def _exchange_together(self, loop: RuleLoop):
        local = loop.param_values()
        pulls = [self.alpha * (x - c) for x, c in zip(local, self._center)]
        loop.set_values(loop.params, [x - d for x, d in zip(local, pulls)])
        for c, total in zip(self._center, loop.all_reduce(loop.params, pulls, "sum")):
            c += np.asarray(total, c.dtype)

    def _exchange_with_center(self, loop: RuleLoop):
        local = loop.param_values()
        pulls = loop.center.exchange(local, np.asarray)
        loop.set_values(loop.params, [x - d for x, d in zip(local, pulls)])

    def merge(self, center, local):
        """Asynchronous: device values ``local`` meet the center (in place); returns the device's pull."""
        pull = self.alpha * (local - center)
        center += pull
        return pull

    def center_values(self, loop: RuleLoop):
        return loop.center.values() if self.asynchronous else [c.copy() for c in self._center]


class _CentralRule(Rule):
    """An asynchronous rule whose devices push to and pull from central parameters."""

    asynchronous = True

    def center_values(self, loop: RuleLoop):
        return loop.center.values()

    @staticmethod
    def _push_and_pull(loop: RuleLoop, pushes):
        """Every parameter block: the rule's :meth:`merge` of ``pushes[i]`` into the center, then the
        device takes the center. Returns the pulled device arrays."""
        pulled = loop.center.exchange(pushes, loop.device_copy)
        loop.set_values(loop.params, pulled)
        return pulled

    def merge(self, center, pushed):
        """Apply a device's push ``pushed`` to a center block ``center`` in place; return the block."""
        raise NotImplementedError


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

    def __init__(self, every=1):
        self.every = _positive_int(every, "every", "Downpour")

    def start(self, loop: RuleLoop):
        self._steps = 0
        self._pulled = [stored(v) for v in loop.params]

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        self._steps += 1
        if self._steps % self.every:
            return False
        updates = [x - np.asarray(last) for x, last in zip(loop.param_values(), self._pulled)]
        first_statistic = len(updates) - loop.n_statistics
        for i in range(first_statistic, len(updates)):
            updates[i] /= loop.n_ranks
        self._pulled = self._push_and_pull(loop, updates)
        return True

    def merge(self, center, pushed):
        center += pushed
        return center
        return center


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

    def __init__(self, every_n_batches=1, alpha=0.5, beta=0.5, max_rate=0.25):
        self.every_n_batches = _positive_int(every_n_batches, "every_n_batches", "RateLimited")
        self.alpha = _fraction(alpha, "alpha", "RateLimited")
        self.beta = _fraction(beta, "beta", "RateLimited")
        self.max_rate = _fraction(max_rate, "max_rate", "RateLimited", low_open=True)

    def start(self, loop: RuleLoop):
        self._steps = 0
        self._last_cost = 0.0

    def after_update(self, loop: RuleLoop, rows, batch_rows):
        self._steps += 1
        if self._steps % self.every_n_batches:
            return False
        cost = self._last_cost
        if loop.sync_seconds + cost > self.max_rate * (loop.elapsed() + cost):
            loop.skipped += 1
            return False
        start = time.perf_counter()
        self._push_and_pull(loop, [self.beta * x for x in loop.param_values()])
        self._last_cost = time.perf_counter() - start
        return True

    def merge(self, center, pushed):
        center *= self.alpha
        center += pushed
        return center
