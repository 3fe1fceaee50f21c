"""Tour 4: the forms of ``batch``, minibatch Data and ``num_slices``.

Every form selects rows before they are split across devices; each device
gathers its own rows from shared memory. Results match ``as_pytensor`` on the
same rows, whatever the slicing.
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
    x = pt.matrix("x")
    f = synk.function([x], [(x.mean(0), "avg"), (x.max(0), "max"), (x, "gather")])
    X = np.random.default_rng(1).normal(size=(50, 3))
    x_dat = synk.data(X)
    shuffled = np.random.default_rng(2).permutation(50)[:17]
    for label, batch, rows in [("int 20", 20, np.arange(20)), ("slice(10, 33)", slice(10, 33), np.arange(10, 33)),
                               ("shuffled indices", shuffled, shuffled), ("list", [4, 4, 9], [4, 4, 9])]:
        for k in (1, 3):
            got = f(x_dat, batch=batch, num_slices=k)
            want = f.as_pytensor(X[rows])
            check(f"batch={label}, num_slices={k}", np.concatenate([g.ravel() for g in got]),
                  np.concatenate([w.ravel() for w in want]))
    mb = synk.data(X[30:40], minibatch=True)               # holds only rows 30..39
    check("minibatch Data, batch=[39, 30, 35]", f(mb, batch=[39, 30, 35])[2], X[[39, 30, 35]])
    synk.close()
    return check.exit_code()


if __name__ == "__main__":
    run(main)
