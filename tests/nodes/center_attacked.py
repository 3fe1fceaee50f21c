"""Run on two nodes (``... center_attacked.py OUT``): both train a linear model under ``Downpour``
while a stranger process on node 0 probes node 0's center server (``center_stranger.py``: junk,
wrong tokens, malformed requests, frames far over the bound). Node 0 starts the stranger at the
first check and waits for it at the fifth; the devices of both nodes keep exchanging with the
center meanwhile. Each node writes its final parameters on every device to OUT/node<R>.json, node
0 also the stranger's findings (OUT/stranger.json) and the server's process id."""

import json
import os
import subprocess
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

out = sys.argv[1]
n = synk.fork()
node, state = synk.node_rank(), session.current()
x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.05)
synk.distribute()
X = np.random.default_rng(0).normal(size=(400, 3))
Y = X @ np.array([1.0, 2.0, 3.0])
stranger, seen = None, {}


def check(history):
    global stranger
    if node != 0:
        return False
    if len(history) == 1:
        address = next(iter(state.loops._centers._routes.values()))
        seen["server_pid"] = state.loops._centers._server.pid
        stranger = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__),
                                                                  "center_stranger.py"),
                                     address, str(seen["server_pid"]),
                                     os.path.join(out, "stranger.json")])
    elif len(history) == 5:
        seen["stranger_code"] = stranger.wait(timeout=120)
    return False


try:
    train.run(step, X, Y, 20, epochs=30, sync=sync.Downpour(every=1), check_every=20,
              on_check=check, seed=1)
    seen["error"] = None
    seen["w"] = [synk.get_value(r, w).tolist() for r in range(n)]
    if node == 0:
        seen["server_alive"] = os.path.exists(f"/proc/{seen['server_pid']}")
except synk.WorkerError as e:
    seen["error"] = str(e)
finally:
    if stranger is not None and stranger.poll() is None:
        stranger.kill()
with open(os.path.join(out, f"node{node}.json"), "w") as f:
    json.dump(seen, f)
synk.close()
