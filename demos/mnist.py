"""Train a digit classifier on many devices, as in the original Synkhronos MNIST demos.

Three variants of the same training:

- ``single``: one process, plain PyTensor (JAX backend) on the full batch: the baseline;
- ``cpu``:    data in shared memory (``synk.data``); every step, each device gathers its
              own rows of a shuffled global batch (``batch=``);
- ``device``: the training set is scattered once into device-resident shared variables
              (``sliceable_shareds``); every step, each device takes a shuffled batch of
              its own rows (``batch_s=``), global batch = per-device batch x devices.

Models (pytensor-ml layers): ``mlp``, ``bn_mlp`` (batch norm after every hidden layer),
``custom_mlp:DEPTH,WIDTH``, ``cnn``. The default data set is
scikit-learn's bundled 8x8 handwritten digits (no network needed); ``--data`` takes real MNIST as
a ``.npz`` (x_train, y_train, x_test, y_test) or a folder of the four IDX files.
Validation runs with ``num_slices``; the loss/accuracy curves are saved as a PNG.

``--loop device`` (variant ``cpu``) runs the training loop on the devices themselves
(``synkhronos.extensions.train.run``), synchronised by ``--sync``: ``allreduce``
(synchronous SGD), ``average`` (local SGD, averaging every 4 steps), ``diloco`` (an outer
Nesterov step every 8), ``easgd`` / ``easgd-async`` (elastic averaging every 4 steps),
``downpour`` (ASGD, pushing every 2 steps) or ``ratelimited`` (Legion's rule); the master
validates after every epoch. Every rule runs on several nodes too (``python -m synkhronos.launch``).

Examples
--------
    python demos/mnist.py --variant cpu --devices 2
    python demos/mnist.py --loop device --sync easgd-async --epochs 20
    python demos/mnist.py --variant device --model cnn --epochs 5
    python demos/mnist.py --variant single --model custom_mlp:3,256 --data mnist.npz
"""

import argparse
import contextlib
import gzip
import os
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

VARIANTS = ("single", "cpu", "device")
LOOPS = ("master", "device")
#: the sync rules of --loop device
SYNC_RULES = {
    "allreduce": lambda: sync.AllReduce(),
    "average": lambda: sync.Average(every=4),
    "diloco": lambda: sync.DiLoCo(every=8),
    "easgd": lambda: sync.EASGD(alpha=0.5, every=4),
    "easgd-async": lambda: sync.EASGD(alpha=0.5, every=4, asynchronous=True),
    "downpour": lambda: sync.Downpour(every=2),
    "ratelimited": lambda: sync.RateLimited(every_n_batches=2, alpha=0.5, beta=0.5, max_rate=0.5),
}


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

def _read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(folder, stem):
    for name in os.listdir(folder):
        if name.startswith(stem):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"no file starting with {stem!r} in {folder}")


def load_data(path=None, seed=0):
    """Return dict of train/val/test arrays: images flattened to float in [0, 1], int64 labels."""
    if path is None:
        from sklearn.datasets import load_digits
        d = load_digits()
        X, Y = d.data / 16.0, d.target.astype("int64")
        order = np.random.default_rng(seed).permutation(len(X))
        X, Y = X[order], Y[order]
        n_test = len(X) // 5
        x_train, y_train, x_test, y_test = X[n_test:], Y[n_test:], X[:n_test], Y[:n_test]
        side = 8
    else:
        if path.endswith(".npz"):
            z = np.load(path)
            x_train, y_train, x_test, y_test = (z[k] for k in ("x_train", "y_train", "x_test", "y_test"))
        else:
            x_train, y_train = _read_idx(_find(path, "train-images")), _read_idx(_find(path, "train-labels"))
            x_test, y_test = _read_idx(_find(path, "t10k-images")), _read_idx(_find(path, "t10k-labels"))
        side = x_train.shape[1]
        x_train = x_train.reshape(len(x_train), -1) / 255.0
        x_test = x_test.reshape(len(x_test), -1) / 255.0
        y_train, y_test = y_train.astype("int64"), y_test.astype("int64")
    n_val = len(x_train) // 10
    floatx = pytensor.config.floatX
    return dict(x_train=x_train[n_val:].astype(floatx), y_train=y_train[n_val:],
                x_val=x_train[:n_val].astype(floatx), y_val=y_train[:n_val],
                x_test=x_test.astype(floatx), y_test=y_test, side=side)


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------

def build_model(spec, side, n_classes=10, seed=0):
    """Build model ``spec`` for ``side`` x ``side`` images.

    Returns ``(make_graph, params, static)``: ``make_graph(rows)`` returns
    ``(x, y, loss, accuracy)`` for a batch of ``rows`` rows (``None``: any), all
    graphs sharing ``params``. ``static`` is True for models whose graph needs
    a fixed batch size under plain PyTensor's JAX mode (pytensor-ml's
    convolutions trace only with concrete shapes): the single-process variant
    builds one graph per batch size. synkhronos takes the graph with free rows
    and compiles it per row count itself.
    """
    from pytensor_ml.activations import ReLU
    from pytensor_ml.layers import (
        BatchNorm,
        Conv2D,
        Input,
        Linear,
        MaxPool2D,
        Sequential,
    )
    from pytensor_ml.loss import CrossEntropy, supervised_loss
    from pytensor_ml.pytensorf import (
        collect_graph_inputs,
        collect_trainable_params,
        rewrite_for_prediction,
    )

    n_in = side * side
    if spec == "bn_mlp":                         # batch norm after every hidden layer
        net = Sequential(Linear("h0", n_in=n_in, n_out=128), BatchNorm("bn0", n_in=128), ReLU(),
                         Linear("h1", n_in=128, n_out=128), BatchNorm("bn1", n_in=128), ReLU(),
                         Linear("out", n_in=128, n_out=n_classes))
        static = False
    elif spec == "mlp" or spec.startswith("custom_mlp"):
        depth, width = (2, 128) if spec == "mlp" else (int(v) for v in spec.split(":")[1].split(","))
        layers, prev = [], n_in
        for i in range(depth):
            layers += [Linear(f"h{i}", n_in=prev, n_out=width), ReLU()]
            prev = width
        net = Sequential(*layers, Linear("out", n_in=prev, n_out=n_classes))
        static = False
    elif spec == "cnn":
        k = 3 if side <= 8 else 5
        conv = Sequential(
            Conv2D("conv1", in_channels=1, out_channels=16, kernel_size=k, padding="same"), ReLU(),
            MaxPool2D("pool1", kernel_size=2),
            Conv2D("conv2", in_channels=16, out_channels=32, kernel_size=k, padding="same"), ReLU(),
            MaxPool2D("pool2", kernel_size=2))
        n_feat = 32 * (side // 4) ** 2
        head = Sequential(Linear("fc", n_in=n_feat, n_out=64), ReLU(),
                          Linear("out", n_in=64, n_out=n_classes))

        def net(x):
            features = conv(x.reshape((-1, side, side, 1)))
            return head(features.reshape((-1, n_feat)))
        static = True
    else:
        raise ValueError(f"unknown model {spec!r}: use mlp, bn_mlp, custom_mlp:DEPTH,WIDTH or cnn")

    graphs = {}

    def make_graph(rows=None, predicting=False):
        # one training graph per row count: pytensor-ml chains a stateful layer's statistics from
        # one application to the next, so batch norm's graph is built once and prediction derived
        if rows not in graphs:
            x = Input("x", shape=(rows if static else None, n_in))
            graphs[rows] = (x, net(x))
        x, logits = graphs[rows]
        if predicting:            # batch norm normalizes by its running statistics
            logits = rewrite_for_prediction(logits)
            x, = collect_graph_inputs(logits)      # the rewritten graph's own input
        loss, y = supervised_loss(logits, CrossEntropy(expect_logits=True))
        return x, y, loss, pt.mean(pt.eq(pt.argmax(logits, axis=-1), y))

    params = collect_trainable_params(make_graph(1 if static else None)[2])
    rng = np.random.default_rng(seed)            # same init for every variant
    for p in params:
        v = p.get_value()
        if v.ndim > 1:
            p.set_value((rng.normal(size=v.shape) * np.sqrt(2.0 / max(1, np.prod(v.shape[:-1])))).astype(v.dtype))
        elif not p.name.startswith("bn"):        # biases; batch norm keeps its scale of ones
            p.set_value(np.zeros_like(v))
    return make_graph, params, static


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------

def _evaluators(variant, make_graph, static, data, n_devices, num_slices=4):
    """Return evaluate(split) -> (loss, accuracy) over the whole split."""
    if variant == "single":
        fns = {}
        for split in ("val", "test"):
            x, y, loss, accuracy = make_graph(len(data[f"x_{split}"]) if static else None, predicting=True)
            fns[split] = pytensor.function([x, y], [loss, accuracy], mode="JAX")
        return lambda split: [float(v) for v in fns[split](data[f"x_{split}"], data[f"y_{split}"])]
    fns, store = {}, {}
    for split in ("val", "test"):
        x, y, loss, accuracy = make_graph(None, predicting=True)
        fns[split] = synk.function([x, y], [(loss, "avg"), (accuracy, "avg")], name=f"evaluate_{split}")
        store[split] = (synk.data(data[f"x_{split}"]), synk.data(data[f"y_{split}"]))
    return lambda split: [float(v) for v in fns[split](*store[split], num_slices=num_slices)]


def _stepper(variant, make_graph, static, params, data, lr, batch, n_devices):
    rule = updates.momentum
    x, y, loss, _ = make_graph(batch if static and variant == "single" else None)
    if variant == "single":
        step = train.make_single_process_train_function(loss, params, x, y, rule, learning_rate=lr)
        return lambda idx: step(data["x_train"][idx], data["y_train"][idx])
    if variant == "cpu":
        step = train.make_train_function(loss, params, x, y, rule, learning_rate=lr)
        x_dat, y_dat = synk.data(data["x_train"]), synk.data(data["y_train"])
        def do(idx):
            return step(x_dat, y_dat, batch=idx)
        do.state_variables = step.state_variables
        return do
    x_sh = pytensor.shared(data["x_train"][:1], name="x_device")
    y_sh = pytensor.shared(data["y_train"][:1], name="y_device")
    step = train.make_device_train_function(loss, params, x, y, x_sh, y_sh, rule, learning_rate=lr)
    synk.scatter([x_sh, y_sh], [data["x_train"], data["y_train"]])
    return step


def run(variant="cpu", model="mlp", epochs=10, batch=128, lr=0.05, devices=2, data_path=None,
        plot=None, seed=0, progress=True, loop="master", sync_rule="allreduce", checkpoint_dir=None,
        resume=False, timeline=None):
    """Train and return a dict with per-epoch curves, test accuracy and mean epoch time."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    if loop not in LOOPS or sync_rule not in SYNC_RULES:
        raise ValueError(f"loop must be one of {LOOPS} and sync one of {tuple(SYNC_RULES)}")
    if loop == "device" and variant != "cpu":
        raise ValueError("--loop device trains on data in shared memory: use it with --variant cpu")
    if checkpoint_dir is not None and variant == "single":
        raise ValueError("--checkpoint-dir saves synkhronos's devices: use it with --variant cpu or device")
    if timeline is not None and variant == "single":
        raise ValueError("--timeline records synkhronos's devices: use it with --variant cpu or device")
    data = load_data(data_path, seed)
    forked_here = False
    if variant != "single" and session.active() is None:
        synk.fork(devices)
        forked_here = True
    node = synk.node_rank() if variant != "single" else 0
    if node:                     # on several nodes (python -m synkhronos.launch), node 0 reports
        progress, plot, timeline = False, None, None
    recording = synk.timeline(timeline) if timeline else contextlib.nullcontext()
    with recording:
        history = _train(variant, model, epochs, batch, lr, data, seed, progress, loop, sync_rule,
                         checkpoint_dir, resume, plot)
    history["node"] = node
    if forked_here:
        synk.close()
    return history


def _train(variant, model, epochs, batch, lr, data, seed, progress, loop, sync_rule, checkpoint_dir,
           resume, plot):
    n_devices = 1 if variant == "single" else session.current().n_parallel
    make_graph, params, static = build_model(model, data["side"], seed=seed)
    step = None if loop == "device" else \
        _stepper(variant, make_graph, static, params, data, lr, batch, n_devices)
    evaluate = _evaluators(variant, make_graph, static, data, n_devices)
    if variant != "single":
        synk.distribute()
        synk.broadcast(params)                   # every device starts from the master's init
    rng = np.random.default_rng(seed + 1)
    history = dict(train_loss=[], val_loss=[], val_acc=[], epoch_time=[])
    if loop == "device":
        _device_loop(make_graph, params, data, lr, batch, epochs, SYNC_RULES[sync_rule](), seed,
                     evaluate, history, progress, checkpoint_dir, resume)
    else:
        _master_loop(variant, step, data, batch, epochs, n_devices, rng, evaluate, history, progress,
                     checkpoint_dir, resume)
    history["test_loss"], history["test_acc"] = evaluate("test")
    history["n_devices"] = n_devices
    history["params"] = [p.get_value() for p in params]       # the master's device's values
    if plot:
        label = f"{variant}" if loop == "master" else f"device loop, {sync_rule}"
        save_plot(history, plot, f"{model} / {label} / {n_devices} device(s)")
    return history


def _report(history, epoch, progress):
    if progress:
        print(f"epoch {epoch + 1:3d}  train loss {history['train_loss'][-1]:.4f}  "
              f"val loss {history['val_loss'][-1]:.4f}  val acc {history['val_acc'][-1]:.4f}  "
              f"{history['epoch_time'][-1]:.2f} s")


def _device_loop(make_graph, params, data, lr, batch, epochs, rule, seed, evaluate, history,
                 progress, checkpoint_dir=None, resume=False):
    """Every device runs its own steps (train.run); the master validates after every epoch."""
    x, y, loss, _ = make_graph(None)
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=lr)
    synk.distribute()
    x_dat, y_dat = synk.data(data["x_train"]), synk.data(data["y_train"])

    def on_check(h):
        check = h[-1]
        v_loss, v_acc = evaluate("val")
        history["train_loss"].append(check.loss)
        history["val_loss"].append(v_loss)
        history["val_acc"].append(v_acc)
        history["epoch_time"].append(check.time - (h[-2].time if len(h) > 1 else 0.0))
        _report(history, len(h) - 1, progress)
        return False
    per_epoch = train.steps_per_epoch(len(data["x_train"]), batch)
    history["run"] = train.run(step, x_dat, y_dat, batch, epochs=epochs, sync=rule, seed=seed,
                               on_check=on_check, checkpoint_dir=checkpoint_dir,
                               checkpoint_every=per_epoch if checkpoint_dir else None, resume=resume)
    history["run_params"] = params


def _master_loop(variant, step, data, batch, epochs, n_devices, rng, evaluate, history, progress,
                 checkpoint_dir=None, resume=False):
    """The master commands every step (three commands: gradient, all-reduce, update).

    With ``checkpoint_dir``, every epoch ends with a checkpoint; ``resume`` starts after the last.
    """
    path = os.path.join(checkpoint_dir, "mnist.safetensors") if checkpoint_dir else None
    first = 0
    if path:
        os.makedirs(checkpoint_dir, exist_ok=True)
        if resume and os.path.exists(path):
            first = synk.checkpoint.restore(path, step.state_variables)["step"]
            if progress:
                print(f"epoch {first:3d}  resumed from {path}")
    n_train = len(data["x_train"])
    steps_per_epoch = n_train // batch
    if variant == "device":
        lengths = synk.get_lengths("x_device")
        local = batch // n_devices
        steps_per_epoch = min(lengths) // local
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    for epoch in range(epochs):
        t0 = time.time()
        if variant == "device":
            perms = [rng.permutation(n) for n in lengths]
            if epoch < first:          # a resumed run draws the same orders from here on
                continue
            batches = [[p[i * local:(i + 1) * local] for p in perms] for i in range(steps_per_epoch)]
            do = lambda b: step(batch_s=b)                     # noqa: E731
        else:
            perm = rng.permutation(n_train)
            if epoch < first:
                continue
            batches = [perm[i * batch:(i + 1) * batch] for i in range(steps_per_epoch)]
            do = step
        it = tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                  disable=not progress) if tqdm else batches
        losses = [float(do(b)) for b in it]
        history["epoch_time"].append(time.time() - t0)
        v_loss, v_acc = evaluate("val")
        history["train_loss"].append(float(np.mean(losses)))
        history["val_loss"].append(v_loss)
        history["val_acc"].append(v_acc)
        _report(history, epoch, progress)
        if path:
            synk.checkpoint.save(path, step.state_variables, step=epoch + 1)


def save_plot(history, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = np.arange(1, len(history["val_loss"]) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(epochs, history["train_loss"], label="train")
    a.plot(epochs, history["val_loss"], label="validation")
    a.set_xlabel("epoch"), a.set_ylabel("loss"), a.legend()
    b.plot(epochs, history["val_acc"], color="tab:green")
    b.set_xlabel("epoch"), b.set_ylabel("validation accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS, default="cpu")
    p.add_argument("--model", default="mlp", help="mlp, bn_mlp, custom_mlp:DEPTH,WIDTH or cnn")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to train on (default: 2, or 1 where there is only one: a one-GPU machine)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data", default=None, help="MNIST .npz or IDX folder (default: bundled digits)")
    p.add_argument("--plot", default="demos/output/mnist_curves.png")
    p.add_argument("--loop", choices=LOOPS, default="master",
                   help="who drives the steps: the master (a command per step) or the devices")
    p.add_argument("--sync", choices=tuple(SYNC_RULES), default="allreduce",
                   help="the sync rule of --loop device")
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint there every epoch")
    p.add_argument("--resume", action="store_true", help="start from the checkpoint in --checkpoint-dir")
    p.add_argument("--timeline", default=None,
                   help="write every rank's timeline there (Chrome trace JSON: open it in Perfetto)")
    args = p.parse_args(argv)
    if args.devices is None:
        args.devices = 1 if args.variant == "single" else min(2, synk.get_n_devices())
    h = run(args.variant, args.model, args.epochs, args.batch, args.lr, args.devices, args.data,
            args.plot, loop=args.loop, sync_rule=args.sync, checkpoint_dir=args.checkpoint_dir,
            resume=args.resume, timeline=args.timeline)
    if h["node"]:
        return 0
    loop = "master loop" if args.loop == "master" else f"device loop, {args.sync}"
    print(f"test accuracy {h['test_acc']:.4f}  mean epoch time {np.mean(h['epoch_time']):.2f} s  "
          f"({args.model}, {args.variant}, {loop}, "
          f"{1 if args.variant == 'single' else h['n_devices']} device(s))")
    print(f"curves saved to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
