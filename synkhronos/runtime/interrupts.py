"""Ctrl-C in the master: it always reaches the user's code, and never leaves the runtime half-changed.

Python raises ``KeyboardInterrupt`` in whatever Python code runs when SIGINT
arrives. Two places would lose it or do harm:

- a garbage-collection callback (JAX registers one that runs at every
  collection) or a ``__del__``: Python prints "Exception ignored in ..." and
  swallows it, and the user's loop runs on. :func:`install` puts a SIGINT
  handler in front of Python's own that, inside such code, lets it finish
  and delivers the signal again a moment later, once it has returned;
- the middle of a synkhronos operation (a function being recorded and
  shipped, a call, a collective): master and workers could be left out of
  step. :func:`shut_down_after` ends the runtime there, with a message that
  says so, so that it is either as it was or gone, never wrong;
- the middle of ``close()``, which would leave the process unable to start
  again: :func:`deferred` holds the interrupt until it has finished.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import weakref
from typing import Any, Callable

from ..platform.threads import start_thread

__all__ = ["install", "uninstall", "shut_down_after", "deferred", "REDELIVER_SECONDS"]

#: how long after a deferred SIGINT it is delivered again
REDELIVER_SECONDS = 0.02

_installed: list[Callable[..., Any]] = []      # the handler put in place, while it is


def _swallowing_codes():
    """The code objects in which a raised exception is printed and dropped instead of propagated."""
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    codes.add(weakref.finalize.__call__.__code__)
    codes.discard(None)
    return codes


def _inside_swallowing_code(frame):
    codes = _swallowing_codes()
    while frame is not None:
        if frame.f_code in codes or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _redeliver():
    signal.raise_signal(signal.SIGINT)


def _on_sigint(signum, frame):
    if _inside_swallowing_code(frame):
        timer = threading.Timer(REDELIVER_SECONDS, _redeliver)
        timer.daemon = True
        start_thread(None, "synk-sigint", thread=timer)
        return
    signal.default_int_handler(signum, frame)


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


@contextlib.contextmanager
def deferred():
    """Hold SIGINT while the block runs (main thread only), then raise the KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def shut_down_after(interrupt: KeyboardInterrupt, what: str, state: Any) -> str | None:
    """End ``state``'s runtime after ``interrupt`` landed inside the operation ``what``.

    The interrupt goes on to the user with a note saying the runtime was shut
    down and how to start again (the fault handling of a wait that the
    interrupt ended may have shut it down already); the note is returned, or
    None if there was no runtime.
    """
    if state is None:
        return None
    if state.is_open:
        state.abort()
    note = (f"synkhronos: the runtime was shut down (Ctrl-C inside {what}, where master and "
            f"workers could have been left out of step); call synk.fork() again")
    interrupt.add_note(note)
    return note
