"""Run on two nodes (``... lost_node.py OUT VICTIM``): both train the digits MLP under ``Downpour``
and node VICTIM's master SIGKILLs itself at its second check. The survivor writes what it saw to
OUT/survivor.json: node 0 its run's end (the History's lost nodes, the warning, the test accuracy
of its final parameters), node 1 the error it got and how long after the kill."""

import json
import os
import signal
import sys
import time
import warnings

from helpers import digits_step  # tests/ is on the path of every node script

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.runtime import session

out, victim = sys.argv[1], int(sys.argv[2])
synk.fork()
node, state = synk.node_rank(), session.current()
with open(os.path.join(out, f"pids{node}.json"), "w") as f:
    json.dump([os.getpid()] + list(state.worker_pids.values())
              + ([state.service.pid] if state.service is not None else []), f)
data, step, params, (x, y, loss, accuracy) = digits_step("custom_mlp:1,128", updates.momentum, 0.05)
synk.distribute()
x_train, y_train = synk.data(data["x_train"]), synk.data(data["y_train"])


def check(history):
    if node == victim and len(history) >= 2:
        with open(os.path.join(out, "killed_at.txt"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return False


seen = {}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train.run(step, x_train, y_train, 128, epochs=40, sync=sync.Downpour(every=2),
                            check_every=10, on_check=check, seed=1)
    seen["lost_nodes"] = history.lost_nodes
    seen["warnings"] = [str(w.message) for w in caught if "was lost" in str(w.message)]
    seen["epochs"] = history[-1].epoch
    seen["accuracy"] = float(synk.function([x, y], (accuracy, "avg")).as_pytensor(
        data["x_test"], data["y_test"]))
except synk.WorkerError as e:
    seen.update(error=str(e), node=e.node, how=e.how, at=time.time())
try:
    synk.close()
    seen["closed"] = True
except Exception as e:      # noqa: BLE001 - what closing raised is what the test reads
    seen["closed"] = f"{type(e).__name__}: {e}"
with open(os.path.join(out, "survivor.json"), "w") as f:
    json.dump(seen, f)
