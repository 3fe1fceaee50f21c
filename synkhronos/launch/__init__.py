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
agent, as torchrun's is (:class:`~.agent.ElasticAgent`, its rendezvous :mod:`.rendezvous`). Node 0's launcher
keeps a rendezvous at ``HOST:PORT``; every launcher runs the script as a child
process on the node rank and node count of the current round, and when a node
is lost (or comes back, or a script fails) the script starts again on the nodes
there are, at most ``K`` times, resuming from its checkpoint
(``train.run(..., checkpoint_dir=..., resume=True)``). Node 0's launcher is the
rendezvous: its loss ends the run on every node.

The package: :mod:`.cli` (the command line), :mod:`.spec` (what one node's
launcher runs, :class:`~.spec.LaunchSpec`), :mod:`.agent` (the elastic agent)
and :mod:`.rendezvous` (where the agents meet).
"""

from __future__ import annotations

from .cli import main, parse_args
from .spec import LaunchSpec

__all__ = ["main", "parse_args", "LaunchSpec"]
