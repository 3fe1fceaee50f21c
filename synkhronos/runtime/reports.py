"""What the ranks report besides results: their errors (as one :class:`WorkerError`) and warnings.

A worker writes an error (type, message, traceback, graph line) into its
result segment, and its warnings into its warnings segment; the master turns
them into one report naming global ranks (and, on several nodes, this node):
errors name ranks in one place, here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..errors import StallError, SynkError, WorkerError, verbose
from ..ipc.packing import read_pickle
from ..ipc.segments import SegmentMirror
from ..wire.control import ControlBlock, Status

__all__ = ["RankReports", "one_report", "Reported", "RAISED_AS_THEY_ARE"]

#: errors of this process's own share of a command that reach the user as they are, not as a
#: WorkerError: synkhronos's own, and a warning that the script's filters made an error here
#: (``python -W error``), which the script catches by its class
RAISED_AS_THEY_ARE = (SynkError, Warning)


class Reported(Protocol):
    """What the reports read of a :class:`~synkhronos.runtime.channel.Channel`."""

    ctl: ControlBlock
    worker_warnings: dict[int, SegmentMirror]
    master_rank: int
    rank_offset: int
    node: int | None
    stall_timeout: float

    def read_result_pickle(self, rank: int) -> Any:
        """What local ``rank`` pickled into its result segment."""


class RankReports:
    """Errors and warnings of this node's ranks.

    Parameters
    ----------
    channel : Channel
        Its control block, result and warning segments.
    """

    def __init__(self, channel: Reported) -> None:
        self._channel = channel
        self._warning_registry: dict[Any, Any] = {}    # shared by every rank: one warning shows once

    def raise_for(self, local_error: BaseException | None, ranks: Iterable[int]) -> None:
        """Raise one :class:`WorkerError` for every rank whose part of the command failed.

        It names the first failing rank (this one first) and every other rank
        that raised the same error (:attr:`WorkerError.ranks`), and lists the
        ranks that raised another (:attr:`WorkerError.others`). It is also an
        instance of the original builtin type (see :meth:`WorkerError.raised`).
        This process's own error is raised as it is when it is one of
        :data:`RAISED_AS_THEY_ARE`.
        """
        if isinstance(local_error, RAISED_AS_THEY_ARE):
            raise local_error
        errors = [] if local_error is None else [self.own_error(local_error)]
        errors += self.worker_errors(ranks)
        if errors:
            raise one_report(errors) from (local_error if verbose() else None)

    def worker_errors(self, ranks: Iterable[int]) -> list[WorkerError]:
        """The errors of the workers in ``ranks`` (their warnings forwarded on the way)."""
        status = self._channel.ctl.status
        errors: list[WorkerError] = []
        for rank in ranks:
            if status[rank, ControlBlock.WARN_NBYTES]:
                self.forward_warnings(rank)
            if self._channel.ctl.state(rank) == Status.ERROR:
                errors.append(self.raised(rank, *self._channel.read_result_pickle(rank)))
        return errors

    def forward_warnings(self, rank: int) -> None:
        """Show the warnings worker ``rank`` raised through this process's ``warnings``.

        They obey the script's filters, and one the ranks share shows once.
        """
        channel = self._channel
        row = channel.ctl.status[rank]
        seg = channel.worker_warnings[rank].get(int(row[ControlBlock.WARN_GEN]))
        caught = read_pickle(seg, int(row[ControlBlock.WARN_NBYTES]))
        row[ControlBlock.WARN_NBYTES] = 0
        for message, category, filename, lineno in caught:
            warnings.warn_explicit(message, category, filename, lineno,
                                   registry=self._warning_registry)

    def raised(self, rank: int, exc_type: str, message: str, tb: str, where: str | None = None) -> WorkerError:
        """The error worker ``rank`` (local) raised."""
        error = WorkerError.raised(rank + self._channel.rank_offset, exc_type, message, tb, where=where)
        error.node = self._channel.node
        return error

    def own_error(self, e: BaseException) -> WorkerError:
        """This process's own error ``e``, as a worker's would be."""
        error = WorkerError.from_exception(self._channel.master_rank + self._channel.rank_offset, e)
        error.node = self._channel.node
        return error

    def stalled(self, what: str, arrived: Iterable[int], missing: Iterable[int], timeout: float | None = None,
                setting: str = "stall_timeout") -> StallError:
        offset = self._channel.rank_offset
        return StallError(what, arrived=sorted(r + offset for r in arrived),
                          missing=sorted(r + offset for r in missing),
                          timeout=self._channel.stall_timeout if timeout is None else timeout,
                          setting=setting)


def one_report(errors: Sequence[WorkerError]) -> WorkerError:
    """The first of ``errors``, naming the ranks that raised the same and listing the others."""
    first = errors[0]
    for other in errors[1:]:
        if (other.exc_type, other.message) == (first.exc_type, first.message):
            first.ranks.append(other.rank)
        else:
            first.others.append((other.rank, other.exc_type, other.message))
        if verbose():
            first.worker_traceback += f"\n--- traceback in rank {other.rank} ---\n{other.worker_traceback}"
    return first
