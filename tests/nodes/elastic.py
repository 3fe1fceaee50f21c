"""Run elastically on simulated nodes (``... elastic.py OUT CHECKPOINTS KILL_NODE KILL_AT [PAUSE]``): every
node trains a linear model under AllReduce, 24 global steps of 12 rows, with a checkpoint and a check
every 2 steps, resuming from CHECKPOINTS when it holds one. At the check of step KILL_AT of the first
round, node KILL_NODE kills its launcher (its whole node goes). Each check appends ``[step, nodes]`` to
OUT/checks<node>.jsonl; on a restart node 0 first copies the checkpoint to OUT/at_restart/; at the end
every node writes its parameters to OUT/final<node>.npy, evaluates through synk.function and saves a
checkpoint. PAUSE: seconds every check waits (a window for a node to come back)."""

import json
import os
import shutil
import signal
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import train, updates

out, checkpoints, kill_node, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
restart = int(os.environ.get("SYNK_RESTART_COUNT", "0"))
synk.fork()
node, nodes = synk.node_rank(), int(os.environ["SYNK_NNODES"])
x, y = pt.matrix("x"), pt.vector("y")
w = pytensor.shared(np.zeros(3), name="w")
loss = ((x @ w - y) ** 2).mean()
step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.01)
evaluate = synk.function([x, y], (loss, "avg"), name="evaluate")
synk.distribute()
rng = np.random.default_rng(3)
X = rng.normal(size=(120, 3))
Y = X @ np.array([1.0, -2.0, 0.5])
if restart and node == 0 and os.path.exists(os.path.join(checkpoints, "checkpoint.safetensors")):
    shutil.copytree(checkpoints, os.path.join(out, f"at_restart{restart}"), dirs_exist_ok=True)


def check(history):
    with open(os.path.join(out, f"checks{node}.jsonl"), "a") as f:
        f.write(json.dumps([history[-1].step, nodes, restart, time.time()]) + "\n")
    if restart == 0 and node == kill_node and history[-1].step == kill_at:
        os.kill(os.getppid(), signal.SIGKILL)          # the launcher: the node goes with it
        signal.pause()
    time.sleep(pause)
    return False


train.run(step, X, Y, 12, steps=24, checkpoint_dir=checkpoints, checkpoint_every=2, check_every=2,
          on_check=check, resume=True)
np.save(os.path.join(out, f"final{node}.npy"), w.get_value())
print("EVALUATED", float(evaluate(X, Y)), flush=True)
synk.checkpoint.save(os.path.join(out, "after.safetensors"), [w], step=24)     # node 0 writes it
synk.close()
