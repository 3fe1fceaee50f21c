"""numpy's BLAS thread count in one process: limited to its rank's cores, and given back.

:mod:`synkhronos.compile.rewrites` runs large CPU matrix products in numpy's BLAS from
inside XLA's computation; they may only do so once the BLAS is limited to the
process's own share of the cores. threadpoolctl finds the OpenBLAS numpy
loaded and sets its threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .process_changes import changes

if TYPE_CHECKING:
    from threadpoolctl import LibController

__all__ = ["limit_blas_threads", "blas_threads", "restore_blas_threads", "current_blas_threads",
           "loaded_blas_libraries", "threads_for_libraries_loaded_since"]


#: threads numpy's BLAS was limited to in this process (None: not limited; see limit_blas_threads)
_blas_threads: int | None = None
#: [(library, threads it had)] before limit_blas_threads, to give the counts back
_previous: list[tuple[LibController, int]] | None = None


def _numpy_openblas() -> list[LibController]:
    """threadpoolctl's controllers of the OpenBLAS numpy loaded (its own copy), or an empty list."""
    import numpy
    from threadpoolctl import ThreadpoolController
    # the loader names libraries by their real path, and a venv may be reached through a link
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(numpy.__file__))), "numpy")
    return [lib for lib in ThreadpoolController().select(internal_api="openblas").lib_controllers
            if lib.filepath and os.path.realpath(lib.filepath).startswith(root)]


def limit_blas_threads(threads: int) -> bool:
    """Limit numpy's BLAS (OpenBLAS) in this process to ``threads`` threads; True if it worked.

    numpy reads ``OPENBLAS_NUM_THREADS`` when it is imported, which in the
    master happens before ``fork()``; so the library's own setter is called on
    the OpenBLAS numpy loaded (through threadpoolctl). Products that
    :mod:`synkhronos.compile.rewrites` hands to numpy's BLAS run in the calling XLA thread,
    on this rank's cores, only once this has worked (:func:`blas_threads`);
    otherwise (numpy with another BLAS) they stay in XLA.
    :func:`restore_blas_threads` (which the process's
    :data:`~synkhronos.platform.process_changes.changes` call at the runtime's stop)
    gives the library its previous count back.
    """
    global _blas_threads, _previous
    libraries = _numpy_openblas()
    if not libraries:
        return False
    if _previous is None:
        _previous = [(lib, lib.num_threads) for lib in libraries]
    changes.record("numpy's BLAS threads", restore_blas_threads)
    for lib in libraries:
        lib.set_num_threads(int(threads))
    _blas_threads = int(threads)
    return True


def restore_blas_threads() -> None:
    """Give numpy's BLAS the thread count it had before :func:`limit_blas_threads`."""
    global _blas_threads, _previous
    for lib, threads in _previous or []:
        lib.set_num_threads(threads)
    _blas_threads = _previous = None


def current_blas_threads() -> int | None:
    """The thread count numpy's BLAS (OpenBLAS) uses now, or None if it cannot be asked."""
    libraries = _numpy_openblas()
    return libraries[0].num_threads if libraries else None


def blas_threads() -> int | None:
    """The threads numpy's BLAS was limited to by :func:`limit_blas_threads`, or None."""
    return _blas_threads


def loaded_blas_libraries() -> set[str]:
    """The paths of the BLAS libraries loaded in this process now (threadpoolctl)."""
    from threadpoolctl import ThreadpoolController
    return {lib.filepath for lib in ThreadpoolController().select(user_api="blas").lib_controllers}


def threads_for_libraries_loaded_since(before: set[str]) -> Callable[[], None]:
    """What gives a BLAS library first loaded while the runtime ran (scipy's, loaded by PyTensor's
    JAX backend under the runtime's ``OPENBLAS_NUM_THREADS=1``) the threads the environment asks for
    once it is the user's again: ``OPENBLAS_NUM_THREADS``, else every core. ``before`` is
    :func:`loaded_blas_libraries` from before the runtime."""
    def give_back() -> None:
        from threadpoolctl import ThreadpoolController
        threads = int(os.environ.get("OPENBLAS_NUM_THREADS") or os.cpu_count() or 1)
        for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
            if lib.filepath not in before:
                lib.set_num_threads(threads)
    return give_back
