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

from .collectives import get_value, set_value
from .data import Data, data
from .errors import SynkError, WorkerError
from .function import Function, function
from .lifecycle import close, distribute, fork, get_n_devices, get_n_gpu

__all__ = ["fork", "distribute", "close", "get_n_devices", "get_n_gpu", "function", "Function",
           "data", "Data", "get_value", "set_value", "SynkError", "WorkerError"]

__version__ = "0.1.0"
