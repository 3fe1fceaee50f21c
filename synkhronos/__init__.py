"""synkhronos: data-parallel PyTensor functions on many devices from one script.

Examples
--------
>>> import synkhronos as synk                                   # doctest: +SKIP
>>> n = synk.fork()                                             # doctest: +SKIP
>>> f = synk.function([x, y], [(loss, "avg")], updates=upd)     # doctest: +SKIP
>>> synk.distribute()                                           # doctest: +SKIP
>>> f(synk.data(X), synk.data(Y), batch=idx)                    # doctest: +SKIP
>>> synk.close()                                                # doctest: +SKIP
"""

import os as _os

# XLA's C++ logging reads this when jaxlib loads (importing synkhronos loads it): without it every
# fork() prints the coordination service's warnings. Errors still show; set it yourself to see more.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from .collectives import (all_gather, all_reduce, broadcast, gather, get_lengths, get_shapes,
                          get_value, reduce, scatter, set_value)
from .data import Data, data
from .errors import StallError, SynkError, WorkerError
from .function import Function, function
from .lifecycle import close, distribute, fork, get_n_devices, get_n_gpu

__all__ = ["fork", "distribute", "close", "get_n_devices", "get_n_gpu", "function", "Function",
           "data", "Data", "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "get_value", "set_value", "get_lengths", "get_shapes", "SynkError", "WorkerError", "StallError"]

__version__ = "0.1.0"
