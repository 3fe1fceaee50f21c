"""Run on two nodes of one device (``... straggler.py OUT``): node 1 is a straggler (after every step
its device sleeps as long as the step took). Both train a wide digits MLP under ``AllReduce()`` and
under ``Downpour()``; node 0 writes its own device's best rows per second under each to
OUT/rates.json."""

import json
import os
import sys
import time

from helpers import digits_step  # tests/ is on the path of every node script

import synkhronos as synk
from synkhronos.extensions import sync, train, updates
from synkhronos.rank.loop import DeviceLoop

out = sys.argv[1]
synk.fork()
node = synk.node_rank()
if node == 1:                      # the one device of node 1 is its master: slow its steps here
    step_at_full_speed = DeviceLoop._step

    def straggling_step(self, *args):
        start = time.perf_counter()
        step_at_full_speed(self, *args)
        time.sleep(time.perf_counter() - start)
    DeviceLoop._step = straggling_step

data, step, params, (x, y, loss, accuracy) = digits_step("custom_mlp:2,512", updates.sgd, 0.01)
synk.distribute()
x_train, y_train = synk.data(data["x_train"]), synk.data(data["y_train"])


def node_zero_rate(rule, steps=120):
    """Node 0's device's rows per second over the second half of ``steps`` (compiled, warm)."""
    history = train.run(step, x_train, y_train, 512, steps=steps, sync=rule, check_every=steps // 2)
    return history[-1].rows_per_device[0] / (history[-1].time - history[-2].time)


# every row count compiled before anything is timed, also those only claims give a device
train.run(step, x_train, y_train, 512, epochs=1)
for _ in range(2):
    train.run(step, x_train, y_train, 512, epochs=2, sync=sync.Downpour())
rates = {"AllReduce": 0.0, "Downpour": 0.0}
for _ in range(2):               # a shared machine: each rule's best of two interleaved rounds
    for name, rule in [("AllReduce", sync.AllReduce()), ("Downpour", sync.Downpour(every=1))]:
        rates[name] = max(rates[name], node_zero_rate(rule))
if node == 0:
    with open(os.path.join(out, "rates.json"), "w") as f:
        json.dump(rates, f)
synk.close()
