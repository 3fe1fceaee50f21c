"""Recording a timeline of one process: spans (a call, a collective, a loop step) and their phases.

Off by default: every instrumented place checks ``trace.on`` (one attribute
read) before doing anything. When on, a span is a list kept on a stack:
:func:`begin` opens it, :func:`mark` closes its current phase (the phase is
named by what just finished), :func:`end` closes the last phase and the span.
:func:`chrome_events` turns a process's spans into Chrome trace events
(``ph: "X"``), each span with its phases as children on the same track, which
Perfetto and ``chrome://tracing`` draw nested. Timestamps are the system
clock's (``time.time_ns``), one clock for every process of a machine.

Examples
--------
>>> start()
>>> begin("call", "f"); mark("gather rows"); mark("compute"); end("reduce")
>>> [e["name"] for e in chrome_events(stop(), rank=0)]
['f', 'gather rows', 'compute', 'reduce']
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["on", "start", "stop", "begin", "mark", "end", "record", "now", "chrome_events", "process_names",
           "write_chrome_trace"]

now = time.time_ns

#: a recorded span: (category, name, start, its phases as (name, end), end, last phase, args)
type Span = tuple[str, str, int, tuple[tuple[str, int], ...], int, str | None, dict[str, Any] | None]
#: an open span: (category, name, start, its phases as (name, end) so far)
type _OpenSpan = tuple[str, str, int, list[tuple[str, int]]]

#: True while this process records
on = False
_spans: list[Span] = []
_open: list[_OpenSpan] = []


def start() -> None:
    """Start recording in this process (forgetting anything recorded before)."""
    global on, _spans, _open
    _spans, _open = [], []
    on = True


def stop() -> list[Span]:
    """Stop recording; return the spans recorded (plain tuples and lists, picklable)."""
    global on, _spans, _open
    on = False
    spans, _spans, _open = _spans, [], []
    return spans


def begin(category: str, name: str, since: int | None = None) -> None:
    """Open a span (nested in the span open now, if any), from ``since`` (a :func:`now`) or now."""
    _open.append((category, name, now() if since is None else since, []))


def mark(phase: str) -> None:
    """Close the current phase of the innermost open span: ``phase`` has just finished."""
    if _open:
        _open[-1][3].append((phase, now()))


def end(phase: str | None = None, at: int | None = None, **args: Any) -> None:
    """Close the innermost span at ``at`` (a :func:`now`) or now; ``phase`` names its last phase
    (None: no phase after the last mark); ``args`` are shown with the span."""
    if _open:
        category, name, t0, marks = _open.pop()
        # a tuple of plain values: the garbage collector stops tracking it, so a long recording
        # does not make every collection longer
        _spans.append((category, name, t0, tuple(marks), now() if at is None else at, phase,
                       args or None))


def record(category: str, name: str, t0: int, t_end: int, **args: Any) -> None:
    """Record a span that already happened, from ``t0`` to ``t_end`` (:func:`now` values), as it is
    (reported after the fact, by a library that timed it)."""
    _spans.append((category, name, t0, (), t_end, None, args or None))


def chrome_events(spans: Iterable[Span], rank: int, origin: int = 0, thread: int = 1) -> list[dict[str, Any]]:
    """Chrome trace events of ``spans`` recorded by ``rank``: microseconds since ``origin`` (ns)."""
    events: list[dict[str, Any]] = []
    for category, name, t0, marks, t_end, last, args in spans:
        events.append(dict(name=name, cat=category, ph="X", ts=(t0 - origin) / 1e3,
                           dur=(t_end - t0) / 1e3, pid=rank, tid=thread, args=args or {}))
        edge = t0
        for phase, t in marks + (((last, t_end),) if last else ()):
            events.append(dict(name=phase, cat="phase", ph="X", ts=(edge - origin) / 1e3,
                               dur=(t - edge) / 1e3, pid=rank, tid=thread))
            edge = t
    return events


def process_names(ranks: Iterable[int], master_rank: int, node: int | None = None) -> list[dict[str, Any]]:
    """Chrome metadata events naming each rank's process and thread (``ranks``: global ranks).

    Examples
    --------
    >>> [e["args"]["name"] for e in process_names([2, 3], 2, node=1) if e["name"] == "process_name"]
    ['rank 2 (node 1, master)', 'rank 3 (node 1, worker)']
    """
    out: list[dict[str, Any]] = []
    for rank in ranks:
        role = "master" if rank == master_rank else "worker"
        where = role if node is None else f"node {node}, {role}"
        out.append(dict(name="process_name", ph="M", pid=rank, args=dict(name=f"rank {rank} ({where})")))
        out.append(dict(name="process_sort_index", ph="M", pid=rank, args=dict(sort_index=rank)))
        out.append(dict(name="thread_name", ph="M", pid=rank, tid=1, args=dict(name=f"rank {rank}")))
    return out


def write_chrome_trace(path: str, spans_by_rank: Mapping[int, Sequence[Span]], master_rank: int,
                       node: int | None = None) -> None:
    """Write every rank's spans to ``path`` as Chrome trace JSON (what Perfetto opens).

    ``spans_by_rank`` is keyed by global rank; ``node`` names this node's tracks
    on several nodes.
    """
    import json
    events = process_names(sorted(spans_by_rank), master_rank, node)
    # times from the first span on: microseconds since 1970 in a float lose the nanoseconds
    origin = min((span[2] for spans in spans_by_rank.values() for span in spans), default=0)
    for rank, spans in sorted(spans_by_rank.items()):
        events += chrome_events(spans, rank, origin)
    with open(path, "w") as fh:
        json.dump(dict(traceEvents=events, displayTimeUnit="ms",
                       otherData=dict(origin_unix_ns=origin)), fh)
