"""Tour 5: data on the devices: ``sliceable_shareds`` and the forms of ``batch_s``.

A data set is scattered once into shared variables (each device keeps its own
rows on its device); ``batch_s`` then picks rows per device without any
host transfer.
"""

import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # for _tour, with -m or as a script
from _tour import run, start


def main(argv=None):
    n, check = start(__doc__, argv)
    s = pytensor.shared(np.zeros((1, 3)), name="s")
    w = pt.vector("w")
    f = synk.function([], [(s @ w, "gather")], bcast_inputs=[w], sliceable_shareds=[s])
    X, W = np.random.default_rng(3).normal(size=(12, 3)), np.array([1.0, 2.0, -1.0])
    synk.scatter(s, X)
    starts = np.cumsum([0] + synk.get_lengths(s))[:-1]
    print("  rows per device:", synk.get_lengths(s))
    per_rank_lists = [np.random.default_rng(r).permutation(4)[:3] for r in range(n)]
    cases = [("all rows", None, [np.arange(L) for L in synk.get_lengths(s)]),
             ("one slice for every device", slice(1, 3), [np.arange(1, 3)] * n),
             ("one index list for every device", [2, 0], [np.array([2, 0])] * n),
             ("one shuffled list per device", per_rank_lists, per_rank_lists)]
    for label, batch_s, local in cases:
        rows = np.concatenate([start + r for start, r in zip(starts, local)])
        check(f"batch_s: {label}", f(W, batch_s=batch_s, num_slices=2)[0], X[rows] @ W)
    synk.close()
    return check.exit_code()


if __name__ == "__main__":
    run(main)
