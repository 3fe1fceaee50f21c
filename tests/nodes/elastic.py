"""Run elastically on simulated nodes
(``... elastic.py OUT CHECKPOINTS RULE KILL_NODE KILL_AT [PAUSE [STEPS [AGAIN]]]``): every node
trains the demo's digits MLP (momentum, STEPS (300) global steps of 64 rows) under RULE
(``allreduce``, ``downpour`` or ``diloco``), with a checkpoint and a check every 20 steps, resuming
from CHECKPOINTS when it holds one. At the check of step KILL_AT of the first round, node KILL_NODE
kills its launcher (its whole node goes). Each check appends ``[step, nodes, restarts, time]`` to
OUT/checks<node>.jsonl; when the script starts again node 0 first copies the checkpoint to
OUT/at_restart<K>/. At the end every node writes its parameters to OUT/final<node>.npz, evaluates the
test accuracy through synk.function (``EVALUATED <accuracy>``) and saves a checkpoint. PAUSE: seconds
every check waits (a window for a node to come back). AGAIN: at the check of that step of the second
round, node 1 kills its launcher too (a second loss). Before a kill the node appends ``[step, "kill",
time]`` to its checks file."""

import json
import os
import shutil
import signal
import sys
import time

import numpy as np
from helpers import digits_step  # tests/ is on the path of every node script

import synkhronos as synk
from synkhronos.extensions import sync, train, updates

out, checkpoints, rule_name = sys.argv[1], sys.argv[2], sys.argv[3]
kill_node, kill_at = int(sys.argv[4]), int(sys.argv[5])
pause = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
steps = int(sys.argv[7]) if len(sys.argv) > 7 else 300
again = int(sys.argv[8]) if len(sys.argv) > 8 else -1
RULES = {"allreduce": sync.AllReduce(), "downpour": sync.Downpour(every=2),
         "diloco": sync.DiLoCo(every=5, outer_lr=0.5, outer_momentum=0.5)}
restart = int(os.environ.get("SYNK_RESTART_COUNT", "0"))
synk.fork()
node, nodes = synk.node_rank(), int(os.environ.get("SYNK_NNODES", "1"))
data, step, params, (x, y, loss, accuracy) = digits_step("custom_mlp:1,128", updates.momentum, 0.03)
evaluate = synk.function([x, y], [(accuracy, "avg")], name="evaluate")
synk.distribute()
if restart and node == 0 and os.path.exists(os.path.join(checkpoints, "checkpoint.safetensors")):
    shutil.copytree(checkpoints, os.path.join(out, f"at_restart{restart}"), dirs_exist_ok=True)


def check(history):
    with open(os.path.join(out, f"checks{node}.jsonl"), "a") as f:
        f.write(json.dumps([history[-1].step, nodes, restart, time.time()]) + "\n")
    if (restart, node, history[-1].step) in ((0, kill_node, kill_at), (1, 1, again)):
        with open(os.path.join(out, f"checks{node}.jsonl"), "a") as f:
            f.write(json.dumps([history[-1].step, "kill", time.time()]) + "\n")
        os.kill(os.getppid(), signal.SIGKILL)          # the launcher: the node goes with it
        signal.pause()
    time.sleep(pause)
    return False


train.run(step, data["x_train"], data["y_train"], 64, steps=steps, sync=RULES[rule_name], seed=1,
          checkpoint_dir=checkpoints, checkpoint_every=20, check_every=20, on_check=check, resume=True)
np.savez(os.path.join(out, f"final{node}.npz"), *[p.get_value() for p in params])
print("EVALUATED", float(evaluate(data["x_test"], data["y_test"])[0]), flush=True)
synk.checkpoint.save(os.path.join(out, "after.safetensors"), step=steps)     # node 0 writes it
synk.close()
