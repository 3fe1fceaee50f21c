"""Run on two nodes (``... killed_node.py OUT DOING [VICTIM [HOW]]``): node VICTIM's master (default
1) SIGKILLs itself (HOW "kill") or stops (HOW "stall": SIGSTOP) after three calls; the other node
keeps calling (DOING: "call" or "all_reduce") and writes what it saw (the error, how long it took,
its segments left) to OUT, then wakes a stalled node, which writes what it sees to OUT/woke.json
if it gets to run Python again. DOING "run": both nodes train in a device-driven loop, and the
victim kills itself at its second check, mid-run."""

import json
import os
import signal
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.runtime import session

out = sys.argv[1]
what = sys.argv[2]                       # "call" or "all_reduce": what the survivor does meanwhile
victim = int(sys.argv[3]) if len(sys.argv) > 3 else 1
how = sys.argv[4] if len(sys.argv) > 4 else "kill"     # "kill": SIGKILL; "stall": SIGSTOP
synk.fork()
node, state = synk.node_rank(), session.current()
with open(os.path.join(out, f"prefix{node}.txt"), "w") as f:
    f.write(state.prefix)
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


def run_until_it_fails(name):
    """Train on the devices until the victim kills itself at its second check (DOING "run")."""
    from synkhronos.extensions import train, updates
    y = pt.vector("y")
    v = pytensor.shared(np.zeros(3), name="v")
    step = train.make_train_function(((x @ v - y) ** 2).mean(), [v], x, y, updates.sgd,
                                     learning_rate=0.01)
    X, Y = np.random.default_rng(0).normal(size=(64, 3)), np.zeros(64)

    def check(history):
        if node == victim and len(history) >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return False
    start = time.time()
    try:
        train.run(step, X, Y, 16, steps=10**6, check_every=4, on_check=check)
        seen = dict(error=None)
    except synk.WorkerError as e:
        seen = dict(error=str(e), node=e.node, how=e.how, seconds=time.time() - start)
    seen["segments"] = [n for n in os.listdir("/dev/shm") if n.startswith(state.prefix)]
    seen["closed"] = session.active() is None
    with open(os.path.join(out, name), "w") as fh:
        json.dump(seen, fh)


def call_until_it_fails(name):
    """Keep calling (up to 60 s); write the error it ends with, its time and what is left to OUT/name."""
    start = time.time()
    try:
        while time.time() - start < 60:
            f(x_data) if what == "call" else synk.all_reduce(w)
        seen = dict(error=None)
    except synk.WorkerError as e:
        seen = dict(error=str(e), node=e.node, how=e.how, seconds=time.time() - start)
    seen["segments"] = [n for n in os.listdir("/dev/shm") if n.startswith(state.prefix)]
    seen["closed"] = session.active() is None
    with open(os.path.join(out, name), "w") as fh:
        json.dump(seen, fh)


if what == "run":
    run_until_it_fails("result.json")
elif node == victim:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    # stalled, then woken by the other node once it gave up on this one: this node's next call
    # finds the other node gone (if JAX's client lets it run Python again)
    call_until_it_fails("woke.json")
else:
    call_until_it_fails("result.json")
    if how == "stall":
        with open(os.path.join(out, f"pids{victim}.json")) as fh:
            os.kill(json.load(fh)[0], signal.SIGCONT)
