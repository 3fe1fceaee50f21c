"""Run on two nodes (``... diverged.py OUT``): node 0 calls ``f``, node 1 calls ``g``; then both call
``f`` on other rows, other indices and other Data. Each node writes the errors it got to
OUT/node<R>.json, then both close."""

import json
import os
import sys

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

synk.fork()
node = synk.node_rank()
x = pt.matrix("x")
f = synk.function([x], [(x.sum(), "sum")], name="f")
g = synk.function([x], [(x.mean(), "avg")], name="g")
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
             "data": dict(data=x_data if node == 0 else other_data)}
errors = {}
for what, kwargs in differing.items():
    try:
        f(kwargs.pop("data", x_data), **kwargs)
        errors[what] = None
    except synk.NodesDiverged as e:
        errors[what] = str(e)
with open(os.path.join(sys.argv[1], f"node{node}.json"), "w") as fh:
    json.dump(dict(error=error, after=after, errors=errors), fh)
synk.close()
