"""Shipping graphs to the workers: pickling that neither recurses with the graph nor copies shared state.

Functions travel to the workers as their :class:`~synkhronos.wire.spec.FunctionSpec`,
cloudpickled (pytensor-ml layers are ops with local closures, which plain pickle
refuses). Two things are added to cloudpickle:

- **Depth.** Pickling follows a variable to the node that made it and on to
  that node's inputs, one nested call per step: Python 3.12's C recursion limit
  (which ``sys.setrecursionlimit`` does not raise) stopped graphs of about 80
  chained operations. Every node of the graphs is pickled first, in topological
  order, so that each node's inputs are already in the pickle's memo and the
  nesting stays a few levels deep whatever the graph's depth.
- **Shared variables.** A shared variable the workers already hold travels as
  a reference to it (its uid), so every function in a worker uses the same
  variable objects no matter when it was shipped; device arrays travel as
  numpy arrays.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

import cloudpickle
import numpy as np
from pytensor.graph.traversal import toposort

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

    from ..wire.spec import FunctionSpec

#: the uid of a shared variable the workers already hold, or None for anything else
type UidOfShipped = Callable[[object], int | None]

__all__ = ["dumps", "loads", "check_shippable"]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle with shared variables by reference (see :func:`dumps`)."""

    def __init__(self, file: IO[bytes], uid_of_shipped: UidOfShipped) -> None:
        super().__init__(file, protocol=5)
        self._uid_of_shipped = uid_of_shipped

    def persistent_id(self, obj: object) -> tuple[str, int] | None:
        uid = self._uid_of_shipped(obj)
        return None if uid is None else ("shared", uid)

    def reducer_override(self, obj: object) -> Any:
        if type(obj).__module__.startswith("jaxlib") and hasattr(obj, "__array__"):
            return np.asarray, (np.asarray(obj),)
        return super().reducer_override(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], shared: Mapping[int, Any]) -> None:
        super().__init__(file)
        self._shared = shared

    def persistent_load(self, pid: tuple[str, int]) -> Any:
        _, uid = pid
        return self._shared[uid]


def dumps(payload: object, graph_vars: Iterable[Variable], uid_of_shipped: UidOfShipped) -> bytes:
    """Pickle ``payload``, whose graphs end in ``graph_vars``, for :func:`loads` in a worker.

    Parameters
    ----------
    payload : object
        What the worker gets back from :func:`loads`.
    graph_vars : list of Variable
        Every variable at the end of a graph in ``payload`` (outputs, update
        values, givens); their nodes are pickled first, in topological order.
    uid_of_shipped : callable
        ``uid_of_shipped(obj)`` returns the uid of a shared variable the
        workers already hold, or None for anything else.

    Returns
    -------
    bytes
    """
    buf = io.BytesIO()
    _Pickler(buf, uid_of_shipped).dump((list(toposort(graph_vars)), payload))
    return buf.getvalue()


def loads(blob: bytes, shared: Mapping[int, Any]) -> Any:
    """Unpickle what :func:`dumps` made; ``shared`` maps uids to the worker's shared variables."""
    _, payload = _Unpickler(io.BytesIO(blob), shared).load()
    return payload


def check_shippable(spec: FunctionSpec) -> None:
    """Raise TypeError if function spec ``spec`` cannot be pickled for the workers.

    Run when a function is built, so a function that cannot travel fails
    alone, at once, and is never registered. Shared variables are left out
    (their values always pickle), which keeps the check cheap.
    """
    from pytensor.compile.sharedvalue import SharedVariable

    def shared_by_reference(obj: object) -> int | None:
        return id(obj) if isinstance(obj, SharedVariable) else None
    try:
        dumps(spec, spec.graph_vars(), shared_by_reference)
    except Exception as e:
        raise TypeError(f"{spec.name} cannot be sent to the workers: pickling its graph failed "
                        f"with {type(e).__name__}: {e}. Every op of the graph must be picklable "
                        f"(cloudpickle); the function was not registered") from e
