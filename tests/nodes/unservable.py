"""Run on two nodes (``... unservable.py OUT``): node 0's center server cannot start (its start is
made to fail with the OSError of a host it cannot bind): both nodes' asynchronous ``train.run``
must raise before any device runs, and a synchronous run must then work. Then, with the server
back, a rule of this script with a merge of its own trains across the nodes: node 0's server
merges the other node's pushes with it. Each node writes what it saw to OUT/node<R>.json."""

import json
import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime.centers import process

out = sys.argv[1]
synk.fork()
node = synk.node_rank()


def cannot_bind(self, host, on_death=None):
    raise OSError(f"the center's server could not bind {host} (made to fail by the test)")


class OwnMerge(sync.Downpour):
    """Every push sets the center to 42: no rule of synkhronos merges so."""

    def merge(self, center, pushed):
        center[...] = 42.0
        return center


x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.1)
synk.distribute()
X = np.random.default_rng(0).normal(size=(40, 3))
Y = X @ np.array([1.0, 2.0, 3.0])
seen = {}
starts = process.CenterServer.__init__
process.CenterServer.__init__ = cannot_bind
try:
    train.run(step, X, Y, 10, steps=4, sync=sync.Downpour())
    seen["error"] = None
except synk.WorkerError as e:
    seen.update(error=str(e), node=e.node)
history = train.run(step, X, Y, 10, steps=40)
seen["after"] = history[-1].loss
process.CenterServer.__init__ = starts
train.run(step, X, Y, 10, steps=8, sync=OwnMerge(every=1))
seen["own_merge"] = w.get_value().tolist()
with open(os.path.join(out, f"node{node}.json"), "w") as f:
    json.dump(seen, f)
synk.close()
