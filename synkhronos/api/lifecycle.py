"""``fork`` / ``distribute`` / ``close``: start the runtime, bring the workers up to date, stop it.

Everything is validated here before anything in the process changes; the
runtime itself is :class:`synkhronos.runtime.session.State`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

from ..comm import Comm, ShmComm, comm_class, default_kind
from ..comm.hierarchical import HierarchicalComm
from ..errors import warn
from ..platform import cluster, jax_init
from ..platform import compile_cache as jax_compile_cache
from ..runtime import session
from ..runtime.session import Settings, current, serialized
from ..tracing import trace
from ..wire.topology import Topology

__all__ = ["fork", "close", "distribute", "get_n_devices", "get_n_gpu", "timeline", "n_nodes",
           "node_rank", "local_devices"]


@serialized
def fork(n_parallel: int | None = None, master_rank: int = 0, platform: str | None = None,
         profile_workers: bool = False, threads_per_device: int | None = None, timeout: float = 60,
         spin_us: float | None = None, stall_timeout: float = 600,
         collectives: str | type[Comm] | None = None, timeline: str | None = None,
         compile_cache: str | os.PathLike | bool | None = None, **options: Any) -> int:
    """Start one process per device; the calling process becomes rank ``master_rank``.

    On several nodes (a script started by ``python -m synkhronos.launch``, or
    one task per node under Slurm or Open MPI) every node's script calls
    ``fork`` alike; each starts its node's processes, and all of them join
    one runtime (see :func:`n_nodes`).

    Parameters
    ----------
    n_parallel : int, optional
        Number of devices (processes) of this node. Default: the launcher's
        ``--devices-per-node``, else every GPU, or on a machine without
        accelerators one CPU device per available core.
    master_rank : int
        The rank of the calling process among its node's processes.
    platform : {"cpu", "gpu", None}
        JAX platform; default: GPU if a JAX GPU plugin finds one, else CPU.
    profile_workers : bool
        Run every worker under cProfile, writing ``synk_profile_rank{r}.prof``.
    threads_per_device : int, optional
        CPU threads each process may use (XLA and BLAS pools); default
        ``cores // n_parallel``, at least 1.
    timeout : float
        Seconds allowed for the workers to start and the JAX runtime to connect
        all processes (a start-up past it raises :class:`StallError`).
    stall_timeout : float
        Seconds the master waits for every rank to finish a command or reach a
        collective before it raises :class:`StallError` (naming the ranks that
        arrived and those that did not) and shuts the runtime down. Set it above
        your longest single call.
    collectives : {"shm", "jax"} or Comm subclass, optional
        How collectives on shared variables travel: ``"jax"`` through the JAX
        runtime (Gloo on CPU, NCCL on GPU), ``"shm"`` through shared memory (CPU
        only, near memory bandwidth), or an implementation of one's own (a
        subclass of :class:`synkhronos.comm.Comm` the workers can import).
        Default: ``"shm"`` on CPU, else ``"jax"``.
    spin_us : float, optional
        Microseconds a waiting process polls before it sleeps. Polling keeps the
        per-call latency low (a sleeping process takes tens of µs to wake); it
        costs CPU only while idle between calls. Default 2000 when every process
        has a core of its own, else 0.
    timeline : str, optional
        Record every rank's timeline from now on and write it to this path
        (Chrome trace JSON) at ``close()``; see :func:`synkhronos.timeline`.
    compile_cache : str, path, False or None
        Where every process keeps the programs it compiles, so that the next
        run (a resumed one, the same script again) loads them instead of
        compiling: JAX's persistent compilation cache, in a directory per host
        CPU inside this one. Default (None): ``$JAX_COMPILATION_CACHE_DIR``
        when set, else ``~/.cache/synkhronos/jax`` (``$XDG_CACHE_HOME``
        honoured); False: nothing is kept. At most 2 GiB per host, least
        recently used first out; remove the directory to clear it. See the
        user guide, "Start-up and the compile cache".

    Returns
    -------
    int
        The number of devices in use, on every node together.

    Notes
    -----
    In this process, ``fork`` sets the environment variables JAX and BLAS read
    at start-up, JAX's platform and multi-process settings, numpy's BLAS thread
    count and (on CPU) glibc's allocator settings; ``close`` puts them back,
    except that glibc stops tuning its thresholds dynamically once they were set.

    Examples
    --------
    >>> import synkhronos as synk
    >>> n = synk.fork(2)            # doctest: +SKIP
    """
    platform = _old_fork_options(options, platform)
    if options:
        raise TypeError(f"fork() got unknown options {sorted(options)}")
    if session.forked_from() is not None:
        raise RuntimeError(f"fork() cannot run in a process made by os.fork() from synkhronos's "
                           f"master (pid {session.forked_from()}): it inherited the master's JAX "
                           f"runtime without its threads; start such processes with "
                           f"multiprocessing's 'spawn' start method instead")
    if session.active() is not None:
        raise RuntimeError("fork() was already called; call synk.close() before forking again")
    if jax_init.backend_exists():
        raise RuntimeError("a JAX backend (device context) already exists in this process, so it "
                           "cannot join the multi-process runtime; call synk.fork() before anything "
                           "runs a JAX computation or compiles a JAX-mode PyTensor function")
    platform = platform or jax_init.default_platform()
    place = cluster.find_node()
    if n_parallel is None:
        n_parallel = place.devices_per_node or jax_init.count_devices(platform)
    n_parallel = int(n_parallel)
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be >= 1, got {n_parallel}")
    if platform == "gpu" and n_parallel > (gpus := jax_init.count_devices("gpu")):
        raise ValueError(f"fork({n_parallel}) on the GPU needs {n_parallel} GPUs and this node has "
                         f"{gpus}: synkhronos runs one process per GPU; fork({gpus or 1}) or fewer")
    if not 0 <= master_rank < n_parallel:
        raise ValueError(f"master_rank must be in [0, {n_parallel}), got {master_rank}")
    if not stall_timeout or stall_timeout <= 0:
        raise ValueError(f"stall_timeout must be a positive number of seconds, got {stall_timeout!r}")
    implementation = comm_class(collectives or default_kind(platform))
    topology = Topology(place.n_nodes, place.node_rank, n_parallel, place.coordinator)
    if topology.several_nodes and implementation is ShmComm:
        implementation = HierarchicalComm        # shared memory within each node only
    if platform not in implementation.platforms:
        raise ValueError(f"collectives={implementation.name!r} works on {list(implementation.platforms)}"
                         f", not on {platform!r}; use collectives='jax'")
    cores = jax_init.count_devices("cpu")
    threads = threads_per_device or max(1, cores // n_parallel)
    if spin_us is None:
        spin_us = 2000 if n_parallel <= cores else 0
    timeline = None if timeline is None else _writable(timeline)
    cache_dir = jax_compile_cache.usable_directory(compile_cache)
    state = session.begin(Settings(n_parallel, master_rank, platform, threads, timeout, profile_workers,
                                  spin=float(spin_us) * 1e-6, stall_timeout=float(stall_timeout),
                                  collectives=implementation, timeline=timeline,
                                  compile_cache=cache_dir, topology=topology))
    if timeline is not None:
        state.timeline.start()
    return state.n_parallel


def _old_fork_options(options: dict[str, Any], platform: str | None) -> str | None:
    """Take the original's ``fork()`` options out of ``options``; return the platform they ask for.

    ``use_gpu`` still means something (the platform); ``max_n_var`` and
    ``max_dim`` sized the original's fixed shared-memory arrays and are refused.
    """
    if "use_gpu" in options:
        use_gpu = options.pop("use_gpu")
        new = "gpu" if use_gpu else "cpu"
        warn(f"fork(use_gpu={use_gpu!r}) is fork(platform={new!r}) now", DeprecationWarning)
        platform = platform or new
    for name in ("max_n_var", "max_dim"):
        if name in options:
            raise TypeError(f"fork() no longer takes {name}=: it sized the original's fixed "
                            f"shared-memory arrays, and synkhronos sizes its control block itself; "
                            f"remove it")
    return platform


@serialized
def distribute() -> None:
    """Ship every function to the workers and make their shared values equal the master's."""
    current().registry.ship(sync_values=True)


@contextmanager
def timeline(path: str) -> Iterator[None]:
    """Record what every rank does inside the ``with`` block; write it to ``path`` as Chrome trace JSON.

    Every call, collective and device-loop step becomes a span on its rank's
    track, split into its phases: on the master a call's ``plan``,
    ``gather rows`` and ``compute`` (its own share), ``wait for devices`` and
    ``reduce``; on a worker ``wait for the command``, ``gather rows``,
    ``compute``, ``report``; a collective's ``prepare``, ``wait for the
    go-ahead`` and ``execute``; a loop step's ``gather rows``, ``gradient``,
    ``all-reduce``, ``update`` and ``sync``. Open the file in Perfetto
    (ui.perfetto.dev) or ``chrome://tracing``. Recording costs a few
    timestamps per span; when off, nothing.

    One timeline records at a time: a block inside another, a block in a
    second thread, or a block while ``fork(timeline=...)`` records raises
    ``RuntimeError``. The path is checked when the block starts. An exception
    raised in the block is never replaced by a failure to write the file (that
    becomes a warning).

    Examples
    --------
    >>> import os, tempfile
    >>> x = pt.vector("x")
    >>> f = synk.function([x], (x.sum(), "sum"))
    >>> with synk.timeline(os.path.join(tempfile.mkdtemp(), "trace.json")):
    ...     total = f(np.arange(6.0))
    >>> total
    array(15.)
    """
    path = _writable(path)
    with session.lock():
        state = current()
        if trace.on:
            raise RuntimeError("a timeline is recording already (a `with synk.timeline(...)` block, "
                               "in this thread or another, or fork(timeline=...)); one records at a "
                               "time: end it first, or record the whole run with one block")
        state.timeline.start()
    raised = False
    try:
        yield
    except BaseException:
        raised = True
        raise
    finally:
        with session.lock():
            if state.is_open:
                try:
                    state.timeline.write(path)
                except Exception as e:
                    if not raised:
                        raise
                    # the block's own exception is the one the user needs: it is not replaced
                    warn(f"the timeline could not be written to {path} ({type(e).__name__}: "
                         f"{e})")


def _writable(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, once a timeline can be written there (else raise, before recording)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the timeline's directory {directory} does not exist; make it "
                                f"first, or give another path")
    if os.path.isdir(path):
        raise IsADirectoryError(f"the timeline's path {path} is a directory; give a file name")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"the timeline cannot be written to {path}: no permission")
    return path


def close() -> None:
    """Stop and join the workers and free every shared-memory segment (idempotent).

    A command that another thread is running is let finish first (for up to
    ``CLOSE_WAIT`` seconds; after that the workers are stopped anyway and that
    command raises).
    """
    session.end()


def get_n_devices(platform: str | None = None) -> int:
    """Number of devices of this machine's platform, counted without creating a context here.

    ``fork()`` uses that many by default, unless ``SYNK_DEVICES_PER_NODE`` (the
    launcher's ``--devices-per-node``) says otherwise.
    """
    return jax_init.count_devices(platform)


def get_n_gpu() -> int:
    """Number of GPUs, counted without creating a context here."""
    return jax_init.count_devices("gpu") if jax_init.has_gpu_plugin() else 0


def n_nodes() -> int:
    """How many nodes run the script (1 unless started on several; see :func:`fork`).

    Examples
    --------
    >>> synk.n_nodes(), synk.node_rank(), synk.local_devices()   # one node of two devices
    (1, 0, 2)
    """
    return current().topology.n_nodes


def node_rank() -> int:
    """Which node this script runs on, from 0; its devices are global ranks
    ``node_rank() * local_devices()`` on."""
    return current().topology.node_rank


def local_devices() -> int:
    """The devices (processes) of this node; ``fork()`` returns those of every node."""
    return current().topology.n_local
