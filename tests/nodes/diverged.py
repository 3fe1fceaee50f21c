"""Run on two nodes (``... diverged.py OUT [DEVICES_PER_NODE]``): node 0 calls ``f``, node 1 calls
``g``; then both call ``f`` on other rows, other indices, other Data and other numpy values, a
function of a broadcast scalar on other scalars, the tutorials' givens idiom on other minibatch
indices, a scatter of other values or other rows, all-reduces of other variables or by other ops,
train.run of other batch sizes or with an on_check that stops on one node only, a training step
built with another learning rate on each node (its update's graph differs), called and run by
train.run, a call whose arguments one node refuses, set_value, get_value, a checkpoint and a
restore of other variables; and the same calls in other words (keywords in another order, values
of other types that the inputs take alike), which must not raise. Each node writes the errors it
got, and what calls made alike afterwards gave, to OUT/node<R>.json, then both close."""

import json
import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import train, updates

synk.fork()
node = synk.node_rank()
ranks = range(2 * (int(sys.argv[2]) if len(sys.argv) > 2 else 1))
x = pt.matrix("x")
f = synk.function([x], [(x.sum(), "sum")], name="f")
g = synk.function([x], [(x.mean(), "avg")], name="g")
index, scale = pt.lscalar("index"), pt.scalar("scale")
table = pytensor.shared(np.arange(24.0).reshape(12, 2), name="table")
by_index = synk.function([index], [(x.sum(), "sum")], givens={x: table[index * 4:(index + 1) * 4]},
                         name="by_index")
scaled = synk.function([x], [(x.sum() * scale, "sum")], bcast_inputs=[scale], name="scaled")
held = pytensor.shared(np.zeros((2, 2)), name="held")
other = pytensor.shared(np.zeros((2, 2)), name="other")
keeps = synk.function([], updates=[(held, held * 1.0), (other, other * 1.0)], name="keeps")
# a step built with another learning rate on each node: its update's graph differs
v = pytensor.shared(np.zeros(2), name="v")
step_lr = train.make_train_function(((x.dot(v) - x.sum(1)) ** 2).mean(), [v], x, pt.vector("y"),
                                    updates.sgd, learning_rate=0.1 if node == 0 else 0.2)
synk.distribute()
x_data = synk.data(np.ones((6, 2)))
f(x_data)                                   # the same call on both: fine
try:
    (f if node == 0 else g)(x_data)
    error = None
except synk.NodesDiverged as e:
    error = str(e)
after = float(np.asarray(f(x_data)).ravel()[0])     # both go on in step again
other_data = synk.data(np.full((6, 2), 2.0))
differing = {"rows": dict(batch=slice(0, 5) if node == 0 else slice(0, 2)),
             "indices": dict(batch=np.array([0, 1, 2]) if node == 0 else np.array([3, 4, 5])),
             "data": dict(data=x_data if node == 0 else other_data),
             "values": dict(data=np.ones((6, 2)) if node == 0 else np.full((6, 2), 2.0))}
calls = {what: (lambda kwargs=kwargs: f(kwargs.pop("data", x_data), **kwargs))
         for what, kwargs in differing.items()}
calls["scalar"] = lambda: scaled(x_data, 1.0 if node == 0 else 2.0)
calls["givens"] = lambda: by_index(1 if node == 0 else 2)
calls["scatter"] = lambda: synk.scatter(held, np.full((4, 2), float(node + 1)))
calls["scatter rows"] = lambda: synk.scatter(held, np.arange(12.0).reshape(6, 2),
                                             batch=[0, 1, 2, 3] if node == 0 else [2, 3, 4, 5])
calls["all_reduce"] = lambda: synk.all_reduce(held if node == 0 else other)
calls["all_reduce op"] = lambda: synk.all_reduce(held, op="sum" if node == 0 else "max")
calls["refused"] = lambda: f(x_data if node == 0 else np.ones(3))     # node 1's is refused there
calls["set_value"] = lambda: synk.set_value(len(ranks) - 1, held if node == 0 else other, np.zeros((2, 2)))
calls["set_value refused"] = lambda: synk.set_value(len(ranks) - 1, held,        # refused on node 1
                                                    np.zeros((2, 2)) if node == 0 else np.zeros(3))
calls["get_value"] = lambda: synk.get_value(0, held if node == 0 else other)
calls["learning rate"] = lambda: step_lr(x_data, synk.data(np.zeros(6)))
calls["save"] = lambda: synk.checkpoint.save(os.path.join(sys.argv[1], "held.safetensors"),
                                             [held] if node == 0 else [other])
# the same call in other words: keywords in another order, values of other types that the inputs
# take alike (a float input's 2 and 2.0, an index's int and np.int32)
calls["keywords"] = lambda: scaled(x=x_data, scale=2) if node == 0 else \
    scaled(scale=np.float32(2.0), x=x_data)
calls["index type"] = lambda: by_index(1 if node == 0 else np.int32(1))
saved = os.path.join(sys.argv[1], "both.safetensors")
synk.checkpoint.save(saved, [held])                 # the same on both: restored below
calls["restore"] = lambda: synk.checkpoint.restore(saved, [held] if node == 0 else [other])
errors, next_calls = {}, {}
for what, call in calls.items():
    try:
        call()
        errors[what] = None
    except Exception as e:
        errors[what] = f"{type(e).__name__}: {e}"
    next_calls[what] = float(np.asarray(f(x_data)).ravel()[0])     # every rank's rows again
alike = float(np.asarray(by_index(1)).ravel()[0])       # rows 4:8 of the table, on both
# a device-driven run of other batch sizes: each node's phases would end at other steps
w = pytensor.shared(np.zeros(2), name="w")
step = train.make_train_function(((x.dot(w) - x.sum(1)) ** 2).mean(), [w], x, pt.vector("y"),
                                 updates.sgd, learning_rate=0.1)
run_x, run_y = synk.data(np.arange(64.0).reshape(32, 2) / 32), synk.data(np.zeros(32))
try:
    train.run(step, run_x, run_y, 8 if node == 0 else 4, steps=4)
    errors["train.run"] = None
except synk.NodesDiverged as e:
    errors["train.run"] = str(e)
try:                                    # a run of a step whose update differs by node
    train.run(step_lr, run_x, run_y, 8, steps=4)
    errors["train.run rate"] = None
except synk.NodesDiverged as e:
    errors["train.run rate"] = str(e)
untrained = synk.get_value(0, w).tolist()
first_step = float(np.asarray(step(run_x, run_y)))       # a master-driven step, then a run
train.run(step, run_x, run_y, 8, steps=4)
trained = [synk.get_value(rank, w).tolist() for rank in ranks]
try:                                    # an on_check that stops the run on node 0 only
    train.run(step, run_x, run_y, 8, steps=8, check_every=4, on_check=lambda history: node == 0)
    errors["on_check"] = None
except Exception as e:
    errors["on_check"] = f"{type(e).__name__}: {e}"
checked = [synk.get_value(rank, w).tolist() for rank in ranks]
kept = [synk.get_value(rank, held).tolist() for rank in ranks]     # no scatter above ran
unstepped = [synk.get_value(rank, v).tolist() for rank in ranks]  # nor the update of either rate
synk.scatter(held, np.arange(8.0).reshape(4, 2))
scattered = [synk.get_value(rank, held).tolist() for rank in ranks]
with open(os.path.join(sys.argv[1], f"node{node}.json"), "w") as fh:
    json.dump(dict(error=error, after=after, errors=errors, next_calls=next_calls, alike=alike,
                   kept=kept, scattered=scattered, untrained=untrained, trained=trained,
                   first_step=first_step, checked=checked, unstepped=unstepped), fh)
synk.close()
