"""Shared fixtures: one 2-process runtime for the whole session (forking takes seconds)."""

import os
import shutil
import signal
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The suite tests the CPU path and simulates devices with processes, whatever accelerator the machine
# has: JAX_PLATFORMS=cpu makes fork()'s default the CPU, as it makes JAX's. The GPU tier (make
# test-gpu, SYNK_TEST_GPU=1) runs tests/test_gpu.py on the GPU instead.
if not os.environ.get("SYNK_TEST_GPU"):
    os.environ["JAX_PLATFORMS"] = "cpu"
# A suite started in the background (``nohup make test-all &``) inherits SIGINT ignored, and so
# would every process it starts, which keeps an ignored signal across exec: the Ctrl-C tests need
# it delivered
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import synkhronos as synk  # noqa: E402
from synkhronos.runtime import session  # noqa: E402

N_PARALLEL = 2

# Hypothesis: "dev" explores new examples at every run; "ci" (.ci/run sets HYPOTHESIS_PROFILE=ci)
# runs the same examples every time, so a CI failure reproduces
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
#: the suite's own compile cache (fork()'s default honours JAX's variable): the user's stays untouched,
#: and each suite starts cold. pytest-xdist's workers inherit the controller's (SUITE_CACHE): they
#: share one, as runs at once on one machine do, and the process that made it removes it.
SUITE_CACHE = "SYNK_TEST_COMPILE_CACHE"
_cache_made_here = SUITE_CACHE not in os.environ
if _cache_made_here:
    os.environ[SUITE_CACHE] = tempfile.mkdtemp(prefix="synk-test-compile-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SUITE_CACHE]


def synk_segments():
    """Names of synkhronos shared-memory segments currently in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("synk_"))


def segments_left_behind(before):
    """Segments that appeared since ``before`` and whose run has ended (the pid in the name is
    gone): what a test's runs left behind, whatever other runs on the machine hold meanwhile."""
    return {name for name in set(synk_segments()) - set(before) if not _alive(int(name.split("_")[1]))}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def child_pids(pid=None):
    """PIDs of live (non-zombie excluded? no: all) children of ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append((int(entry), fields[0]))
    return out


def worker_children():
    """Child processes that are synkhronos workers (resource trackers excluded)."""
    rt = session.active()
    return [p for p, _ in child_pids() if rt is None or p in set(rt.worker_pids.values())]


@pytest.fixture
def synk2(request):
    """A running 2-device runtime (re-forked if a test closed it or forked another count), of the
    test's ``comm_kind`` when it takes that fixture too, else of the default collectives."""
    kind = request.getfixturevalue("comm_kind") if "comm_kind" in request.fixturenames else "shm"
    active = session.active()
    if active is not None and (active.n_parallel != N_PARALLEL or active.comm_kind != kind):
        synk.close()
    if session.active() is None:
        synk.fork(N_PARALLEL, collectives=kind)
    yield session.current()


@pytest.fixture(scope="module", params=["shm", "jax"])
def comm_kind(request):
    """Run a module's tests under each collective implementation (both on CPU)."""
    rt = session.active()
    if rt is not None and rt.comm_kind != request.param:
        synk.close()
    if session.active() is None:
        synk.fork(N_PARALLEL, collectives=request.param)
    yield request.param
    if session.active() is not None and session.active().comm_kind != "shm":
        synk.close()   # leave the default runtime for the next modules


@pytest.fixture(scope="session", autouse=True)
def _close_at_end():
    yield
    synk.close()


def pytest_sessionfinish(session):
    """The process that made the suite's compile cache removes it (xdist's controller: after its
    workers have ended)."""
    if _cache_made_here:
        shutil.rmtree(os.environ[SUITE_CACHE], ignore_errors=True)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def no_jax_backend_left_in_the_test_process():
    """A test that leaves a JAX backend in the test process, with no runtime open, fails here: every
    later fork() in the same worker would be refused ("a JAX backend already exists"), far from it."""
    yield
    from synkhronos.platform.internals import jax_backend_exists
    if session.active() is None and jax_backend_exists():
        from jax.extend import backend
        backend.clear_backends()             # (the next tests fork as they would have)
        pytest.fail("this test left a JAX backend in the test process: run JAX code only in a runtime "
                    "(inside synk.fork()) or in a subprocess")


def pytest_collection_finish(session):
    """What collecting imported (JAX, PyTensor, PyMC, every test module) lives as long as the test
    process: frozen out of the collector, it is not walked again by every full collection (leaving a
    runtime collects until its backend is gone)."""
    import gc
    gc.collect()
    gc.freeze()
