"""An elastic launcher: the script restarted on the nodes that are left, or that come back.

With ``python -m synkhronos.launch --nnodes MIN:MAX --max-restarts K ...`` the
launcher is an agent, as torchrun's is: it runs the script as a child
process, on the node rank and node count of the current round of the
rendezvous (:mod:`synkhronos.platform.rendezvous`, kept by node 0's launcher at
the ``--coordinator`` address). When a node is lost, or one joins, or a
script fails, every launcher stops its script and the survivors start it again
on the new set of nodes, at most ``K`` times; the script resumes from its last
checkpoint (``train.run(..., checkpoint_dir=..., resume=True)``). Node 0's
launcher is the rendezvous: its loss ends the run on every node.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

from .rendezvous import JOINED, RendezvousClient, RendezvousLost, RendezvousServer

__all__ = ["run_elastic"]

#: seconds a script is given to end after SIGTERM before it is killed
STOP_GRACE = 3.0


def run_elastic(script, args, node_rank, coordinator, min_nodes, max_nodes, max_restarts,
                devices_per_node=None, join_timeout=300.0, out=sys.stderr):
    """Run ``script`` with ``args`` under the rendezvous until it ends on every node; the exit code."""
    def say(text):
        print(f"synkhronos.launch: {text}", file=out, flush=True)

    # launchers of one run run one command: a launcher of another run at this address is refused
    job = f"{os.path.basename(script)} --nnodes {min_nodes}:{max_nodes}"     # arguments may differ
    try:
        server = RendezvousServer(coordinator, min_nodes, max_nodes, job=job) if node_rank == 0 else None
    except OSError as e:
        why = ("another launcher with --node-rank 0 runs there, or the port is taken; start node 0 "
               "once, with a free port") if e.errno == errno.EADDRINUSE else \
            "give --coordinator an address of this machine (node 0) and a free port"
        say(f"cannot keep the rendezvous at {coordinator} ({e.strerror or e}): {why}")
        return 1
    try:
        client = RendezvousClient(server.address if server else coordinator, node_rank, join_timeout, job)
    except TimeoutError as e:
        say(str(e))
        if server is not None:
            server.close()
        return 1
    restarts, child, round_, done = 0, None, None, False
    try:
        client.join()
        while True:
            # waiting for a round is bounded; waiting, done, for the other nodes to finish is not
            message = client.next_message(None if done else join_timeout)
            if message is None:
                say(f"no round started within {join_timeout:.0f} s: fewer than {min_nodes} nodes' "
                    f"launchers joined the rendezvous at {coordinator}")
                return 1
            kind = message["kind"]
            if kind == "finished":
                return 0
            if kind == "refused":
                say(f"the rendezvous at {coordinator} refused this launcher: {message.get('why')}")
                return 1
            if kind == "restart" and message.get("round") == round_:
                done = False
                client.join()               # its script was done; another node's was not
                continue
            if kind != "round":
                continue                    # the end of a round this launcher already left
            round_ = message["round"]
            child = _start(script, args, message, devices_per_node)
            ended, why = _watch(child, client, round_)
            if ended == 0:
                client.tell("done")
                done = True
                continue                    # until every node is done (or the round restarts)
            _stop(child)
            # as torchrun's agent: a node joining is a change of membership, not a failure
            joined = ended is None and why == JOINED
            restarts += 0 if joined else 1
            if ended is not None:
                client.tell("failed", why=f"node {message['node_rank']}'s script exited with {ended}")
            if restarts > max_restarts:
                say(f"round {round_} ended ({why}); --max-restarts {max_restarts} exhausted; giving up")
                return 1
            counted = ("starting again (a node joining is no failure: --max-restarts counts failures)"
                       if joined else f"restart {restarts} of {max_restarts}")
            say(f"round {round_} ended ({why}); {counted}")
            client.join()
    except RendezvousLost:
        say("node 0's launcher (the rendezvous) was lost; the run ends on every node (start every "
            "node's launcher again to go on from the last checkpoint)")
        return 1
    finally:
        _stop(child)
        client.close()
        if server is not None:
            server.close()


def _start(script, args, round_message, devices_per_node):
    # the restarts of the run before this round: the same on every node, a returning one's too
    env = dict(os.environ, SYNK_NNODES=str(round_message["nnodes"]),
               SYNK_NODE_RANK=str(round_message["node_rank"]),
               SYNK_COORDINATOR=round_message["coordinator"],
               SYNK_RESTART_COUNT=str(round_message["round"] - 1))
    if devices_per_node is not None:
        env["SYNK_DEVICES_PER_NODE"] = str(devices_per_node)
    # a session of its own: stopping it stops its workers too; it dies with the launcher
    return subprocess.Popen([sys.executable, script, *args], env=env, start_new_session=True,
                            preexec_fn=_die_with_parent)


def _die_with_parent():
    """In the child, before the script: the kernel kills it when its launcher dies (Linux)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def _watch(child, client, round_):
    """Until the script ends or its round does: ``(exit code, why)``, or ``(None, why)``."""
    while True:
        code = child.poll()
        if code is not None:
            return code, f"the script exited with {code}"
        message = client.next_message(0.1)
        if message is not None and message["kind"] == "restart" and message.get("round") == round_:
            return None, message.get("why", "the rendezvous restarted")


def _stop(child):
    """End the script and its workers: SIGTERM to the script (its runtime shuts its workers down and
    frees its shared memory), then SIGKILL to its whole session."""
    if child is None:
        return
    if child.poll() is None:
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + STOP_GRACE
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        os.killpg(child.pid, signal.SIGKILL)       # whatever of its session is left
    except (ProcessLookupError, PermissionError):
        pass
    child.wait(timeout=5)
