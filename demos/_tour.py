"""Shared bits of the short tours demo_1 ... demo_5: argument parsing and result checks."""

import argparse
import sys

import numpy as np


class Checker:
    """Prints each comparison and remembers whether any failed."""

    def __init__(self):
        self.failed = 0

    def __call__(self, what, got, want, rtol=1e-7):
        ok = np.allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-10)
        self.failed += not ok
        print(f"  [{'ok' if ok else 'MISMATCH'}] {what}")
        if not ok:
            print(f"      got  {np.asarray(got)}\n      want {np.asarray(want)}")

    def exit_code(self):
        print("all checks passed" if not self.failed else f"{self.failed} check(s) FAILED")
        return 1 if self.failed else 0


def start(doc, argv=None):
    """Parse the tour's arguments and fork; return (number of devices, a Checker)."""
    import synkhronos as synk
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="number of devices (processes)")
    args = p.parse_args(argv)
    return synk.fork(args.devices), Checker()


def run(main):
    sys.exit(main())
