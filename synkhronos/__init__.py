"""synkhronos: data-parallel PyTensor functions on many devices from one script.

Importing synkhronos changes nothing outside it (no JAX import, no environment
variable, no PyTensor setting); ``fork()`` prepares the process and ``close()``
puts it back.

Examples
--------
>>> import synkhronos as synk                                   # doctest: +SKIP
>>> n = synk.fork()                                             # doctest: +SKIP
>>> f = synk.function([x, y], [(loss, "avg")], updates=upd)     # doctest: +SKIP
>>> synk.distribute()                                           # doctest: +SKIP
>>> f(synk.data(X), synk.data(Y), batch=idx)                    # doctest: +SKIP
>>> synk.close()                                                # doctest: +SKIP
"""

from .api import checkpoint
from .api.collectives import (
                               all_gather,
                               all_reduce,
                               broadcast,
                               gather,
                               get_lengths,
                               get_shapes,
                               get_value,
                               reduce,
                               scatter,
                               set_value,
)
from .api.data import Data, data
from .api.function import Function, function
from .api.lifecycle import (
                               close,
                               distribute,
                               fork,
                               get_n_devices,
                               get_n_gpu,
                               local_devices,
                               n_nodes,
                               node_rank,
                               timeline,
)
from .errors import (
                               LocalUpdatesWarning,
                               NodesDiverged,
                               StallError,
                               SynkError,
                               SynkWarning,
                               WorkerError,
)

__all__ = ["fork", "distribute", "close", "get_n_devices", "get_n_gpu", "n_nodes", "node_rank",
           "local_devices", "function", "Function",
           "data", "Data", "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "get_value", "set_value", "get_lengths", "get_shapes", "checkpoint", "timeline", "SynkError",
           "WorkerError", "StallError", "NodesDiverged", "SynkWarning", "LocalUpdatesWarning"]

__version__ = "0.1.0"
