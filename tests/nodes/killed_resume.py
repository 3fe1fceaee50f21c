"""Run on two nodes (``... killed_resume.py OUT KILL_AT RESUME``): both train under ``Downpour`` with
a checkpoint every 2 steps and a check every 2, and append every check's step and rows to
OUT/checks<R>.jsonl. With KILL_AT > 0 every node's master SIGKILLs itself at the check of that step
(its workers and node 0's center server follow it); with RESUME 1 the run resumes from OUT/checkpoints."""

import json
import os
import signal
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates

out, kill_at, resume = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))
synk.fork()
node = synk.node_rank()
x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd, learning_rate=0.01)
synk.distribute()
rng = np.random.default_rng(3)
X = rng.normal(size=(60, 3))
Y = X @ np.array([1.0, -2.0, 0.5])


def check(history):
    with open(os.path.join(out, f"checks{node}.jsonl"), "a") as f:
        f.write(json.dumps([history[-1].step, sum(history[-1].rows_per_device)]) + "\n")
    if history[-1].step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return False


train.run(step, X, Y, 10, steps=12, sync=sync.Downpour(), checkpoint_dir=os.path.join(out, "checkpoints"),
          checkpoint_every=2, check_every=2, on_check=check, resume=resume)
synk.close()
