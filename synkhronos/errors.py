"""Exception types raised by synkhronos."""

import builtins
import functools
import traceback

__all__ = ["SynkError", "WorkerError", "StallError", "NodesDiverged", "ShapeMismatch",
           "SynkWarning", "LocalUpdatesWarning", "exception_name"]


def exception_name(e):
    """The name of ``e``'s type: bare for builtins (``"ValueError"``), else ``"module.Qualname"``."""
    module = type(e).__module__
    return type(e).__qualname__ if module == "builtins" else f"{module}.{type(e).__qualname__}"


class SynkError(RuntimeError):
    """Base class of the runtime errors synkhronos raises itself."""


class WorkerError(SynkError):
    """A worker process failed: it raised an exception, or it died.

    Parameters
    ----------
    rank : int
        Rank of the failing process.
    how : str
        ``"raised"`` when the worker raised an exception and is still alive
        (the runtime stays usable), ``"died"`` when the process ended (the
        runtime has been shut down; call ``fork()`` again).
    exc_type : str
        Qualified name of the worker's exception type, or the way the process
        ended (e.g. ``"killed by SIGKILL"``).
    message : str
        The worker's exception message.
    worker_traceback : str
        The traceback formatted in the worker process.
    node : int, optional
        On several nodes, the node of the failing process.

    Examples
    --------
    >>> try:                                                # doctest: +SKIP
    ...     f(x_dat)
    ... except synk.WorkerError as e:
    ...     print(e.rank, e.exc_type, e.worker_traceback)
    """

    @classmethod
    def raised(cls, rank, exc_type, message, worker_traceback=""):
        """The error of rank ``rank`` that raised ``exc_type``, whichever rank it is.

        When ``exc_type`` names a builtin exception (``"ValueError"``), the
        error is an instance of that type as well, so ``except ValueError``
        catches it from any rank, the master's own included.

        Examples
        --------
        >>> e = WorkerError.raised(1, "ValueError", "bad rows")
        >>> isinstance(e, ValueError), isinstance(e, WorkerError), e.rank
        (True, True, 1)
        """
        return _with_builtin_type(exc_type)(rank, "raised", exc_type, message, worker_traceback)

    @classmethod
    def from_exception(cls, rank, e):
        """:meth:`raised` for exception ``e`` caught in this process (rank ``rank``)."""
        return cls.raised(rank, exception_name(e), str(e), "".join(traceback.format_exception(e)))

    def __init__(self, rank, how, exc_type, message, worker_traceback="", node=None):
        self.rank = rank
        self.how = how
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        self.node = node
        where = f"rank {rank}" if node is None else f"rank {rank} (node {node})"
        text = f"{where} {how}: {exc_type}: {message}"
        if worker_traceback:
            text += f"\n--- traceback in rank {rank} ---\n{worker_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild_worker_error, (self.rank, self.how, self.exc_type, self.message,
                                        self.worker_traceback, self.node))


def _rebuild_worker_error(rank, how, exc_type, message, worker_traceback, node=None):
    if how == "raised":
        error = WorkerError.raised(rank, exc_type, message, worker_traceback)
        error.node = node
        return error
    return WorkerError(rank, how, exc_type, message, worker_traceback, node)


@functools.cache
def _with_builtin_type(exc_type):
    """WorkerError, also a subclass of the builtin exception named ``exc_type`` where there is one."""
    base = getattr(builtins, exc_type, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(WorkerError, base):
        return WorkerError
    try:
        return type(f"WorkerError[{exc_type}]", (WorkerError, base), {"__module__": __name__})
    except TypeError:        # a builtin with a layout of its own (OSError, ...)
        return WorkerError


class StallError(SynkError):
    """Some ranks did not reach or finish a command (or collective) within the stall timeout.

    The runtime has been shut down (a rank stuck in a collective cannot be
    recovered); call ``fork()`` again.

    Parameters
    ----------
    what : str
        What was being waited for.
    arrived, missing : list of int
        Ranks that did and did not get there.
    timeout : float
        The stall timeout, in seconds (``fork(stall_timeout=...)``).
    """

    def __init__(self, what, arrived, missing, timeout):
        self.what, self.arrived, self.missing, self.timeout = what, arrived, missing, timeout
        super().__init__(f"{what} stalled: ranks {arrived} arrived, ranks {missing} did not within "
                         f"{timeout:g} s (fork(stall_timeout=...)); the runtime was shut down, "
                         f"call synk.fork() to start again")

    def __reduce__(self):
        return (type(self), (self.what, self.arrived, self.missing, self.timeout))


class NodesDiverged(SynkError):
    """The masters of several nodes made different synkhronos calls at the same point.

    Every node must run the same script and make the same calls in the same
    order; the nodes that disagree raise this at the first difference, naming
    both calls, and their runtimes stay usable.
    """


class SynkWarning(UserWarning):
    """Base class of the warnings synkhronos gives."""


class LocalUpdatesWarning(SynkWarning):
    """A function's updates are computed from each device's own rows and never combined.

    ``synk.function(inputs, outputs, updates=sgd_updates)`` ported as it stands
    trains one model per device: each device steps on the gradient of its own
    rows and the copies drift apart. A data-parallel step all-reduces the
    gradient between computing it and applying it
    (``synkhronos.extensions.train.make_train_function``). Pass
    ``local_updates=True`` to ``synk.function`` when per-device updates are meant.
    """


class ShapeMismatch(ValueError):
    """A rank's value has another shape than the master's (found while preparing a collective)."""
