"""Tour 3: collectives on shared variables.

Rank-specific values are set with ``set_value(rank, ...)``, then moved with
broadcast, scatter, gather, all_gather, reduce and all_reduce; every result is
checked against numpy on the values each rank held.
"""

import os
import sys

import numpy as np
import pytensor

import synkhronos as synk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # for _tour, with -m or as a script
from _tour import run, start


def main(argv=None):
    n, check = start(__doc__, argv)
    w = pytensor.shared(np.zeros(3), name="w")
    rows = pytensor.shared(np.zeros((1, 2)), name="rows")
    synk.function([], [(w.sum() + rows.sum(), "sum")])     # the workers hold what a function uses
    held = [np.full(3, r + 1.0) for r in range(n)]
    for r in range(n):
        synk.set_value(r, w, held[r])
    check("gather, stacked", synk.gather(w, nd_up=1), np.stack(held))
    check("reduce sum, returned", synk.reduce(w, op="sum", in_place=False), sum(held))
    synk.all_reduce(w, op="avg")
    check("all_reduce avg on the last rank", synk.get_value(n - 1, w), sum(held) / n)
    synk.broadcast(w, np.array([7.0, 8.0, 9.0]))
    check("broadcast", synk.get_value(n - 1, w), [7, 8, 9])
    data = np.arange(14.0).reshape(7, 2)
    synk.scatter(rows, data)
    print("  lengths after scatter of 7 rows:", synk.get_lengths(rows))
    check("gather, concatenated (uneven lengths)", synk.gather(rows, nd_up=0), data)
    synk.all_gather(rows)
    check("all_gather on rank 0", synk.get_value(0, rows), data)
    synk.close()
    return check.exit_code()


if __name__ == "__main__":
    run(main)
