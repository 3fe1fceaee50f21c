"""fork / close / distribute lifecycle: re-forking, clean shutdown, no leaks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL, child_pids, synk_segments
from helpers import close, run_script, source_env

import synkhronos as synk

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_second_fork_raises(synk2):
    with pytest.raises(RuntimeError, match="already called"):
        synk.fork(2)


@pytest.mark.slow
def test_close_leaves_nothing_and_fork_works_again(synk2, rng):
    prefix = synk2.prefix
    workers = list(synk2.worker_pids.values())
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(0), "sum"))
    d = synk.data(rng.normal(size=(5, 2)))
    f(d)
    assert any(n.startswith(prefix) for n in synk_segments())
    synk.close()
    synk.close()                                   # harmless
    assert not [n for n in synk_segments() if n.startswith(prefix)]
    alive = {pid for pid, state in child_pids() if state != "Z"}
    assert not alive & set(workers)
    for what in (lambda: f(d), lambda: synk.data(np.zeros(2)), lambda: synk.function([x], x.sum()),
                 lambda: d.set_value(np.zeros((1, 2)))):
        with pytest.raises(RuntimeError, match="closed"):
            what()
    assert synk.fork(N_PARALLEL) == N_PARALLEL     # again, in the same process
    g = synk.function([x], (x.sum(0), "sum"))
    X = rng.normal(size=(5, 2))
    close(g(X), X.sum(0))


@pytest.mark.slow
def test_fork_after_a_jax_computation_raises():
    out = run_script("""
        import jax.numpy as jnp, synkhronos as synk
        jnp.ones(2).sum().block_until_ready()
        try:
            synk.fork(2)
        except RuntimeError as e:
            print("RuntimeError:", e)
    """)
    assert "RuntimeError: a JAX backend" in out.stdout, out.stderr
    assert "before anything runs a JAX computation" in out.stdout


def test_counting_devices_creates_no_context():
    out = run_script("""
        import synkhronos as synk
        from synkhronos.platform import jax_init
        print(synk.get_n_devices(), synk.get_n_gpu(), jax_init.backend_exists())
    """)
    n, n_gpu, exists = out.stdout.split()
    assert int(n) >= 1 and int(n_gpu) == 0 and exists == "False", out.stderr


@pytest.mark.parametrize("collectives", ["shm", "jax"])
@pytest.mark.parametrize("host_faces", ["1", "0"],
                         ids=["host-faces", "device-values"])
@pytest.mark.slow
def test_close_lets_the_jax_backend_go_though_the_user_keeps_the_functions(host_faces, collectives):
    """What synkhronos keeps (functions, steps, Data, shared values) no longer holds JAX's backend
    after close(): a GPU's memory is given back, and the backend's watch of the coordination
    service ends before the service does (its failures would be logged at exit). With the JAX
    runtime's collectives (the default on GPUs) a step is one program over the runtime's mesh, and
    the loop's collectives run in a thread: neither may keep the mesh's devices, nor the threads
    stay; a gathered or reduced value the script keeps is an array of its own, not a view of a
    device array."""
    out = run_script(f"""
        import gc, threading, numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        from synkhronos.extensions import train, updates
        synk.fork(2, collectives="{collectives}")
        x, y = pt.matrix("x"), pt.vector("y")
        w = pytensor.shared(np.zeros(3), name="w_kept")
        loss = ((x @ w - y) ** 2).mean()
        step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
        f = synk.function([x, y], (loss, "avg"))
        X = np.random.default_rng(0).normal(size=(64, 3))
        xd, yd = synk.data(X), synk.data(X @ np.ones(3))
        for _ in range(3):
            step(X, X @ np.ones(3))
            f(xd, yd, batch=32)
        train.run(step, xd, yd, batch_size=16, steps=4)
        kept = [synk.gather(w), synk.reduce(w, op="sum", in_place=False)]    # kept, and the user's own
        for value in kept:
            value[...] = 0.0
        synk.close()
        gc.collect()
        print(sum(type(o).__name__ == "Client" for o in gc.get_objects()), float(w.get_value()[0]) > 0,
              [t.name for t in threading.enumerate() if t.name.startswith("synk")])
    """, env={"SYNK_HOST_FACES": host_faces})
    assert out.stdout.split() == ["0", "True", "[]"], out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_after_close_a_call_of_new_shapes_leaves_no_backend_and_as_pytensor_lets_fork_run_again():
    """The values a call of new shapes keeps to undo are let go at close(); as_pytensor after close
    computes in a backend of its own that goes with its result, so fork() runs again."""
    out = run_script("""
        import gc, numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        synk.fork(2)
        x = pt.vector("x")
        w = pytensor.shared(np.zeros(3), name="w_once")
        f = synk.function([x], (x.sum() + w.sum(), "sum"), updates=[(w, w + 1)])
        f(np.arange(4.0))                                   # once: its shapes are new
        synk.close()
        gc.collect()
        print(sum(type(o).__name__ == "Client" for o in gc.get_objects()))
        print(float(f.as_pytensor(np.arange(4.0))), w.get_value().tolist())
        synk.fork(2)
        g = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1)])
        print(float(g(np.arange(4.0))), np.asarray(synk.get_value(1, w)).tolist())
        synk.close()
    """, env={"SYNK_HOST_FACES": "0"})
    expected = ["0", "9.0 [2.0, 2.0, 2.0]", "6.0 [3.0, 3.0, 3.0]"]
    assert out.stdout.split("\n")[:3] == expected, out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_as_pytensor_after_close_goes_on_with_its_random_stream():
    out = run_script("""
        import numpy as np, pytensor, pytensor.tensor as pt
        from pytensor.tensor.random.utils import RandomStream
        import synkhronos as synk
        x = pt.matrix("x")
        def graph():
            return x.sum() + RandomStream(seed=1).normal(size=())
        X = np.zeros((4, 3))
        synk.fork(2)
        g = synk.function([x], (graph(), "sum"))
        got = [float(g.as_pytensor(X))]
        synk.close()
        got += [float(g.as_pytensor(X)) for _ in range(3)]
        plain = pytensor.function([x], graph(), mode="JAX")      # (its backend, made last, stays)
        want = [float(plain(X)) for _ in range(4)]
        print(np.allclose(got, want), len(set(got)))
    """)
    assert out.stdout.split() == ["True", "4"], out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_function_before_fork_and_exit_cleanup():
    out = run_script("""
        import os, numpy as np, pytensor.tensor as pt, synkhronos as synk
        x = pt.vector("x")
        try:
            synk.function([x], x.sum())
        except RuntimeError as e:
            print("before fork:", e)
        synk.fork(2)
        f = synk.function([x], (x.sum(), "sum"))
        print("sum", float(f(np.arange(5.0))))
        print("prefix", synk.runtime.session.current().prefix)
        # no close(): the atexit hook must clean up
    """)
    assert "before fork: synkhronos is not running; call synk.fork() first" in out.stdout, out.stderr
    assert "sum 10.0" in out.stdout, out.stderr
    prefix = out.stdout.split("prefix ")[1].split()[0]
    assert not [n for n in synk_segments() if n.startswith(prefix)]


@pytest.mark.slow
def test_a_worker_ends_as_a_python_process_ends(tmp_path):
    """What a process leaves to its exit is done in the workers as in the master: a file's buffered
    line written out, an atexit handler run, a non-daemon thread joined."""
    out = run_script("""
        import numpy as np, pytensor.tensor as pt
        import synkhronos as synk
        from helpers import LeavesWorkForTheExit
        synk.fork(2)
        x = pt.matrix("x")
        print("SUM", synk.function([x], (LeavesWorkForTheExit()(x).sum(), "sum"))(np.ones((4, 3))))
        synk.close()
        """, timeout=120, env={"SYNK_TEST_EXIT_DIR": str(tmp_path)})
    assert out.returncode == 0 and "SUM 12.0" in out.stdout, out.stdout + out.stderr[-3000:]
    pids = {name.split("-")[1] for name in os.listdir(tmp_path)}
    assert len(pids) == 2, sorted(os.listdir(tmp_path))            # the master and its worker
    for pid in pids:
        for kind, line in (("log", "rows"), ("atexit", "ran"), ("thread", "done")):
            with open(tmp_path / f"{kind}-{pid}") as fh:
                assert fh.read() == line + "\n", (kind, pid)


@pytest.mark.slow
def test_bad_fork_arguments():
    out = run_script("""
        import synkhronos as synk
        for kwargs in ({"n_parallel": 0}, {"n_parallel": 2, "master_rank": 2}, {"bogus": 1},
                       {"n_parallel": 2, "collectives": "mpi"}, {"n_parallel": 2, "stall_timeout": 0}):
            try:
                synk.fork(**kwargs)
            except (ValueError, TypeError) as e:
                print(type(e).__name__, e)
        print(synk.fork(2, master_rank=1))
        import numpy as np, pytensor.tensor as pt
        x = pt.vector("x")
        f = synk.function([x], [(x.sum(), "sum"), (x, None)])
        s, own = f(np.arange(6.0))
        print(float(s), own.tolist())
        synk.close()
    """)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ValueError n_parallel must be >= 1"), out.stderr
    assert lines[1].startswith("ValueError master_rank must be in [0, 2)")
    assert lines[2].startswith("TypeError fork() got unknown options ['bogus']")
    assert lines[3].startswith("ValueError collectives must be one of ['jax', 'shm']")
    assert lines[4].startswith("ValueError stall_timeout must be a positive number")
    assert lines[5] == "2"
    # with master_rank=1 the master computes the second half of the rows
    assert lines[6] == "15.0 [3.0, 4.0, 5.0]"
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("collectives", ["shm", "jax"])
def test_a_master_of_another_rank_runs_and_closes_cleanly(collectives):
    """With ``master_rank`` other than 0 the master is not JAX's process 0, which would serve the
    coordination service: a service of its own outlives the workers, so close() (and the script's
    end) leaves the JAX runtime cleanly, and fork() works again."""
    out = run_script(f"""
        import numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        for _ in range(2):
            synk.fork(3, master_rank=2, collectives={collectives!r})
            g = pytensor.shared(np.zeros(2), name="g")
            synk.function([], (g.sum(), "sum"))
            for rank in range(3):
                synk.set_value(rank, g, np.full(2, float(rank)))
            print(synk.gather(g, nd_up=0).tolist())
            synk.all_reduce(g, op="sum")
            print(g.get_value().tolist())
            synk.close()
        print("closed")
        synk.fork(3, master_rank=1, collectives={collectives!r})
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]", "[3.0, 3.0]"] * 2 + ["closed"], out
    assert not out.stderr, out.stderr         # (nor the service's notices)


@pytest.mark.slow
def test_profile_workers_writes_one_file_per_worker(tmp_path):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import numpy as np, pytensor.tensor as pt, synkhronos as synk
        synk.fork(2, profile_workers=True)
        x = pt.vector("x")
        f = synk.function([x], (x.sum(), "sum"))
        f(np.arange(4.0))
        synk.close()
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=source_env())
    assert out.returncode == 0, out.stderr
    import pstats
    stats = pstats.Stats(str(tmp_path / "synk_profile_rank1.prof"))
    assert any("run_share" in name for _, _, name in stats.stats)


def _thread_affinities(pid):
    """{thread id: set of allowed cores} of every thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:                # the thread ended meanwhile
            pass
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores to bind ranks to")
def test_each_rank_computes_on_its_own_cores_and_the_script_keeps_all(synk2, rng):
    """XLA's CPU pool is bound to the rank's cores, and so is the thread that runs its programs:
    a worker's main thread for good, the master's only during its part of a command."""
    cores = sorted(os.sched_getaffinity(0))
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(0), "sum"))
    f(synk.data(rng.normal(size=(6, 2))))          # the backends exist and have run
    assert os.sched_getaffinity(0) == set(cores)   # the user's thread is not pinned
    per_rank = {synk2.master_rank: os.getpid(), **synk2.worker_pids}
    for rank, pid in per_rank.items():
        share = {cores[(rank * synk2.settings.threads + i) % len(cores)] for i in range(synk2.settings.threads)}
        bound = [a for a in _thread_affinities(pid).values() if a == share]
        assert bound, f"rank {rank}: no thread bound to its cores {share}"
        if pid != os.getpid():
            assert os.sched_getaffinity(pid) == share, f"rank {rank}'s main thread is not on its cores"
        else:
            assert set(synk2.channel.local_cores) == share


def _share_of_time_on(cores, call, thread_id):
    """The share of samples, taken while ``call()`` ran, in which thread ``thread_id`` was bound
    to exactly ``cores``."""
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(os.sched_getaffinity(thread_id) == set(cores))
            time.sleep(1e-4)                     # leaves the GIL to the calls
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        call()
    finally:
        done.set()
        sampler.join()
    return sum(samples) / max(1, len(samples))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores to bind ranks to")
def test_the_master_computes_a_long_call_on_its_cores_and_a_tiny_one_anywhere(synk2, rng):
    """A call that took a millisecond or more runs, the next time, with the master's thread on
    its rank's cores; a tiny call does not pay for the binding; the script keeps every core."""
    cores = os.sched_getaffinity(0)
    share = synk2.channel.local_cores
    me = threading.get_native_id()
    x = pt.matrix("x")
    long_call = synk.function([x], ((pt.tanh(x @ x.T) @ x).sum(), "sum"), name="long_call")
    tiny_call = synk.function([x], (x.sum(), "sum"), name="tiny_call")
    big, small = synk.data(rng.normal(size=(1200, 600))), synk.data(rng.normal(size=(4, 2)))
    long_call(big), tiny_call(small), tiny_call(small)     # compiled; the long one measured
    assert _share_of_time_on(share, lambda: [long_call(big) for _ in range(3)], me) > 0.5
    # a tiny call slowed past the bound by a busy moment binds only the next one
    assert _share_of_time_on(share, lambda: [tiny_call(small) for _ in range(200)], me) < 0.2
    assert os.sched_getaffinity(0) == cores


def test_a_compile_runs_on_every_core_the_process_started_with_and_gives_them_back():
    """A rank's thread is bound to its cores; for an XLA compile it gets every core the process
    started with (the compile's own threads take them), and its cores back after."""
    from synkhronos.platform.cpu_tuning import on_cores, on_every_core
    cores = os.sched_getaffinity(0)
    one = [min(cores)]
    with on_cores(one):
        with on_every_core():
            assert os.sched_getaffinity(0) == cores
            seen = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start(), t.join()
            assert seen == [cores]                   # what XLA's compile threads get
        assert os.sched_getaffinity(0) == set(one)
        with pytest.raises(ZeroDivisionError):
            with on_every_core():
                1 / 0
        assert os.sched_getaffinity(0) == set(one)
    assert os.sched_getaffinity(0) == cores


def test_on_cores_binds_the_thread_for_the_block_and_gives_it_back():
    from synkhronos.platform.cpu_tuning import on_cores
    cores = os.sched_getaffinity(0)
    one = [min(cores)]
    with on_cores(one):
        assert os.sched_getaffinity(0) == set(one)
        seen = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start(), t.join()
        assert seen == [set(one)]                   # a thread started inside keeps the binding
        with on_cores(sorted(cores)):               # nested: bound once, by the outer block
            assert os.sched_getaffinity(0) == set(one)
        assert os.sched_getaffinity(0) == set(one)
    assert os.sched_getaffinity(0) == cores
    with on_cores(None):
        assert os.sched_getaffinity(0) == cores
    with pytest.raises(ZeroDivisionError):
        with on_cores(one):
            1 / 0
    assert os.sched_getaffinity(0) == cores


def test_a_joining_process_waits_for_the_coordination_service_to_listen_and_no_longer():
    """What fork()'s processes do before joining JAX's runtime: go on as soon as the service
    listens (IPv4, IPv6, a host name), stop waiting at the bound, and leave an address that is
    not host:port to JAX's own message."""
    import socket
    import time

    from synkhronos.platform.coordination import wait_until_served
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert wait_until_served(f"127.0.0.1:{port}", 1) and wait_until_served(f"localhost:{port}", 1)
    if socket.has_ipv6:
        try:
            server = socket.create_server(("::1", 0), family=socket.AF_INET6)
        except OSError:           # no IPv6 loopback here
            server = None
        if server is not None:
            with server:
                assert wait_until_served(f"[::1]:{server.getsockname()[1]}", 1)
    start = time.monotonic()
    assert not wait_until_served(f"127.0.0.1:{port}", 0.3)       # nothing listens there now
    assert 0.3 <= time.monotonic() - start < 2
    assert wait_until_served("no-port-here", 1)


@pytest.mark.slow
def test_a_ctrl_c_to_the_terminals_group_with_a_master_of_another_rank_leaves_fork_usable():
    """The terminal sends Ctrl-C to the whole process group: the coordination service's own
    process (``master_rank`` other than 0) ignores it and outlives every process of the runtime,
    so the master shuts down cleanly and forks again, as with ``master_rank=0``."""
    script = textwrap.dedent("""
        import numpy as np, pytensor.tensor as pt
        import synkhronos as synk
        synk.fork(2, master_rank=1)
        x = pt.matrix("x"); y = x
        for _ in range(20):
            y = pt.tanh(y @ y.T @ y / 100.0)
        f = synk.function([x], (y.sum(), "sum"))
        synk.distribute()
        X = np.random.default_rng(0).normal(size=(1200, 1200))
        print("ready", flush=True)
        try:
            for _ in range(100):
                f(X)
        except KeyboardInterrupt:
            synk.fork(2, master_rank=1)
            g = synk.function([x], (x.sum(), "sum"))
            print("again", float(g(np.ones((6, 2)))), flush=True)
            synk.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=source_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(2.0)                             # inside a call
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["again 12.0"], (out, err)
