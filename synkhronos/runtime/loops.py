"""The master's side of a device-driven loop: one entry point, :class:`Loops`.

``train.run`` asks :meth:`Loops.new` for a loop over its step's functions and
data, then runs it phase by phase (:meth:`Loops.run`: global steps
``[first, last)`` on every rank without a command per step) and ends it
(:meth:`Loops.finish`: the rule's final parameters on every device). Each
rank runs its part in :class:`synkhronos.rank.loop.DeviceLoop`.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import numpy as np

from ..comm import Reservation
from ..errors import Failure, SynkError, WorkerError
from ..platform.values import nbytes_of, stored
from ..tracing import trace
from ..wire.loop import LoopSpec
from .part import Part

if TYPE_CHECKING:
    from .nodes import NodeLink

__all__ = ["Loops", "TrainParts"]


class TrainParts(Protocol):
    """What a loop takes of a training step (``extensions.train.TrainStep`` has it)."""

    functions: tuple
    grad_shared: Any
    params: list
    statistics: list
    optimizer_state: list


class Loops(Part):
    """The device-driven loops of one runtime."""

    def __init__(self, state):
        super().__init__(state)
        self._loops = {}      # loop id -> the master's DeviceLoop, from its first phase to finish
        self._centers = {}    # loop id -> the master's handle on its center, until its loop takes it
        self._routes = {}     # loop id -> where its devices find its center (a segment, or a server)
        self._server = None   # node 0's server of its centers to the other nodes (several nodes)
        self._server_died = None   # node 0: how its server ended while a loop used it
        self._next_loop = 0

    def new(self, step: TrainParts, inputs, batch_size, shuffle, seed, rule, rule_state=None):
        """A new loop's :class:`~synkhronos.wire.loop.LoopSpec` (nothing runs yet).

        Parameters
        ----------
        step : TrainStep
            The training step (``make_train_function``'s): its functions and variables.
        inputs : list of InputRef
            Where the step's scattered inputs live.
        batch_size : int
        shuffle : bool
        seed : int
        rule : Rule
        rule_state : list of numpy.ndarray, optional
            The rule's state a checkpoint kept (a resumed run).
        """
        state = self._state
        uids = state.registry.uids_of
        grad, update = step.functions
        self._next_loop += 1
        loop_id = self._next_loop
        return LoopSpec(loop_id=loop_id, grad_fid=grad.spec.fid, update_fid=update.spec.fid,
                        grad_uid=state.registry.uid_of(step.grad_shared), param_uids=tuple(uids(step.params)),
                        stat_uids=tuple(uids(step.statistics)), state_uids=tuple(uids(step.optimizer_state)),
                        inputs=tuple(inputs), batch_size=int(batch_size), shuffle=bool(shuffle),
                        seed=int(seed), rule=rule,
                        center=f"{state.prefix}_center{loop_id}" if rule.asynchronous else None,
                        rule_state=None if rule_state is None else tuple(rule_state))

    def run(self, spec, first, last):
        """Run global steps ``[first, last)`` of loop ``spec`` on every rank.

        Returns every rank's counters, shape ``(n_ranks, len(STAT_FIELDS))``.
        """
        return self._phase(spec, "run", first, last)

    def finish(self, spec):
        """Leave every device with loop ``spec``'s final parameters; the loop is then forgotten."""
        if spec.rule.asynchronous and spec.loop_id not in self._routes:
            return          # its center was never made: no device ran
        self._phase(spec, "finish")

    def center_values(self, spec):
        """Loop ``spec``'s center now (copies), or the master's parameters for a rule without one."""
        loop = self._loops.get(spec.loop_id)
        values = loop.center_values() if loop is not None else None
        if values is None:
            values = [np.array(self._state.registry.shared_by_uid(uid).get_value())
                      for uid in spec.synced_uids]
        return values

    def rule_state(self, spec):
        """Loop ``spec``'s rule state as the master's device holds it (arrays; see Rule.saved_state)."""
        loop = self._loops.get(spec.loop_id)
        return loop.saved_rule_state() if loop is not None else []

    def release(self):
        """At the runtime's end: close every center."""
        for center in self._centers.values():
            if center is not None:
                center.close()
        for loop in self._loops.values():
            loop.close_center()
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._server_died = None
        self._loops, self._centers, self._routes = {}, {}, {}

    def _phase(self, spec, phase, first=0, last=0):
        state = self._state
        state.registry.ensure_shipped()
        channel, nodes = state.channel, state.nodes
        self._check_server()
        if not spec.rule.asynchronous:
            state.context.comm.reserve(self._reservation(spec))
        elif spec.loop_id not in self._routes:      # before the workers attach to it
            self._open_center(spec, first)
        # the workers attach to the center where it is (on another node: node 0's server)
        sent = replace(spec, center=self._routes[spec.loop_id]) if spec.rule.asynchronous else spec
        if spec.loop_id in self._loops and spec.rule_state is not None:
            sent = replace(sent, rule_state=None)     # every rank's loop has started from it already
        # cloudpickle: a rule of the user's own may be a class of the script itself (__main__)
        channel.send_payload(cloudpickle.dumps(dict(spec=sent, phase=phase, first=first, last=last),
                                               protocol=pickle.HIGHEST_PROTOCOL))

        def master_loop():
            # made once the workers have the command: a rule may start with a collective
            loop = self._loops.get(spec.loop_id)
            if loop is None:
                loop = self._loops[spec.loop_id] = state.context.device_loop(
                    spec, self._centers.pop(spec.loop_id, None), self._after_step)
            return loop

        def local():
            loop = master_loop()
            try:
                return loop.finish() if phase == "finish" else loop.run(first, last)
            except Exception as e:
                if nodes is None or isinstance(e, SynkError):
                    raise
                # a collective across nodes failed: a lost node is named, as in a call
                nodes.raise_dead_node("train.run across nodes", e)
        # (one rank has no native collective to watch: it runs here, where Ctrl-C can be held off)
        threaded = not spec.rule.asynchronous and state.n_parallel > 1 and \
            not state.context.comm.waits_in_python
        if trace.on:
            trace.begin("loop", f"train.run {phase}")
        try:
            own = channel.loop_phase(local, threaded)
            self._check_server()
        finally:
            if trace.on:
                trace.end(None, first=first, last=last)
            if phase == "finish" or not state.is_open:
                self._loops.pop(spec.loop_id, None)
        if phase == "finish":
            self._routes.pop(spec.loop_id, None)
            if spec.rule.asynchronous and nodes is not None:
                # node 0 serves the center until every node's devices took it
                nodes.exchange(("train.run finish", spec.loop_id), None, tolerate_loss=True)
                if self._server is not None:
                    try:
                        self._server.forget(spec.center)
                    except OSError:      # it ended after its last use: the next loop starts another
                        pass
            return None
        stats = np.zeros((state.n_local, len(own)))
        stats[state.local_master] = own
        for rank in state.worker_ranks:
            stats[rank] = channel.read_result_arrays(rank)[0]
        if nodes is None:
            return stats
        # an asynchronous run goes on without a lost node (its ranks count nothing); a synchronous
        # one cannot (its collectives need every rank)
        by_node = nodes.exchange(("train.run", phase), stats, tolerate_loss=spec.rule.asynchronous)
        return np.concatenate([np.zeros_like(stats) if got is None else got for got in by_node])

    def lost_nodes(self):
        """The nodes an asynchronous run went on without (none on one node)."""
        nodes = self._state.nodes
        return set() if nodes is None else set(nodes.lost)

    def _open_center(self, spec, first):
        """Make the loop's central parameters, from the master's values, their claims starting at
        global step ``first`` (a resumed run's), and the master's handle on them.

        They live in node 0's shared memory. On several nodes node 0's server
        process (:class:`~synkhronos.runtime.centers.CenterServer`, started
        with the first such loop, and again after one that ended) serves them
        too, and node 0's master tells the other nodes where; their devices
        exchange with it. A server that dies while a loop uses it ends the run
        on every node (:meth:`_center_lost`).
        """
        from ..rank.center import Center
        from ..rank.center_server import RemoteCenter, rule_document
        state, nodes = self._state, self._state.nodes
        params = [state.registry.shared_by_uid(uid) for uid in spec.synced_uids]
        home = nodes is None or state.topology.node_rank == 0
        where = spec.center
        if nodes is not None:
            rule_document(spec.rule)     # a rule the server cannot apply: every node raises here
            if self._watch_center not in nodes.watches:
                nodes.watches.append(self._watch_center)
        if home:
            center = Center.of(spec.center, params, create=True, merge=spec.rule.merge,
                               check=state.channel.watch.during_collective)
            center.start_claims_at(first * state.n_parallel)
            if nodes is not None:
                try:
                    where = self._running_server().serve(
                        spec.center, [b.shape for b in center.blocks],
                        [b.dtype for b in center.blocks], spec.rule)
                except OSError as e:         # every node raises, before any device starts
                    center.close()
                    where = ("failed", str(e))
        if nodes is not None:
            where = nodes.exchange(("train.run's center", spec.loop_id), where if home else None)[0]
            if isinstance(where, tuple):
                raise nodes.error_on(0, f"node 0 could not serve the center of {spec.rule!r} to "
                                        f"the other nodes ({where[1]}); nothing ran. Check that "
                                        f"node 0's coordinator host accepts connections on a "
                                        f"free port, or use a synchronous rule")
        if not home:
            center = RemoteCenter.of(where, params, check=self._check_node_zero,
                                     on_silence=self._node_zero_silent,
                                     on_gone=self._node_zero_center_gone)
        self._centers[spec.loop_id] = center
        self._routes[spec.loop_id] = where

    @property
    def _nodes(self) -> NodeLink:
        """The link to the other nodes: the paths that use it run on several nodes only."""
        nodes = self._state.nodes
        assert nodes is not None, "on several nodes only"
        return nodes

    def _running_server(self):
        """Node 0's center server, started now if there is none or it ended."""
        from .centers import CenterServer
        if self._server is not None and not self._server.alive:
            self._server.stop()
            self._server = None
        if self._server is None:
            coordinator = self._state.topology.coordinator
            assert coordinator is not None, "a center server runs on several nodes only"
            self._server = CenterServer(coordinator.rsplit(":", 1)[0], on_death=self._server_ended)
        return self._server

    def _server_ended(self, why):
        """From the server's watcher thread: a server that ended while a loop used it ends the
        run; node 0 tells the other nodes through the coordination service."""
        from ..rank.center_server import GONE_KEY
        if not self._routes:
            return                       # no loop uses it: the next one starts another
        self._server_died = why
        try:
            self._nodes.client.key_value_set(GONE_KEY, why, allow_overwrite=True)
        except Exception:                # noqa: BLE001 - no service: the nodes' beats say the rest
            pass

    def _after_step(self):
        """After every step of the master's device: its workers, and on node 0 its server."""
        self._state.channel.watch.during_collective()
        self._check_server()

    def _check_server(self):
        if self._server_died is not None:
            raise self._center_lost(self._server_died)

    def _watch_center(self):
        """While this node's master waits for the other nodes, during a loop across nodes: a center
        server that node 0 said died."""
        from ..rank.center_server import server_gone
        if self._routes:
            why = self._server_died or server_gone()
            if why is not None:
                raise self._center_lost(why)

    def _node_zero_center_gone(self, why):
        raise self._center_lost(why)

    def _center_lost(self, why):
        """The error of every node whose run lost node 0's center server (the runtime shut down)."""
        nodes = self._nodes
        nodes.on_fault()
        return WorkerError(nodes.topology.ranks_of(0)[0], Failure.DIED, "center server lost",
                           f"{why} during an asynchronous train.run, which cannot go on without it; "
                           f"this node's runtime was shut down, call synk.fork() on every node to "
                           f"start again", node=0)

    def _check_node_zero(self):
        """While a device of another node waits for node 0's center: this node's runtime, the nodes."""
        self._state.channel.watch.during_collective()
        self._nodes.check_nodes_alive()

    def _node_zero_silent(self, waited):
        raise self._nodes.node_died(0, 0, f"node 0's center has not answered for {waited:.0f} s")

    def _reservation(self, spec):
        """What a synchronous loop's collectives need: the flat gradient, or the parameters and state."""
        def nbytes(uid):
            return nbytes_of(stored(self._state.registry.shared_by_uid(uid)))
        if spec.rule.reduces_gradient:
            grad = nbytes(spec.grad_uid)
            return Reservation(nbytes=grad + 64, result_bytes=grad, reduce_bytes=grad,
                               result_consumed=True)
        padded = sum(nbytes(uid) + 64 for uid in spec.synced_uids + spec.state_uids)
        return Reservation(nbytes=padded, reduce_bytes=padded)
