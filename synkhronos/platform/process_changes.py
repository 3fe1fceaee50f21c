"""What a runtime changes in its process, and the one place that gives it all back.

``fork()`` changes process-wide settings: the environment variables JAX and
BLAS read at start-up, JAX's configuration, numpy's BLAS threads, the
allocator's settings, the compile cache's locks. Each change is made through
:data:`changes`, which keeps how to undo it, the first time it is made (a
second change of the same setting keeps the first earlier value).
:meth:`ProcessChanges.restore`, which the runtime's stop calls (``close()``,
or a fault's teardown), undoes them all, the newest first.

Examples
--------
>>> import os
>>> process = ProcessChanges()
>>> process.set_environment({"SYNK_EXAMPLE": "1"})
>>> process.set_environment({"SYNK_EXAMPLE": "2"})
>>> os.environ["SYNK_EXAMPLE"], process.changed()
('2', ['environment SYNK_EXAMPLE'])
>>> process.restore()
>>> "SYNK_EXAMPLE" in os.environ, process.changed()
(False, [])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

__all__ = ["ProcessChanges", "changes"]

log = logging.getLogger(__name__)


class ProcessChanges:
    """The process-wide settings changed so far, each with how to give it back."""

    def __init__(self) -> None:
        self._undo: dict[str, Callable[[], None]] = {}

    def record(self, setting: str, undo: Callable[[], None]) -> None:
        """``setting`` is about to change; ``undo()`` gives its present value back. A setting
        recorded already keeps its first ``undo`` (the value from before the first change)."""
        self._undo.setdefault(setting, undo)

    def set_environment(self, values: Mapping[str, str]) -> None:
        """Set environment variables, recording what each was (or that it was unset)."""
        for key, value in values.items():
            self.record(f"environment {key}", _environment_undo(key, os.environ.get(key)))
            os.environ[key] = value

    def changed(self) -> list[str]:
        """The settings changed and not given back yet, in the order they first changed."""
        return list(self._undo)

    def restore(self) -> None:
        """Give every setting back, the newest change first; an undo that fails is logged, and the
        others still run."""
        undo, self._undo = self._undo, {}
        for setting, give_back in reversed(undo.items()):
            try:
                give_back()
            except Exception:
                log.warning("could not give back %s", setting, exc_info=True)


def _environment_undo(key: str, earlier: str | None) -> Callable[[], None]:
    def undo() -> None:
        if earlier is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = earlier
    return undo


#: this process's changes (one per process)
changes = ProcessChanges()
