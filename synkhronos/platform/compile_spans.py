"""XLA's compiles on a rank's timeline: each program compiled, or loaded from the compile cache.

JAX reports every backend compile through :mod:`jax.monitoring`: a time span
when it ends, and, just before, an event when the program came from the
persistent cache. :func:`watch` listens (once per process); while the process
records a timeline, each becomes a span of category ``"compile"`` named
``"compile program"`` or ``"load compiled program"``, with JAX's name for the
program in its arguments. So a timeline shows where start-up time goes, rank
by rank, and whether a run compiled or loaded.
"""

from __future__ import annotations

import threading
from typing import Any

from ..tracing import trace

__all__ = ["watch", "COMPILED", "LOADED"]

#: the span names
COMPILED, LOADED = "compile program", "load compiled program"
#: JAX's monitoring names (jax._src.dispatch.BACKEND_COMPILE_EVENT, jax._src.compiler's cache hit)
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_watching = False
_hit = threading.local()


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT:
        _hit.value = True


def _on_span(event: str, start_time: float, end_time: float, **kwargs: Any) -> None:
    if event != _BACKEND_COMPILE:
        return
    loaded, _hit.value = getattr(_hit, "value", False), False
    if trace.on:
        trace.record("compile", LOADED if loaded else COMPILED, int(start_time * 1e9), int(end_time * 1e9),
                     program=kwargs.get("fun_name", ""))


def watch() -> None:
    """Listen to JAX's compile reports in this process (from now on; again is a no-op)."""
    global _watching
    if _watching:
        return
    import jax.monitoring
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_time_span_listener(_on_span)
    _watching = True
