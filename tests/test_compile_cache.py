"""The compile cache: a second run loads every program, anything that changes the program compiles anew,
a corrupt entry is compiled again with a warning, compile_cache=False keeps nothing, runs at once share it.

Every run is a fresh process (JAX opens its cache once per process). Whether a rank compiled or loaded
a program is read from its timeline (JAX reports each, see synkhronos.platform.compile_spans), never
from timing.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from helpers import run_script, source_env

import synkhronos as synk
from synkhronos.platform import compile_cache
from synkhronos.platform.compile_spans import COMPILED, LOADED
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: argv: cache ("off", or a directory), timeline path, devices, floatX, collectives
RUN = """
import json, sys
import numpy as np, pytensor, pytensor.tensor as pt
cache, timeline, n, float_x, kind = sys.argv[1:6]
pytensor.config.floatX = float_x
import synkhronos as synk
synk.fork(int(n), compile_cache=False if cache == "off" else cache, timeline=timeline, collectives=kind)
from synkhronos.compile import rewrites
rewrites.set_cpu_rewrite(False)      # no timing of products, whose programs only a first run compiles
x = pt.matrix("x")
w = pytensor.shared(np.arange(6.0).reshape(3, 2).astype(float_x), name="w")
g = pytensor.shared(np.ones(4, float_x), name="g")
f = synk.function([x], [((x @ w).sum(), "sum"), (x @ w, "gather")], updates=[(g, g * 2)])
total, rows = f(np.arange(24.0).reshape(8, 3).astype(float_x))
synk.all_reduce(g)
print("RESULT " + json.dumps([float(total), np.asarray(rows).tolist(), synk.get_value(1, g).tolist()]))
synk.close()
"""
EXPECTED_TOTAL = float((np.arange(24.0).reshape(8, 3) @ np.arange(6.0).reshape(3, 2)).sum())


def run(tmp_path, cache, name, n=2, float_x="float64", collectives="shm", env=None, background=False):
    """One run of RUN; returns (its printed result, what each rank did: {rank: {span name: count}})."""
    timeline = str(tmp_path / f"{name}.json")
    args = [str(cache), timeline, str(n), float_x, collectives]
    if background:
        environ = source_env(**(env or {}))
        return subprocess.Popen([sys.executable, "-c", RUN, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=environ), timeline
    out = run_script(RUN, timeout=240, env=env, args=args)
    return finished(out.returncode, out.stdout, out.stderr, timeline)


def finished(code, stdout, stderr, timeline):
    assert code == 0, stdout + stderr[-3000:]
    result = json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")))
    assert result[0] == pytest.approx(EXPECTED_TOTAL)
    return result, finished_spans(timeline), stderr


def finished_spans(timeline):
    """What each rank of a timeline did with its programs: {rank: {COMPILED: n, LOADED: n}}."""
    with open(timeline) as fh:
        events = json.load(fh)["traceEvents"]
    done = {}
    for e in events:
        if e.get("cat") == "compile" and e["name"] in (COMPILED, LOADED):
            done.setdefault(e["pid"], {COMPILED: 0, LOADED: 0})[e["name"]] += 1
    return done


def entries(directory):
    return sorted(name for _, _, names in os.walk(directory) for name in names if name.endswith("-cache"))


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A first run into an empty cache: (its directory, result, what each rank did)."""
    tmp = tmp_path_factory.mktemp("cold")
    cache = tmp / "cache"
    result, done, _ = run(tmp, cache, "cold")
    return cache, result, done


def copy_of(cold, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cold[0], cache)
    return cache


def compiled(done):
    return sum(d[COMPILED] for d in done.values())


@pytest.mark.slow
def test_the_ranks_of_a_host_compile_each_program_once_between_them(cold):
    cache, _, done = cold
    assert sorted(done) == [0, 1]
    assert compiled(done) == len(entries(cache))      # one compile per program kept, whichever rank
    assert sum(d[LOADED] for d in done.values()) > 0, done    # a rank loaded what the other compiled


@pytest.mark.slow
def test_a_second_run_loads_every_program_that_the_first_compiled(cold, tmp_path):
    cache, first, done_cold = cold
    assert sorted(done_cold) == [0, 1]
    kept = entries(cache)
    assert kept and os.listdir(cache) == [compile_cache.host_fingerprint()]   # one host's directory
    again = copy_of(cold, tmp_path)
    result, done, _ = run(tmp_path, again, "warm")
    assert result == first
    assert sorted(done) == [0, 1]
    for rank, d in done.items():              # every program of every rank came from the cache
        assert d[COMPILED] == 0 and d[LOADED] == sum(done_cold[rank].values()), (rank, d, done_cold)
    assert entries(again) == kept             # and nothing new was written


@pytest.mark.slow
@pytest.mark.parametrize("change", ["xla_flag", "devices", "float32"])
def test_a_changed_flag_device_count_or_float_x_compiles_anew(cold, tmp_path, change):
    cache = copy_of(cold, tmp_path)
    kwargs = dict(xla_flag=dict(env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}),
                  devices=dict(n=3, collectives="jax"), float32=dict(float_x="float32"))[change]
    result, done, _ = run(tmp_path, cache, change, **kwargs)
    np.testing.assert_allclose(result[1], cold[1][1], rtol=1e-6)
    assert compiled(done) > 0, (change, done)
    if change == "xla_flag":                 # the flags key every program: each is compiled anew
        assert compiled(done) == compiled(cold[2]), (change, done, cold[2])
    # (with another floatX or device count, a program that does not depend on it, moving integer
    # indices say, is the same program and is loaded)
    assert len(entries(cache)) == len(entries(cold[0])) + compiled(done)


@pytest.mark.slow
def test_a_corrupt_entry_is_compiled_again_with_a_warning(cold, tmp_path):
    cache = copy_of(cold, tmp_path)
    for root, _, names in os.walk(cache):
        for name in names:
            if name.endswith("-cache"):
                with open(os.path.join(root, name), "r+b") as fh:
                    fh.truncate(max(1, os.path.getsize(fh.name) // 3))      # a write cut short
    result, done, stderr = run(tmp_path, cache, "corrupt")
    assert result == cold[1]
    assert all(d[COMPILED] > 0 and d[LOADED] == 0 for d in done.values()), done
    assert "persistent compilation cache" in stderr, stderr[-3000:]


@pytest.mark.slow
def test_compile_cache_false_keeps_nothing_even_where_jax_is_told_to(tmp_path):
    told = tmp_path / "jax_cache"
    told.mkdir()
    result, done, _ = run(tmp_path, "off", "off", env={"JAX_COMPILATION_CACHE_DIR": str(told)})
    assert os.listdir(told) == []
    assert all(d[LOADED] == 0 for d in done.values())


def test_by_default_the_cache_is_jax_s_directory_when_set_else_the_user_s_cache(tmp_path):
    assert compile_cache.directory(None).startswith(os.environ["JAX_COMPILATION_CACHE_DIR"])
    home = tmp_path / "xdg"
    out = run_script("""
        import os
        from synkhronos.platform import compile_cache
        print(compile_cache.directory(None))
    """, env={"JAX_COMPILATION_CACHE_DIR": None, "XDG_CACHE_HOME": str(home)})
    assert out.stdout.strip() == os.path.join(home, "synkhronos", "jax", compile_cache.host_fingerprint())


@pytest.mark.slow
def test_the_source_pytensor_generates_is_kept_once_in_the_users_cache_not_left_in_tmp(tmp_path):
    """Every rank compiles every function, per shape: PyTensor's default would leave a new file in the
    temporary directory each time, for good. The user's own choice of place is kept."""
    tmp, home, chosen = tmp_path / "tmp", tmp_path / "xdg", tmp_path / "chosen"
    tmp.mkdir()
    script = """
        import sys
        import numpy as np, pytensor, pytensor.tensor as pt
        pytensor.config.generated_src_dir = sys.argv[1]
        import synkhronos as synk
        synk.fork(2, compile_cache=False)
        x = pt.vector("x")
        f = synk.function([x], [((x * 2).sum(), "sum"), (x + 1, "gather")])
        for rows in (4, 6, 8):
            f(np.arange(float(rows)))
        during = pytensor.config.generated_src_dir
        synk.close()
        print("KEPT", during, "|", pytensor.config.generated_src_dir, "|")
    """

    def generated_in(directory):
        return [name for name in os.listdir(directory)
                if "jax_funcified_fgraph" in open(os.path.join(directory, name), errors="replace").read()]

    out = run_script(script, env={"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home)}, args=[""])
    assert out.returncode == 0, out.stderr[-3000:]
    kept = home / "synkhronos" / "pytensor-src"
    assert out.stdout.split("KEPT")[1].split() == [str(kept), "|", "|"]     # given back at close
    assert generated_in(tmp) == [] and len(generated_in(kept)) >= 1
    out = run_script(script, env={"TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home)}, args=[str(chosen)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("KEPT")[1].split() == [str(chosen), "|", str(chosen), "|"]
    assert generated_in(tmp) == [] and len(generated_in(chosen)) >= 1


@pytest.mark.slow
def test_a_place_for_generated_source_set_during_the_run_stays_and_an_unwritable_one_is_not_taken(tmp_path):
    """A ``generated_src_dir`` the user sets while the runtime runs is theirs after close(); where
    the cache's directory cannot be written (a read-only file system; as root, permissions would
    not stop it), PyTensor's default place serves, and every compile, theirs too, works."""
    unwritable = "/sys/kernel"
    if not os.path.isdir(unwritable) or os.access(unwritable, os.W_OK) and _writable(unwritable):
        pytest.skip("no unwritable directory to point the cache at here")
    home, mine = tmp_path / "xdg", tmp_path / "mine"
    (home / "synkhronos").mkdir(parents=True)
    os.symlink(unwritable, home / "synkhronos" / "pytensor-src")
    out = run_script("""
        import sys
        import numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        synk.fork(2, compile_cache=False)
        x = pt.vector("x")
        f = synk.function([x], [((x * 3).sum(), "sum")])
        plain = pytensor.function([x], x * 2)
        print("RAN", float(f(np.arange(4.0))[0]), plain(np.ones(2)).tolist(), repr(pytensor.config.generated_src_dir))
        pytensor.config.generated_src_dir = sys.argv[1]
        synk.close()
        print("AFTER", pytensor.config.generated_src_dir)
    """, env={"XDG_CACHE_HOME": str(home)}, args=[str(mine)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAN 18.0 [2.0, 2.0] ''" in out.stdout and f"AFTER {mine}" in out.stdout, out.stdout


def _writable(directory):
    try:
        with tempfile.NamedTemporaryFile(dir=directory):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_two_runs_at_once_share_one_cache(tmp_path):
    cache = tmp_path / "cache"
    started = [run(tmp_path, cache, f"at_once_{i}", background=True) for i in range(2)]
    results = []
    for proc, timeline in started:
        stdout, stderr = proc.communicate(timeout=240)
        results.append(finished(proc.returncode, stdout, stderr, timeline)[0])
    assert results[0] == results[1]
    assert entries(cache)


def test_a_compile_cache_that_cannot_be_used_is_refused_before_anything_starts(tmp_path):
    if session.active() is not None:
        synk.close()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(TypeError, match="compile_cache must be"):
        synk.fork(2, compile_cache=3)
    with pytest.raises(ValueError, match="writable directory"):
        synk.fork(2, compile_cache=blocker / "below_a_file")
    assert session.active() is None


#: argv: cache, timeline, graph. A ResNet's gradient ("resnet": it traces only on concrete shapes) or
#: a tanh layer ("layer": it traces on free rows), called with two row counts
FINDINGS = """
import json, sys
import numpy as np, pytensor, pytensor.tensor as pt
import synkhronos as synk
from demos.resnet_synthetic import build
synk.fork(2, compile_cache=sys.argv[1])
rng = np.random.default_rng(0)
if sys.argv[3] == "resnet":
    make_graph, params = build(4, 2, 4)
    x, y, loss, _ = make_graph(None)
    outputs = [(loss, "avg"), (pytensor.grad(loss, params[0]), "avg")]
    data = [(rng.normal(size=(n, 4, 4, 3)), rng.integers(0, 2, size=n)) for n in (5, 7)]
else:
    x, y = pt.matrix("x"), pt.matrix("y")
    outputs = [(((pt.tanh(x @ np.ones((3, 2))) - y) ** 2).sum(), "sum")]
    data = [(rng.normal(size=(n, 3)), rng.normal(size=(n, 2))) for n in (5, 7)]
with synk.timeline(sys.argv[2]):
    f = synk.function([x, y], outputs, name="findings")
    got = [f(*args) for args in data]
want = [f.as_pytensor(*args) for args in data]
gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for g, w in zip(got, want) for a, b in zip(g, w))
print("RESULT " + json.dumps(gap))
synk.close()
"""


def builds_of_two_runs(tmp_path, graph):
    """Per run (one cache, two fresh processes): the builds of the function, as (rank, shapes), and
    the results' largest gap from the single process."""
    builds, gaps = [], []
    for name in ("first", "second"):
        timeline = str(tmp_path / f"{name}.json")
        out = run_script(FINDINGS, timeout=240, args=[str(tmp_path / "cache"), timeline, graph])
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        gaps.append(json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT "))))
        with open(timeline) as fh:
            builds.append(sorted((e["pid"], e["args"]["shapes"]) for e in json.load(fh)["traceEvents"]
                                 if e.get("cat") == "compile" and e["name"] == "build findings"))
    return builds, gaps


@pytest.mark.slow
def test_a_graph_found_to_trace_only_on_concrete_shapes_is_built_per_shape_at_once_next_time(tmp_path):
    builds, gaps = builds_of_two_runs(tmp_path, "resnet")
    assert (0, "any rows") in builds[0]        # the second row count tried free rows, and found out
    assert builds[1] == [(0, "((2, 4, 4, 3), (2,))"), (0, "((3, 4, 4, 3), (3,))"),
                         (1, "((3, 4, 4, 3), (3,))"), (1, "((4, 4, 4, 3), (4,))")]     # per shape only
    assert max(gaps) < 1e-12                   # and each run computes what one process does


@pytest.mark.slow
def test_a_graph_found_to_trace_on_free_rows_is_built_so_at_once_next_time(tmp_path):
    builds, gaps = builds_of_two_runs(tmp_path, "layer")
    assert builds[0] == [(0, "((2, 3), (2, 2))"), (0, "any rows"), (1, "((3, 3), (3, 2))"), (1, "any rows")]
    assert builds[1] == [(0, "any rows"), (1, "any rows")]      # once, for every row count
    assert max(gaps) < 1e-12


def test_the_master_and_its_workers_run_with_the_same_xla_flags():
    """The workers' environment is made from the master's, made already: the flags (which key every
    program in the cache) come out once each, the same in both, with the user's own kept."""
    from synkhronos.platform.jax_init import configure_environment
    master = configure_environment({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, "cpu", 1)
    worker = configure_environment(dict(master), "cpu", 1)
    assert worker["XLA_FLAGS"] == master["XLA_FLAGS"]
    flags = master["XLA_FLAGS"].split()
    assert len(flags) == len(set(flags)) and flags[0] == "--xla_cpu_enable_fast_math=false"


#: argv: cache, timeline. A first runtime of other thread flags, then one of two devices
AFTER_ANOTHER = """
import json, sys
import numpy as np, pytensor, pytensor.tensor as pt
import synkhronos as synk
cache, timeline = sys.argv[1:3]
synk.fork(1, threads_per_device=2, compile_cache=cache)        # XLA reads its flags now, once
x = pt.vector("x")
print("one device", synk.function([x], (x.sum(), "sum"))(np.ones(4)))
synk.close()
synk.fork(2, threads_per_device=1, compile_cache=cache, timeline=timeline)
w = pytensor.shared(np.arange(6.0), name="w")
m = pytensor.shared(np.zeros(6), name="m")
f = synk.function([], [], updates=[(m, 0.9 * m + w), (w, w - 0.1 * m)], name="after")
f()
f()
print("RESULT " + json.dumps([synk.get_value(r, w).tolist() for r in (0, 1)]))
synk.close()
"""


@pytest.mark.slow
def test_a_runtime_after_one_of_other_threads_still_compiles_each_program_once_per_host(tmp_path):
    """XLA reads its flags once per process: a runtime after one with another thread count keeps the
    first one's flags in its workers too, so that a worker loads what the master compiled."""
    timeline = tmp_path / "after.json"
    out = run_script(AFTER_ANOTHER, timeout=240, args=[str(tmp_path / "cache"), str(timeline)])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    w = np.arange(6.0) - 0.1 * np.arange(6.0)               # step 2 from m = w after step 1
    for got in json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT "))):
        np.testing.assert_allclose(got, w, rtol=1e-15)
    done = finished_spans(str(timeline))
    assert done[0][COMPILED] > 0 and done[1][LOADED] > 0, done
    assert done[1][COMPILED] == 0, done                   # nothing compiled twice on the host


#: argv: cache. Prints whether the master timed the products, and what it decided
PRODUCTS = """
import json, sys
import numpy as np, pytensor.tensor as pt
import synkhronos as synk
from synkhronos.compile import rewrites
synk.fork(2, compile_cache=sys.argv[1])
x, w = pt.matrix("x"), pt.matrix("w")
f = synk.function([x], ((x @ w).sum(), "sum"), bcast_inputs=[w])
assert float(f(np.ones((4, 3)), np.ones((3, 2)))) == 24.0
print("DECIDED " + json.dumps([bool(rewrites.products_measured), rewrites.use_cpu_rewrite()]))
synk.close()
"""


@pytest.mark.slow
def test_the_product_timing_is_measured_once_per_host_and_kept(tmp_path):
    decided = []
    for _ in range(2):
        out = run_script(PRODUCTS, timeout=240, args=[str(tmp_path / "cache")])
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        decided.append(json.loads(next(line[8:] for line in out.stdout.splitlines()
                                       if line.startswith("DECIDED "))))
    (measured_first, chosen_first), (measured_again, chosen_again) = decided
    assert measured_first and not measured_again          # the second run took the kept finding
    assert chosen_again == chosen_first


#: argv: directory A, directory B, "recreate" or "gone", JAX's directory. One process forks three
#: times: into A, into B after A was removed (and, with "recreate", made again empty), then with the
#: cache off. Prints what B and A hold after the second run, every file after the third, the results
RECACHE = """
import json, os, shutil, sys
import numpy as np, pytensor.tensor as pt
import synkhronos as synk
from synkhronos.compile import rewrites
first, second, recreate, told = sys.argv[1:5]


def files(*tops):
    return sorted(os.path.join(d, n) for top in tops for d, _, names in os.walk(top) for n in names)


x = pt.matrix("x")
X = np.arange(24.0).reshape(8, 3)
synk.fork(2, compile_cache=first)
rewrites.set_cpu_rewrite(False)
assert float(synk.function([x], (x.sum(), "sum"))(X)) == X.sum()
synk.close()
shutil.rmtree(first)
if recreate == "recreate":
    os.makedirs(first)
synk.fork(2, compile_cache=second)
f = synk.function([x], [((pt.tanh(x) * 3.0).sum(), "sum"), (pt.exp(x[:, :2]), "gather")], name="in_b")
gaps = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(f(X), f.as_pytensor(X))]
synk.close()
in_b, in_a = files(second), files(first)
before = files(first, second, told)
synk.fork(2, compile_cache=False)
g = synk.function([x], ((pt.cos(x) + 7.0).sum(), "sum"), name="off")
gaps.append(abs(float(g(X)) - float(g.as_pytensor(X))))
synk.close()
print("RESULT " + json.dumps(dict(gaps=gaps, in_b=in_b, in_a=in_a, before=before,
                                  after=files(first, second, told))))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("first_again", ["gone", "recreate"])
def test_a_second_fork_keeps_its_compiles_and_locks_in_its_own_cache(tmp_path, first_again):
    """fork(compile_cache=A), close, A removed, fork(compile_cache=B): every compile of the second
    runtime works, its entries and locks are in B only; then fork(compile_cache=False) writes nowhere."""
    first, second, told = tmp_path / "a", tmp_path / "b", tmp_path / "jax_told"
    told.mkdir()
    out = run_script(RECACHE, timeout=280, env={"JAX_COMPILATION_CACHE_DIR": str(told)},
                     args=[str(first), str(second), first_again, str(told)])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    got = json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")))
    assert max(got["gaps"]) < 1e-12
    assert any(name.endswith("-cache") for name in got["in_b"]), got["in_b"]
    assert not any(name.endswith(".lock") for name in got["in_b"]), got["in_b"]
    assert got["in_a"] == []
    assert got["after"] == got["before"]
    assert os.listdir(told) == []
