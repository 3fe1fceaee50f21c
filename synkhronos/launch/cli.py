"""The launcher's command line: ``python -m synkhronos.launch ...`` (see :mod:`synkhronos.launch`)."""


from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import sys

from ..platform.cluster import check_coordinator
from .agent import ElasticAgent
from .spec import LaunchSpec

__all__ = ["main", "parse_args", "spec_of"]


def parse_args(argv: list[str]) -> argparse.Namespace:
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


def spec_of(args: argparse.Namespace) -> LaunchSpec:
    """The launch :func:`parse_args`' options describe."""
    return LaunchSpec(args.script, tuple(args.args), node_rank=args.node_rank,
                      coordinator=args.coordinator, min_nodes=args.min_nodes,
                      max_nodes=args.max_nodes, max_restarts=args.max_restarts,
                      devices_per_node=args.devices_per_node)


def main(argv: list[str] | None = None) -> None:
    """``python -m synkhronos.launch``: run the script on this node, or keep it running (elastic)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = spec_of(args)
    if not os.path.isfile(args.script):      # else an elastic run would try it K times
        print(f"synkhronos.launch: the script {args.script!r} is not a file (looked for from "
              f"{os.getcwd()})", file=sys.stderr)
        sys.exit(2)
    # as fork() does for its own processes: XLA's warnings (one per process about the recoverable
    # tasks of the runtime) would drown the script's output; set it yourself to see everything
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if spec.elastic:                # the script, a child, inherits the environment
        sys.exit(_elastic(spec))
    os.environ.update(spec.environment(args.nnodes, args.node_rank, args.coordinator))
    sys.argv = [args.script] + args.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


def _elastic(spec: LaunchSpec) -> int:
    """The agent's exit code; Ctrl-C or SIGTERM stop its script and end it quietly."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    try:
        return ElasticAgent(spec).run()
    except KeyboardInterrupt:
        print("synkhronos.launch: interrupted; this node's script, if it still ran, was stopped",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGINT

