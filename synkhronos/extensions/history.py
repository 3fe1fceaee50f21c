"""What a device-driven run reports at every check: :class:`History`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike

from ..errors import warn

if TYPE_CHECKING:
    from ..rank.rule import Rule

__all__ = ["History", "Check", "Resize"]


@dataclass(frozen=True)
class Check:
    """One check of a run: the steps since the previous one, summed over every device.

    Attributes
    ----------
    step : int
        Global steps done (an asynchronous rule's minibatches, over the number of devices).
    epoch : float
        Passes over the training rows done.
    time : float
        Seconds of training so far (``on_check`` excluded).
    loss : float
        Mean training loss over the rows trained on since the previous check.
    samples_per_s : float
        Rows trained on since the previous check, per second, by all devices together.
    sync_fraction : float
        The fraction of its time a device spent syncing (mean over devices).
    syncs : int
        Gradient all-reduces, averages or exchanges made, over all devices.
    skipped : int
        Syncs a rate-limited rule skipped.
    rows_per_device : tuple of int
        Rows each device trained on since the previous check.
    """

    step: int
    epoch: float
    time: float
    loss: float
    samples_per_s: float
    sync_fraction: float
    syncs: int
    skipped: int
    rows_per_device: tuple


class Resize(NamedTuple):
    """A run resumed at global step ``step`` on other nodes or devices than its checkpoint's."""

    step: int
    nodes_before: int | None
    nodes_after: int
    devices_before: int
    devices_after: int


class History:
    """The checks of a run, in order; ``history["loss"]`` is one field over every check.

    ``on_check(history)`` receives it after every check; :meth:`center_values`
    then reads the current central parameters.

    Examples
    --------
    >>> from synkhronos.extensions.history import Resize
    >>> h = History("AllReduce()")
    >>> h.append(Check(10, 1.0, 0.5, 0.7, 2560.0, 0.1, 10, 0, (640, 640)))
    >>> len(h), h["loss"], h[-1].step
    (1, [0.7], 10)
    >>> h.lose_node(1, step=14); h.lost_nodes
    [(14, 1)]
    >>> h.resize(Resize(step=60, nodes_before=3, nodes_after=2, devices_before=3, devices_after=2))
    >>> h.resizes[0].nodes_after
    2

    Attributes
    ----------
    checks : list of Check
    lost_nodes : list of (int, int)
        ``(step, node)`` for every node an asynchronous run went on without:
        found lost in the phase that ended at global step ``step``.
    resizes : list of Resize
        A resumed run on another number of nodes or devices than its
        checkpoint was written on (an elastic run that lost or gained a node).
    """

    def __init__(self, rule: Rule | str, center_values: Callable[[], list] | None = None) -> None:
        self.rule = rule
        self.checks: list[Check] = []
        self.lost_nodes: list[tuple[int, int]] = []
        self.resizes: list[Resize] = []
        self._center_values = center_values

    def append(self, check: Check) -> None:
        self.checks.append(check)

    def lose_node(self, node: int, step: int) -> None:
        """Record that the run went on without ``node`` from the phase ending at ``step``."""
        self.lost_nodes.append((int(step), int(node)))

    def lose_nodes(self, lost: set, step: int) -> None:
        """The run went on without the nodes in ``lost``: record the new ones, warn naming each."""
        for node in sorted(lost - {n for _, n in self.lost_nodes}):
            self.lose_node(node, step)
            warn(f"train.run: node {node} was lost (not heard from) by step {step}; the "
                 f"asynchronous run goes on with the other nodes, and the minibatches its "
                 f"devices had claimed are not trained on")

    def resize(self, change: Resize) -> None:
        """Record that the run resumed on another set of nodes or devices, and warn once saying so."""
        self.resizes.append(change)
        nodes = (f"{change.nodes_before} to {change.nodes_after} nodes, "
                 if change.nodes_before is not None and change.nodes_before != change.nodes_after else "")
        warn(f"train.run: resumed at step {change.step} on {nodes}{change.devices_before} to "
             f"{change.devices_after} devices from its checkpoint: the same global batch and "
             f"data order go on, split over the devices there are")

    def __len__(self) -> int:
        return len(self.checks)

    def __iter__(self) -> Iterator[Check]:
        return iter(self.checks)

    @overload
    def __getitem__(self, key: str) -> list[Any]: ...
    @overload
    def __getitem__(self, key: int) -> Check: ...
    @overload
    def __getitem__(self, key: slice) -> list[Check]: ...

    def __getitem__(self, key: str | int | slice) -> list[Any] | Check | list[Check]:
        if isinstance(key, str):
            return [getattr(c, key) for c in self.checks]
        return self.checks[key]

    def __repr__(self) -> str:
        last = f", last {asdict(self.checks[-1])}" if self.checks else ""
        lost = f", lost nodes {self.lost_nodes}" if self.lost_nodes else ""
        return f"History({self.rule}, {len(self)} checks{lost}{last})"

    def end_run(self) -> None:
        """The run has ended: the center is gone (the devices hold the final parameters)."""
        self._center_values = None

    def center_values(self) -> list:
        """The central parameters now (asynchronous rules), else the master's parameters.

        Each parameter block is read under its lock, a copy at a time: the
        devices never wait longer than one block's copy. Valid during the run
        (in ``on_check``).
        """
        if self._center_values is None:
            raise RuntimeError("the run has ended; read the parameters with synk.get_value")
        return self._center_values()

    def plot(self, path: str, title: str | None = None) -> None:
        """Write the loss and the samples per second against training time to the PNG ``path``."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        a.plot(self["time"], self["loss"], marker=".")
        a.set_xlabel("training time (s)"), a.set_ylabel("mean train loss")
        b.plot(self["time"], self["samples_per_s"], marker=".", color="tab:green")
        b.set_xlabel("training time (s)"), b.set_ylabel("samples/s")
        b.set_ylim(bottom=0)
        fig.suptitle(title or str(self.rule))
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def check_from_stats(stats: ArrayLike, step: int, steps_per_epoch: float, elapsed: float,
                     seconds: float) -> Check:
    """A :class:`Check` from every rank's counters of one phase (``LoopStats`` rows).

    ``seconds`` is the phase's wall time, ``elapsed`` the training time so far.
    """
    steps, rows, loss_sum, sync_s, busy_s, syncs, skipped = np.asarray(stats).T
    total = rows.sum()
    return Check(step=int(step), epoch=step / steps_per_epoch, time=float(elapsed),
                 loss=float(loss_sum.sum() / total) if total else float("nan"),
                 samples_per_s=float(total / seconds) if seconds > 0 else 0.0,
                 sync_fraction=float(np.mean(sync_s / np.maximum(busy_s, 1e-12))),
                 syncs=int(syncs.sum()), skipped=int(skipped.sum()),
                 rows_per_device=tuple(int(r) for r in rows))
