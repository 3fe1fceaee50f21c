"""Property-based and soak tests: random batch specs never hang or corrupt, and nothing grows."""

import os
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import synk_segments
from helpers import close
from hypothesis import given, settings
from hypothesis import strategies as st

import synkhronos as synk

pytestmark = pytest.mark.timeout(300)

_functions = {}


def functions_for(dtype):
    """One function per dtype, built once per runtime (every output mode that suits it)."""
    rt = synk.runtime.session.current()
    key = (id(rt), dtype)
    if key not in _functions:
        x = pt.matrix("x", dtype=dtype)
        outs = [(x.sum(0), "sum"), (x.max(0), "max"), (x, "gather")]
        if dtype.startswith("float"):
            outs.append((x.mean(0), "avg"))
        _functions[key] = synk.function([x], outs, name=f"prop_{dtype}")
    return _functions[key]


def expected_rows(spec, n):
    """The rows ``spec`` selects from ``n``, or the exception type synkhronos must raise."""
    kind, value = spec
    if kind == "none":
        rows = np.arange(n)
    elif kind == "int":
        if value > n:
            return IndexError
        rows = np.arange(value)
    elif kind == "slice":
        start, stop, step = value
        if step not in (None, 1):
            return ValueError
        if stop < start:
            return ValueError
        if stop > n:
            return IndexError
        rows = np.arange(start, stop)
    else:
        idx = np.asarray(value, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            return IndexError
        rows = idx
    if len(rows) == 0:
        return ValueError
    return rows


def as_batch(spec):
    kind, value = spec
    if kind == "slice":
        return slice(*value)
    if kind == "array":
        return np.asarray(value, dtype=np.int64)
    return value


specs = st.one_of(
    st.just(("none", None)),
    st.tuples(st.just("int"), st.integers(0, 14)),
    st.tuples(st.just("slice"), st.tuples(st.integers(0, 14), st.integers(0, 14),
                                          st.sampled_from([None, None, 1, 2]))),
    st.tuples(st.just("list"), st.lists(st.integers(-2, 14), max_size=9)),
    st.tuples(st.just("array"), st.lists(st.integers(0, 14), max_size=9)),
)


# the profile (conftest: "dev" explores new examples, "ci" runs the same ones every time)
@pytest.mark.slow
@settings(max_examples=120)
@given(n=st.integers(0, 12), dtype=st.sampled_from(["float32", "float64", "int32"]), spec=specs,
       num_slices=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_random_calls_match_pytensor_or_raise_the_documented_error(synk2, n, dtype, spec, num_slices, seed):
    f = functions_for(dtype)
    X = (np.random.default_rng(seed).normal(size=(n, 2)) * 10).astype(dtype)
    want = expected_rows(spec, n)
    batch = as_batch(spec)
    if isinstance(want, type):
        with pytest.raises(want):
            f(X, batch=batch, num_slices=num_slices)
        # the runtime is still right afterwards
        close(f(np.ones((3, 2), dtype))[0], [3, 3])
        return
    got = f(X, batch=batch, num_slices=num_slices)
    ref = f.as_pytensor(X[want])
    for g, r, (var, _) in zip(got, ref, f.spec.outputs):
        assert g.dtype == r.dtype == np.dtype(var.type.dtype)    # the graph's declared dtype
        close(g, r, rtol=1e-5 if dtype == "float32" else 1e-10)


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def _measure(rt):
    pids = [os.getpid()] + list(rt.worker_pids.values())
    return dict(rss_kb=[_rss_kb(p) for p in pids], fds=[_fds(p) for p in pids],
                segments=len([n for n in synk_segments() if n.startswith(rt.prefix)]))


@pytest.mark.slow
def test_soak_memory_descriptors_and_segments_stay_flat(synk2):
    """Thousands of calls with random specs, reallocations and collectives.

    XLA compiles one executable per distinct input shape, so memory is flat once
    every shape has been seen: the soak draws batch sizes, slice counts and Data
    lengths from small sets, as a training loop does, and warms up on all of them.
    """
    rng = np.random.default_rng(0)
    f = functions_for("float64")
    v = pytensor.shared(np.zeros(50), name="v_soak")
    g = synk.function([], [(v.sum(), "sum")], updates=[(v, v + 1)])
    lengths, batch_sizes = [64, 128, 256], [8, 16, 32]
    d = synk.data(rng.normal(size=(64, 2)))

    def burst(calls):
        for i in range(calls):
            n, b = len(d), int(rng.choice(batch_sizes))
            kind = i % 4
            batch = (None if kind == 0 else b if kind == 1 else slice(n - b, n) if kind == 2
                     else rng.integers(0, n, b))
            f(d, batch=batch, num_slices=int(rng.choice([1, 2])))
            if i % 25 == 0:
                d.set_value(rng.normal(size=(int(rng.choice(lengths)), 2)))   # grows and shrinks
                g()
                synk.all_reduce(v)
    burst(600)                                     # warm-up: every shape, caches, allocator pools
    before = _measure(synk2)
    t0 = time.time()
    burst(3000)
    after = _measure(synk2)
    per_call_us = (time.time() - t0) / 3000 * 1e6
    print(f"\nsoak: 3000 calls, {per_call_us:.0f} us/call; before {before}; after {after}")
    assert after["segments"] == before["segments"]
    assert after["fds"] == before["fds"]
    for b, a in zip(before["rss_kb"], after["rss_kb"]):
        assert a - b < 20_000, (before, after)    # < 20 MB drift per process over 3000 calls
