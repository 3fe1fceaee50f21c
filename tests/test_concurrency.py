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


def test_a_child_made_by_os_fork_leaves_the_runtime_alone():
    """A forked helper exits normally; the parent's workers, segments and JAX runtime carry on."""
    out = run_script(FORKED_CHILD)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "CHILD True" in lines and "CHILD FORK True" in lines
    assert "STATUS 0" in lines
    assert lines[-2] == "24.0" and lines[-1] == "LEFT []", out.stdout


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
