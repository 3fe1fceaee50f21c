"""Shared memory: a full /dev/shm is an exception, Data go with their last reference, staging is let go."""

import gc
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import synk_segments
from helpers import close, source_env

import synkhronos as synk
from synkhronos.api.data import STAGING_KEEP_BYTES

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _private_shm_works():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


def run_with_small_shm(code, size="64m"):
    """Run ``code`` in a mount namespace of its own whose /dev/shm is a tmpfs of ``size``."""
    python = f"{sys.executable} -c '{textwrap.dedent(code)}'"
    return subprocess.run(["unshare", "-m", "sh", "-c",
                           f"mount -t tmpfs -o size={size} tmpfs /dev/shm && {python}"],
                          capture_output=True, text=True, timeout=120, env=source_env())


FULL_SHM = """
import os, numpy as np, pytensor.tensor as pt, synkhronos as synk
synk.fork(2)
x = pt.matrix("x")
f = synk.function([x], (x.sum(), "sum"))
print(f(np.ones((4, 3))), flush=True)
before = sorted(os.listdir("/dev/shm"))
for what, make in [("DATA", lambda: synk.data(np.ones((1600000, 8)))),
                   ("ARGUMENT", lambda: f(np.ones((1600000, 8))))]:
    try:
        make()
        print(what, "no error", flush=True)
    except MemoryError as e:
        print(what, "/dev/shm" in str(e) and "--shm-size" in str(e), flush=True)
    print("NOTHING NEW", set(os.listdir("/dev/shm")) <= set(before), flush=True)
print(f(np.full((4, 3), 2.0)), flush=True)
prefix = synk.runtime.session.current().prefix
synk.close()
print("LEFT", [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _private_shm_works(), reason="needs root and unshare -m for a private /dev/shm")
def test_a_full_dev_shm_raises_memory_error_and_leaves_nothing_half_made():
    """100 MB into a 64 MB /dev/shm (Docker's default): MemoryError, not SIGBUS; still usable."""
    out = run_with_small_shm(FULL_SHM)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == ["12.0", "DATA True", "NOTHING NEW True",
                                           "ARGUMENT True", "NOTHING NEW True", "24.0", "LEFT []"], out.stdout


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_data_is_freed_with_its_last_reference(synk2, rng):
    rt = synk2
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    f(synk.data(np.ones((2, 2))))
    gc.collect()
    f(np.ones((2, 2)))

    def own_segments():               # this runtime's only: other runs on the machine may have theirs
        return [n for n in synk_segments() if n.startswith(rt.prefix)]
    segments, fds = len(own_segments()), [_fds(os.getpid())] + [_fds(pid) for pid in rt.worker_pids.values()]
    for i in range(40):                        # 2 MB each, mapped by every rank
        X = rng.normal(size=(1000, 256))
        close(f(synk.data(X)), X.sum(), rtol=1e-9)
    gc.collect()
    close(f(np.ones((3, 2))), 6.0)            # the workers let go before this command
    assert len(own_segments()) == segments
    now = [_fds(os.getpid())] + [_fds(pid) for pid in rt.worker_pids.values()]
    assert all(n <= before + 2 for n, before in zip(now, fds)), (fds, now)
    kept = synk.data(np.arange(6.0).reshape(3, 2))      # a Data still referenced stays usable
    gc.collect()
    close(f(kept), 15.0)


def test_large_numpy_arguments_do_not_hold_shared_memory_after_the_call(synk2):
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros((2, 8)), name="w_staging")
    f = synk.function([x], (x.sum(), "sum"), updates=[(w, w)])
    f(np.ones((4, 8)))
    synk.all_reduce(w)                               # the collectives' own regions exist
    prefix = synk2.prefix

    def synk_segments_here():
        return [n for n in synk_segments() if n.startswith(prefix)]
    segments = synk_segments_here()
    rows = STAGING_KEEP_BYTES // 64 + 1000           # just over the threshold, as float64 x 8
    close(f(np.ones((rows, 8))), 8.0 * rows)
    assert set(synk_segments_here()) <= set(segments)     # the large staging segment is gone
    synk.scatter(w, np.ones((rows, 8)))
    assert set(synk_segments_here()) <= set(segments)
    close(synk.get_value(1, w), np.ones((rows - rows // 2, 8)))
    close(f(np.ones((4, 8))), 32.0)                  # small arguments still staged and kept


def test_a_pooled_buffer_is_reused_only_once_nothing_views_it():
    """A slice of a loan, or a device array adopting it, keeps the buffer from being handed out again."""
    import time

    import jax

    from synkhronos.ipc.buffers import BufferPool
    pool = BufferPool(min_bytes=1024)

    def next_address():
        return pool.empty((4096,), np.float64).ctypes.data

    first = pool.empty((4096,), np.float64)
    address = first.ctypes.data
    part = first[10:20]
    del first
    while_sliced = next_address()
    del part
    again = pool.empty((4096,), np.float64)
    freed = again.ctypes.data
    adopted = jax.device_put(again, jax.devices("cpu")[0])
    zero_copy = adopted.unsafe_buffer_pointer() == address
    del again
    while_adopted = next_address()
    del adopted
    deadline = time.time() + 5           # JAX lets go of an adopted buffer a little after the array
    after = next_address()
    while after != address and time.time() < deadline:
        gc.collect()                     # the device array may sit in a reference cycle
        time.sleep(0.01)
        after = next_address()
    assert while_sliced != address       # the slice still viewed it
    assert freed == address              # then it was free
    assert zero_copy                     # adopted by the device, not copied
    assert while_adopted != address      # the device array viewed it
    assert after == address              # free again once the device array was gone


GROW_FAILS = """
import numpy as np, pytensor.tensor as pt, synkhronos as synk
synk.fork(2)
x = pt.matrix("x")
f = synk.function([x], (x.sum(), "sum"))
rows = np.arange(24.0).reshape(8, 3)
d = synk.data(rows)
for what, grow in [("SET_VALUE", lambda: d.set_value(np.ones((2000000, 3)))),
                   ("SET_LENGTH", lambda: d.set_length(2000000))]:
    try:
        grow()
        print(what, "no error", flush=True)
    except MemoryError:
        print(what, "MemoryError", flush=True)
    print("KEPT", np.array_equal(d.data, rows), float(f(d)) == rows.sum(), flush=True)
synk.close()
"""


@pytest.mark.slow
@pytest.mark.skipif(not _private_shm_works(), reason="needs root and unshare -m for a private /dev/shm")
def test_a_data_that_cannot_grow_keeps_its_rows():
    """Growing past a 32 MB /dev/shm raises MemoryError, and the Data keeps its rows for the next call."""
    out = run_with_small_shm(GROW_FAILS, size="32m")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == ["SET_VALUE MemoryError", "KEPT True True",
                                           "SET_LENGTH MemoryError", "KEPT True True"], out.stdout


def test_names_another_process_holds_are_skipped(synk2):
    """Files made in /dev/shm under the run's next segment names (another local user can list the
    run's prefix) are skipped: new Data, numpy arguments and a Data's growth all work, the
    strangers' files are left alone, and no data is lost."""
    rt = synk2
    first = rt.data._next_id
    squatted = [f"/dev/shm/{rt.prefix}_d{i}g{g}" for i in range(first, first + 40) for g in range(1, 4)]
    squatted += [f"/dev/shm/{rt.prefix}_ixg{g}" for g in range(rt.data.indices.gen + 1, rt.data.indices.gen + 4)]
    made = []
    try:
        for path in squatted:
            if not os.path.exists(path):
                with open(path, "wb"):
                    made.append(path)
        x = pt.matrix("x")
        f = synk.function([x], (x.sum(), "sum"))
        X = np.arange(12.0).reshape(4, 3)
        d = synk.data(X)
        assert float(f(d)) == X.sum()
        assert float(f(2 * X)) == 2 * X.sum()
        d.set_length(400)
        np.testing.assert_array_equal(d.data[:4], X)
        assert float(f(d)) == X.sum()
        assert all(os.path.getsize(p) == 0 for p in made)      # never written, never ours
    finally:
        for path in made:
            os.unlink(path)


SQUATTED_CLOSE = """
import os, numpy as np, pytensor.tensor as pt, synkhronos as synk
from synkhronos.runtime import session
synk.fork(2)
prefix = session.current().prefix
names = [f"{prefix}_{k}1g{g}" for k in "rw" for g in range(1, 6)]
names += [f"{prefix}_d{i}g{g}" for i in range(6) for g in range(1, 4)]
made = []
for name in names:
    path = "/dev/shm/" + name
    if not os.path.exists(path):
        open(path, "wb").close()
        os.chown(path, 65534, 65534)          # another user's (nobody)
        made.append(path)
x = pt.matrix("x")
f = synk.function([x], (x * 2, "gather"))
for rows in (4, 4000, 40000):                 # results that make the workers grow their segments
    X = np.ones((rows, 8))
    assert np.array_equal(f(X), 2 * X)
synk.close()
print("KEPT", all(os.path.exists(p) for p in made), len(made) > 0)
for p in made:
    os.unlink(p)
print("LEFT", [n for n in os.listdir("/dev/shm") if n.startswith(prefix)])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files as another user")
@pytest.mark.slow
def test_close_leaves_another_users_files_under_the_runs_names():
    from helpers import run_script
    out = run_script(SQUATTED_CLOSE, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KEPT True True" in out.stdout and "LEFT []" in out.stdout, out.stdout
