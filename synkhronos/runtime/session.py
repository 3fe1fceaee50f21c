"""The session: the one running :class:`~.state.State` of this process, from :func:`begin` to :func:`end`.

``synk.fork()`` validates its arguments and calls :func:`begin`, which starts
one worker process per extra device (the master is itself a rank), all of
them joining the JAX multi-process runtime. The State owns every shared-memory
segment and every process of that session; :func:`end` (what ``synk.close()``
and the exit hook call) stops and joins the workers, unlinks the segments and
gives the process back what ``begin`` changed in it.

Everything that talks to the workers runs under one lock (:func:`serialized`):
a call, a collective or a Data change is one conversation through the one
control block.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable, Collection
from typing import Any, ParamSpec, TypeVar, overload

from ..errors import WorkerError, verbose
from ..ipc.segments import remove_stale_segments
from ..platform import cpu_blas, jax_init
from ..platform.process_changes import changes
from ..platform.threads import is_own
from ..platform.values import hold_faces
from . import interrupts
from .interrupts import shut_down_after
from .state import Settings, State

__all__ = ["State", "Settings", "begin", "end", "current", "active", "serialized", "lock",
           "forked_from", "CLOSE_WAIT"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
#: a serialized command's arguments -> the shared variables it touches (None: every one)
Touches = Callable[..., Collection[Any] | None]

#: how long end() waits for another thread's command to finish before it stops the workers anyway
CLOSE_WAIT = 10.0


class _Lifecycle:
    """The module's one piece of global state: the running State and how the last one ended."""

    def __init__(self) -> None:
        self.state: State | None = None
        self.closed_once = False
        #: why the last runtime was shut down by a fault the user caused (Ctrl-C), for the next call
        self.shut_down_because: str | None = None
        self.forked_from: int | None = None      # in a child made by os.fork() of a master: the master's pid
        #: one thread at a time talks to the workers (re-entrant: a collective may stage a Data)
        self.lock = threading.RLock()
        #: how many serialized calls the thread holding the lock is inside
        self.depth = 0


_life = _Lifecycle()


@overload
def serialized(fn: Callable[P, R], *, touches: Touches | None = None, name: str | None = None
               ) -> Callable[P, R]: ...


@overload
def serialized(fn: None = None, *, touches: Touches | None = None,
               name: str | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def serialized(fn: Callable[P, R] | None = None, *, touches: Touches | None = None,
               name: str | None = None) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
    """Run ``fn`` holding the runtime's lock, so that threads take turns with the workers.

    Two threads calling functions at once would otherwise write their commands
    into the same control block and read each other's results. A Ctrl-C inside
    ``fn`` shuts the runtime down (:func:`~.interrupts.shut_down_after`).

    Around the outermost such call the master's shared values go to the devices
    and come back as numpy faces for user code
    (:meth:`~synkhronos.runtime.registry.Registry.values_to_devices`). ``touches(*args)``,
    if given, names the shared variables the command reads or writes (a function's
    own; None: every one): only those make the trip, so a call costs the same
    however many variables the other functions hold. ``name`` is how a report
    of a Ctrl-C or a fault inside ``fn`` names the call (default:
    :func:`what_was_called`).
    """
    if fn is None:
        return functools.partial(serialized, touches=touches, name=name)

    @functools.wraps(fn)
    def locked(*args: P.args, **kwargs: P.kwargs) -> R:
        # one frame between the caller and ``fn``: the reports' tracebacks count on it
        with _life.lock:
            outermost, state = _life.depth == 0, _life.state
            _life.depth += 1
            scope = None
            try:
                if outermost and state is not None:
                    scope = touches(*args) if touches is not None else None
                    hold_faces(other_threads_alive())
                    set_here = state.registry.values_to_devices(scope)
                    if set_here and state.n_parallel > 1:
                        # a value set in the one script is every device's (Average's and EASGD's
                        # per-device values, and synk.set_value's, are stored by synkhronos)
                        state.collectives.broadcast_from_master(set_here)
                return fn(*args, **kwargs)
            except Exception as error:
                if outermost:
                    _remember_a_fault(error, what_was_called(fn, args, name), state)
                if not outermost or verbose() or not isinstance(error, WorkerError):
                    raise
                # the report names what the user needs; synkhronos's own frames are left out
                raise error.with_traceback(None) from None
            except KeyboardInterrupt as interrupt:
                # (a fault that the interrupt caused forgets the state: the one seen at the start)
                if outermost:
                    _shut_down_after_a_ctrl_c(interrupt, what_was_called(fn, args, name), state)
                raise
            finally:
                _life.depth -= 1
                if outermost:
                    try:
                        if _life.state is not None and _life.state.is_open:
                            _life.state.registry.values_to_user(scope if _life.state is state else None)
                    except KeyboardInterrupt as interrupt:
                        # (landed while the values are handed back: as one inside the command)
                        _shut_down_after_a_ctrl_c(interrupt, what_was_called(fn, args, name), state)
                        raise
                    finally:
                        hold_faces(False)
    return locked


def what_was_called(fn: Callable[..., Any], args: tuple[Any, ...], name: str | None = None) -> str:
    """How a report names the call of ``fn``: ``name`` if given, ``synk.all_reduce`` for a function
    of synkhronos, and the object's own name for a method (a function's call, by the function's name).

    Examples
    --------
    >>> class Function:
    ...     name = "train_step"
    ...     @serialized
    ...     def __call__(self): ...
    ...     @serialized
    ...     def as_pytensor(self): ...
    >>> what_was_called(Function.__call__.__wrapped__, (Function(),))
    "a call of the function 'train_step'"
    >>> what_was_called(Function.as_pytensor.__wrapped__, (Function(),))
    "the function 'train_step'.as_pytensor"
    >>> def all_reduce(): ...
    >>> what_was_called(all_reduce, ())
    'synk.all_reduce'
    """
    if name is not None:
        return name
    owner = args[0] if args else None
    if getattr(getattr(type(owner), fn.__name__, None), "__wrapped__", None) is not fn:
        return f"synk.{fn.__name__}"            # a function, or a method bound already
    name = getattr(owner, "name", None)
    kind = type(owner).__name__
    who = f"the {kind.lower()} {name!r}" if isinstance(name, str) else f"a {kind}"
    return f"a call of {who}" if fn.__name__ == "__call__" else f"{who}.{fn.__name__}"


def _shut_down_after_a_ctrl_c(interrupt: KeyboardInterrupt, what: str, state: State | None) -> None:
    """End the runtime after a Ctrl-C inside the call ``what``; the next call says so."""
    shut_down_after(interrupt, what, state, remember=_say_at_the_next_call)


def _say_at_the_next_call(why: str) -> None:
    """What the next call raises while no runtime runs: why the last one was shut down."""
    _life.shut_down_because = why


def _remember_a_fault(error: Exception, what: str, state: State | None) -> None:
    """If ``error`` shut the runtime down (a worker's error or death, a stall), have the next call
    say so, not that synkhronos "is not running"."""
    if state is None or _life.state is not None:
        return
    first_line = (str(error).splitlines() or [""])[0][:300]
    _say_at_the_next_call(f"synkhronos: the runtime was shut down by an error in {what} "
                          f"({type(error).__name__}: {first_line}); call synk.fork() again")


#: the modules whose threads never read a user's shared variables (progress bars, a notebook
#: kernel's own threads): they keep nothing from donating
LIBRARY_THREADS = ("tqdm.", "IPython.", "ipykernel.", "jupyter_client.", "zmq.", "debugpy.")


def other_threads_alive() -> bool:
    """True if a Python thread other than this one, synkhronos's own and the libraries' of
    :data:`LIBRARY_THREADS` runs.

    Such a thread may read the master's shared variables at any moment (a
    monitor calling ``get_value``, a plain PyTensor function): a command then
    keeps every value a numpy face of a device array that nothing overwrites
    (:func:`~synkhronos.platform.values.hold_faces`), which costs donation.
    """
    if threading.active_count() == 1:
        return False
    me, dummy = threading.current_thread(), getattr(threading, "_DummyThread", ())
    return any(t is not me and not is_own(t) and not isinstance(t, dummy) and not _a_librarys(t)
               for t in threading.enumerate())


def _a_librarys(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)
    module = getattr(target, "__module__", None) or type(thread).__module__
    return module.startswith(LIBRARY_THREADS)


def lock() -> threading.RLock:
    """The runtime's lock (re-entrant), for a caller that spans several commands: ``with lock(): ...``."""
    return _life.lock


def current() -> State:
    """Return the running :class:`State`, or raise (saying what to do) if there is none."""
    state = _life.state
    if state is None:
        if _life.forked_from is not None:
            raise RuntimeError(f"this process was made by os.fork() from synkhronos's master (pid "
                               f"{_life.forked_from}); the runtime belongs to that process and cannot "
                               f"be used here: call synkhronos from the master")
        if _life.shut_down_because:
            raise RuntimeError(_life.shut_down_because)
        if _life.closed_once:
            raise RuntimeError("synkhronos was closed; call synk.fork() again before using it")
        raise RuntimeError("synkhronos is not running; call synk.fork() first")
    return state


def active() -> State | None:
    """The running :class:`State`, or None."""
    return _life.state


def forked_from() -> int | None:
    """In a child made by ``os.fork()`` of a master: the master's pid; else None."""
    return _life.forked_from


def _forget_runtime_in_child() -> None:
    """After ``os.fork()`` in the master: the child leaves the parent's runtime alone.

    A data-loader pool or a helper process forked from the user's script
    inherits the runtime's objects; at its exit it must not stop the parent's
    workers, unlink the parent's segments or shut down the parent's JAX
    runtime, whose client and threads belong to the parent.
    """
    # another thread of the parent may have held the lock at the fork: it is never released here
    _life.lock = threading.RLock()
    if _life.state is not None:
        _life.forked_from = os.getppid()
        _life.state = None
        jax_init.forget_runtime_in_child()


os.register_at_fork(after_in_child=_forget_runtime_in_child)


def begin(settings: Settings) -> State:
    """Start a runtime with ``settings`` (validated by ``synk.fork``); return its :class:`State`.

    The master's environment gets what JAX and BLAS read at start-up
    (:func:`~synkhronos.platform.jax_init.configure_environment`); the runtime's
    stop gives it back, with every other change to the process
    (:data:`~synkhronos.platform.process_changes.changes`).
    """
    if _life.state is not None:
        raise RuntimeError("fork() was already called; call synk.close() before forking again")
    _sweep_segments()
    _life.shut_down_because = None
    wanted = jax_init.configure_environment(dict(os.environ), settings.platform, settings.threads)
    # recorded before the environment: given back after it, under the user's own variables
    changes.record("BLAS libraries loaded while the runtime ran",
                   cpu_blas.threads_for_libraries_loaded_since(cpu_blas.loaded_blas_libraries()))
    changes.set_environment({k: v for k, v in wanted.items() if os.environ.get(k) != v})
    state = _life.state = State(settings, on_abort=_forget)
    interrupts.install()            # before JAX is first imported (a Ctrl-C waits for its imports)
    try:
        state.start()
    except BaseException:
        state.abort()
        _life.state = None
        changes.restore()
        interrupts.uninstall()
        raise
    # atexit runs handlers last-in first-out: registering now (after JAX registered its own
    # clean-up, which shuts the distributed runtime down) stops our workers before JAX's
    # shutdown barrier waits for them.
    atexit.unregister(end)
    atexit.register(end)
    return state


def _sweep_segments() -> None:
    """Remove the segments of this user's runs killed whole (their trackers too); what is not
    ours, or cannot be read, never stops a run."""
    try:
        sweep = remove_stale_segments()
    except OSError as e:
        log.warning("the shared memory of ended runs was not swept: %s", e)
        return
    if sweep.stale:
        log.info("removed %d shared-memory segments of runs that no longer run", len(sweep.stale))
    if sweep.skipped:
        log.info("left %d entries named like synkhronos segments that are not this user's "
                 "segments (python -m synkhronos.cleanup --dry-run lists them)", len(sweep.skipped))


def end() -> None:
    """Stop the running State, if any, and restore the environment (idempotent).

    A command that another thread is running is let finish first (for up to
    ``CLOSE_WAIT`` seconds; after that the workers are stopped anyway and that
    command raises). A Ctrl-C meanwhile is raised once everything is stopped.
    """
    try:
        with interrupts.deferred():
            _stop_and_restore()
    finally:
        interrupts.uninstall()


def _stop_and_restore() -> None:
    locked = _life.lock.acquire(timeout=CLOSE_WAIT)
    try:
        state, _life.state = _life.state, None
        if state is not None:
            _life.closed_once = True
            if state.settings.timeline and state.is_open:
                try:
                    state.timeline.write(state.settings.timeline)
                except Exception:       # closing must not fail for the timeline's sake
                    log.warning("the timeline could not be written to %s", state.settings.timeline,
                                exc_info=True)
            state.stop()
    finally:
        if locked:
            _life.lock.release()


def _forget(state: State) -> None:
    """A runtime torn down by a fault is no longer the running one."""
    if _life.state is state:
        _life.state = None
