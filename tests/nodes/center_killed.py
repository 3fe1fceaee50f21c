"""Run on two nodes (``... center_killed.py OUT``): both train under ``Downpour`` and node 0
SIGKILLs its center server 0.2 s after the first check, in the middle of a phase. Each node
writes the error it got, and when, to OUT/node<R>.json (node 0 also when it killed the server,
OUT/killed_at.txt), and its processes to OUT/pids<R>.json."""

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

out = sys.argv[1]
synk.fork()
node, state = synk.node_rank(), session.current()
with open(os.path.join(out, f"pids{node}.json"), "w") as f:
    json.dump([os.getpid()] + list(state.worker_pids.values()), f)
x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.01)
synk.distribute()
X = np.random.default_rng(0).normal(size=(400, 3))
Y = X @ np.array([1.0, 2.0, 3.0])


def kill_server(pid):
    with open(os.path.join(out, "killed_at.txt"), "w") as f:
        f.write(repr(time.time()))
    os.kill(pid, signal.SIGKILL)


def check(history):
    if node == 0 and len(history) == 1:
        pid = state.loops._centers._server.pid
        with open(os.path.join(out, "server_pid.txt"), "w") as f:
            f.write(str(pid))
        threading.Timer(0.2, kill_server, (pid,)).start()
    return False


seen = {}
try:
    train.run(step, X, Y, 20, steps=10**6, sync=sync.Downpour(every=1), check_every=20,
              on_check=check, seed=1)
    seen["error"] = None
except synk.WorkerError as e:
    seen.update(error=str(e), node=e.node, how=e.how, at=time.time())
try:
    synk.close()
    seen["closed"] = True
except Exception as e:      # noqa: BLE001 - what closing raised is what the test reads
    seen["closed"] = f"{type(e).__name__}: {e}"
with open(os.path.join(out, f"node{node}.json"), "w") as f:
    json.dump(seen, f)
