"""What native libraries print on the process's own file descriptors, kept from the user's output.

XLA, its coordination service and Gloo print from C++ straight to file
descriptors 1 and 2, which Python's ``sys.stdout``/``sys.stderr`` never see.
``TF_CPP_MIN_LOG_LEVEL`` quiets XLA only in a process that sets it before
JAX loads, which a user's script that imported JAX first has already done.
So the few calls that print lines a user cannot act on run with that
descriptor sent to a file, and every other line comes back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import TextIO

__all__ = ["native_lines_dropped", "RECOVERABLE_TASKS", "GLOO_CONNECTED", "TASK_WATCH_CANCELLED",
           "TASK_WATCH_DETAIL"]

#: JAX's coordination service, made with recoverable tasks (which synkhronos asks for), says so
RECOVERABLE_TASKS = re.compile(r"Using experimental recoverable task feature")
#: Gloo's "[Gloo] Rank r is connected to n peer ranks" as the ranks first connect
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected")
#: the coordination service's watch of each task, ended by the runtime's own shutdown: absl's log line
#: (``W0101 00:00:00.000000 1234 pjrt_client.cc:1605] WatchTasksAsync failed ...``) or gRPC's line
#: naming the call; each opens a block of TASK_WATCH_DETAIL lines
TASK_WATCH_CANCELLED = re.compile(
    r"^[EWIF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] .*WatchTasks"
    r"|^Additional GRPC error information from remote target coordination_service .*WatchTasks")
#: the lines gRPC adds under such a line: its "additional information", a ``:STATUS:`` line, the
#: source-location trace and a blank line (dropped only inside a block a TASK_WATCH_CANCELLED line opened)
TASK_WATCH_DETAIL = re.compile(
    r"^Additional GRPC error information|^:[A-Z_]+:|^=== Source Location Trace: ==="
    r"|^\S+/(tsl|xla)/\S+\.(h|cc):\d+\s*$|^\s*$")


@contextlib.contextmanager
def native_lines_dropped(fd: int, *patterns: re.Pattern,
                         continued_by: re.Pattern | None = None) -> Iterator[None]:
    """Run the block with file descriptor ``fd`` sent to a file; then write back every line
    that matches none of ``patterns`` (what else the block printed still reaches the user), less
    the lines matching ``continued_by`` right under a dropped one.

    Examples
    --------
    >>> import os, re
    >>> with native_lines_dropped(1, re.compile("noise")):
    ...     _ = os.write(1, b"noise from C++\\n")   # gone; any other line would come back
    """
    stream = sys.stdout if fd == 1 else sys.stderr
    try:
        saved = os.dup(fd)
    except OSError:              # the descriptor is closed (a daemon's stderr): nothing to keep from
        yield
        return
    _flush(stream)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), fd)
        try:
            yield
        finally:
            _flush(stream)
            os.dup2(saved, fd)
            os.close(saved)
            caught.seek(0)
            kept = _lines_kept(caught.read().splitlines(keepends=True), patterns, continued_by)
            if kept:
                _flush(stream)
                with contextlib.suppress(OSError):
                    os.write(fd, b"".join(kept))


def _lines_kept(lines: list[bytes], patterns: tuple[re.Pattern, ...],
                continued_by: re.Pattern | None) -> list[bytes]:
    """The lines that match none of ``patterns``, less those matching ``continued_by`` that follow
    a dropped line (a block).

    Examples
    --------
    >>> _lines_kept([b"noise\\n", b"  more\\n", b"kept\\n", b"  more\\n"], (re.compile("noise"),),
    ...             re.compile("^  "))
    [b'kept\\n', b'  more\\n']
    """
    kept, dropping = [], False
    for line in lines:
        text = line.decode(errors="replace")
        dropping = any(p.search(text) for p in patterns) or \
            (dropping and continued_by is not None and continued_by.search(text) is not None)
        if not dropping:
            kept.append(line)
    return kept


def _flush(stream: TextIO | None) -> None:
    """Flush ``stream`` if there is one (``sys.stderr`` is None in a process started without it)."""
    if stream is not None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
