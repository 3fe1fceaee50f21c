"""Recording every rank's timeline: start on every rank, stop and collect, write one trace file."""

from __future__ import annotations

import pickle
from typing import Any

from ..tracing import trace
from ..wire.control import Op
from .part import Part

__all__ = ["Timeline"]


class Timeline(Part):
    """The timeline commands of one runtime (see ``synk.timeline``)."""

    def start(self) -> None:
        """Every rank starts recording its timeline (:mod:`synkhronos.tracing.trace`)."""
        state = self._state
        state.check_open()
        trace.start()
        state.channel.ctl.args[0] = 1
        state.channel.command(Op.TIMELINE)

    def stop(self) -> dict[int, list[Any]]:
        """Every rank stops recording; return ``{global rank: spans}``."""
        state = self._state
        state.check_open()
        state.channel.ctl.args[0] = 0
        state.channel.command(Op.TIMELINE)
        spans = {state.master_rank: trace.stop()}
        for rank in state.worker_ranks:
            spans[state.topology.global_rank(rank)] = pickle.loads(
                state.channel.read_result_arrays(rank)[0].tobytes())
        return spans

    def write(self, path: str) -> None:
        """Stop recording and write every rank's timeline to ``path`` (Chrome trace JSON)."""
        t = self._state.topology
        trace.write_chrome_trace(path, self.stop(), self._state.master_rank,
                                 t.node_rank if t.several_nodes else None)
