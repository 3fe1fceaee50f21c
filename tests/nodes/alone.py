"""Run on one node of two whose peer never starts (``... alone.py OUT TIMEOUT``): fork() must raise;
writes the error and how long it took to OUT/node<R>.json."""

import json
import os
import sys
import time

import synkhronos as synk
from synkhronos.platform.cluster import find_node

node = find_node(os.environ).node_rank
start = time.monotonic()
try:
    synk.fork(timeout=float(sys.argv[2]))
    error, kind = None, None
except Exception as e:
    error, kind = str(e), type(e).__name__
with open(os.path.join(sys.argv[1], f"node{node}.json"), "w") as fh:
    json.dump(dict(error=error, type=kind, seconds=time.monotonic() - start), fh)
