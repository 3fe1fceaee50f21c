"""The digits training demo: three variants agree and reach 90% test accuracy."""

import os
import subprocess
import sys

import numpy as np
import pytest

import synkhronos as synk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "demos"))
import mnist  # noqa: E402
import tutorial_logreg  # noqa: E402
import tutorial_lstm  # noqa: E402
from helpers import close, source_env  # noqa: E402

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_three_variants_train_the_digits_mlp(synk2, tmp_path):
    runs = {v: mnist.run(v, "mlp", epochs=8, batch=128, lr=0.05, progress=False,
                         plot=str(tmp_path / f"{v}.png") if v == "cpu" else None)
            for v in mnist.VARIANTS}
    for variant, h in runs.items():
        assert h["test_acc"] >= 0.90, (variant, h["test_acc"])
    # the shared-memory variant takes the same global batches as the single process:
    # same curve, same parameters
    close(runs["cpu"]["train_loss"], runs["single"]["train_loss"], rtol=1e-8)
    for a, b in zip(runs["cpu"]["params"], runs["single"]["params"]):
        close(a, b, rtol=1e-6, atol=1e-9)
    # device data shuffles within each device, so it agrees statistically
    assert abs(runs["device"]["test_acc"] - runs["single"]["test_acc"]) < 0.05
    assert (tmp_path / "cpu.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_batch_norm_model_reaches_the_single_process_accuracy(synk2):
    """Batch norm's running statistics follow the global batches: prediction, which normalizes
    by them, is as good as the single process's."""
    runs = {v: mnist.run(v, "bn_mlp", epochs=10, batch=128, lr=0.05, progress=False)
            for v in ("single", "cpu")}
    assert runs["single"]["test_acc"] >= 0.95
    assert abs(runs["cpu"]["test_acc"] - runs["single"]["test_acc"]) <= 0.01, runs


@pytest.mark.slow
def test_the_ported_theano_tutorial_prints_the_single_process_numbers_epoch_by_epoch(tmp_path):
    """The givens/index logistic regression: synkhronos on 2 devices and plain PyTensor agree."""
    synk.close()
    printed = {}
    for variant in ("single", "synk"):
        lines = printed[variant] = []
        records, test_error = tutorial_logreg.sgd_optimization(
            variant, n_epochs=4, devices=2, model_path=str(tmp_path / f"{variant}.pkl"),
            out=lines.append)
    assert printed["synk"] == printed["single"]
    assert len(printed["synk"]) == 5 and "test error of the pickled model" in printed["synk"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("rule,epochs", [("allreduce", 8),
                                         # asynchronous: which device takes which batch follows their speed
                                         pytest.param("downpour", 20, marks=pytest.mark.serial)])
def test_the_device_loop_trains_the_digits_mlp(synk2, rule, epochs):
    """--loop device: the devices run the steps, the master validates every epoch."""
    h = mnist.run("cpu", "mlp", epochs=epochs, batch=128, lr=0.05, progress=False, loop="device",
                  sync_rule=rule)
    assert h["test_acc"] >= 0.90 and len(h["val_acc"]) == epochs
    assert h["run"][-1].epoch == epochs and h["train_loss"][-1] < h["train_loss"][0]
    for a, b in zip(h["params"], synk.get_value(1, list(h["run_params"]))):
        close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["master", "device"])
def test_the_demo_resumes_from_its_checkpoint_exactly(synk2, tmp_path, loop):
    """--checkpoint-dir D --resume: 2 epochs, then resumed to 4, ends where 4 straight epochs do."""
    options = dict(model="mlp", batch=128, lr=0.05, progress=False, loop=loop)
    straight = mnist.run("cpu", epochs=4, **options)
    mnist.run("cpu", epochs=2, checkpoint_dir=str(tmp_path), **options)
    resumed = mnist.run("cpu", epochs=4, checkpoint_dir=str(tmp_path), resume=True, **options)
    assert len(resumed["val_acc"]) == 2
    close(resumed["val_loss"], straight["val_loss"][2:], rtol=1e-9)
    for a, b in zip(resumed["params"], straight["params"]):
        close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_the_demo_writes_a_timeline(synk2, tmp_path):
    """--timeline: the demo's calls and steps on both ranks, in a file Perfetto opens."""
    import json
    path = tmp_path / "trace.json"
    mnist.run("cpu", "mlp", epochs=1, batch=128, lr=0.05, progress=False, timeline=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert {"train_grad", "train_update", "evaluate_val"} <= {e["name"] for e in events}


@pytest.mark.slow
@pytest.mark.parametrize("batch", [50, 128])
def test_the_cnn_trains_at_any_batch_size_exactly_as_one_process(synk2, batch):
    """Free rows: an uneven last split and num_slices=4 validation; the same curve as one process."""
    runs = {v: mnist.run(v, "cnn", epochs=1, batch=batch, lr=0.05, progress=False)
            for v in ("cpu", "single")}
    close(runs["cpu"]["train_loss"], runs["single"]["train_loss"], rtol=1e-8)
    close(runs["cpu"]["val_loss"], runs["single"]["val_loss"], rtol=1e-8)
    assert runs["cpu"]["test_acc"] == runs["single"]["test_acc"]


@pytest.mark.slow
def test_the_demo_prints_only_its_own_lines(tmp_path):
    """What `make demo` runs: no line from XLA, Gloo or the workers (tqdm's bars aside)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "demos", "mnist.py"), "--variant", "cpu",
                          "--devices", "2", "--epochs", "2", "--plot", str(tmp_path / "c.png")],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"})
    assert out.returncode == 0, out.stderr[-3000:]
    own = ("epoch ", "test accuracy ", "curves saved to ")
    stdout = [line for line in out.stdout.splitlines() if line.strip()]
    assert all(line.startswith(own) for line in stdout), stdout
    bars = ("it/s", "s/it", "%|")
    stderr = [line for line in out.stderr.replace("\r", "\n").splitlines()
              if line.strip() and not any(b in line for b in bars)]
    assert stderr == [], stderr


@pytest.mark.slow
def test_the_jax_runtime_collectives_print_nothing():
    """Gloo announces its connections on stdout; a script sees only its own lines."""
    from helpers import run_script
    out = run_script("""
        import numpy as np, pytensor, synkhronos as synk
        synk.fork(2, collectives="jax")
        v = pytensor.shared(np.ones(3), name="v")
        synk.function([], (v.sum(), "sum"))
        print("before", flush=True)
        synk.all_reduce(v)
        print("after", synk.get_value(1, v).sum(), flush=True)
        synk.close()
    """, env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n") == ["before", "after 3.0", ""] and out.stderr == "", (out.stdout, out.stderr)


def test_idx_and_npz_loaders(tmp_path, rng):
    images = rng.integers(0, 256, size=(30, 4, 4), dtype=np.uint8)
    labels = rng.integers(0, 10, size=30).astype(np.uint8)

    def idx(arr, code):
        header = bytes([0, 0, code, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
        return header + arr.tobytes()
    for stem, arr in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels),
                      ("t10k-images-idx3-ubyte", images[:10]), ("t10k-labels-idx1-ubyte", labels[:10])):
        (tmp_path / stem).write_bytes(idx(arr, 8))
    d = mnist.load_data(str(tmp_path))
    assert d["side"] == 4 and d["x_train"].shape == (27, 16) and d["x_test"].shape == (10, 16)
    close(d["x_val"][0] * 255, images[0].reshape(-1))
    np.savez(tmp_path / "m.npz", x_train=images, y_train=labels, x_test=images[:5], y_test=labels[:5])
    d = mnist.load_data(str(tmp_path / "m.npz"))
    assert d["y_test"].dtype == np.int64 and len(d["x_test"]) == 5


@pytest.mark.slow
@pytest.mark.parametrize("script", ["mnist.py", "demo_quickstart.py", "demo_1.py", "resnet_synthetic.py",
                                    "tutorial_logreg.py"])
def test_demo_scripts_have_help(script):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "demos", script), "--help"],
                         capture_output=True, text=True, timeout=60,
                         env=source_env())
    assert out.returncode == 0 and "usage" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [["demo_1.py"], ["demo_2.py"], ["demo_3.py"], ["demo_4.py"], ["demo_5.py"],
                                  ["resnet_synthetic.py", "--epochs", "1", "--train-size", "128"]],
                         ids=lambda a: a[0])
def test_tours_and_resnet_run_clean(args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "demos", args[0]), *args[1:]],
                         capture_output=True, text=True, timeout=300,
                         env=source_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout


def test_api_reference_is_current():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gen_api_docs
    with open(os.path.join(ROOT, "docs", "api.md")) as fh:
        assert fh.read() == gen_api_docs.render(), "docs/api.md is stale: run `make docs`"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ported_lstm_tutorial_prints_the_single_process_costs_and_pays_for_each_length_once():
    """lstm.py on 3 devices (time-major, split along the samples: 16 samples as 6, 5 and 5) gives
    the single-process costs batch by batch. Padded to each minibatch's own longest sequence, an
    epoch whose lengths were all met before takes at most 3x the epoch padded to one length (the
    scan's gradient needs concrete shapes: every length is built once per device, and kept)."""
    import pytensor
    synk.close()
    floatx, pytensor.config.floatX = pytensor.config.floatX, "float64"
    options = dict(epochs=2, n=320, batch_size=16, vocab=100, dim=8, maxlen=14, log=lambda line: None)
    try:
        single = tutorial_lstm.train("single", **options)
        unpadded = tutorial_lstm.train("synk", devices=3, **options)
        padded = tutorial_lstm.train("synk", devices=3, pad_to_maxlen=True, **options)
    finally:
        pytensor.config.floatX = floatx
    for (_, _, costs), (_, _, want) in zip(unpadded, single):
        close(costs, want, rtol=1e-9)
    lengths = tutorial_lstm.lengths_by_epoch(**options)
    met = set(lengths[0])
    assert set(lengths[1]) <= met, lengths          # the second epoch meets no new length
    assert unpadded[1][1] <= 3 * padded[1][1], (unpadded, padded)
