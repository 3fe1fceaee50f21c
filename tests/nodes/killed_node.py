"""Run on two nodes (``... killed_node.py OUT DOING [VICTIM]``): node VICTIM's master (default 1)
SIGKILLs itself after three calls; the other node keeps calling (DOING: "call" or "all_reduce") and
writes what it saw (the error, how long it took, its segments left) to OUT."""

import json
import os
import signal
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.runtime import master

out = sys.argv[1]
what = sys.argv[2]                       # "call" or "all_reduce": what the survivor does meanwhile
victim = int(sys.argv[3]) if len(sys.argv) > 3 else 1
synk.fork()
node, state = synk.node_rank(), master.current()
with open(os.path.join(out, f"pids{node}.json"), "w") as f:
    json.dump([os.getpid()] + list(state.worker_pids.values())
              + ([state.service.pid] if state.service is not None else []), f)
x = pt.matrix("x")
w = pytensor.shared(np.ones((3, 2)), name="w")
f = synk.function([x], [((x @ w).sum(), "sum")], name="f")
synk.distribute()
x_data = synk.data(np.ones((8, 3)))
for _ in range(3):
    f(x_data)
    synk.all_reduce(w)
if node == victim:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.time()
try:
    while time.time() - start < 60:
        f(x_data) if what == "call" else synk.all_reduce(w)
    result = dict(error=None)
except synk.WorkerError as e:
    result = dict(error=str(e), node=e.node, how=e.how, seconds=time.time() - start)
result["segments"] = [n for n in os.listdir("/dev/shm") if n.startswith(state.prefix)]
result["closed"] = master.active() is None
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(result, f)
