"""The timeline: every rank's calls, collectives and loop steps with their phases, as Chrome trace JSON."""

import json

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL
from test_extensions import mlp

import synkhronos as synk
from synkhronos.extensions import train, updates
from synkhronos.runtime import session
from synkhronos.tracing import trace

pytestmark = pytest.mark.timeout(300)


def spans_and_phases(events):
    spans = [e for e in events if e.get("ph") == "X" and e["cat"] != "phase"]
    phases = [e for e in events if e.get("ph") == "X" and e["cat"] == "phase"]
    return spans, phases


def parent_of(phase, spans):
    """The innermost span on the same rank that holds ``phase`` in time (1 µs of rounding allowed)."""
    holding = [s for s in spans if s["pid"] == phase["pid"] and s["ts"] - 1e-3 <= phase["ts"]
               and phase["ts"] + phase["dur"] <= s["ts"] + s["dur"] + 1e-3]
    return min(holding, key=lambda s: s["dur"]) if holding else None


@pytest.fixture
def traced(synk2, tmp_path, rng):
    """A timeline of calls (range and shuffled rows), an all-reduce and a device-driven run."""
    x = pt.matrix("x")
    w = pytensor.shared(np.ones(3), name="w_timeline")
    f = synk.function([x], ((x @ w).sum(), "sum"), name="f_timeline")
    X, y, loss, params, _ = mlp(seed=21)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    data = synk.data(rng.normal(size=(100, 3)))
    x_np, y_np = rng.normal(size=(60, 6)), rng.integers(0, 3, size=60)
    path = tmp_path / "trace.json"
    with synk.timeline(path):
        results = [f(data), f(data, batch=rng.permutation(100)[:40])]
        synk.all_reduce(w)
        train.run(step, x_np, y_np, 20, steps=6)
    assert not trace.on
    np.testing.assert_allclose(results[0], f.as_pytensor(data.data), rtol=1e-12)
    with open(path) as fh:
        return json.load(fh)["traceEvents"]


@pytest.mark.slow
def test_the_trace_names_every_rank_and_holds_calls_collectives_and_steps(traced):
    names = {e["pid"]: e["args"]["name"] for e in traced if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (master)", 1: "rank 1 (worker)"}
    spans, phases = spans_and_phases(traced)
    for rank in range(N_PARALLEL):
        mine = [s for s in spans if s["pid"] == rank]
        assert sum(s["name"] == "step" for s in mine) == 6
        assert any(s["cat"] == "collective" or (s["cat"] == "command" and s["name"] == "collective")
                   for s in mine)
    master_calls = [s for s in spans if s["pid"] == 0 and s["cat"] == "call"]
    assert [s["name"] for s in master_calls] == ["f_timeline", "f_timeline"]
    worker_calls = [s for s in spans if s["pid"] == 1 and s["cat"] == "command" and s["name"] == "call"]
    assert len(worker_calls) == 2
    step_phases = {p["name"] for p in phases if parent_of(p, spans)["name"] == "step"}
    assert {"gather rows", "gradient", "all-reduce", "update"} <= step_phases
    call_phases = {p["name"] for p in phases if parent_of(p, spans) in master_calls}
    assert {"plan", "compute", "wait for devices", "reduce"} <= call_phases
    assert "gather rows" in call_phases                  # the shuffled call gathered its rows
    worker_phases = {p["name"] for p in phases if parent_of(p, spans) in worker_calls}
    assert {"wait for the command", "compute", "report"} <= worker_phases


def test_every_phase_nests_inside_its_span(traced):
    spans, phases = spans_and_phases(traced)
    assert phases
    for phase in phases:
        assert parent_of(phase, spans) is not None, phase
    for span in spans:                       # a span's phases tile it, in order
        inner = sorted((p for p in phases if parent_of(p, spans) is span), key=lambda p: p["ts"])
        for a, b in zip(inner, inner[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3


def test_the_ranks_share_one_clock(traced):
    """A collective ends on every rank at nearly the same moment (it ends in a barrier)."""
    spans, phases = spans_and_phases(traced)
    ends = {}
    for phase in phases:
        if phase["name"] == "execute":
            ends.setdefault(phase["pid"], []).append(phase["ts"] + phase["dur"])
    assert set(ends) == {0, 1}
    first = [min(ends[rank]) for rank in range(N_PARALLEL)]
    # microseconds: clocks of other epochs would differ by far more; a loaded machine may
    # deschedule one rank for a few milliseconds after the barrier
    assert abs(first[0] - first[1]) < 50_000


@pytest.mark.slow
def test_fork_timeline_writes_at_close(tmp_path, rng):
    synk.close()
    path = tmp_path / "fork.json"
    synk.fork(N_PARALLEL, timeline=str(path))
    try:
        x = pt.vector("x")
        f = synk.function([x], (x.sum(), "sum"), name="at_close")
        synk.distribute()
        assert f(np.arange(8.0)) == 28.0
    finally:
        synk.close()
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("name") == "at_close"} == {0}
    assert any(e.get("name") == "call" and e["pid"] == 1 for e in events)
    assert session.active() is None and not trace.on


def test_the_timeline_is_off_unless_asked(synk2):
    assert not trace.on
    x = pt.vector("x")
    f = synk.function([x], (x.sum(), "sum"), name="untraced")
    synk.distribute()
    f(np.arange(4.0))
    assert trace.stop() == []


def test_one_timeline_at_a_time_a_checked_path_and_the_users_exception_kept(synk2, tmp_path):
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"), name="f_one_timeline")
    outer = tmp_path / "outer.json"
    with synk.timeline(outer):
        f(np.ones((4, 2)))
        with pytest.raises(RuntimeError, match="recording already"):
            with synk.timeline(tmp_path / "inner.json"):
                pass
        errors = []

        def other_thread():
            try:
                with synk.timeline(tmp_path / "thread.json"):
                    pass
            except RuntimeError as e:
                errors.append(e)
        import threading
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and "recording already" in str(errors[0])
        f(np.ones((4, 2)))
    spans = [e for e in json.load(open(outer))["traceEvents"] if e.get("name") == "f_one_timeline"]
    assert len(spans) == 2                               # the outer recording kept both calls
    with pytest.raises(FileNotFoundError, match="does not exist"):
        with synk.timeline(tmp_path / "missing" / "trace.json"):
            pytest.fail("the block must not run")
    assert not trace.on
    gone = tmp_path / "gone"
    gone.mkdir()
    with pytest.warns(synk.SynkWarning, match="could not be written"):
        with pytest.raises(KeyError, match="the user's"):
            with synk.timeline(gone / "trace.json"):
                gone.rmdir()                         # the file cannot be written at the end
                raise KeyError("the user's")
    f(np.ones((4, 2)))
