"""Each command's work on one rank, written once: the master is a rank like the others.

The worker's handlers (:class:`synkhronos.runtime.worker.Worker`) and the
master's parts (:class:`~synkhronos.runtime.calls.Calls`,
:class:`~synkhronos.runtime.loops.Loops`) run these same functions for their
own rank; each side keeps only what is its own: the worker decodes the command
and reports, the master publishes it, waits for the workers and gathers.

- :func:`call_share`: a call's share (``CALL``, and the first half of ``STEP``);
- :func:`step_share`: a training step's share, its tail prepared (``STEP``);
- :func:`fused_step_share`: a training step as one program (``STEP``, fused);
- :func:`loop_phase`: one phase of a device-driven loop (``LOOP``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..seams.loop import CenterClient
from ..wire.control import STEP_COLLECTIVE_AT, ControlBlock, Words
from ..wire.loop import LoopSpec
from ..wire.plan import CallPlan
from .context import RankContext
from .executor import run_fused_share, run_share

if TYPE_CHECKING:
    from .loop import DeviceLoop

__all__ = ["call_share", "step_share", "fused_step_share", "loop_phase"]


def call_share(context: RankContext, plan: CallPlan, ctl: ControlBlock,
               record: np.dtype | None) -> tuple[int, list | None]:
    """Run this rank's share of the call ``plan``.

    Returns its rows (also written to ``ctl``), and its outputs as host arrays,
    unless they went into ``ctl``'s result records (``record``: their
    structured dtype; None: the outputs travel as arrays) or it computed none.
    """
    rows, outs = run_share(context, plan)
    ctl.rows[context.local_rank] = rows
    if not rows or not outs:
        return rows, None
    if record is not None:
        ctl.put_record(record, context.local_rank, outs)
        return rows, None
    return rows, [np.asarray(o) for o in outs]


def step_share(context: RankContext, plan: CallPlan, ctl: ControlBlock,
               record: np.dtype | None) -> tuple[Callable[[], None], int, list | None]:
    """This rank's share of a training step (:func:`call_share`), and the step's tail prepared:
    ``(run_tail, rows, outputs)``, where ``run_tail()`` all-reduces then updates, as the master
    wrote the step in ``ctl``."""
    rows, outs = call_share(context, plan, ctl, record)
    run_tail = context.step_tail(Words(ctl.args[STEP_COLLECTIVE_AT:]),
                                 int(ctl.header[ControlBlock.UPDATE_FID]))
    return run_tail, rows, outs


def fused_step_share(context: RankContext, plan: CallPlan, ctl: ControlBlock,
                     program: Any = None) -> tuple[int, list]:
    """This rank's share of a training step as one program (see :mod:`.fused`): ``program``, or
    the one this rank builds for the step ``ctl`` holds. Returns ``(rows, outputs)`` once the
    program's collective is done (its errors raised here).

    Raises
    ------
    RuntimeError
        This rank cannot run the step as one program (its graphs differ from the master's).
    """
    if program is None:
        program = context.fused_step(plan, Words(ctl.args[STEP_COLLECTIVE_AT:]),
                                     int(ctl.header[ControlBlock.UPDATE_FID]))
        if program is None:
            raise RuntimeError(f"rank {context.rank} cannot run the step as one program, as the "
                               f"master does (its graphs differ)")
    rows, values = run_fused_share(context, plan, program)
    if context.n_ranks > 1:
        import jax
        jax.block_until_ready(values)
    return rows, values


def loop_phase(loops: dict[int, DeviceLoop], context: RankContext, spec: LoopSpec, phase: str, first: int,
               last: int, center: Callable[[], CenterClient | None],
               beat: Callable[[], None]) -> np.ndarray | None:
    """Run phase ``phase`` of the device-driven loop ``spec`` on this rank: its global steps
    ``[first, last)`` (``"run"``: returns this rank's counters), or ``"finish"`` (the rule's final
    parameters; the loop is then forgotten).

    ``loops`` holds this rank's :class:`~.loop.DeviceLoop` of every loop from its
    first phase to its finish; a new one takes ``center()`` (its rule's center
    client, or None) and calls ``beat()`` after every step.
    """
    loop = loops.get(spec.loop_id)
    if loop is None:
        loop = loops[spec.loop_id] = context.device_loop(spec, center(), beat)
    if phase == "finish":
        loops.pop(spec.loop_id).finish()
        return None
    return loop.run(first, last)
