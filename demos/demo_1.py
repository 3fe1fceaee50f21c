"""Tour 1: output modes and broadcast inputs.

One function returns the same quantities under every reduction mode; each is
compared with the single-process PyTensor function (``as_pytensor``) on the
whole data set. 11 rows split 5/6 over 2 devices: "avg" is weighted by rows.
"""

import os
import sys

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # for _tour, with -m or as a script
from _tour import run, start


def main(argv=None):
    n, check = start(__doc__, argv)
    x, w = pt.matrix("x"), pt.vector("w")          # x is scattered, w goes whole to every device
    z = x @ w
    f = synk.function([x], [(z.mean(), "avg"), (z.sum(), "sum"), (z.max(), "max"), (z.min(), "min"),
                            ((1 + 0.01 * z).prod(), "prod"), (z, "gather"), (z.mean(), None)],
                      bcast_inputs=[w])
    synk.distribute()
    X, W = np.random.default_rng(0).normal(size=(11, 3)), np.array([0.5, -1.0, 2.0])
    got, want = f(X, W), f.as_pytensor(X, W)
    for mode, g, r in zip(["avg", "sum", "max", "min", "prod", "gather"], got, want):
        check(f"mode {mode!r}", g, r)
    check("mode None: the master's own rows", got[-1], f.as_pytensor(X[:5], W)[-1])
    print("output modes:", f.output_modes)
    synk.close()
    return check.exit_code()


if __name__ == "__main__":
    run(main)
