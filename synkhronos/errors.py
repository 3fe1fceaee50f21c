"""Exception types raised by synkhronos."""

from __future__ import annotations

import builtins
import enum
import functools
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SynkError", "Failure", "WorkerError", "StallError", "NodesDiverged", "ShapeMismatch",
           "SynkWarning", "LocalUpdatesWarning", "exception_name", "graph_line", "verbose", "is_whole"]


def is_whole(value: object, at_least: int | None = None, below: int | None = None) -> bool | np.bool:
    """True if ``value`` is a whole number (a Python or numpy integer, not a bool) in ``[at_least, below)``.

    Examples
    --------
    >>> is_whole(3, at_least=1), is_whole(True), is_whole(2.0), is_whole(5, below=5)
    (True, False, False, False)
    """
    if isinstance(value, bool) or not (isinstance(value, int) or _is_numpy_integer(value)):
        return False
    return (at_least is None or value >= at_least) and (below is None or value < below)


def _is_numpy_integer(value: object) -> TypeGuard[np.integer]:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.integer)


def exception_name(e: BaseException) -> str:
    """The name of ``e``'s type: bare for builtins (``"ValueError"``), else ``"module.Qualname"``."""
    module = type(e).__module__
    return type(e).__qualname__ if module == "builtins" else f"{module}.{type(e).__qualname__}"


#: how XLA reports an exception raised in a host callback: the callback's whole traceback, as text
_CALLBACK_FAILED = re.compile(r"(?:Cpu|Gpu)?Callback error calling callback|pure_callback failed")
_LAST_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?:: (.*))?$")


def what_raised(e: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of ``e``; for an exception a host callback raised while the device
    computed (which XLA reports as its own error holding the callback's traceback as text), the
    callback's exception.

    Examples
    --------
    >>> what_raised(ValueError("bad rows"))
    ('ValueError', 'bad rows')
    >>> what_raised(RuntimeError("INTERNAL: CpuCallback error calling callback: Traceback (most "
    ...                          "recent call last):\\n  File ...\\nValueError: bad rows"))
    ('ValueError', 'bad rows')
    """
    text = str(e)
    if _CALLBACK_FAILED.search(text):
        for line in reversed(text.replace("\\n", "\n").splitlines()):
            found = _LAST_EXCEPTION_LINE.match(line.strip())
            if found and (found.group(2) is not None or found.group(1).endswith(("Error", "Exception"))):
                return found.group(1), found.group(2) or ""
    return exception_name(e), text


class SynkError(RuntimeError):
    """Base class of the runtime errors synkhronos raises itself."""


def verbose() -> bool:
    """Whether errors carry every rank's traceback: ``SYNK_VERBOSE=1``, or PyTensor's
    ``exception_verbosity`` set above ``"low"``."""
    if os.environ.get("SYNK_VERBOSE", "") not in ("", "0"):
        return True
    config = getattr(sys.modules.get("pytensor"), "config", None)
    return getattr(config, "exception_verbosity", "low") != "low"


def graph_line(e: BaseException | None) -> str | None:
    """The line of a compiled PyTensor graph at which ``e`` was raised, or None.

    PyTensor's JAX backend runs a graph as a generated Python function whose
    source holds each apply node, as a comment, above the line that computes
    it; the traceback of ``e`` (or of the exceptions it was raised from)
    leads to that line.
    """
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            if frame.f_code.co_name == "jax_funcified_fgraph":
                lines = linecache.getlines(frame.f_code.co_filename)
                comment: list[str] = []
                for text in reversed(lines[:max(lineno - 1, 0)]):
                    text = text.strip()
                    if not text.startswith("#"):
                        break
                    comment.insert(0, text.lstrip("# ").rstrip())
                if comment:
                    return " ".join(comment)
        e = e.__cause__ or e.__context__
    return None


class Failure(enum.StrEnum):
    """How a rank failed (:attr:`WorkerError.how`); each compares equal to its name in lower case.

    Examples
    --------
    >>> Failure("died") is Failure.DIED, Failure.RAISED == "raised", f"{Failure.DIED}"
    (True, True, 'died')
    """

    #: the rank raised an exception and is still alive: the runtime stays usable
    RAISED = "raised"
    #: the rank's process ended: the runtime has been shut down
    DIED = "died"


class WorkerError(SynkError):
    """A rank failed: it raised an exception, or its process died.

    ``str(error)`` is one short report: which ranks raised, the error once,
    the line of the compiled graph it came from, and a hint where the cause is
    known. Every rank's traceback is on the error (``worker_traceback``), and in
    the report with ``SYNK_VERBOSE=1`` (or PyTensor's ``exception_verbosity``
    above ``"low"``).

    Parameters
    ----------
    rank : int
        Rank of the failing process (the first, if several failed alike).
    how : Failure or str
        :attr:`Failure.RAISED` (``"raised"``) when the rank raised an exception and
        is still alive (the runtime stays usable), :attr:`Failure.DIED` (``"died"``)
        when the process ended (the runtime has been shut down; call ``fork()`` again).
    exc_type : str
        Qualified name of the rank's exception type, or the way the process
        ended (e.g. ``"killed by SIGKILL"``).
    message : str
        The rank's exception message.
    worker_traceback : str
        The traceback formatted in the rank's process.
    node : int, optional
        On several nodes, the node of the failing process.
    where : str, optional
        The apply node of the compiled graph that raised (see :func:`graph_line`).

    Attributes
    ----------
    ranks : list of int
        Every rank that raised this same error.
    others : list of (int, str, str)
        Ranks that raised another error in the same command: (rank, type, message).
    hint : str or None
        What the cause probably is, and the fix.

    Examples
    --------
    >>> e = WorkerError(1, "raised", "ValueError", "bad rows", "Traceback ...", where="Reshape{2}(x, [4 3])")
    >>> e.ranks = [0, 1]
    >>> print(e)
    ranks 0 and 1 raised ValueError: bad rows
      in the graph: Reshape{2}(x, [4 3])
      every rank's traceback: error.worker_traceback, or run with SYNK_VERBOSE=1
    """

    @classmethod
    def raised(cls, rank: int, exc_type: str, message: str, worker_traceback: str = "",
               where: str | None = None) -> WorkerError:
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
        return _with_builtin_type(exc_type)(rank, Failure.RAISED, exc_type, message, worker_traceback,
                                            where=where)

    @classmethod
    def from_exception(cls, rank: int, e: BaseException) -> WorkerError:
        """:meth:`raised` for exception ``e`` caught in this process (rank ``rank``)."""
        exc_type, message = what_raised(e)
        return cls.raised(rank, exc_type, message, "".join(traceback.format_exception(e)),
                          where=graph_line(e))

    def __init__(self, rank: int, how: Failure | str, exc_type: str, message: str, worker_traceback: str = "",
                 node: int | None = None, where: str | None = None) -> None:
        self.rank = rank
        self.how = Failure(how)
        self.exc_type = exc_type
        self.message = message
        self.worker_traceback = worker_traceback
        self.node = node
        self.where = where
        self.ranks = [rank]
        self.others: list[tuple[int, str, str]] = []
        self.hint: str | None = None
        super().__init__(rank, how, exc_type, message)

    def _who(self) -> str:
        ranks = sorted(self.ranks)
        named = f"rank {ranks[0]}" if len(ranks) == 1 else \
            "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
        return named if self.node is None else f"{named} (node {self.node})"

    def __str__(self) -> str:
        lines = [f"{self._who()} {self.how}: {self.exc_type}: {self.message}" if self.how is not Failure.RAISED
                 else f"{self._who()} raised {self.exc_type}: {self.message}"]
        lines += [f"  rank {r} raised {t}: {m}" for r, t, m in self.others]
        if self.where:
            lines.append(f"  in the graph: {self.where}")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        if self.worker_traceback:
            if verbose():
                lines.append(f"--- traceback in rank {self.rank} ---\n{self.worker_traceback.rstrip()}")
            else:
                lines.append("  every rank's traceback: error.worker_traceback, or run with SYNK_VERBOSE=1")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Callable[..., WorkerError], tuple[Any, ...]]:
        return (_rebuild_worker_error, (self.rank, self.how, self.exc_type, self.message,
                                        self.worker_traceback, self.node, self.where, self.ranks,
                                        self.others, self.hint))


def _rebuild_worker_error(rank: int, how: Failure | str, exc_type: str, message: str, worker_traceback: str,
                          node: int | None = None, where: str | None = None, ranks: Sequence[int] | None = None,
                          others: Iterable[tuple[int, str, str]] = (), hint: str | None = None) -> WorkerError:
    if Failure(how) is Failure.RAISED:
        error = WorkerError.raised(rank, exc_type, message, worker_traceback, where=where)
        error.node = node
    else:
        error = WorkerError(rank, how, exc_type, message, worker_traceback, node, where=where)
    error.ranks, error.others, error.hint = list(ranks or [rank]), list(others), hint
    return error


@functools.cache
def _with_builtin_type(exc_type: str) -> type[WorkerError]:
    """WorkerError, also a subclass of the builtin exception named ``exc_type`` where there is one."""
    base = getattr(builtins, exc_type, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(WorkerError, base):
        return WorkerError
    try:
        return cast("type[WorkerError]", type(f"WorkerError[{exc_type}]", (WorkerError, base),
                                              {"__module__": __name__}))
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
        The bound, in seconds.
    setting : str
        The ``fork()`` argument that set it: ``"stall_timeout"``, or ``"timeout"``
        for the workers' start-up.
    """

    def __init__(self, what: str, arrived: list[int], missing: list[int], timeout: float,
                 setting: str = "stall_timeout") -> None:
        self.what, self.arrived, self.missing, self.timeout = what, arrived, missing, timeout
        self.setting = setting
        super().__init__(f"{what} stalled: ranks {arrived} arrived, ranks {missing} did not within "
                         f"{timeout:g} s (fork({setting}=...)); the runtime was shut down, "
                         f"call synk.fork() to start again")

    def __reduce__(self) -> tuple[type[StallError], tuple[Any, ...]]:
        return (type(self), (self.what, self.arrived, self.missing, self.timeout, self.setting))


class NodesDiverged(SynkError):
    """The masters of several nodes made different synkhronos calls at the same point.

    Every node must run the same script and make the same calls in the same
    order; the nodes that disagree raise this at the first difference, naming
    both calls, and their runtimes stay usable.
    """


class SynkWarning(UserWarning):
    """Base class of the warnings synkhronos gives."""


#: synkhronos's own directory: a warning given deep inside it names the first line outside it, the
#: user's (``warnings.warn(..., skip_file_prefixes=(PACKAGE_DIR,))``), whichever way it was called
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category: type[Warning] = SynkWarning) -> None:
    """Warn with ``message``, naming the first line outside synkhronos: the user's, however deep
    inside synkhronos it was found and whichever way the user called it.

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn("a word to the user")
    >>> caught[0].message.args[0], caught[0].filename.startswith(PACKAGE_DIR)
    ('a word to the user', False)
    """
    import warnings
    warnings.warn(message, category, skip_file_prefixes=(PACKAGE_DIR,))


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
