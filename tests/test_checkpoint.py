"""Checkpoints: save/restore on every device, atomic under SIGKILL, and train.run resuming exactly."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import N_PARALLEL, segments_left_behind, synk_segments
from helpers import run_script, source_env

import synkhronos as synk
from synkhronos.api import checkpoint
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_function(seed=0):
    rng = np.random.default_rng(seed)
    w = pytensor.shared(rng.normal(size=(3, 4)), name="w")
    v = pytensor.shared(np.zeros(4), name="v")
    x = pt.matrix("x")
    f = synk.function([x], ((x @ w + v).sum(), "sum"), updates=[(w, w * 1.5)], name="ck_small")
    return f, w, v


def test_save_and_restore_replicated_and_per_device_values(synk2, tmp_path):
    f, w, v = small_function()
    synk.distribute()
    f(np.ones((4, 3)))
    for rank in range(N_PARALLEL):
        synk.set_value(rank, v, np.full(4, float(rank)))          # differs per device
    w_saved = synk.get_value(0, w)
    path = tmp_path / "c.safetensors"
    synk.checkpoint.save(path, [w, v], step=12, extra={"epoch": 3, "order": [1, 2]})
    meta, extra, tensors = checkpoint.read(str(path))
    assert [e["per_rank"] for e in meta["variables"]] == [False, True] and extra["epoch"] == 3
    w.set_value(np.zeros((3, 4)))
    synk.broadcast(w)
    for rank in range(N_PARALLEL):
        synk.set_value(rank, v, np.full(4, -1.0))
    assert synk.checkpoint.restore(path, [w, v]) == {"step": 12, "extra": {"epoch": 3, "order": [1, 2]}}
    for rank in range(N_PARALLEL):
        np.testing.assert_array_equal(synk.get_value(rank, w), w_saved)
        np.testing.assert_array_equal(synk.get_value(rank, v), np.full(4, float(rank)))
    # the restored values compute what the saved ones did, on every device
    expected = sum((np.ones((2, 3)) @ w_saved + np.full(4, float(r))).sum() for r in range(N_PARALLEL))
    np.testing.assert_allclose(f(np.ones((4, 3))), expected, rtol=1e-12)


def test_a_ctrl_c_inside_restore_leaves_the_scripts_values_all_restored_or_none(synk2, tmp_path):
    """A SIGINT landing while restore sets the master's variables one by one: the script keeps
    every value of the checkpoint (replicated and its own per-device ones), never a mixture."""
    x = pt.matrix("x")
    many = [pytensor.shared(np.zeros(5), name=f"many_{i}") for i in range(6)]
    own = pytensor.shared(np.full(2, -1.0), name="own_per_device")
    synk.function([x], [(x.sum(), "sum")] + [(v.sum(), None) for v in many + [own]])
    synk.distribute()
    for rank in range(N_PARALLEL):
        synk.set_value(rank, own, np.full(2, float(rank)))
    path = tmp_path / "c.safetensors"
    synk.checkpoint.save(path, many + [own])
    for var in many:
        var.set_value(np.full(5, -1.0))
    own.set_value(np.full(2, -1.0))
    class_set = type(many[2]).set_value

    def interrupted(value, borrow=False):         # a Ctrl-C while the third of six is set
        os.kill(os.getpid(), signal.SIGINT)
        class_set(many[2], value, borrow)
    many[2].set_value = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            synk.checkpoint.restore(path, many + [own])
    finally:
        del many[2].set_value
    for var in many:
        np.testing.assert_array_equal(var.get_value(), np.zeros(5))
    np.testing.assert_array_equal(own.get_value(), np.zeros(2))      # the master's, rank 0's


def test_a_complex_variable_is_refused_naming_it_before_anything_is_written(synk2, tmp_path):
    z = pytensor.shared(np.ones(3, dtype="complex128"), name="z_complex")
    v = pt.vector("v")
    synk.function([v], [(v.sum(), "sum"), (z.real.sum(), None)])
    with pytest.raises(TypeError, match="z_complex holds complex128, which a checkpoint"):
        synk.checkpoint.save(tmp_path / "c.safetensors", [z])
    assert list(tmp_path.iterdir()) == []


def test_save_ships_functions_built_since_the_last_call(synk2, tmp_path):
    w = pytensor.shared(np.arange(3.0), name="w_new")
    synk.function([], (w.sum(), "sum"))                     # built, never called nor distributed
    synk.checkpoint.save(tmp_path / "c.safetensors", [w], step=1)
    w.set_value(np.zeros(3))
    synk.checkpoint.restore(tmp_path / "c.safetensors", [w])
    for rank in range(N_PARALLEL):
        np.testing.assert_array_equal(synk.get_value(rank, w), np.arange(3.0))


def test_default_variables_are_parameters_and_state_not_gradients_or_data(synk2, rng):
    X, y = pt.matrix("X"), pt.vector("y")
    w = pytensor.shared(np.zeros(3), name="w_default")
    loss = ((X @ w - y) ** 2).mean()
    step = train.make_train_function(loss, [w], X, y, updates.momentum, learning_rate=0.1)
    x_dev = pytensor.shared(np.zeros((2, 3)), name="x_dev_ckpt")
    synk.function([], (x_dev.sum(), "sum"), sliceable_shareds=[x_dev], name="ck_data")
    synk.distribute()
    default = {id(v) for v in checkpoint.default_variables()}
    grad, velocity = step.grad_shared, [s for s in step.functions[1].get_shared()
                                        if s is not w and s is not step.grad_shared]
    assert id(w) in default and velocity and all(id(v) in default for v in velocity)
    assert id(grad) not in default and id(x_dev) not in default


def test_restore_misuse_is_refused(synk2, tmp_path):
    f, w, v = small_function(1)
    synk.distribute()
    path = tmp_path / "c.safetensors"
    synk.checkpoint.save(path, [w, v])
    with pytest.raises(ValueError, match="holds 2 variables but 1 were given"):
        synk.checkpoint.restore(path, [w])
    with pytest.raises(ValueError, match="holds 'w' where 'v' was given"):
        synk.checkpoint.restore(path, [v, w])
    other = pytensor.shared(np.zeros(5), name="w")
    with pytest.raises(ValueError, match="not used by any synk.function"):
        synk.checkpoint.restore(path, [other, v])
    synk.function([], updates=[(other, other * 1.0)])
    with pytest.raises(ValueError, match=r"holds w as float64\[3, 4\] but it is float64\[5\] now"):
        synk.checkpoint.restore(path, [other, v])
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        synk.checkpoint.restore(tmp_path / "missing.safetensors", [w, v])
    with pytest.raises(TypeError, match="JSON-serializable"):
        synk.checkpoint.save(path, [w], extra={"f": object()})
    with pytest.raises(TypeError, match="checkpoints hold shared variables"):
        synk.checkpoint.save(path, [np.zeros(3)])
    assert synk.checkpoint.restore(path, [w, v])["step"] is None      # still usable


@pytest.mark.slow
def test_per_device_values_need_the_same_device_count(tmp_path):
    synk.close()
    try:
        synk.fork(N_PARALLEL)
        f, w, v = small_function(2)
        synk.distribute()
        synk.set_value(1, v, np.ones(4))
        path = tmp_path / "c.safetensors"
        synk.checkpoint.save(path, [w, v])
        synk.close()
        synk.fork(1)
        f, w, v = small_function(3)
        synk.distribute()
        with pytest.raises(ValueError, match="saved per device from 2 devices"):
            synk.checkpoint.restore(path, [w, v])
        synk.checkpoint.save(tmp_path / "r.safetensors", [w])      # replicated: any device count
        synk.close()
        synk.fork(N_PARALLEL)
        f, w2, _ = small_function(4)
        synk.distribute()
        synk.checkpoint.restore(tmp_path / "r.safetensors", [w2])
        for rank in range(N_PARALLEL):
            np.testing.assert_array_equal(synk.get_value(rank, w2), w.get_value())
    finally:
        synk.close()


WRITER = """
import sys, numpy as np
from synkhronos.api.checkpoint import _write_atomically
path = sys.argv[1]
big = np.zeros(4 << 20)
for step in range(1, 10**6):
    big[:] = step
    _write_atomically(path, {"big": big, "step": np.array(step)},
                      {"synkhronos": '{"version": 1, "n_devices": 1, "step": %d, "variables": []}' % step,
                       "extra": "null"})
    print(step, flush=True)
"""


@pytest.mark.slow
def test_a_kill_during_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """20 writers of 32 MB checkpoints, each SIGKILLed at a random point: the file is always whole."""
    path = str(tmp_path / "c.safetensors")
    env = source_env()
    rng = random.Random(0)
    last_step = 0
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path], env=env, stdout=subprocess.PIPE,
                                text=True)
        proc.stdout.readline()                           # one save done: kill in a later one
        time.sleep(rng.uniform(0, 0.3))
        proc.kill()
        proc.wait()
        meta, _, tensors = checkpoint.read(path)
        assert meta["step"] == int(tensors["step"]) and np.all(tensors["big"] == meta["step"])
        last_step = meta["step"]
    assert last_step >= 1


RUN = """
import json, os, signal, sys
import numpy as np, pytensor
pytensor.config.floatX = "float64"
import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from test_extensions import mlp
directory, out, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
rng = np.random.default_rng(0)
X, Y = rng.normal(size=(203, 6)), rng.integers(0, 3, size=203)
synk.fork(2)
x, y, loss, params, _ = mlp(seed=4)
step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.1)
synk.distribute()

def on_check(history):
    with open(out, "a") as fh:
        fh.write(json.dumps([history[-1].step, history[-1].loss]) + "\\n")
    if history[-1].step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
train.run(step, X, Y, 21, steps=40, check_every=4, on_check=on_check, checkpoint_dir=directory,
          checkpoint_every=8, resume=resume)
with open(out, "a") as fh:
    fh.write(json.dumps(["params"] + [p.get_value().tolist() for p in params]) + "\\n")
synk.close()
"""


def _records(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_same_losses(tmp_path):
    before = set(synk_segments())
    whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
    out = run_script(RUN, 200, args=[str(tmp_path / "a"), str(whole), "-1", "0"])
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_script(RUN, 200, args=[str(tmp_path / "b"), str(killed), "28", "0"])
    assert out.returncode == -signal.SIGKILL
    first = _records(killed)
    assert [s for s, _ in first] == [4, 8, 12, 16, 20, 24, 28]
    out = run_script(RUN, 200, args=[str(tmp_path / "b"), str(killed), "-1", "1"])
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = _records(killed)[len(first):]
    assert [s for s, _ in resumed[:-1]] == [28, 32, 36, 40]    # from the checkpoint at step 24
    expected = _records(whole)
    np.testing.assert_allclose([loss for _, loss in first[:6] + resumed[:-1]],
                               [loss for _, loss in expected[:-1]], rtol=1e-12, atol=1e-15)
    for a, b in zip(resumed[-1][1:], expected[-1][1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
    deadline = time.time() + 10                              # the killed run left nothing behind
    while segments_left_behind(before) and time.time() < deadline:
        time.sleep(0.1)
    assert not segments_left_behind(before)


@pytest.mark.slow
def test_run_checkpoint_misuse_is_refused(synk2, rng, tmp_path):
    from test_extensions import mlp
    x_np, y_np = rng.normal(size=(60, 6)), rng.integers(0, 3, size=60)
    X, y, loss, params, _ = mlp(seed=12)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        train.run(step, x_np, y_np, 10, steps=2, checkpoint_every=1)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive"):
        train.run(step, x_np, y_np, 10, steps=2, checkpoint_dir=tmp_path)
    train.run(step, x_np, y_np, 10, steps=4, checkpoint_dir=tmp_path, checkpoint_every=2, seed=1,
              sync=sync.Average(every=2))
    refused = {"seed is 1 in the checkpoint, 2 here": dict(seed=2, sync=sync.Average(every=2)),
               "Average.every is 2 in the checkpoint, 4 here": dict(seed=1, sync=sync.Average(every=4)),
               "the rule is Average in the checkpoint, DiLoCo here": dict(seed=1, sync=sync.DiLoCo(every=2))}
    for difference, differing in refused.items():
        with pytest.raises(ValueError, match=f"written by another run: {difference}; resume with"):
            train.run(step, x_np, y_np, 10, steps=4, checkpoint_dir=tmp_path, checkpoint_every=2,
                      resume=True, **differing)
    with pytest.raises(ValueError, match="written by another run: data_digest is '[0-9a-f]+' in the "
                                         "checkpoint, '[0-9a-f]+' here; resume with the same data"):
        train.run(step, x_np * 10, y_np, 10, steps=4, checkpoint_dir=tmp_path, checkpoint_every=2,
                  resume=True, seed=1, sync=sync.Average(every=2))      # other data, as many rows
    history = train.run(step, x_np, y_np, 10, steps=6, checkpoint_dir=tmp_path, checkpoint_every=2,
                        seed=1, resume=True, sync=sync.Average(every=2))
    assert [c.step for c in history] == [6]                  # resumed at step 4
    assert session.active() is not None


@pytest.mark.parametrize("taken", [pytest.param("checkpoint.safetensors", marks=pytest.mark.slow),
                                   "checkpoint.safetensors.partial"])
def test_a_directory_where_the_checkpoint_goes_is_refused_before_any_step(synk2, rng, tmp_path, taken):
    from test_extensions import mlp
    x_np, y_np = rng.normal(size=(60, 6)), rng.integers(0, 3, size=60)
    X, y, loss, params, _ = mlp(seed=12)
    step = train.make_train_function(loss, params, X, y, updates.adam, learning_rate=0.1)
    synk.distribute()
    before = [p.get_value() for p in step.state_variables]
    (tmp_path / taken).mkdir()
    for resume in (True, False):
        with pytest.raises(ValueError, match=f"{taken}' is a directory, where the run keeps its "
                                             f"checkpoint; remove it or give another checkpoint_dir"):
            train.run(step, x_np, y_np, 10, steps=3, checkpoint_dir=tmp_path, checkpoint_every=1,
                      resume=resume)
    for b, p in zip(before, step.state_variables):        # nothing ran
        np.testing.assert_array_equal(p.get_value(), b)
    (tmp_path / taken).rmdir()
    (tmp_path / taken).symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{taken}' is a link to nothing, where the run keeps"):
        train.run(step, x_np, y_np, 10, steps=3, checkpoint_dir=tmp_path, checkpoint_every=1)
    (tmp_path / taken).unlink()
    train.run(step, x_np, y_np, 10, steps=3, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert checkpoint.exists(tmp_path / "checkpoint.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("rule", [sync.Downpour(every=1), sync.EASGD(0.5, every=1, asynchronous=True),
                                  sync.RateLimited(every_n_batches=1, max_rate=1.0)], ids=repr)
def test_a_resumed_asynchronous_run_continues_its_steps_and_data_order(synk2, rng, tmp_path, rule,
                                                                       monkeypatch):
    """Resumed at step 4 of 8, the run trains steps 4..7 only, on the rows of those steps; the
    checkpoint is read once (what the run checks in it is what it restores)."""
    from test_extensions import mlp

    from synkhronos.api import checkpoint as api_checkpoint
    read = api_checkpoint.read
    x_np, y_np = rng.normal(size=(60, 6)), rng.integers(0, 3, size=60)
    X, y, loss, params, _ = mlp(seed=13)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    first = train.run(step, x_np, y_np, 10, steps=4, sync=rule, checkpoint_dir=tmp_path,
                      checkpoint_every=2, check_every=2)
    assert [c.step for c in first] == [2, 4] and [sum(c.rows_per_device) for c in first] == [20, 20]
    reads = []
    monkeypatch.setattr(api_checkpoint, "read", lambda path: reads.append(path) or read(path))
    resumed = train.run(step, x_np, y_np, 10, steps=8, sync=rule, checkpoint_dir=tmp_path,
                        checkpoint_every=2, check_every=2, resume=True)
    assert len(reads) == 1, reads
    assert [c.step for c in resumed] == [6, 8]
    # 4 steps of 10 rows, no more: the devices claim the units of steps 4 to 7, whose rows are
    # positions 40 to 79 of the epochs' orders
    assert [sum(c.rows_per_device) for c in resumed] == [20, 20]
    assert resumed[-1].epoch == pytest.approx(8 * 10 / 60)


def test_damaged_files_paths_and_arguments_are_named(synk2, tmp_path):
    f, w, v = small_function(seed=3)
    synk.distribute()
    path = str(tmp_path / "ck.safetensors")
    stray = pytensor.shared(np.zeros(2), name="stray")          # no function uses it
    with pytest.raises(ValueError, match="stray is not used by any synk.function"):
        checkpoint.save(path, [w, stray])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.save(str(tmp_path / "nowhere" / "ck.safetensors"), [w])
    with pytest.raises(TypeError, match="step must be a whole number"):
        checkpoint.save(path, [w], step="abc")
    open(path + ".partial", "wb").write(b"left by a killed save")      # reused, then renamed
    open(path + ".tmpl", "wb").write(b"the user's own")                # left alone
    checkpoint.save(path, [w, v], step=np.int64(5))
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors", "ck.safetensors.tmpl"]
    assert open(path + ".tmpl", "rb").read() == b"the user's own"
    assert checkpoint.restore(path, [w, v])["step"] == 5
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[:len(raw) // 2])                       # truncated
    with pytest.raises(ValueError, match=f"{path} is not a readable checkpoint"):
        checkpoint.restore(path, [w, v])
    open(path, "wb").write(raw.replace(b'per_rank', b'per_runk'))       # a damaged metadata key
    with pytest.raises(ValueError, match=f"{path} is not a readable checkpoint"):
        checkpoint.restore(path, [w, v])
    changed = bytearray(raw)
    changed[-3] ^= 0xFF                                               # a data byte changed
    open(path, "wb").write(bytes(changed))
    with pytest.raises(ValueError, match=r"the data of 'v' .* do not match their checksum"):
        checkpoint.restore(path, [w, v])
    assert session.active() is not None


def test_a_save_writes_regular_files_only_and_leaves_nothing_when_it_fails(synk2, tmp_path, monkeypatch):
    """A device, a pipe or a directory at the path is refused (a save would replace it with a file),
    a symbolic link keeps pointing at the file it names, which the save replaces, and a write that
    fails (a full disk) leaves the previous checkpoint and nothing beside it."""
    import safetensors.numpy
    f, w, v = small_function(seed=4)
    synk.distribute()
    pipe, directory = tmp_path / "pipe.safetensors", tmp_path / "dir.safetensors"
    os.mkfifo(pipe)
    directory.mkdir()
    for taken, kind in ((pipe, "not a regular file"), (directory, "a directory")):
        with pytest.raises(ValueError, match=f"{taken} is {kind}.*give the path of a checkpoint file"):
            checkpoint.save(taken, [w, v])
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match="is a symbolic link that does not resolve"):
        checkpoint.save(loop, [w, v])
    with pytest.raises(ValueError, match="ends with a separator"):
        checkpoint.save(f"{tmp_path}/new.safetensors/", [w, v])
    loop.unlink()
    assert pipe.is_fifo() and directory.is_dir()
    target, link = tmp_path / "run1.safetensors", tmp_path / "latest.safetensors"
    checkpoint.save(target, [w, v], step=1)
    link.symlink_to(target)
    checkpoint.save(link, [w, v], step=2)
    assert link.is_symlink() and checkpoint.read(target)[0]["step"] == 2
    assert checkpoint.restore(link, [w, v])["step"] == 2

    def disk_full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(target, [w, v], step=3)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dir.safetensors", "latest.safetensors", "pipe.safetensors", "run1.safetensors"]
    assert checkpoint.restore(target, [w, v])["step"] == 2
    assert session.active() is not None


def test_the_checksum_is_xxh3_and_files_checksummed_with_blake2b_still_read(synk2, tmp_path):
    """Files name their checksum (XXH3-128, at memory speed); a file without the name was written
    with blake2b and still restores, and a changed byte in it is still caught; a 0-d value keeps
    its shape."""
    import hashlib

    import xxhash
    from safetensors.numpy import save_file
    f, w, v = small_function(seed=4)
    count = pytensor.shared(np.int64(7), name="count")
    synk.function([], updates=[(count, count + 1)], name="ck_count")
    synk.distribute()
    path = str(tmp_path / "new.safetensors")
    checkpoint.save(path, [w, count], step=1)
    meta, _, tensors = checkpoint.read(path)
    assert meta["checksum"] == "xxh3_128" and tensors["1/count"].shape == ()
    assert meta["checksums"]["0/w"] == xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tensors["0/w"]).tobytes())
    old = {k: a.copy() for k, a in tensors.items()}
    old_meta = dict(meta, checksums={k: hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()
                                     for k, a in old.items()})
    del old_meta["checksum"], old_meta["header_checksum"]       # neither was written then
    old_path = str(tmp_path / "old.safetensors")
    save_file(old, old_path, metadata={"synkhronos": json.dumps(old_meta), "extra": "null"})
    w_saved = w.get_value()
    w.set_value(np.zeros((3, 4)))
    assert checkpoint.restore(old_path, [w, count])["step"] == 1
    np.testing.assert_array_equal(synk.get_value(1, w), w_saved)
    assert int(synk.get_value(1, count)) == 7
    raw = bytearray(open(old_path, "rb").read())
    raw[-3] ^= 0xFF
    open(old_path, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="do not match their checksum"):
        checkpoint.read(old_path)


def test_resuming_past_the_end_says_so(synk2, rng, tmp_path):
    from test_extensions import mlp
    x_np, y_np = rng.normal(size=(60, 6)), rng.integers(0, 3, size=60)
    X, y, loss, params, _ = mlp(seed=14)
    step = train.make_train_function(loss, params, X, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    train.run(step, x_np, y_np, 10, steps=4, checkpoint_dir=tmp_path, checkpoint_every=2)
    with pytest.warns(synk.SynkWarning, match="at step 4, at or past this run's end"):
        history = train.run(step, x_np, y_np, 10, steps=4, checkpoint_dir=tmp_path,
                            checkpoint_every=2, resume=True)
    assert len(history) == 0


def test_a_checkpoint_whose_metadata_changed_is_refused(synk2, tmp_path):
    """The step and extra are covered by a checksum, as the data are: an edited step is refused."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    w = pytensor.shared(np.arange(4.0), name="w")
    synk.function([], updates=[(w, w + 1)], name="touch_w")
    synk.distribute()
    path = str(tmp_path / "ckpt.safetensors")
    synk.checkpoint.save(path, [w], step=5, extra={"epoch": 1})
    with safe_open(path, "np") as fh:
        header, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    for key, edit in [("synkhronos", lambda m: m.replace('"step": 5', '"step": -7')),
                      ("extra", lambda m: m.replace('1', '2'))]:
        edited = dict(header, **{key: edit(header[key])})
        assert edited != header
        save_file(tensors, path + ".edited", metadata=edited)
        with pytest.raises(ValueError, match="its metadata .step, extra, layout. do not match their checksum"):
            synk.checkpoint.restore(path + ".edited", [w])
    assert synk.checkpoint.restore(path, [w])["step"] == 5


@pytest.mark.slow
def test_diloco_resumes_on_another_device_count_only_from_a_rounds_end():
    """DiLoCo weighs its outer step by each device's rows of the round: a checkpoint written in the
    middle of a round resumes on its own device count only (refused elsewhere before anything
    runs); one written at a round's end resumes on any count and trains on."""
    out = run_script("""
        import tempfile, numpy as np, synkhronos as synk
        from synkhronos.extensions import sync, train, updates
        from test_extensions import mlp
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(120, 6)), rng.integers(0, 3, size=120)
        rule, d, e = sync.DiLoCo(every=4, outer_lr=0.5, outer_momentum=0.0), tempfile.mkdtemp(), tempfile.mkdtemp()
        def session(n, **kwargs):
            synk.fork(n)
            try:
                X, Y, loss, params, _ = mlp(seed=4)
                step = train.make_train_function(loss, params, X, Y, updates.sgd, learning_rate=0.2)
                synk.distribute()
                return [c.loss for c in train.run(step, x, y, 20, sync=rule, check_every=2, **kwargs)]
            except ValueError as error:
                return str(error)
            finally:
                synk.close()
        session(1, steps=6, checkpoint_dir=d, checkpoint_every=6)          # 2 steps into a round
        print("MID:", session(2, steps=12, checkpoint_dir=d, checkpoint_every=6, resume=True))
        print("SAME:", session(1, steps=12, checkpoint_dir=d, checkpoint_every=6, resume=True)[-1] > 0)
        first = session(2, steps=8, checkpoint_dir=e, checkpoint_every=8)   # at a round's end
        resumed = session(1, steps=24, checkpoint_dir=e, checkpoint_every=8, resume=True)
        print("END:", first[-1], resumed[0], resumed[-1])
    """, timeout=240)
    lines = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if ":" in line}
    # (on several devices the devices' parameters differ inside a round: restore refuses them first)
    assert "written 2 steps into a DiLoCo round on 1 device," in lines.get("MID", ""), out.stdout + out.stderr
    assert "resume it on 1 device" in lines["MID"] and lines["SAME"] == "True", out.stdout
    at_checkpoint, first_after, last = map(float, lines["END"].split())
    assert last < at_checkpoint and first_after < 2 * at_checkpoint, lines["END"]


@pytest.mark.slow
def test_a_centred_rules_checkpoint_resumes_from_its_center_on_another_device_count():
    """Downpour and EASGD keep their center in the checkpoint: resumed on 2 devices from 3, every
    device starts from that center, and each keeps the optimizer's state of saved device r mod 3."""
    out = run_script("""
        import os, tempfile, warnings, numpy as np, synkhronos as synk
        from synkhronos.extensions import sync, train, updates
        from test_extensions import mlp
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(120, 6)), rng.integers(0, 3, size=120)
        def session(n, rule, directory, steps):
            synk.fork(n)
            try:
                X, Y, loss, params, _ = mlp(seed=4)
                step = train.make_train_function(loss, params, X, Y, updates.momentum, learning_rate=0.1)
                synk.distribute()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", synk.SynkWarning)     # nothing left to train
                    train.run(step, x, y, 24, steps=steps, sync=rule, checkpoint_dir=directory,
                              checkpoint_every=4, resume=True)
                return ([[synk.get_value(r, p) for p in params] for r in range(n)],
                        [[synk.get_value(r, s) for s in step.optimizer_state] for r in range(n)])
            finally:
                synk.close()
        for rule in (sync.Downpour(every=2), sync.EASGD(0.5, every=3)):
            d = tempfile.mkdtemp()
            session(3, rule, d, 4)
            _, _, tensors = synk.checkpoint.read(os.path.join(d, "checkpoint.safetensors"))
            held = len([k for k in tensors if k.startswith("array/rule/")])
            center = [tensors[f"array/rule/{i}"] for i in range(held)]
            saved_state = sorted(k for k in tensors if "@" in k and not k.startswith("array"))
            params, state = session(2, rule, d, 4)
            from_center = all(np.array_equal(p, c) for ps in params for p, c in zip(ps, center))
            keys = sorted({k.rsplit("@", 1)[0] for k in saved_state})
            by_rank = all(any(np.array_equal(s, tensors[f"{k}@{r}"]) for k in keys)
                          for r in range(2) for s in state[r])
            print(type(rule).__name__ + ":", len(center) > 0, from_center, len(saved_state) > 0, by_rank)
        d = tempfile.mkdtemp()                  # Average, 1 step into its round of 3: devices differ
        session(3, sync.Average(every=3), d, 6)
        try:
            session(2, sync.Average(every=3), d, 6)
        except ValueError as e:
            print("MID:", e)
    """, timeout=240)
    lines = {line.split(":")[0]: line.split(":", 1)[1].split() for line in out.stdout.splitlines() if ":" in line}
    for rule in ("Downpour", "EASGD"):
        assert lines.get(rule) == ["True"] * 4, out.stdout + out.stderr
    mid = " ".join(lines.get("MID", []))
    assert "was written on 3 devices whose parameters differed" in mid, out.stdout + out.stderr
    assert "resume it on 3 devices, or on 2 from a checkpoint where they agree" in mid, mid


def test_restore_takes_any_count_as_shared_variables_only(synk2, tmp_path):
    w = pytensor.shared(np.arange(4.0), name="w")
    synk.function([], updates=[(w, w + 1)], name="touch_w")
    synk.distribute()
    path = str(tmp_path / "ckpt.safetensors")
    synk.checkpoint.save(path, [w], step=1)
    for fine in (None, w, [w], iter([w]), ()):
        assert synk.checkpoint.restore(path, [w], any_count=fine)["step"] == 1
    with pytest.raises(TypeError, match="any_count takes shared variables .* got 'w'"):
        synk.checkpoint.restore(path, [w], any_count=["w"])
    with pytest.raises(TypeError, match="any_count takes shared variables .* got 5"):
        synk.checkpoint.restore(path, [w], any_count=5)
    other = pytensor.shared(np.zeros(4), name="other")
    with pytest.raises(ValueError, match="any_count names other, which is not among the variables "
                       "restored; .* give it in variables= too"):
        synk.checkpoint.restore(path, [w], any_count=[other])
    assert synk.checkpoint.restore(path, [w])["step"] == 1         # the runtime goes on


def test_exists_finds_a_checkpoint_file_and_nothing_else(tmp_path):
    """A directory at the path is no checkpoint; a file is (``restore`` reads what it holds)."""
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "a_file").write_bytes(b"junk")
    assert not synk.checkpoint.exists(tmp_path / "a_directory")
    assert not synk.checkpoint.exists(tmp_path / "nothing")
    assert synk.checkpoint.exists(tmp_path / "a_file")
