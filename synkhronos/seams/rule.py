"""What a sync rule is: settings in a frozen dataclass, and one rank's state apart from them.

:class:`Rule` is the base every rule of :mod:`synkhronos.rank.sync` derives
from; its hooks are what :class:`~synkhronos.rank.loop.DeviceLoop` calls on
every rank. :func:`rule_record` and :func:`rule_difference` are what a
checkpoint keeps of a rule, and how a resume with other settings is named.
"""

from __future__ import annotations

import inspect
import json
import sys
from dataclasses import dataclass, fields
from typing import Any

import cloudpickle
import numpy as np

from ..errors import is_whole
from .loop import RuleLoop

__all__ = ["Rule", "RuleState", "rule_record", "rule_difference", "check_rule", "steps_before_sync"]


def positive_int(value: Any, name: str, rule: str) -> int:
    if not is_whole(value, at_least=1):
        raise ValueError(f"{rule}: {name} must be a positive whole number of steps, got {value!r}")
    return int(value)


def number(value: Any, name: str, rule: str) -> float:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{rule}: {name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{rule}: {name} must be a number, got {value!r}") from None


def positive_number(value: Any, name: str, rule: str) -> float:
    value = number(value, name, rule)
    if not value > 0 or not np.isfinite(value):
        raise ValueError(f"{rule}: {name} must be a positive number, got {value!r}")
    return value


def fraction(value: Any, name: str, rule: str, low_open: bool = False) -> float:
    value = number(value, name, rule)
    if not (0 < value <= 1 if low_open else 0 <= value <= 1):
        bounds = "in (0, 1]" if low_open else "in [0, 1]"
        raise ValueError(f"{rule}: {name} must be {bounds}, got {value!r}")
    return value


def flag(value: Any, name: str, rule: str) -> bool:
    """``value`` as a bool: a bool, or the whole numbers 0 and 1 (a string such as 'False' is refused)."""
    if isinstance(value, (bool, np.bool_)) or (is_whole(value) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{rule}: {name} must be True or False, got {value!r}")


def settle(rule: object, name: str, value: Any) -> None:
    """Settle a checked setting on a frozen rule (in ``__post_init__``)."""
    object.__setattr__(rule, name, value)


@dataclass
class RuleState:
    """One rank's state of a rule during a run: what :meth:`Rule.start` makes and the hooks change.

    A rule's own state derives from it; a mixin may keep its own attributes on it.

    Attributes
    ----------
    steps : int
        Local steps since the rule last synchronised (or since the start).
    """

    steps: int = 0


@dataclass(frozen=True)
class Rule:
    """Base of the sync rules: settings only, and what a device does around its local steps.

    A rule is a frozen dataclass: its fields are its settings (compared,
    printed, recorded in checkpoints). Everything a rank changes during a run
    lives in the :class:`RuleState` that :meth:`start` makes, which every hook
    receives. A rule of your own derives from :class:`Rule` (or a rule here),
    is decorated ``@dataclass(frozen=True)``, and uses nothing of the loop but
    :class:`~synkhronos.seams.loop.RuleLoop`.

    The hooks, each run on every rank (override those the rule needs):

    - ``start(loop) -> RuleState``: before the first step of a run;
    - ``resume(loop, saved) -> RuleState``: instead, in a run resumed from a
      checkpoint holding ``saved`` (what ``saved_state`` gave; default: ``start``);
    - ``after_update(state, loop, rows, batch_rows) -> bool``: after each local
      step of ``rows`` of a global batch of ``batch_rows``; True if it synchronised;
    - ``steps_to_sync(state) -> int | None``: the local steps before the next one
      after which it may synchronise (the loop runs them as one program);
    - ``finish(state, loop)``: once every rank's last step is done, leaving the
      final parameters (default: the center's, for a rule with one);
    - ``center_values(state, loop)``: the center's values now, or None;
    - ``saved_state(state, loop) -> list``: the arrays a checkpoint keeps (the
      same on every device); ``check_saved(saved, n_ranks, n_params)`` refuses,
      on the master, a resume those arrays cannot serve.

    An asynchronous rule also declares ``merge(center, pushed)``: how one
    device's push meets a block of the center, on node 0 (under that block's
    lock, in its shared memory or its server for the other nodes). Node 0's
    server rebuilds the rule itself, so a rule of your own merges there as here.

    Attributes
    ----------
    asynchronous : bool
        Devices step at their own pace and exchange with central parameters
        (in node 0's shared memory, served to the other nodes); else they step
        together.
    reduces_gradient : bool
        The flat gradient is all-reduced (row-weighted) before every update;
        else every device steps on its own gradient.
    saves_center : bool
        The rule has a center that is the run's parameters: a checkpoint keeps
        it (:meth:`saved_state` gives :meth:`center_values`) and a resumed run
        starts every device from it, on any number of devices.

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class EveryOther(Rule):          # average the parameters every other step
    ...     def after_update(self, state, loop, rows, batch_rows):
    ...         state.steps += 1
    ...         if state.steps % 2:
    ...             return False
    ...         mean = loop.all_reduce(loop.params, loop.param_values(), "avg")
    ...         loop.set_values(loop.params, mean)
    ...         return True
    >>> EveryOther() == EveryOther(), rule_record(EveryOther())["type"]
    (True, 'EveryOther')
    """

    asynchronous = False
    reduces_gradient = False
    saves_center = False

    def start(self, loop: RuleLoop) -> RuleState:
        """Every rank, before its first step of a run: this rank's state."""
        return RuleState()

    def resume(self, loop: RuleLoop, saved: list) -> RuleState:
        """Every rank, before its first step of a resumed run: the state ``saved`` (what
        :meth:`saved_state` gave) holds. A rule that saves nothing starts afresh."""
        return self.start(loop)

    def after_update(self, state: Any, loop: RuleLoop, rows: int, batch_rows: int) -> bool:
        """Every rank, after each local step of ``rows`` of a global batch of ``batch_rows``.

        Returns True if the rank synchronised (the time is counted as syncing).
        """
        return False

    def steps_to_sync(self, state: Any) -> int | None:
        """Every rank, before a block of local steps: how many steps it may take before the next
        one after which :meth:`after_update` may synchronise (None: it never does).

        A loop on the devices runs that many steps as one program
        (:class:`~synkhronos.rank.fused.BlockProgram`), then calls
        :meth:`after_update` for each of them: only the last may synchronise.
        A rule whose :meth:`after_update` is overridden below the class that
        defines this hook is asked after every step (:func:`steps_before_sync`).
        """
        return None

    def finish(self, state: Any, loop: RuleLoop) -> None:
        """Every rank, once every rank's last step is done: leave the final parameters.

        A centred rule's devices all take the center.
        """
        center = self.center_values(state, loop)
        if center is not None:
            loop.set_values(loop.params, center)

    def center_values(self, state: Any, loop: RuleLoop) -> list | None:
        """The center's values now (copies), or None for a rule without one."""
        return None

    def check_saved(self, saved: list, n_ranks: int, n_params: int) -> None:
        """On the master, before a resumed run starts anything: raise ValueError, naming the fix,
        unless ``saved`` (what :meth:`saved_state` gave) resumes on ``n_ranks`` devices training
        ``n_params`` parameters."""

    def merge(self, center: np.ndarray, pushed: np.ndarray) -> np.ndarray:
        """Asynchronous rules, on node 0: apply one device's push ``pushed`` to the center block
        ``center`` in place; return what the device takes back (the block, or a pull)."""
        raise NotImplementedError(f"{type(self).__name__} has no merge")

    def saved_state(self, state: Any, loop: RuleLoop) -> list:
        """What a checkpoint keeps of this rank's state beside the variables (arrays, the same on
        every device); :meth:`resume` takes it back. A rule that ``saves_center`` keeps its center."""
        return (self.center_values(state, loop) or []) if self.saves_center else []


def steps_before_sync(rule: Rule, state: Any) -> int | None:
    """The local steps ``rule`` lets a rank take before it may synchronise (see
    :meth:`Rule.steps_to_sync`): 1 where its ``after_update`` was overridden below the class whose
    ``steps_to_sync`` answers, which cannot know what the override does after each step.

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Clipped(Rule):
    ...     def after_update(self, state, loop, rows, batch_rows):
    ...         return False
    >>> steps_before_sync(Rule(), RuleState()), steps_before_sync(Clipped(), RuleState())
    (None, 1)
    """
    mro = type(rule).__mro__
    answers = next(c for c in mro if "steps_to_sync" in vars(c))
    updates = next(c for c in mro if "after_update" in vars(c))
    if updates is not answers and issubclass(updates, answers):
        return 1
    return rule.steps_to_sync(state)


def rule_record(rule: Rule) -> dict:
    """What a checkpoint records of ``rule``: its type and settings (JSON).

    Examples
    --------
    >>> from synkhronos.rank.sync import AllReduce, Average
    >>> rule_record(Average(every=4))
    {'type': 'Average', 'settings': {'every': 4, 'state': False}}
    """
    settings = {f.name: getattr(rule, f.name) for f in fields(rule)}
    # as JSON gives it back: a tuple as a list, a value JSON cannot hold as its repr (an array's
    # whole, which numpy's repr would cut short)
    return {"type": type(rule).__name__, "settings": json.loads(json.dumps(settings, default=_setting_text))}


def _setting_text(value: Any) -> str:
    """A setting JSON cannot hold, as text that tells any two different values apart."""
    if isinstance(value, np.ndarray):
        with np.printoptions(threshold=value.size + 1):
            return repr(value)
    return repr(value)


def rule_difference(recorded: dict, rule: Rule) -> str | None:
    """How ``rule`` differs from the record ``recorded`` (:func:`rule_record`), in words; None if not.

    Examples
    --------
    >>> from synkhronos.rank.sync import AllReduce, Average
    >>> rule_difference(rule_record(Average(every=4)), Average(every=8))
    'Average.every is 4 in the checkpoint, 8 here'
    >>> rule_difference(rule_record(Average()), AllReduce())
    'the rule is Average in the checkpoint, AllReduce here'
    """
    here = rule_record(rule)
    if recorded.get("type") != here["type"]:
        return f"the rule is {recorded.get('type')} in the checkpoint, {here['type']} here"
    saved, wanted = recorded.get("settings", {}), here["settings"]
    # compared as JSON text: a NaN setting equals itself
    differ = [f"{here['type']}.{k} is {saved.get(k)!r} in the checkpoint, {wanted.get(k)!r} here"
              for k in sorted(set(saved) | set(wanted))
              if json.dumps(saved.get(k)) != json.dumps(wanted.get(k))]
    return "; ".join(differ) or None


#: each hook's arguments after ``self``, as every rank calls it
HOOK_ARGUMENTS = {"start": "loop", "resume": "loop, saved", "after_update": "state, loop, rows, batch_rows",
                  "steps_to_sync": "state",
                  "finish": "state, loop", "center_values": "state, loop", "saved_state": "state, loop",
                  "check_saved": "saved, n_ranks, n_params", "merge": "center, pushed"}


def _check_hook_signatures(cls: type[Rule]) -> None:
    """Raise TypeError naming the hook whose own version takes other arguments than the loop gives."""
    for name, arguments in HOOK_ARGUMENTS.items():
        hook = getattr(cls, name, None)
        if hook is None or hook is getattr(Rule, name):
            continue
        try:
            params = list(inspect.signature(hook).parameters.values())[1:]      # after self
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            continue
        takes = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                 inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        needed = len(arguments.split(", "))
        if len(takes) < needed or any(p.default is inspect.Parameter.empty for p in takes[needed:]):
            raise TypeError(f"{cls.__name__}.{name} takes ({', '.join(p.name for p in takes)}), but every "
                            f"rank calls {name}(self, {arguments}): a rule's hooks receive this rank's "
                            f"RuleState (what start returns) before the loop (see sync.Rule)")


def _check_importable_elsewhere(cls: type) -> None:
    """Raise TypeError unless the workers can rebuild a rule of class ``cls``: cloudpickle sends a
    class of the script by value, and a class of a module by its name, which the workers import."""
    name = cls.__module__
    module = sys.modules.get(name)
    if name == "__main__" or module is None or getattr(module, "__spec__", None) is not None:
        return
    if name in getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", ()):
        return
    raise TypeError(f"{cls.__name__} is a class of the module {name!r}, made while this process ran "
                    f"(it has no import spec): the devices' processes cannot import it. Define the "
                    f"rule in the script or in a module on the path, or call "
                    f"cloudpickle.register_pickle_by_value({name}) before train.run")


def check_rule(rule: Any) -> None:
    """Raise TypeError naming the fix unless ``rule`` is a sync rule whose settings are all fields."""
    if not isinstance(rule, Rule):
        raise TypeError(f"sync must be a rule of synkhronos.extensions.sync (AllReduce(), "
                        f"EASGD(...), ...), got {rule!r}")
    _check_hook_signatures(type(rule))
    _check_importable_elsewhere(type(rule))
    if rule.asynchronous and type(rule).merge is Rule.merge:
        raise TypeError(f"{type(rule).__name__} is asynchronous but declares no merge(center, pushed): "
                        f"define how a device's push meets a center block, or derive from "
                        f"sync.Downpour, sync.EASGD or sync.RateLimited")
    loose = sorted(set(vars(rule)) - {f.name for f in fields(rule)})
    if loose:
        raise TypeError(f"{type(rule).__name__} keeps {loose} outside its settings: a rule is a frozen "
                        f"dataclass whose fields are its settings (decorate it with "
                        f"@dataclasses.dataclass(frozen=True) and declare them), and what a rank "
                        f"changes during a run belongs in the RuleState its start() returns")
