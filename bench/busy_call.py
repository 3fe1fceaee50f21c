"""Keep one process calling the tiny benchmark function, to measure a call while a peer computes.

    python -m bench.busy_call SECONDS

Prints ``ready`` once the function is compiled, then calls it in a loop for
SECONDS (or until killed). A synkhronos call has every device compute at
once; on a machine whose cores share execution resources, that alone makes
each device's share slower than a call made by one process alone.
"""

import sys
import time

import numpy as np


def tiny_direct():
    """The tiny function of the call-overhead benchmark, compiled for one process, and its input."""
    import pytensor
    import pytensor.tensor as pt
    x = pt.vector("x", dtype="float32")
    return pytensor.function([x], (x * 2 + 1).sum(), mode="JAX"), np.arange(8, dtype="float32")


def main(seconds):
    fn, X = tiny_direct()
    np.asarray(fn(X))
    print("ready", flush=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.asarray(fn(X))


if __name__ == "__main__":
    main(float(sys.argv[1]))
