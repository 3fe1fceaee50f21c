"""The elastic agent: the script restarted on the nodes that are left, or that come back.

With ``python -m synkhronos.launch --nnodes MIN:MAX --max-restarts K ...`` the
launcher is an agent, as torchrun's is: it runs the script as a child
process, on the node rank and node count of the current round of the
rendezvous (:mod:`.rendezvous`, kept by node 0's launcher at
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
from typing import IO, Any, NamedTuple

from .rendezvous import JOINED, Kind, RendezvousClient, RendezvousLost, RendezvousServer
from .spec import LaunchSpec

__all__ = ["ElasticAgent"]

#: seconds a script is given to end after SIGTERM before it is killed
STOP_GRACE = 3.0
#: seconds between tries to join a rendezvous that was busy (full of strangers' connections)
BUSY_RETRY_SECONDS = 1.0


class RoundEnd(NamedTuple):
    """How a round's script ended: its exit ``code`` (None: the round ended first), and ``why``."""

    code: int | None
    why: str


class ElasticAgent:
    """One node's elastic launcher: the script run round after round until it ends on every node.

    Node 0's agent also keeps the rendezvous. :meth:`run` joins it, then
    repeats three steps: wait for a round (:meth:`_wait_for_round`), run the
    script in it (:meth:`_run_round`), and after a failure stop the script and
    join the next round unless the restarts are spent (:meth:`_after_failure`).

    Parameters
    ----------
    spec : LaunchSpec
    out : file
        Where the agent says what happens (standard error).
    """

    def __init__(self, spec: LaunchSpec, out: IO[str] = sys.stderr) -> None:
        self.spec, self.out = spec, out
        self._client: RendezvousClient | None = None
        self._child: subprocess.Popen | None = None
        self._round: int | None = None
        self._done = False          # this node's script ended well; the others' may not have
        self._restarts = 0
        self._address = spec.coordinator
        self._join_by = 0.0         # monotonic time by which the first round must have started
        self._busy_said = False

    def run(self) -> int:
        """Run the script under the rendezvous until it ends on every node; the exit code."""
        spec = self.spec
        try:
            server = RendezvousServer(spec.coordinator, spec.min_nodes, spec.max_nodes,
                                      job=spec.job) if spec.node_rank == 0 else None
        except OSError as e:
            why = ("another launcher with --node-rank 0 runs there, or the port is taken; start "
                   "node 0 once, with a free port") if e.errno == errno.EADDRINUSE else \
                "give --coordinator an address of this machine (node 0) and a free port"
            self._say(f"cannot keep the rendezvous at {spec.coordinator} ({e.strerror or e}): {why}")
            return 1
        self._address = server.address if server else spec.coordinator
        self._join_by = time.monotonic() + spec.join_timeout
        try:
            self._client = self._connect()
        except (TimeoutError, RendezvousLost) as e:
            self._say(str(e))
            if server is not None:
                server.close()
            return 1
        try:
            while True:
                message = self._wait_for_round()
                if isinstance(message, int):
                    return message
                code = self._run_round(message)
                if code is not None:
                    return code
        except RendezvousLost:
            self._say("node 0's launcher (the rendezvous) was lost; the run ends on every node "
                      "(start every node's launcher again to go on from the last checkpoint)")
            return 1
        finally:
            _stop(self._child)
            self._client.close()
            if server is not None:
                server.close()

    def _connect(self) -> RendezvousClient:
        """A connection to the rendezvous, joined."""
        spec = self.spec
        client = RendezvousClient(self._address, spec.node_rank,
                                  max(1.0, self._join_by - time.monotonic()), spec.job)
        client.join()
        return client

    def _try_again(self, why: str) -> bool:
        """After a refusal that was only "not now" (the rendezvous was full of strangers'
        connections): connect and join again, until the join time is up; False once it is."""
        self._rendezvous.close()
        if self._busy_said is False:
            self._say(f"the rendezvous at {self.spec.coordinator} is busy ({why}); trying again")
            self._busy_said = True
        wait = min(BUSY_RETRY_SECONDS, self._join_by - time.monotonic())
        if wait <= 0:
            return False
        time.sleep(wait)
        try:
            self._client = self._connect()
        except TimeoutError:
            return False
        return True

    @property
    def _rendezvous(self) -> RendezvousClient:
        assert self._client is not None, "the agent has joined the rendezvous"
        return self._client

    def _wait_for_round(self) -> dict[str, Any] | int:
        """The next round's message, or the agent's exit code: 0 once every node's script ended
        well, 1 if refused or no round started in time."""
        spec, client = self.spec, self._rendezvous
        while True:
            # waiting for a round is bounded; waiting, done, for the other nodes to finish is not
            first = self._round is None
            message = client.next_message(None if self._done else max(0.0, self._join_by - time.monotonic())
                                          if first else spec.join_timeout)
            if message is None:
                busy = "the rendezvous was busy (a flood of connections), or " if first and self._busy_said else ""
                self._say(f"no round started within {spec.join_timeout:.3g} s: {busy}fewer than "
                          f"{spec.min_nodes} nodes' launchers joined the rendezvous at {spec.coordinator}")
                return 1
            kind = message["kind"]
            if kind == Kind.FINISHED:
                return 0
            if kind == Kind.REFUSED and message.get("busy") and first:
                if self._try_again(str(message.get("why"))):
                    client = self._rendezvous
                    continue
                self._say(f"no round started within {spec.join_timeout:.3g} s: the rendezvous at "
                          f"{spec.coordinator} stayed busy ({message.get('why')})")
                return 1
            if kind == Kind.REFUSED:
                self._say(f"the rendezvous at {spec.coordinator} refused this launcher: "
                          f"{message.get('why')}")
                return 1
            if kind == Kind.RESTART and message.get("round") == self._round:
                self._done = False
                client.join()               # its script was done; another node's was not
            elif kind == Kind.ROUND:
                return message
            # (else the end of a round this launcher already left)

    def _run_round(self, message: dict[str, Any]) -> int | None:
        """Run the script in the round ``message`` starts, until it ends or the round does; None
        to go on, or the agent's exit code."""
        self._round = message["round"]
        self._child = _start(self.spec, message)
        ended = _watch(self._child, self._rendezvous, self._round)
        if ended.code == 0:
            self._rendezvous.tell(Kind.DONE)
            self._done = True               # until every node is done (or the round restarts)
            return None
        return self._after_failure(ended, message)

    def _after_failure(self, ended: RoundEnd, message: dict[str, Any]) -> int | None:
        """After a round that did not end well here: stop the script, count the restart, join the
        next round; None to go on, or 1 once the restarts are spent."""
        _stop(self._child)
        # as torchrun's agent: a node joining is a change of membership, not a failure
        joined = ended.code is None and ended.why == JOINED
        self._restarts += 0 if joined else 1
        if ended.code is not None:
            self._rendezvous.tell(Kind.FAILED,
                                  why=f"node {message['node_rank']}'s script exited with {ended.code}")
        limit = self.spec.max_restarts
        if self._restarts > limit:
            self._say(f"round {self._round} ended ({ended.why}); --max-restarts {limit} exhausted; "
                      f"giving up")
            return 1
        counted = ("starting again (a node joining is no failure: --max-restarts counts failures)"
                   if joined else f"restart {self._restarts} of {limit}")
        self._say(f"round {self._round} ended ({ended.why}); {counted}")
        self._rendezvous.join()
        return None

    def _say(self, text: str) -> None:
        print(f"synkhronos.launch: {text}", file=self.out, flush=True)


def _start(spec: LaunchSpec, round_message: dict[str, Any]) -> subprocess.Popen:
    """The script, started on the node rank and node count of the round ``round_message`` starts."""
    # the restarts of the run before this round: the same on every node, a returning one's too
    env = dict(os.environ, **spec.environment(round_message["nnodes"], round_message["node_rank"],
                                              round_message["coordinator"], round_message["round"] - 1))
    # a session of its own: stopping it stops its workers too; it dies with the launcher
    return subprocess.Popen([sys.executable, spec.script, *spec.args], env=env, start_new_session=True,
                            preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child, before the script: the kernel kills it when its launcher dies (Linux)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def _watch(child: subprocess.Popen, client: RendezvousClient, round_: int | None) -> RoundEnd:
    """Until the script ends or its round does."""
    while True:
        code = child.poll()
        if code is not None:
            return RoundEnd(code, f"the script exited with {code}")
        message = client.next_message(0.1)
        if message is not None and message["kind"] == Kind.RESTART and message.get("round") == round_:
            return RoundEnd(None, message.get("why", "the rendezvous restarted"))


def _stop(child: subprocess.Popen | None) -> None:
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
