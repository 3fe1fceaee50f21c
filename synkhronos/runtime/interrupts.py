"""Ctrl-C in the master: it always reaches the user's code, and never leaves the runtime half-changed.

Python raises ``KeyboardInterrupt`` in whatever Python code runs when SIGINT
arrives. Two places would lose it or do harm:

- a garbage-collection callback (JAX registers one that runs at every
  collection) or a ``__del__``: Python prints "Exception ignored in ..." and
  swallows it, and the user's loop runs on. :func:`install` puts a SIGINT
  handler in front of Python's own that, inside such code, lets it finish
  and raises the ``KeyboardInterrupt`` at the next line run by the frame
  that code interrupted or a frame below it (``sys.monitoring`` line events
  on their code, armed only until one fires), or, where no such frame or
  monitoring tool is free, delivers the signal again a moment later;
- the middle of a synkhronos operation (a function being recorded and
  shipped, a call, a collective): master and workers could be left out of
  step. :func:`shut_down_after` ends the runtime there, with a message that
  says so, so that it is either as it was or gone, never wrong;
- the middle of ``close()``, which would leave the process unable to start
  again: :func:`deferred` holds the interrupt until it has finished.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import CodeType, FrameType
from typing import Any, cast

from ..platform.interrupt_hold import held
from ..platform.threads import start_thread

__all__ = ["install", "uninstall", "shut_down_after", "deferred", "REDELIVER_SECONDS"]

#: how long after a deferred SIGINT it is delivered again if no line of its caller has raised it
REDELIVER_SECONDS = 0.1
#: the same where no line event can raise it
RETRY_SECONDS = 0.02

_installed: list[Callable[..., Any]] = []      # the handler put in place, while it is


def _swallowing_codes() -> set[CodeType]:
    """The code objects in which a raised exception is printed and dropped instead of propagated."""
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    codes.add(weakref.finalize.__call__.__code__)
    codes.discard(None)
    return cast(set[CodeType], codes)


def _outside_swallowing_code(frame: FrameType | None) -> tuple[bool, FrameType | None]:
    """``(inside, caller)``: whether ``frame`` runs inside code that an interrupt must not stop, and
    the frame that code interrupted (the first frame outside it, or None).

    That code is a garbage-collection callback or a ``__del__`` (which swallow
    the exception), and an import of one of JAX's modules (an interrupted
    import of JAX's MLIR dialects cannot be done again: every later compile
    fails with "Dialect namespace ... is already registered").
    """
    codes = _swallowing_codes()
    inside, caller, importing = False, None, None
    while frame is not None:
        code = frame.f_code
        if code in codes or code.co_name == "__del__" or (
                code.co_name == "<module>" and code.co_filename.startswith(_JAX_DIRECTORIES)):
            inside, caller, importing = True, frame.f_back, None
        elif inside and code.co_filename.startswith("<frozen importlib"):
            importing = importing or frame
        elif importing is not None:
            caller, importing = frame, None
        frame = frame.f_back
    return inside, caller


def _jax_directories() -> tuple[str, ...]:
    """The directories of the installed ``jax`` and ``jaxlib`` packages (without importing them)."""
    import importlib.util
    import os
    found = []
    for name in ("jax", "jaxlib"):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            found.append(os.path.join(location, ""))
    return tuple(found)


_JAX_DIRECTORIES = _jax_directories()


class _Pending:
    """A SIGINT held back from swallowing code, raised at the next line of the code it interrupted.

    ``sys.monitoring`` line events are switched on for the code objects of the
    interrupted frame and the frames below it while the interrupt is pending,
    under a tool id claimed for that time only (a debugger or profiler may
    claim it again as soon as the interrupt has been raised).
    """

    def __init__(self) -> None:
        self.codes: set[CodeType | None] = set()
        self.tool: int | None = None

    def arm(self, caller: FrameType | None) -> bool:
        """Raise at the next line run by ``caller`` or any frame below it (``caller`` may end
        without running another line); False if no monitoring tool id is free."""
        if self.tool is None:
            self.tool = _claim_monitoring_tool(self._on_line)
        if self.tool is None:
            return False
        while caller is not None:
            if caller.f_code not in self.codes:
                self.codes.add(caller.f_code)
                sys.monitoring.set_local_events(self.tool, caller.f_code, sys.monitoring.events.LINE)
            caller = caller.f_back
        return True

    @property
    def armed(self) -> bool:
        return bool(self.codes)

    def disarm(self) -> None:
        """Switch the line events off and give the tool id back."""
        tool, self.tool = self.tool, None
        if tool is not None:
            for code in self.codes:
                if code is not None:
                    sys.monitoring.set_local_events(tool, code, 0)
            sys.monitoring.register_callback(tool, sys.monitoring.events.LINE, None)
            sys.monitoring.free_tool_id(tool)
        self.codes.clear()

    def _on_line(self, code: CodeType, line: int) -> None:
        if self.codes and threading.current_thread() is threading.main_thread():
            inside, _ = _outside_swallowing_code(sys._getframe(1))
            if not inside:
                self.disarm()
                raise KeyboardInterrupt

    def release(self) -> None:
        """Forget a pending interrupt (at :func:`uninstall`)."""
        self.disarm()


def _claim_monitoring_tool(on_line: Callable[[CodeType, int], None]) -> int | None:
    """A free ``sys.monitoring`` tool id with ``on_line`` as its line callback, or None."""
    # the ids no tool claims by convention first, then the profiler's and the optimizer's
    for tool in (4, 3, 2, 5):
        if sys.monitoring.get_tool(tool) is None:
            sys.monitoring.use_tool_id(tool, "synkhronos-sigint")
            sys.monitoring.register_callback(tool, sys.monitoring.events.LINE, on_line)
            return tool
    return None


_pending = _Pending()


def _redeliver() -> None:
    if _pending.armed:
        signal.raise_signal(signal.SIGINT)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    inside, caller = _outside_swallowing_code(frame)
    if not inside:
        _pending.disarm()
        signal.default_int_handler(signum, frame)
    delay = REDELIVER_SECONDS
    if caller is None or not _pending.arm(caller):
        _pending.codes.add(None)        # armed for the timer alone
        delay = RETRY_SECONDS
    # also the fallback for a caller that never reaches its next line (a long call into C)
    timer = threading.Timer(delay, _redeliver)
    timer.daemon = True
    start_thread(None, "synk-sigint", thread=timer)


def install() -> None:
    """Put the handler in front of Python's default SIGINT handler (main thread only; a handler of
    the user's own is left alone)."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, _on_sigint)
    _installed.append(_on_sigint)


def uninstall() -> None:
    """Give SIGINT back to Python's default handler, if :func:`install` took it and still has it."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is _installed[0]:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _installed.clear()
    _pending.release()


def deferred() -> AbstractContextManager[None]:
    """Hold SIGINT while the block runs (main thread only), then raise the KeyboardInterrupt
    (:func:`~synkhronos.platform.interrupt_hold.held`)."""
    return held()


def shut_down_after(interrupt: KeyboardInterrupt, what: str, state: Any,
                    remember: Callable[[str], None]) -> None:
    """End ``state``'s runtime after ``interrupt`` landed inside the operation ``what``.

    The interrupt goes on to the user with a note saying the runtime was shut
    down and how to start again (the fault handling of a wait that the
    interrupt ended may have shut it down already). ``remember(note)`` is
    called before the teardown, for the next call to say: a second Ctrl-C,
    raised once the teardown has run, carries the note too and must not lose it.
    Nothing is done without a runtime (``state`` None).
    """
    if state is None:
        return
    note = (f"synkhronos: the runtime was shut down (Ctrl-C inside {what}, where master and "
            f"workers could have been left out of step); call synk.fork() again")
    interrupt.add_note(note)
    remember(note)
    try:
        if state.is_open:
            state.abort()
    except KeyboardInterrupt as again:
        if again is not interrupt:
            again.add_note(note)
        raise
