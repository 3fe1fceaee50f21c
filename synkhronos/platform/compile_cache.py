"""Compiled programs kept between runs: JAX's persistent compilation cache, one directory per host.

Every process of a runtime points JAX's persistent compilation cache at the
same directory before it compiles anything
(:func:`synkhronos.platform.jax_init.use_compile_cache`), so a program that
an earlier run compiled, or that this run compiled before, is loaded instead of
compiled again: every program, whatever its compile time or size (the
per-row-count variants and the collectives' programs included). The ranks of
one host compile each program once between them: the key leaves out which of
the host's devices a program runs on, and whichever rank misses an entry first
compiles it under a lock that the others wait on
(:func:`synkhronos.platform.internals.compile_once_per_host`).

Where it lives (:func:`directory`): ``fork(compile_cache=None)`` means
``$JAX_COMPILATION_CACHE_DIR`` when set, else the user's cache directory
(``$XDG_CACHE_HOME``, by default ``~/.cache``) ``/synkhronos/jax``; a path means
that directory; ``False`` turns it off. Inside it, the entries of one host
sit in a directory named for its CPU (model and instruction-set features):
JAX's key of an entry covers the program, the JAX and jaxlib versions, the
devices' kind and count, the compile options and the XLA flags, but an XLA CPU
program is also compiled for the features of the CPU it was compiled on.

Beside the programs, the directory keeps what synkhronos found out about a
function's graph (:func:`record`, :func:`recalls`): whether it traces on free
rows or only on concrete shapes, so that a later run builds it that way at once
(see :class:`synkhronos.rank.compiled.CompiledFunction`). A finding is a
shortcut, never a result: a wrong one could only cost compile time.

How big it gets: at most :data:`MAX_BYTES` per host; JAX evicts the least
recently used entries beyond it, under a file lock, so runs at once on one
machine share it safely. Clear it by removing the directory. A corrupt entry
is read with a warning and compiled again (JAX's own handling); it never
fails a call.

Examples
--------
>>> directory(False) is None
True
>>> directory("/tmp/my-cache").startswith("/tmp/my-cache/cpu-")
True
"""

from __future__ import annotations

import hashlib
import os
import platform as _platform

from ..errors import warn

__all__ = ["directory", "host_fingerprint", "usable_directory", "recalls", "record", "generated_source_directory",
           "MAX_BYTES", "ENV_VAR"]

#: JAX's own setting of the cache directory, honoured when set
ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
#: the most the cache of one host holds (bytes); least recently used entries go first
MAX_BYTES = 2 * 2**30


def _cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def _default_base() -> str:
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    return os.path.join(_cache_home(), "synkhronos", "jax")


def generated_source_directory() -> str:
    """Where PyTensor keeps the Python source of the functions a runtime compiles: one file per
    distinct source, in the user's cache directory (``$XDG_CACHE_HOME``, by default ``~/.cache``)
    ``/synkhronos/pytensor-src``; PyTensor removes the files unused for weeks.

    See :func:`synkhronos.platform.jax_init.keep_generated_source`.
    """
    return os.path.join(_cache_home(), "synkhronos", "pytensor-src")


def host_fingerprint() -> str:
    """``cpu-`` and a digest of this host's CPU model and instruction-set features.

    From ``/proc/cpuinfo`` where there is one (its model name and flags), else
    from :func:`platform.processor` and :func:`platform.machine`.
    """
    identity = [_platform.machine(), _platform.processor()]
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part", "vendor_id"):
                    identity.append(line.strip())
                elif not line.strip() and len(identity) > 2:
                    break                    # the first processor describes the others
    except OSError:
        pass
    return "cpu-" + hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]


def directory(compile_cache: str | os.PathLike | bool | None = None) -> str | None:
    """The directory this host's compiled programs are kept in, or None when off.

    ``compile_cache`` is ``fork()``'s: None (the default place), a path, or False (off).
    """
    if compile_cache is False:
        return None
    if compile_cache is None or compile_cache is True:
        base = _default_base()
    elif isinstance(compile_cache, (str, os.PathLike)):
        base = os.fspath(compile_cache)
    else:
        raise TypeError(f"compile_cache must be None (the default place), a directory or False (off), "
                        f"got {compile_cache!r}")
    return os.path.join(os.path.abspath(os.path.expanduser(base)), host_fingerprint())


def usable_directory(compile_cache: str | os.PathLike | bool | None = None) -> str | None:
    """:func:`directory`, made if missing; None when off, or when the default place cannot be made.

    A directory the caller named that cannot be made raises ``ValueError``
    naming the fix; the default place only warns (the cache is then off), so
    a machine with a read-only home still runs.
    """
    path = directory(compile_cache)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        if compile_cache is None or compile_cache is True:
            warn(f"the compile cache is off: {path} cannot be made ({e}); set "
                 f"fork(compile_cache=DIRECTORY) or {ENV_VAR} to a writable directory")
            return None
        raise ValueError(f"fork(compile_cache={compile_cache!r}): {path} cannot be made ({e}); give a "
                         f"writable directory, or compile_cache=False to compile without one") from None
    return path


#: where the cache keeps what synkhronos found out about a graph: a marker file per finding and digest
FINDINGS = "synkhronos-findings"


def recalls(directory: str | None, finding: str, key: str | None) -> bool:
    """True if an earlier run recorded ``finding`` about the graph of digest ``key`` in ``directory``
    (False where there is no cache, or no key)."""
    return directory is not None and key is not None and os.path.exists(os.path.join(directory, FINDINGS, finding, key))


def record(directory: str | None, finding: str, key: str | None) -> None:
    """Record ``finding`` about the graph of digest ``key`` (nothing when the cache is off, or on a
    failure to write: a finding is only ever a shortcut)."""
    if directory is None or key is None:
        return
    try:
        os.makedirs(os.path.join(directory, FINDINGS, finding), exist_ok=True)
        open(os.path.join(directory, FINDINGS, finding, key), "a").close()
    except OSError:
        pass
