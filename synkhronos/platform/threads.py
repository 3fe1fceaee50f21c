"""The threads synkhronos starts, told apart from the user's by a mark on the thread object.

The master treats any other Python thread as one that may read shared
variables while it computes (see :func:`synkhronos.runtime.session.other_threads_alive`);
a name could be the user's too, a mark set here cannot.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["start_thread", "is_own"]


def start_thread(target: Callable[..., Any] | None, name: str, daemon: bool = True,
                 thread: threading.Thread | None = None) -> threading.Thread:
    """Start ``thread`` (default: a new one running ``target``) marked as synkhronos's own.

    Examples
    --------
    >>> t = start_thread(lambda: None, "synk-example")
    >>> t.join(); is_own(t), is_own(threading.current_thread())
    (True, False)
    """
    if thread is None:
        thread = threading.Thread(target=target, name=name, daemon=daemon)
    thread._synkhronos_own = True  # type: ignore[attr-defined]
    thread.start()
    return thread


def is_own(thread: threading.Thread) -> bool:
    """True if synkhronos started ``thread`` (:func:`start_thread`)."""
    return getattr(thread, "_synkhronos_own", False)
