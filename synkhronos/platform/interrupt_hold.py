"""Holding Ctrl-C across the few lines that hand buffers to XLA and take the results back.

A program that donates its inputs (``donate_argnums``) invalidates them the
moment it is dispatched; its results exist only once the call returns and are
stored. A ``KeyboardInterrupt`` raised between the two loses both: the old
values are deleted and the new ones dropped. :func:`held` keeps SIGINT from
raising inside that window and raises it right after; :func:`can_hold`
says whether this thread can do that (Python delivers SIGINT to the main
thread only, and a worker process ignores it), so a program run elsewhere
donates nothing.
"""

from __future__ import annotations

import _signal
import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["held", "can_hold"]

_SIGINT = int(signal.SIGINT)


def can_hold() -> bool:
    """True if no Ctrl-C can land in this thread unheld: its main thread, or a process that ignores
    SIGINT (a worker, whose master handles Ctrl-C).

    Examples
    --------
    >>> can_hold()
    True
    """
    if threading.current_thread() is threading.main_thread():
        return True
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Within the block, a SIGINT is held and raised as ``KeyboardInterrupt`` once it ends (in the
    main thread; elsewhere the block runs as it is).

    Examples
    --------
    >>> import os
    >>> try:
    ...     with held():
    ...         os.kill(os.getpid(), signal.SIGINT)
    ...         finished = True
    ... except KeyboardInterrupt:
    ...     print("raised after the block:", finished)
    raised after the block: True
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list = []
    # ``_signal`` is what ``signal`` wraps: the same calls without converting to and from enums,
    # which cost as much as the rest of a small step's host path
    previous = _signal.signal(_SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        _signal.signal(_SIGINT, previous)
    if arrived:
        if callable(previous):
            previous(signal.SIGINT, None)         # the handler in place decides (Python's raises)
        elif previous == _signal.SIG_DFL:
            raise KeyboardInterrupt
