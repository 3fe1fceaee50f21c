"""ResNet-style training on synthetic images, with pytensor-ml's ResnetBlock2D.

The images are random noise with a class-dependent pattern added, so the
network has something to learn and nothing needs downloading. The parameters
are broadcast after ``distribute()`` so every device starts from the master's
initialization; the global batch is the per-device batch times the number of
devices; validation runs with ``num_slices``.

Examples
--------
    python demos/resnet_synthetic.py --devices 2 --epochs 3
"""

import argparse
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import train, updates


def synthetic_images(n, side, n_classes, seed):
    patterns = np.random.default_rng(1234).normal(size=(n_classes, side, side, 3))  # shared by all splits
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_classes, size=n)
    images = rng.normal(size=(n, side, side, 3)) + 1.5 * patterns[labels]
    return images.astype(pytensor.config.floatX), labels.astype("int64")


def build(side, n_classes, width):
    """Return make_graph(rows) -> (x, y, loss, accuracy) for ``rows`` rows (None: any) and the parameters."""
    from pytensor_ml.activations import ReLU
    from pytensor_ml.layers import Conv2D, Input, Linear, Sequential
    from pytensor_ml.loss import CrossEntropy, supervised_loss
    from pytensor_ml.models import ResnetBlock2D
    from pytensor_ml.pytensorf import collect_trainable_params

    body = Sequential(
        Conv2D("stem", in_channels=3, out_channels=width, kernel_size=3, padding="same"), ReLU(),
        ResnetBlock2D("block_0", in_channels=width, n_groups=4),
        ResnetBlock2D("block_1", in_channels=width, out_channels=2 * width, n_groups=4))
    head = Linear("head", n_in=2 * width, n_out=n_classes)

    def make_graph(rows):
        x = Input("x", shape=(rows, side, side, 3))
        features = body(x).mean(axis=(1, 2))                # global average pooling
        loss, y = supervised_loss(head(features), CrossEntropy(expect_logits=True))
        return x, y, loss, pt.mean(pt.eq(pt.argmax(head(features), axis=-1), y))

    return make_graph, collect_trainable_params(make_graph(1)[2])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-device-batch", type=int, default=16)
    p.add_argument("--side", type=int, default=8)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--train-size", type=int, default=512)
    args = p.parse_args(argv)

    n = synk.fork(args.devices)
    n_classes, slices = 4, 2
    X, Y = synthetic_images(args.train_size, args.side, n_classes, seed=0)
    n_val = n * slices * 16
    Xv, Yv = synthetic_images(n_val, args.side, n_classes, seed=1)
    make_graph, params = build(args.side, n_classes, args.width)
    global_batch = args.per_device_batch * n
    x, y, loss, _ = make_graph(None)          # free rows: each device's graph is compiled for its share
    step = train.make_train_function(loss, params, x, y, updates.adam, learning_rate=3e-3)
    xv, yv, v_loss, v_acc = make_graph(None)
    f_val = synk.function([xv, yv], [(v_loss, "avg"), (v_acc, "avg")], name="validate")
    synk.distribute()
    synk.broadcast(params)                                   # every device starts from the master's init
    x_dat, y_dat, xv_dat, yv_dat = synk.data(X), synk.data(Y), synk.data(Xv), synk.data(Yv)
    rng = np.random.default_rng(0)
    print(f"{n} devices, global batch {global_batch}, {sum(p.get_value().size for p in params)} parameters")
    for epoch in range(args.epochs):
        t = time.time()
        perm = rng.permutation(len(X))
        losses = [float(step(x_dat, y_dat, batch=perm[i:i + global_batch]))
                  for i in range(0, len(X) - global_batch + 1, global_batch)]
        vl, va = f_val(xv_dat, yv_dat, num_slices=slices)
        print(f"epoch {epoch + 1}  train loss {np.mean(losses):.4f}  val loss {float(vl):.4f}  "
              f"val acc {float(va):.3f}  {time.time() - t:.1f} s")
    synk.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
