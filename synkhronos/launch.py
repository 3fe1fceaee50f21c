"""Run a script on one node of several: ``python -m synkhronos.launch``.

Usage::

    python -m synkhronos.launch --nnodes N --node-rank R --coordinator HOST:PORT \\
        [--devices-per-node D] script.py [args...]
    python -m synkhronos.launch --nnodes MIN:MAX --max-restarts K --node-rank R \\
        --coordinator HOST:PORT script.py [args...]          # elastic

Run the same command on every node, each with its own ``--node-rank``. The
script runs in this process as ``python script.py args...`` would run it, with
the variables :func:`synkhronos.fork` reads (``SYNK_NNODES``,
``SYNK_NODE_RANK``, ``SYNK_COORDINATOR``, ``SYNK_DEVICES_PER_NODE``). Under
Slurm (``srun --ntasks-per-node=1``) or Open MPI (``mpirun --npernode 1``) no
launcher is needed: ``fork()`` finds the nodes through JAX's cluster detection.

Node 0's master starts a process that serves JAX's coordination service at
``HOST:PORT``, bound to that address only (:mod:`synkhronos.platform.coordination`);
every process of every node connects to it.

Elastic (``--nnodes MIN:MAX`` or ``--max-restarts K`` > 0): the launcher is an
agent, as torchrun's is (:mod:`synkhronos.platform.elastic`). Node 0's launcher
keeps a rendezvous at ``HOST:PORT``; every launcher runs the script as a child
process on the node rank and node count of the current round, and when a node
is lost (or comes back, or a script fails) the script starts again on the nodes
there are, at most ``K`` times, resuming from its checkpoint
(``train.run(..., checkpoint_dir=..., resume=True)``). Node 0's launcher is the
rendezvous: its loss ends the run on every node.
"""

import argparse
import os
import re
import runpy
import signal
import sys

from .platform.cluster import check_coordinator
from .platform.elastic import run_elastic

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
    parser.add_argument("--nnodes", required=True, metavar="N or MIN:MAX",
                        help="how many nodes run the script (MIN:MAX: elastic, on as few as MIN)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="elastic: start the script again on the nodes left at most K times")
    parser.add_argument("--node-rank", type=int, required=True, help="this node, 0 to nnodes - 1")
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                        help="where node 0 serves JAX's coordination service (an address of node 0 "
                             "the other nodes reach)")
    parser.add_argument("--devices-per-node", type=int, default=None, metavar="D",
                        help="devices (processes) per node; default: what fork() finds")
    parser.add_argument("script", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    counts = re.fullmatch(r"([0-9]+)(?::([0-9]+))?", args.nnodes, re.ASCII)
    if counts is None:
        parser.error(f"--nnodes must be N or MIN:MAX (whole numbers), got {args.nnodes!r}")
    args.min_nodes, args.max_nodes = int(counts[1]), int(counts[2] or counts[1])
    if not 1 <= args.min_nodes <= args.max_nodes:
        parser.error(f"--nnodes needs 1 <= MIN <= MAX, got {args.nnodes!r}")
    args.nnodes = args.max_nodes
    args.elastic = args.min_nodes < args.max_nodes or args.max_restarts > 0
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
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
    if not os.path.isfile(args.script):      # else an elastic run would try it K times
        print(f"synkhronos.launch: the script {args.script!r} is not a file (looked for from "
              f"{os.getcwd()})", file=sys.stderr)
        sys.exit(2)
    # as fork() does for its own processes: XLA's warnings (one per process about the recoverable
    # tasks of the runtime) would drown the script's output; set it yourself to see everything
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.elastic:                # the script, a child, inherits the environment
        sys.exit(_elastic(args))
    os.environ.update(SYNK_NNODES=str(args.nnodes), SYNK_NODE_RANK=str(args.node_rank),
                      SYNK_COORDINATOR=args.coordinator)
    if args.devices_per_node is not None:
        os.environ["SYNK_DEVICES_PER_NODE"] = str(args.devices_per_node)
    sys.argv = [args.script] + args.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


def _elastic(args):
    """The agent's exit code; Ctrl-C or SIGTERM stop its script and end it quietly."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    try:
        return run_elastic(args.script, args.args, args.node_rank, args.coordinator, args.min_nodes,
                           args.max_nodes, args.max_restarts, args.devices_per_node)
    except KeyboardInterrupt:
        print("synkhronos.launch: interrupted; this node's script, if it still ran, was stopped",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    main()
