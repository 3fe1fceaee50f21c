"""numpy's BLAS thread count in one process: limited to its rank's cores, and given back.

:mod:`synkhronos.compile.rewrites` runs large CPU matrix products in numpy's BLAS from
inside XLA's computation; they may only do so once the BLAS is limited to the
process's own share of the cores.
"""

import ctypes
import os

__all__ = ["limit_blas_threads", "blas_threads", "restore_blas_threads", "current_blas_threads"]


#: threads numpy's BLAS was limited to in this process (None: not limited; see limit_blas_threads)
_blas_threads = None
#: (library, threads it had before limit_blas_threads), to give the count back
_previous = None
#: the thread-count functions of the OpenBLAS builds numpy ships (64-bit integer builds first)
_OPENBLAS_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("64_", "")


def _numpy_openblas():
    """(set_num_threads, get_num_threads) of the OpenBLAS numpy loaded, or None."""
    import numpy
    root = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy")
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line.split()[-1].lower()}
    except OSError:
        return None
    for path in sorted(lib for lib in libs if lib.startswith(root)):
        lib = ctypes.CDLL(path)
        for prefix in _OPENBLAS_PREFIXES:
            for suffix in _SUFFIXES:
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    return setter, getter
    return None


def limit_blas_threads(threads):
    """Limit numpy's BLAS (OpenBLAS) in this process to ``threads`` threads; True if it worked.

    numpy reads ``OPENBLAS_NUM_THREADS`` when it is imported, which in the
    master happens before ``fork()``; so the library's own setter is called on
    the OpenBLAS numpy loaded. Products that :mod:`synkhronos.compile.rewrites` hands to
    numpy's BLAS run in the calling XLA thread, on this rank's cores, only once
    this has worked (:func:`blas_threads`); otherwise (numpy with another BLAS,
    a platform without ``/proc``) they stay in XLA. :func:`restore_blas_threads`
    gives the library its previous count back.
    """
    global _blas_threads, _previous
    functions = _numpy_openblas()
    if functions is None:
        return False
    setter, getter = functions
    if _previous is None:
        _previous = (setter, int(getter()))
    setter(ctypes.c_int(int(threads)))
    _blas_threads = int(threads)
    return True


def restore_blas_threads():
    """Give numpy's BLAS the thread count it had before :func:`limit_blas_threads`."""
    global _blas_threads, _previous
    if _previous is not None:
        setter, threads = _previous
        setter(ctypes.c_int(threads))
    _blas_threads = _previous = None


def current_blas_threads():
    """The thread count numpy's BLAS (OpenBLAS) uses now, or None if it cannot be asked."""
    functions = _numpy_openblas()
    return None if functions is None else int(functions[1]())


def blas_threads():
    """The threads numpy's BLAS was limited to by :func:`limit_blas_threads`, or None."""
    return _blas_threads
