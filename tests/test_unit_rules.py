"""Unit tests of the sync rules (synkhronos.rank.sync) against an in-process fake of their loop.

Each fake rank is a :class:`FakeLoop` (the :class:`~synkhronos.seams.loop.RuleLoop` contract over
PyTensor shared variables holding numpy arrays); ranks of a synchronous rule run in lock-step
threads whose collectives combine what every rank gave, ranks of an asynchronous one share a
:class:`~tests.helpers.ListCenter`. Nothing forks, nothing touches JAX or shared memory.
"""

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytensor
import pytest
from helpers import ListCenter

from synkhronos.rank.sync import EASGD, AllReduce, Average, DiLoCo, Downpour, RateLimited
from synkhronos.seams.loop import CenterClient, RuleLoop
from synkhronos.seams.rule import Rule, check_rule, steps_before_sync

REDUCE: dict[str, Callable[[np.ndarray], np.ndarray]] = {"sum": lambda a: a.sum(0), "avg": lambda a: a.mean(0)}


class Group:
    """The collectives of ``n`` fake ranks in lock-step threads: each call sees what all gave."""

    def __init__(self, n: int) -> None:
        self.given: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=5)

    def everyone(self, rank: int, values: Sequence[Any]) -> list[list[np.ndarray]]:
        self.given[rank] = [np.array(v) for v in values]
        self.barrier.wait()
        seen = list(self.given)
        self.barrier.wait()             # nobody overwrites its slot before every rank has read
        return seen


class FakeLoop:
    """One rank's :class:`RuleLoop`: parameters in shared variables, a fake clock, fake collectives."""

    def __init__(self, rank: int, n_ranks: int, values: Sequence[Any], group: Group | None = None,
                 center: CenterClient | None = None, n_statistics: int = 0, state: Sequence[Any] = ()):
        self.rank, self.n_ranks, self.n_statistics = rank, n_ranks, n_statistics
        self.params = [pytensor.shared(np.array(v, float)) for v in values]
        self.state_vars = [pytensor.shared(np.array(v)) for v in state]
        self.sync_seconds, self.skipped, self.clock = 0.0, 0, 0.0
        self.group, self._center = group, center

    @property
    def center(self) -> CenterClient:
        assert self._center is not None, "a synchronous rule asked for the center"
        return self._center

    def elapsed(self) -> float:
        return self.clock

    def param_values(self) -> list:
        return [np.asarray(v.get_value(borrow=True)) for v in self.params]

    def device_copy(self, host: Any) -> Any:
        return np.array(host)

    def set_values(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values):
            var.set_value(np.array(value, var.type.dtype))

    def all_reduce(self, variables: Sequence[Any], values: Sequence[Any], op: str) -> list:
        assert self.group is not None, "an asynchronous rule asked for a collective"
        return [REDUCE[op](np.stack(parts)) for parts in zip(*self.group.everyone(self.rank, values))]

    def broadcast_from_master(self, values: Sequence[Any]) -> list:
        assert self.group is not None
        return [v.copy() for v in self.group.everyone(self.rank, values)[0]]

    def move(self, *deltas: Any) -> None:
        """A local step: each parameter moves by its delta."""
        self.set_values(self.params, [x + d for x, d in zip(self.param_values(), deltas)])

    def values(self) -> list[np.ndarray]:
        return [np.array(v) for v in self.param_values()]


def lockstep(n: int, run: Callable[[int, Group], Any]) -> list:
    """``run(rank, group)`` for every rank at once, in threads; every rank's result, or the first
    failure that was not a peer left waiting (a failing rank breaks the barrier for the others)."""
    group = Group(n)

    def guarded(rank: int) -> Any:
        try:
            return run(rank, group)
        except BaseException:
            group.barrier.abort()
            raise

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(guarded, r) for r in range(n)]
        errors = [e for e in (f.exception(timeout=10) for f in futures) if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [f.result() for f in futures]


def test_the_fakes_meet_the_contracts() -> None:
    """FakeLoop is a RuleLoop and ListCenter a CenterClient, as the rules are written against."""
    assert isinstance(FakeLoop(0, 1, [[0.0]]), RuleLoop)
    assert isinstance(ListCenter([[0.0]], Downpour().merge), CenterClient)


def test_allreduce_leaves_the_averaging_to_the_loop() -> None:
    """AllReduce asks for the all-reduced gradient and never touches the parameters itself."""
    rule, loop = AllReduce(), FakeLoop(0, 2, [[1.0, 2.0]])
    assert rule.reduces_gradient and not rule.asynchronous and not rule.saves_center
    state = rule.start(loop)
    assert [rule.after_update(state, loop, 3, 7) for _ in range(4)] == [False] * 4
    rule.finish(state, loop)
    np.testing.assert_array_equal(loop.values()[0], [1.0, 2.0])
    assert steps_before_sync(rule, state) is None and rule.saved_state(state, loop) == []


@pytest.mark.parametrize("state", [False, True])
def test_average_weights_each_rank_by_its_rows_since_the_last_average(state: bool) -> None:
    """Average(every=2) over 3 ranks of rows (2,2,3) then (1,1,2): weights 3/11, 3/11, 5/11."""
    rows = [[2, 2, 3], [1, 1, 2]]                     # chunks of global batches of 7, then 4

    def run(r: int, group: Group) -> tuple:
        loop = FakeLoop(r, 3, [[r, 2.0 * r]], group, state=[[10.0 * r]])
        rule = Average(every=2, state=state)
        s = rule.start(loop)
        loop.move([1.0, r])
        first = rule.after_update(s, loop, rows[0][r], 7), loop.values()[0]
        loop.move([r, 1.0])
        return first, rule.after_update(s, loop, rows[1][r], 4), loop.values()[0], loop.state_vars[0].get_value()

    results = lockstep(3, run)
    local = [np.array([r + 1.0 + r, 2.0 * r + r + 1.0]) for r in range(3)]
    want = (3 * local[0] + 3 * local[1] + 5 * local[2]) / 11
    assert not np.allclose(want, np.mean(local, 0))                   # the weighting matters here
    for r, ((synced_first, after_first), synced, values, moments) in enumerate(results):
        assert not synced_first and synced
        np.testing.assert_allclose(after_first, [r + 1.0, 2.0 * r + r])  # untouched before step 2
        np.testing.assert_allclose(values, want)
        np.testing.assert_allclose(moments, [(3 * 0 + 3 * 10 + 5 * 20) / 11 if state else 10.0 * r])


def test_average_with_state_keeps_an_integer_step_counter_every_rank_shares() -> None:
    """Average(state=True) over rows (1, 2): an int64 step counter at 7 on both ranks stays 7."""
    def run(r: int, group: Group) -> int:
        loop = FakeLoop(r, 2, [[float(r)]], group, state=[np.array(7, np.int64)])
        rule = Average(every=1, state=True)
        assert rule.after_update(rule.start(loop), loop, [1, 2][r], 3)
        return int(loop.state_vars[0].get_value())

    assert lockstep(2, run) == [7, 7]


def test_average_finishes_a_round_cut_short() -> None:
    """A run that ends one step into Average(every=3) averages that step's values at finish."""
    def run(r: int, group: Group) -> list:
        loop, rule = FakeLoop(r, 2, [[4.0 * r]], group), Average(every=3)
        s = rule.start(loop)
        assert not rule.after_update(s, loop, [1, 3][r], 4)
        assert rule.steps_to_sync(s) == 2
        rule.finish(s, loop)
        return loop.values()[0]

    for values in lockstep(2, run):
        np.testing.assert_allclose(values, [3.0])                   # (1 * 0 + 3 * 4) / 4


@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_takes_outer_momentum_steps_from_the_masters_parameters(nesterov: bool) -> None:
    """DiLoCo(every=1): theta from rank 0, Delta = theta - weighted mean, v and theta per the paper."""
    lr, mu = 0.7, 0.9

    def run(r: int, group: Group) -> list:
        loop = FakeLoop(r, 2, [[5.0 + r], [1.0 + r]], group, n_statistics=1)   # a parameter, a statistic
        rule = DiLoCo(every=1, outer_lr=lr, outer_momentum=mu, nesterov=nesterov)
        s, seen = rule.start(loop), []
        for step in range(2):
            loop.move([[-1.0, -3.0][r]], [2.0 * r])
            assert rule.after_update(s, loop, [2, 3][r], 5)     # a batch of 5: rank 0 has 2 rows, rank 1 3
            seen.append(loop.values())
        return seen

    seen = lockstep(2, run)
    theta, v = 5.0, 0.0                                     # rank 0's parameter; rank 1's was 6
    for step, locals_ in enumerate([(4.0, 3.0), None]):     # round 2 starts both ranks from theta
        x = locals_ or (theta - 1.0, theta - 3.0)
        delta = theta - (0.4 * x[0] + 0.6 * x[1])
        v = mu * v + delta
        theta -= lr * (delta + mu * v if nesterov else v)
        for r in range(2):
            np.testing.assert_allclose(seen[r][step][0], [theta])
    np.testing.assert_allclose(seen[0][0][1], [0.4 * 1.0 + 0.6 * 4.0])   # the statistic: averaged


def test_diloco_with_no_outer_momentum_and_rate_one_is_average() -> None:
    """DiLoCo(every=2, outer_lr=1, outer_momentum=0) leaves what Average(every=2) leaves."""
    def run(rule: Rule) -> list:
        def one(r: int, group: Group) -> list:
            loop = FakeLoop(r, 3, [[1.0, 2.0]], group)
            s = rule.start(loop)
            for step in range(4):
                loop.move([r * step, -r])
                rule.after_update(s, loop, [2, 2, 3][r], 7)
            return loop.values()[0]
        return lockstep(3, one)

    np.testing.assert_allclose(run(DiLoCo(every=2, outer_lr=1, outer_momentum=0)), run(Average(every=2)))


def test_diloco_refuses_a_checkpoint_it_cannot_resume() -> None:
    """check_saved names another checkpoint_dir for another model, and the device count mid-round."""
    rule = DiLoCo(every=4)
    mid_round = [np.array([2]), np.array([3, 3]), np.zeros(1), np.zeros(1)]
    with pytest.raises(ValueError, match="written for another model: use another checkpoint_dir"):
        rule.check_saved(mid_round, 2, n_params=2)
    with pytest.raises(ValueError, match=r"2 steps into a DiLoCo round on 2 devices.*resume it on 2 devices"):
        rule.check_saved(mid_round, 3, n_params=1)
    rule.check_saved(mid_round, 2, n_params=1)
    rule.check_saved([np.array([0]), np.zeros(2, int), np.zeros(1), np.zeros(1)], 5, n_params=1)


def test_easgd_pulls_devices_and_center_toward_each_other() -> None:
    """EASGD(0.25, every=2): d_r = alpha (x_r - c), x_r -= d_r, c += sum d_r; finish gives c."""
    def run(r: int, group: Group) -> tuple:
        loop, rule = FakeLoop(r, 2, [[1.0 + 2 * r, 1.0]], group), EASGD(0.25, every=2)
        s = rule.start(loop)                     # the center: the master's [1, 1]
        loop.move([1.0, 2.0 * r])
        assert not rule.after_update(s, loop, 1, 2)
        loop.move([1.0, 2.0 * r])
        assert rule.after_update(s, loop, 1, 2)
        synced, center = loop.values()[0], rule.saved_state(s, loop)[0]
        rule.finish(s, loop)
        return synced, center, loop.values()[0]

    (x0, c0, f0), (x1, c1, f1) = lockstep(2, run)
    c, local = np.array([1.0, 1.0]), [np.array([3.0, 1.0]), np.array([5.0, 5.0])]
    d = [0.25 * (x - c) for x in local]
    np.testing.assert_allclose(x0, local[0] - d[0])
    np.testing.assert_allclose(x1, local[1] - d[1])
    for center in (c0, c1, f0, f1):
        np.testing.assert_allclose(center, c + d[0] + d[1])


def test_asynchronous_easgd_moves_the_center_by_each_devices_pull_alone() -> None:
    """EASGD(0.5, asynchronous): each device, at its own pace, meets the center the last one left."""
    rule = EASGD(0.5, every=1, asynchronous=True)
    center = ListCenter([[0.0, 0.0]], rule.merge)
    loops = [FakeLoop(r, 2, [[0.0, 0.0]], center=center) for r in range(2)]
    states = [rule.start(loop) for loop in loops]
    loops[0].move([4.0, 0.0])
    assert rule.after_update(states[0], loops[0], 1, 2)      # pull [2, 0]: center [2, 0], x [2, 0]
    loops[1].move([0.0, 8.0])
    assert rule.after_update(states[1], loops[1], 1, 2)      # pull [-1, 4]: center [1, 4], x [1, 4]
    np.testing.assert_allclose(loops[0].values()[0], [2.0, 0.0])
    np.testing.assert_allclose(loops[1].values()[0], [1.0, 4.0])
    np.testing.assert_allclose(center.values()[0], [1.0, 4.0])
    rule.finish(states[0], loops[0])
    np.testing.assert_allclose(loops[0].values()[0], [1.0, 4.0])


def test_downpour_pushes_the_change_since_its_last_pull_every_k_steps() -> None:
    """Downpour(every=2): the center gains each push, a statistic's divided by n; devices pull it."""
    rule = Downpour(every=2)
    center = ListCenter([[1.0], [0.0]], rule.merge)
    loops = [FakeLoop(r, 2, [[1.0], [0.0]], center=center, n_statistics=1) for r in range(2)]
    states = [rule.start(loop) for loop in loops]

    def two_steps(r: int, dx: float, ds: float) -> None:
        loops[r].move([dx], [ds])
        assert not rule.after_update(states[r], loops[r], 1, 2)
        np.testing.assert_allclose(center.values()[0], pushed_so_far[:1])        # nothing pushed yet
        loops[r].move([dx], [ds])
        assert rule.after_update(states[r], loops[r], 1, 2)
        pushed_so_far[:] = [pushed_so_far[0] + 2 * dx, pushed_so_far[1] + 2 * ds / 2]

    pushed_so_far = [1.0, 0.0]
    two_steps(0, 0.5, 4.0)                   # center 2, 4
    two_steps(1, -1.0, 2.0)                  # center 0, 6
    np.testing.assert_allclose(np.concatenate(loops[1].values()), [0.0, 6.0])
    two_steps(0, 3.0, 0.0)                   # from rank 0's last pull (2, 4), not its start
    np.testing.assert_allclose(np.concatenate(center.values()), [6.0, 6.0])
    np.testing.assert_allclose(np.concatenate(loops[0].values()), [6.0, 6.0])


def test_rate_limited_blends_into_the_center_and_skips_syncs_over_its_rate() -> None:
    """RateLimited(every_n_batches=2, alpha=0.25, beta=0.5): c = 0.25 c + 0.5 x; over 0.25 of the
    time spent syncing, the sync is skipped and counted."""
    rule = RateLimited(every_n_batches=2, alpha=0.25, beta=0.5, max_rate=0.25)
    center = ListCenter([[8.0]], rule.merge)
    loop = FakeLoop(0, 1, [[4.0]], center=center)
    s = rule.start(loop)
    loop.clock = 10.0
    assert not rule.after_update(s, loop, 1, 1)            # not a sync step: no skip counted
    assert rule.after_update(s, loop, 1, 1)
    np.testing.assert_allclose([center.values()[0], loop.values()[0]], [[0.25 * 8 + 0.5 * 4]] * 2)
    loop.sync_seconds = 3.0                                 # 3 s of 10: over 0.25
    loop.move([1.0])
    assert [rule.after_update(s, loop, 1, 1) for _ in range(4)] == [False] * 4
    assert loop.skipped == 2
    np.testing.assert_allclose([center.values()[0], loop.values()[0]], [[4.0], [5.0]])
    loop.clock = 100.0
    assert rule.after_update(s, loop, 1, 1) is False and rule.after_update(s, loop, 1, 1)
    np.testing.assert_allclose(center.values()[0], [0.25 * 4 + 0.5 * 5])
    assert loop.skipped == 2


def test_steps_to_sync_counts_down_to_each_rules_next_sync() -> None:
    """steps_to_sync: Average counts from its last average, EASGD from its period's start."""
    avg, easgd = Average(every=4), EASGD(every=3)
    assert avg.steps_to_sync(avg.start(FakeLoop(0, 1, [[0.0]]))) == 4
    s = EASGD(every=3, asynchronous=True).start(FakeLoop(0, 1, [[0.0]]))
    s.steps = 4
    assert easgd.steps_to_sync(s) == 2

    @dataclass(frozen=True)
    class Overridden(Average):
        def after_update(self, state: Any, loop: Any, rows: int, batch_rows: int) -> bool:
            return super().after_update(state, loop, rows, batch_rows)

    assert steps_before_sync(Overridden(every=4), s) == 1     # it cannot know what the override does


@pytest.mark.parametrize("build, message", [
    (lambda: Average(every=0), "Average: every must be a positive whole number of steps, got 0"),
    (lambda: Average(every=2.0), "Average: every must be a positive whole number of steps, got 2.0"),
    (lambda: Average(state="False"), "Average: state must be True or False, got 'False'"),
    (lambda: EASGD(alpha=1.5), r"EASGD: alpha must be in \[0, 1\], got 1.5"),
    (lambda: EASGD(alpha=True), "EASGD: alpha must be a number, got True"),
    (lambda: EASGD(alpha="x"), "EASGD: alpha must be a number, got 'x'"),
    (lambda: Downpour(every=-1), "Downpour: every must be a positive whole number"),
    (lambda: RateLimited(max_rate=0), r"RateLimited: max_rate must be in \(0, 1\], got 0.0"),
    (lambda: RateLimited(beta=-0.1), r"RateLimited: beta must be in \[0, 1\]"),
    (lambda: DiLoCo(outer_momentum=1), "DiLoCo: outer_momentum must be below 1, got 1.0"),
    (lambda: DiLoCo(outer_lr=0), "DiLoCo: outer_lr must be a positive number, got 0.0"),
    (lambda: DiLoCo(outer_lr=float("inf")), "DiLoCo: outer_lr must be a positive number, got inf"),
])
def test_a_bad_setting_is_refused_naming_the_rule_the_setting_and_the_range(build: Callable, message: str) -> None:
    """Every rule checks its settings at construction, naming what it wants."""
    with pytest.raises(ValueError, match=message):
        build()


def test_settings_are_settled_to_plain_types() -> None:
    """Numpy and integer settings become plain ints and floats (as a checkpoint records them)."""
    rule = EASGD(alpha=np.float32(0.5), every=np.int64(3), asynchronous=1)
    assert (rule.alpha, rule.every, rule.asynchronous) == (0.5, 3, True)
    assert type(rule.every) is int and type(rule.alpha) is float


def test_check_rule_names_the_fix_for_what_is_not_a_rule() -> None:
    """check_rule refuses a non-rule, a hook of the wrong arguments, and state kept on the rule."""
    with pytest.raises(TypeError, match="sync must be a rule of synkhronos.extensions.sync"):
        check_rule("EASGD")

    @dataclass(frozen=True)
    class Stateless(Rule):
        def after_update(self, loop: Any, rows: int) -> bool:                 # type: ignore[override]
            return False

    with pytest.raises(TypeError, match=r"Stateless.after_update takes \(loop, rows\)"):
        check_rule(Stateless())

    @dataclass(frozen=True)
    class Counting(Rule):
        def __post_init__(self) -> None:
            object.__setattr__(self, "count", 0)

    with pytest.raises(TypeError, match=r"keeps \['count'\] outside its settings"):
        check_rule(Counting())
    check_rule(EASGD())
