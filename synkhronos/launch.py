"""Run a script on one node of several: ``python -m synkhronos.launch``.

Usage::

    python -m synkhronos.launch --nnodes N --node-rank R --coordinator HOST:PORT \\
        [--devices-per-node D] script.py [args...]

Run the same command on every node, each with its own ``--node-rank``. The
script runs in this process as ``python script.py args...`` would run it, with
the variables :func:`synkhronos.fork` reads (``SYNK_NNODES``,
``SYNK_NODE_RANK``, ``SYNK_COORDINATOR``, ``SYNK_DEVICES_PER_NODE``). Under
Slurm (``srun --ntasks-per-node=1``) or Open MPI (``mpirun --npernode 1``) no
launcher is needed: ``fork()`` finds the nodes through JAX's cluster detection.

Node 0's master starts a process that serves JAX's coordination service at
``HOST:PORT``, bound to that address only (:mod:`synkhronos.platform.coordination`);
every process of every node connects to it.
"""

import argparse
import os
import runpy
import sys

from .platform.cluster import check_coordinator

__all__ = ["main", "parse_args"]


def parse_args(argv):
    """The launcher's options and the script's command line.

    Examples
    --------
    >>> a = parse_args(["--nnodes", "2", "--node-rank", "1", "--coordinator", "10.0.0.1:7777",
    ...                 "train.py", "--epochs", "3"])
    >>> a.nnodes, a.node_rank, a.coordinator, a.script, a.args
    (2, 1, '10.0.0.1:7777', 'train.py', ['--epochs', '3'])
    """
    parser = argparse.ArgumentParser(
        prog="python -m synkhronos.launch",
        description="Run a synkhronos script on one node of several (the same command on every "
                    "node, each with its own --node-rank).")
    parser.add_argument("--nnodes", type=int, required=True, help="how many nodes run the script")
    parser.add_argument("--node-rank", type=int, required=True, help="this node, 0 to nnodes - 1")
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                        help="where node 0 serves JAX's coordination service (an address of node 0 "
                             "the other nodes reach)")
    parser.add_argument("--devices-per-node", type=int, default=None, metavar="D",
                        help="devices (processes) per node; default: what fork() finds")
    parser.add_argument("script", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.nnodes < 1:
        parser.error(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    try:
        check_coordinator(args.coordinator)
    except ValueError as e:
        parser.error(f"--coordinator: {e}")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        parser.error(f"--devices-per-node must be >= 1, got {args.devices_per_node}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.update(SYNK_NNODES=str(args.nnodes), SYNK_NODE_RANK=str(args.node_rank),
                      SYNK_COORDINATOR=args.coordinator)
    # as fork() does for its own processes: XLA's warnings (one per process about the recoverable
    # tasks of the runtime) would drown the script's output; set it yourself to see everything
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.devices_per_node is not None:
        os.environ["SYNK_DEVICES_PER_NODE"] = str(args.devices_per_node)
    sys.argv = [args.script] + args.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
