"""Threads and processes of the user's own: several threads at once, os.fork(), fork() in a thread."""

import os
import signal
import threading

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL, synk_segments
from helpers import close, run_script, wait_until_dead

import synkhronos as synk
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(180)


def test_threads_calling_functions_and_collectives_at_once_each_get_their_own_results(synk2):
    """Calls and collectives from several threads are serialised: no result reaches the wrong caller."""
    x = pt.matrix("x")
    w = pytensor.shared(np.ones(3), name="w_threads")
    plain = synk.function([x], [(x.sum(), "sum")], name="plain")
    doubled = synk.function([x], [(2 * x.sum(), "sum")], updates=[(w, w + 1)], name="doubled")
    synk.distribute()
    wrong, errors = [], []

    def call(fn, factor, n):
        try:
            for i in range(n):
                X = np.full((5, 3), float(i + 1000 * factor))
                result = fn(X)
                if abs(result - factor * X.sum()) > 1e-9:
                    wrong.append((factor, i, result))
        except Exception as e:       # noqa: BLE001 - reported below
            errors.append(e)

    def reduce(n):
        try:
            for _ in range(n):
                synk.all_reduce(w, "avg")
        except Exception as e:       # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=call, args=(plain, 1, 150)),
               threading.Thread(target=call, args=(doubled, 2, 150)),
               threading.Thread(target=reduce, args=(100,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors and not wrong
    close(synk.get_value(1, w), np.full(3, 151.0))      # every update ran once on every rank
    close(synk.get_value(0, w), np.full(3, 151.0))


FORKED_CHILD = """
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import numpy as np, pytensor.tensor as pt
    from pytensor.tensor.random.utils import RandomStream
    import synkhronos as synk
    synk.fork(2)
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    noise = synk.function([x], [(RandomStream(seed=1).normal(size=x.shape), "gather")])
    noise(np.zeros((4, 2)))             # the compiler's thread pool has run
    print(f(np.ones((4, 3))), flush=True)
    pid = os.fork()
    if pid == 0:
        try:
            f(np.ones((4, 3)))
        except RuntimeError as e:
            print("CHILD", "os.fork" in str(e), flush=True)
        try:
            synk.fork(2)
        except RuntimeError as e:
            print("CHILD FORK", "spawn" in str(e), flush=True)
        sys.exit(0)                     # a normal exit: atexit handlers and finalizers run
    _, status = os.waitpid(pid, 0)
    print("STATUS", status, flush=True)
    print(f(np.full((4, 3), 2.0)), flush=True)
    prefix = synk.runtime.session.current().prefix
    synk.close()
    print("LEFT", [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], flush=True)
"""


@pytest.mark.slow
def test_a_child_made_by_os_fork_leaves_the_runtime_alone():
    """A forked helper exits normally; the parent's workers, segments and JAX runtime carry on."""
    out = run_script(FORKED_CHILD)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "CHILD True" in lines and "CHILD FORK True" in lines
    assert "STATUS 0" in lines
    assert lines[-2] == "24.0" and lines[-1] == "LEFT []", out.stdout


@pytest.mark.slow
def test_a_child_forked_while_another_thread_is_in_a_call_raises_instead_of_hanging(tmp_path):
    out = run_script("""
        import os, sys, threading, time, warnings
        warnings.simplefilter("ignore")
        import numpy as np, pytensor.tensor as pt, synkhronos as synk
        from helpers import InsideCall, wait_for_marker
        synk.fork(2)
        x, w = pt.matrix("x"), pt.matrix("w")
        # the master stays 3 s inside each call of this function, after saying it is inside
        held = InsideCall(sys.argv[1], os.getpid(), seconds=3)
        f = synk.function([x], ((held(x) @ w).sum(), "sum"), bcast_inputs=[w])
        X, W = np.ones((20, 4)), np.ones((4, 4))
        busy = threading.Thread(target=lambda: f(X, W))
        busy.start()
        wait_for_marker(sys.argv[1], os.getpid())     # the thread is in a call, holding the lock
        pid = os.fork()
        if pid == 0:
            try:
                f(X, W)
            except RuntimeError as e:
                print("CHILD", "os.fork" in str(e), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        busy.join()
        print("STATUS", status, flush=True)
        synk.close()
    """, timeout=150, args=[str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["CHILD True", "STATUS 0"], out.stdout


@pytest.mark.slow
def test_fork_in_a_thread_that_ends():
    """Workers started from a thread outlive it (no parent-death signal tied to that thread)."""
    out = run_script("""
        import threading, time, warnings
        warnings.simplefilter("ignore")
        import numpy as np, pytensor.tensor as pt, synkhronos as synk
        def start():
            synk.fork(2)
            time.sleep(0.5)         # the thread ends once the workers are well under way
        t = threading.Thread(target=start)
        t.start(); t.join()
        time.sleep(1.0)
        x = pt.matrix("x")
        print(synk.function([x], (x.sum(), "sum"))(np.ones((4, 3))), flush=True)
        synk.close()
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["12.0"]


@pytest.mark.slow
def test_sigterm_to_a_worker_is_named(synk2):
    rt = synk2
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    os.kill(rt.worker_pids[1], signal.SIGTERM)
    wait_until_dead(rt.worker_pids[1])
    with pytest.raises(synk.WorkerError, match="killed by SIGTERM") as info:
        f(np.ones((4, 3)))
    assert info.value.rank == 1 and info.value.how == "died"
    assert session.active() is None
    assert not [n for n in synk_segments() if n.startswith(rt.prefix)]
    synk.fork(N_PARALLEL)


def _watch(var, plain, stop, seen, expected_steps):
    """Read ``var`` every way another thread may until ``stop``; count what each read saw."""
    while not stop.is_set():
        for how in ("get_value", "borrow", "plain"):
            try:
                value = var.get_value() if how == "get_value" else \
                    var.get_value(borrow=True) if how == "borrow" else plain()
            except Exception as e:        # noqa: BLE001 - what a read raised is the finding
                seen[f"{how} raised {type(e).__name__}: {str(e)[:80]}"] += 1
                continue
            if how == "plain":
                # the mean of a completed step's values: a whole number of steps
                ok = float(value) in expected_steps
            else:
                ok = type(value) is np.ndarray and float(value.flat[0]) in expected_steps and \
                    bool((value == value.flat[0]).all())
            seen[f"{how} {'ok' if ok else 'wrong'}"] += 1


@pytest.mark.slow
def test_another_thread_reading_a_shared_variable_sees_numpy_values_of_a_completed_step(synk2):
    """A monitor thread reads a 2.4 MB ``w`` (whose updates would be donated) through ``get_value``,
    ``get_value(borrow=True)`` and a plain PyTensor function (PyTensor's default mode) while the
    main thread calls, steps a training function and all-reduces: every read is a numpy array of
    whole steps, and nothing raises."""
    import collections

    from synkhronos.extensions import train, updates
    w = pytensor.shared(np.zeros((600, 500)), name="w_watched")
    x = pt.matrix("x")
    count = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1.0)], name="counts")
    plain = pytensor.function([], w.mean())
    v = pytensor.shared(np.zeros(3), name="v_watched")
    y = pt.vector("y")
    step = train.make_train_function(((x @ v - y) ** 2).mean(), [v], x, y, updates.sgd,
                                     learning_rate=0.01)
    X, Y = synk.data(np.ones((8, 3))), synk.data(np.ones(8))
    n_calls = 150
    stop, seen = threading.Event(), collections.Counter()
    # named as synkhronos names its own threads: it is still the user's
    watcher = threading.Thread(target=_watch, args=(w, plain, stop, seen, set(map(float, range(n_calls + 1)))),
                               name="synk-monitor")
    watcher.start()
    try:
        for i in range(n_calls):
            count(X)
            if i % 10 == 0:
                step(X, Y)
                synk.all_reduce(w, op="avg")
    finally:
        stop.set()
        watcher.join(timeout=60)
    bad = {k: n for k, n in seen.items() if not k.endswith(" ok")}
    assert not bad, bad
    assert all(seen[f"{how} ok"] > 0 for how in ("get_value", "borrow", "plain")), seen
    close(w.get_value(), np.full((600, 500), float(n_calls)))
    for r in range(N_PARALLEL):
        close(synk.get_value(r, w), np.full((600, 500), float(n_calls)))
