"""Tour 2: the Data interface: shared memory every device maps.

Creating, writing in place, growing with ``oversize``, ``set_length``,
``minibatch`` Data and ``free_memory``; each step is checked through a function
that sums the rows on every device.
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
    total = synk.function([x], (x.sum(0), "sum"))
    d = synk.data(var=x, shape=(6, 2), name="rows")       # allocated, zero
    print(f"  {d}: len {len(d)}, size {d.size}, alloc_size {d.alloc_size}")
    check("zeros after allocation", total(d), [0, 0])
    d[:] = np.arange(12.0).reshape(6, 2)                   # in-place write, seen by every device
    check("in-place write", total(d), d.data.sum(0))
    d.set_value(np.ones((20, 2)), oversize=1.5)            # grows: new segment, announced
    print(f"  after growing: shape {d.shape}, alloc_size {d.alloc_size}")
    check("after reallocation", total(d), [20, 20])
    d.set_length(25)                                       # fits the oversized allocation
    check("set_length keeps rows, adds zeros", total(d), [20, 20])
    mb = synk.data(np.full((4, 2), 3.0), minibatch=True)   # stands for rows 100..103
    check("minibatch Data with batch=slice(100, 104)", total(mb, batch=slice(100, 104)), [12, 12])
    d.free_memory()
    print(f"  freed: shape {d.shape}")
    synk.close()
    return check.exit_code()


if __name__ == "__main__":
    run(main)
