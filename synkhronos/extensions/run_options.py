"""The options of :func:`synkhronos.extensions.train.run`, grouped: the data order, the checks, the checkpoints.

Each group is a frozen dataclass that checks itself when it is made, so a
misuse is refused before any device runs. ``run`` takes them as
``order=``, ``checks=`` and ``checkpointing=``, or takes the same settings
as its keywords (``shuffle``, ``seed``, ``check_every``, ``on_check``,
``checkpoint_dir``, ``checkpoint_every``, ``resume``), which it gathers into
these groups.

Examples
--------
>>> Checkpointing("runs/mlp", every=100, resume=True)
Checkpointing(directory='runs/mlp', every=100, resume=True)
>>> DataOrder(seed=-1)
Traceback (most recent call last):
...
ValueError: seed must be a whole number >= 0 (it seeds numpy's generator of every epoch's order), got -1
>>> order, checks, checkpointing = options_of(None, None, None, {"seed": 3, "checkpoint_dir": "runs/mlp",
...                                                               "checkpoint_every": 50})
>>> order, checkpointing.every
(DataOrder(shuffle=True, seed=3), 50)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from ..api.checkpoint import Checkpointing
from ..errors import is_whole
from ..seams.rule import flag, settle

__all__ = ["DataOrder", "Checks", "Checkpointing", "RunShorthands", "options_of"]


@dataclass(frozen=True)
class DataOrder:
    """Which rows every global step takes: a seeded permutation per epoch, or the rows in order.

    Parameters
    ----------
    shuffle : bool
        Visit the rows in a seeded permutation per epoch (else in order).
    seed : int
        Seeds numpy's generator of every epoch's order (a whole number >= 0).
    """

    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_whole(self.seed, at_least=0):
            raise ValueError(f"seed must be a whole number >= 0 (it seeds numpy's generator of every "
                             f"epoch's order), got {self.seed!r}")
        settle(self, "shuffle", flag(self.shuffle, "shuffle", "DataOrder"))
        settle(self, "seed", int(self.seed))


@dataclass(frozen=True)
class Checks:
    """When the master wakes during a run, and what it calls then.

    Parameters
    ----------
    every : int, optional
        Global steps between checks (default: one epoch).
    on_check : callable, optional
        ``on_check(history) -> bool``; True stops the run.
    """

    every: int | None = None
    on_check: Callable[[Any], bool | None] | None = None

    def __post_init__(self) -> None:
        if self.every is not None and not is_whole(self.every, at_least=1):
            raise ValueError(f"check_every must be a positive number of steps or None, got {self.every!r}")
        if self.on_check is not None and not callable(self.on_check):
            raise TypeError(f"on_check must be a callable taking the History, got {self.on_check!r}")


class RunShorthands(TypedDict, total=False):
    """The keywords of :func:`~synkhronos.extensions.train.run` that stand for the groups' settings."""

    shuffle: bool
    seed: int
    check_every: int | None
    on_check: Callable[[Any], bool | None] | None
    checkpoint_dir: str | os.PathLike | None
    checkpoint_every: int | None
    resume: bool


_GROUP_OF = {"shuffle": "order", "seed": "order", "check_every": "checks", "on_check": "checks",
             "checkpoint_dir": "checkpointing", "checkpoint_every": "checkpointing", "resume": "checkpointing"}


def options_of(order: DataOrder | None, checks: Checks | None, checkpointing: Checkpointing | None,
               shorthands: dict) -> tuple[DataOrder, Checks, Checkpointing | None]:
    """The run's groups, from the groups given and the keywords standing for them (not both)."""
    unknown = sorted(set(shorthands) - set(_GROUP_OF))
    if unknown:
        raise TypeError(f"run() got unexpected keyword arguments {unknown}")
    given = {"order": order, "checks": checks, "checkpointing": checkpointing}
    both = sorted({f"{k} and {_GROUP_OF[k]}=" for k in shorthands if given[_GROUP_OF[k]] is not None})
    if both:
        raise TypeError(f"run() got {', '.join(both)}: give a setting either as its keyword or in "
                        f"its group, not both")
    for name, kind in (("order", DataOrder), ("checks", Checks), ("checkpointing", Checkpointing)):
        if given[name] is not None and not isinstance(given[name], kind):
            raise TypeError(f"{name}= takes a {kind.__name__}, got {given[name]!r}")
    s = shorthands
    if order is None:
        order = DataOrder(s.get("shuffle", True), s.get("seed", 0))
    if checks is None:
        checks = Checks(s.get("check_every"), s.get("on_check"))
    if checkpointing is None and s.get("checkpoint_dir") is not None:
        checkpointing = Checkpointing(s["checkpoint_dir"], s.get("checkpoint_every"),  # type: ignore[arg-type]
                                      s.get("resume", False))           # None: refused, naming the keyword
    elif checkpointing is None and (s.get("checkpoint_every") is not None or s.get("resume")):
        raise ValueError("checkpoint_every= and resume= need checkpoint_dir=")
    return order, checks, checkpointing
