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

__all__ = ["native_lines_dropped", "RECOVERABLE_TASKS", "GLOO_CONNECTED", "TASK_WATCH_CANCELLED"]

#: JAX's coordination service, made with recoverable tasks (which synkhronos asks for), says so
RECOVERABLE_TASKS = re.compile(r"Using experimental recoverable task feature")
#: Gloo's "[Gloo] Rank r is connected to n peer ranks" as the ranks first connect
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected")
#: the coordination service's watch of each task, cancelled by the runtime's own shutdown: gRPC's
#: error, its "additional information", status and source-location lines, and the blank lines between
TASK_WATCH_CANCELLED = re.compile(r"WatchTasks|GRPC error information|grpc_util\.h|grpc_status|CANCELLED|"
                                  r"Source Location Trace|DerivedStatus|failed to connect to all addresses|"
                                  r"^\s*$")


@contextlib.contextmanager
def native_lines_dropped(fd: int, *patterns: re.Pattern) -> Iterator[None]:
    """Run the block with file descriptor ``fd`` sent to a file; then write back every line
    that matches none of ``patterns`` (what else the block printed still reaches the user).

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
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not any(p.search(line.decode(errors="replace")) for p in patterns)]
            if kept:
                _flush(stream)
                with contextlib.suppress(OSError):
                    os.write(fd, b"".join(kept))


def _flush(stream):
    """Flush ``stream`` if there is one (``sys.stderr`` is None in a process started without it)."""
    if stream is not None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
