"""Run on every node (``... asynchronous.py OUT [EPOCHS]``): the asynchronous rules across nodes.

1. One exchange each, at learning rate 0, from values set per device: what every device ends with
   (node 0's center) and every device's syncs, to compare with the rule's formula in numpy.
2. Resumed from a checkpoint at step 4 of 8 (``Downpour``): the steps of every check, and the rows.
3. Every asynchronous rule trains the digits MLP (``EPOCHS`` epochs, default 40): the test
   accuracy, and whether every device of every node ends holding the center.
Each node writes what it got to OUT/node<R>.npz.
"""

import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
from helpers import digits_step  # tests/ is on the path of every node script

import synkhronos as synk
from synkhronos.extensions import sync, train, updates

out_dir = sys.argv[1]
epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 40
out = {}
n = synk.fork()
node = synk.node_rank()

# --- one exchange per device, learning rate 0: only the rule moves the values ------------------------
EXCHANGE_RULES = {"easgd": sync.EASGD(0.5, every=1, asynchronous=True),
                  "downpour": sync.Downpour(every=1),
                  "rate_limited": sync.RateLimited(1, alpha=0.3, beta=0.6, max_rate=1.0)}
x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
still = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.0)

# --- the digits MLP ------------------------------------------------------------------------------------
data, step, params, (dx, dy, loss, accuracy) = digits_step("custom_mlp:1,128", updates.momentum, 0.05)
evaluate = synk.function([dx, dy], [(accuracy, "avg")], name="evaluate_digits")
synk.distribute()

X, Y = np.ones((4 * n, 3)), np.zeros(4 * n)
for name, rule in EXCHANGE_RULES.items():
    for rank in range(n):                     # device r starts from (r + 1) * [1, 2, 3]
        synk.set_value(rank, w, (rank + 1) * np.array([1.0, 2.0, 3.0]))
    history = train.run(still, X, Y, 4 * n, steps=1, sync=rule)
    out[f"{name}_center"] = np.stack([synk.get_value(r, w) for r in range(n)])
    out[f"{name}_exchange_rows"] = np.array(history[-1].rows_per_device)

# --- resumed from a checkpoint: the step count and the data order go on -------------------------------
checkpoints = os.path.join(out_dir, "checkpoints")
XR, YR = np.random.default_rng(3).normal(size=(60, 3)), np.zeros(60)
first = train.run(still, XR, YR, 10, steps=4, sync=sync.Downpour(), checkpoint_dir=checkpoints,
                  checkpoint_every=2, check_every=2)
resumed = train.run(still, XR, YR, 10, steps=8, sync=sync.Downpour(), checkpoint_dir=checkpoints,
                    checkpoint_every=2, check_every=2, resume=True)
out["resume_steps"] = np.array([c.step for c in first] + [c.step for c in resumed])
out["resume_rows"] = np.array([sum(c.rows_per_device) for c in list(first) + list(resumed)])

init = [p.get_value() for p in params]
stores = {k: synk.data(data[k]) for k in ("x_train", "y_train", "x_test", "y_test")}
TRAIN_RULES = {"easgd": sync.EASGD(alpha=0.5, every=4, asynchronous=True),
               "downpour": sync.Downpour(every=2),
               "rate_limited": sync.RateLimited(every_n_batches=2, alpha=0.5, beta=0.5, max_rate=0.5)}
for name, rule in TRAIN_RULES.items():
    for p, v in zip(params, init):
        p.set_value(v)
    for s in step.functions[1].get_shared():
        if all(s is not p for p in params):
            s.set_value(np.zeros_like(s.get_value()))
    synk.broadcast(list(step.functions[1].get_shared()))
    history = train.run(step, stores["x_train"], stores["y_train"], 128, epochs=epochs, sync=rule,
                        seed=1)
    out[f"{name}_accuracy"] = np.array(evaluate(stores["x_test"], stores["y_test"])[0])
    out[f"{name}_epochs"] = np.array(history[-1].epoch)
    out[f"{name}_rows"] = np.array(history[-1].rows_per_device)
    master = [np.asarray(v) for v in synk.get_value(0, params)]
    out[f"{name}_same_everywhere"] = np.array(all(
        np.array_equal(a, b) for r in range(1, n) for a, b in zip(synk.get_value(r, params), master)))

np.savez(os.path.join(out_dir, f"node{node}.npz"), **out)
synk.close()
