"""synkhronos: data-parallel PyTensor functions on many devices from one script.

Importing synkhronos changes nothing outside it (no JAX import, no environment
variable, no PyTensor setting); ``fork()`` prepares the process and ``close()``
puts it back. Neither moves ``numpy.random``'s or ``random``'s global state: a
script seeded at its top draws the same numbers with synkhronos as without.

Examples
--------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> import synkhronos as synk
>>> n = synk.fork(2)                                  # two devices: this process and one more
>>> x, y = pt.matrix("x"), pt.vector("y")
>>> w = pytensor.shared(np.zeros(3), name="w")
>>> loss = ((x.dot(w) - y) ** 2).mean()
>>> f = synk.function([x, y], [(loss, "avg"), (x.dot(w), "gather")])
>>> synk.distribute()                                 # every device compiles f
>>> X, Y = synk.data(np.ones((8, 3))), synk.data(np.arange(8.0))
>>> f(X, Y, batch=np.arange(8))                       # 4 rows on each device: averaged, gathered
[array(17.5), array([0., 0., 0., 0., 0., 0., 0., 0.])]
>>> synk.close()
"""

from __future__ import annotations

from . import checkpoint
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
