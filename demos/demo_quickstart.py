"""Quick start: train softmax regression on scikit-learn's bundled digits on 2 devices.

Every step runs on all devices: each takes its share of a shuffled index
batch from shared-memory Data, computes its local gradient, and the row-weighted
average comes back to the master; an update function then applies the same
step on every device. Validation uses ``num_slices``. The script checks the
distributed loss against the single-process PyTensor function and exits
non-zero if they differ.

Run ``python demos/demo_quickstart.py --help`` for options.
"""

import argparse
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk


def load_digits():
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    X = (d.data / 16.0).astype("float32")
    return X, d.target.astype("int32")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="number of devices (processes)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.5)
    args = p.parse_args(argv)

    t0 = time.time()
    n = synk.fork(args.devices)
    print(f"forked {n} devices in {time.time() - t0:.1f} s")

    X, Y = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(X))
    n_val = len(X) // 5
    val, train = order[:n_val], order[n_val:]

    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    W = pytensor.shared(np.zeros((64, 10), "float32"), name="W")
    b = pytensor.shared(np.zeros(10, "float32"), name="b")
    p_y = pt.special.softmax(x @ W + b, axis=-1)
    loss = -pt.mean(pt.log(p_y[pt.arange(y.shape[0]), y]))
    acc = pt.mean(pt.eq(pt.argmax(p_y, axis=-1), y))
    gW, gb = pytensor.grad(loss, [W, b])
    f_grad = synk.function([x, y], [(loss, "avg"), (gW, "avg"), (gb, "avg")], name="grad")
    dW, db = pt.matrix("dW", dtype="float32"), pt.vector("db", dtype="float32")
    f_upd = synk.function([], bcast_inputs=[dW, db],
                          updates=[(W, W - args.lr * dW), (b, b - args.lr * db)], name="update")
    f_val = synk.function([x, y], [(loss, "avg"), (acc, "avg")], name="validate")
    synk.distribute()

    x_dat, y_dat = synk.data(X), synk.data(Y)
    for epoch in range(args.epochs):
        t = time.time()
        perm = rng.permutation(train)
        losses = []
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            batch_loss, g_W, g_b = f_grad(x_dat, y_dat, batch=perm[i:i + args.batch])
            f_upd(g_W, g_b)
            losses.append(float(batch_loss))
        v_loss, v_acc = f_val(x_dat, y_dat, batch=val, num_slices=4)
        print(f"epoch {epoch + 1:2d}  train loss {np.mean(losses):.4f}  val loss {float(v_loss):.4f}  "
              f"val acc {float(v_acc):.3f}  ({time.time() - t:.2f} s)")

    ref_loss, ref_acc = f_val.as_pytensor(X[val], Y[val])
    ok = np.isclose(v_loss, ref_loss, rtol=1e-5) and np.isclose(v_acc, ref_acc)
    print(f"distributed val loss {float(v_loss):.6f} vs single-process {float(ref_loss):.6f}: "
          f"{'match' if ok else 'MISMATCH'}")
    synk.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
