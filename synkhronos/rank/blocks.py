"""A device-driven loop's steps in blocks: many steps as one program, the data on the device.

A synchronous loop (:class:`~.loop.DeviceLoop`) runs the steps up to the next
check, the rule's next sync point, or the epoch's last (shorter) step as one
:class:`~.fused.BlockProgram`: a ``lax.scan`` over the block's index rows, each
step gathering its rows from the step's Data held on the device, computing,
reducing the flat gradient inside the program and updating. The host sends
the block's indices and nothing else, and reads the losses once per phase.

A block needs what a program needs: the gradient function's graph for the
block's rows already built (the loop's first step, taken apart, builds it),
equal shares on every rank, a collective implementation that reduces inside
a program (or one device), and room on the device for the data. Otherwise the
loop takes its steps one by one, as before.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import numpy as np

from ..platform.device_arrays import adopt, to_device
from ..seams.rule import steps_before_sync
from ..tracing import trace
from .fused import BlockProgram, fused_graph

__all__ = ["Blocks", "MAX_BLOCK", "BLOCK_SECONDS", "DATA_SHARE_OF_MEMORY"]

#: the most steps one block runs (its index rows go to the device at once)
MAX_BLOCK = 1024
#: a block that runs longer than this (on a CPU, whose programs run in the caller) halves the next
#: blocks: a Ctrl-C waits for the block it lands in
BLOCK_SECONDS = 2.0
#: a loop's data goes to a device with memory statistics only if it takes at most this share of
#: the device's memory (its size, not what is free: every rank decides alike, and a rank that
#: decided otherwise would run other programs than its peers, whose collectives then never meet)
DATA_SHARE_OF_MEMORY = 0.5


class Blocks:
    """One rank's blocks of a loop: its programs (per rows) and its data on the device.

    Parameters
    ----------
    loop : DeviceLoop
    context : RankContext
    """

    def __init__(self, loop: Any, context: Any):
        self.loop, self.context = loop, context
        #: the step's Data on this device (None: not yet placed; False: it does not fit)
        self._tables: list | Literal[False] | None = None
        #: the most steps a block may take now (see BLOCK_SECONDS)
        self._cap = MAX_BLOCK
        #: this rank's seconds in its last block (told to every rank by the next block), and that
        #: block's length; a CPU's programs run in the caller, so only there do they count
        self._last: tuple[float, int] = (0.0, 0)
        self._timed = _programs_run_in_the_caller()
        #: (gradient, rows per rank) of the steps loops have taken apart (each builds the gradient's
        #: graph for its rows): a block of those rows may run, on every rank alike
        self._stepped = context.stepped_apart
        #: no block can run here: unequal shares, or a reduction only between programs
        self._never = (loop.n_ranks > 1 and (loop.spec.batch_size % loop.n_ranks or loop.comm is None
                                             or context.program_reducer() is None))

    def run(self, step: int, last: int, stats: Any) -> int:
        """Run global steps from ``step`` (before ``last``) as one block; return how many ran (0:
        none, the loop takes the step apart)."""
        loop = self.loop
        spec = loop.spec
        full = spec.n_rows // spec.batch_size            # the epoch's steps of a whole batch
        i = step % spec.steps_per_epoch
        if self._never or i >= full:
            return 0
        to_sync = steps_before_sync(loop.rule, loop.rule_state)
        length = int(min(last - step, full - i, self._cap, math.inf if to_sync is None else to_sync))
        # a power of two: the few lengths compile once each, however a run's steps fall
        length = 1 << (length.bit_length() - 1) if length >= 1 else 0
        rows = spec.batch_size // loop.n_ranks
        # (whether a block runs is decided alike on every rank: from what the loop did, never from
        # what this rank compiled besides, as the master's check of its first share)
        program = self._program(rows) if length >= 1 and (spec.grad_fid, rows) in self._stepped else None
        tables = self._device_tables() if program is not None else False
        if program is None or tables is False:
            return 0
        if trace.on:
            trace.begin("step", "block")
        indices = np.stack([loop.step_rows(s, loop.rank)[0] for s in range(step, step + length)])
        weight = self.context.uploads.put(("loop", spec.loop_id),
                                          loop.weight_rows(rows, spec.batch_size))
        grad, runner, update, upd_runner = program.runners
        grad.continue_streams(runner)
        update.continue_streams(upd_runner)
        # (the gradient's reductions run inside the program: they cannot be timed apart as syncing)
        start = time.perf_counter()
        seconds = self.context.uploads.put(("loop seconds", spec.loop_id), np.float32(self._last[0]))
        loss, slowest = program(tables, to_device(indices.astype(np.int32)), weight, seconds)
        loop.add_loss(loss, rows)
        if self._timed:
            # every rank halves its blocks alike: by the slowest rank's time of the previous block
            if float(slowest) > BLOCK_SECONDS:
                self._cap = max(1, self._last[1] // 2)
            self._last = (time.perf_counter() - start, length)
        if trace.on:
            trace.end("compute", first=step, steps=length, rows=rows)
        loop.after_steps(rows, spec.batch_size, length, stats)
        return length

    def stepped_apart(self, rows: int) -> None:
        """The loop took a step of ``rows`` rows on this rank apart (its graph is built)."""
        self._stepped.add((self.loop.spec.grad_fid, rows))

    def _program(self, rows: int) -> BlockProgram | None:
        """The block program for steps of ``rows`` rows on this rank, or None (not yet, or never).

        Kept by the rank (:attr:`RankContext.step_programs`): a later run of the
        same step finds its programs compiled.
        """
        loop = self.loop
        spec = loop.spec
        shapes = tuple((rows,) + tuple(view.shape[1:]) for view in loop.views)
        runner, upd_runner = loop.grad.settled_runner(shapes), loop.update.settled_runner(())
        if runner is None or upd_runner is None:
            return None                  # the graph for these rows is not built yet: ask again
        op = "avg" if loop.rule.reduces_gradient else None
        key = ("block", spec.grad_fid, spec.update_fid, spec.grad_uid, shapes, op, id(runner))

        def build() -> BlockProgram | None:
            if runner.runs_host_code() or upd_runner.runs_host_code():
                # host code can fail in the middle of a block, which stores all its steps or none:
                # taken one at a time, the steps leave the values of the last whole one
                return None
            grad, update = fused_graph(runner.fn), fused_graph(upd_runner.fn)
            reducer = self.context.program_reducer()
            if grad is None or update is None or reducer is None:
                return None
            program = BlockProgram(grad, update, loop.grad_var.container.storage, op, reducer)
            program.runners = (loop.grad, runner, loop.update, upd_runner)
            return program
        return self.context.step_programs.get(key, build)

    def _device_tables(self) -> list | Literal[False]:
        """The step's Data on this device, placed at the first block (False if they do not fit)."""
        if self._tables is None:
            views = self.loop.views
            self._tables = [adopt(np.ascontiguousarray(v)) for v in views] \
                if _fits(sum(v.nbytes for v in views)) else False
        return self._tables


def _programs_run_in_the_caller() -> bool:
    """Whether this process's device runs a program in the thread that calls it (a CPU device, whose
    dispatch the runtime makes synchronous), so that a block's time is its compute."""
    import jax
    return jax.local_devices()[0].platform == "cpu"


def _fits(nbytes: int) -> bool:
    """Whether ``nbytes`` of data fit this process's device (a CPU device shares the host's memory,
    and adopts a Data's rows without a copy)."""
    import jax
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return True
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return limit is None or nbytes <= DATA_SHARE_OF_MEMORY * limit
