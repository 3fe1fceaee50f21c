"""Run on two nodes (``... unservable.py OUT``): first a rule with a merge of its own, which node
0's center server cannot apply; then node 0's center server cannot start (its start is made to
fail with the OSError of a host it cannot bind). Both nodes' asynchronous ``train.run`` must raise
before any device runs, each time, and a synchronous run must then work; each node writes what
it saw to OUT/node<R>.json."""

import json
import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import centers

out = sys.argv[1]
synk.fork()
node = synk.node_rank()


def cannot_bind(self, host, on_death=None):
    raise OSError(f"the center's server could not bind {host} (made to fail by the test)")


class OwnMerge(sync.Downpour):
    def merge(self, center, pushed):
        center += 2 * pushed
        return center


x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.1)
synk.distribute()
X = np.random.default_rng(0).normal(size=(40, 3))
Y = X @ np.array([1.0, 2.0, 3.0])
seen = {}
try:
    train.run(step, X, Y, 10, steps=4, sync=OwnMerge())
    seen["own_merge"] = None
except ValueError as e:
    seen["own_merge"] = str(e)
centers.CenterServer.__init__ = cannot_bind
try:
    train.run(step, X, Y, 10, steps=4, sync=sync.Downpour())
    seen["error"] = None
except synk.WorkerError as e:
    seen.update(error=str(e), node=e.node)
history = train.run(step, X, Y, 10, steps=40)
seen["after"] = history[-1].loss
with open(os.path.join(out, f"node{node}.json"), "w") as f:
    json.dump(seen, f)
synk.close()
