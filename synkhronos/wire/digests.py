"""What the masters of several nodes compare of what each gave: digests of values, the same in every
process that gave equal ones (memory addresses left out of what they print)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["values_text", "update_with_values", "without_addresses"]

#: a memory address in a default ``repr`` ("<Mode object at 0x7f...>")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """``text`` without the memory addresses a default ``repr`` names (other in every process).

    Examples
    --------
    >>> without_addresses("<Mode object at 0x7f3a2c>")
    '<Mode object>'
    """
    return _ADDRESS.sub("", text)


def update_with_values(digest: Any, values: Iterable[Any]) -> int:
    """Add each value's dtype, shape and bytes (an object's ``repr``, addresses left out) to
    ``digest`` (an ``xxhash`` or ``hashlib`` hash); return how many there were."""
    n = 0
    for value in values:
        array = np.asarray(value)
        digest.update(f"{array.dtype.str}{array.shape};".encode())
        if array.dtype.hasobject:
            digest.update(without_addresses(repr(value)).encode())
        else:
            digest.update(np.ascontiguousarray(array).view(np.uint8))
        n += 1
    return n


def values_text(values: Iterable[Any]) -> str:
    """What nodes compare of a call's arguments given as values (numpy arrays, numbers, the rows
    a givens index selects), not as Data: a digest of their bytes, types and shapes ("" for none).

    Every node gives such an argument whole, and every device takes its share of it: arguments
    that differ between nodes would mix the nodes' values silently.

    Examples
    --------
    >>> values_text([np.arange(3), 2.0]) == values_text([np.arange(3), 2.0])
    True
    >>> values_text([np.arange(3)]) == values_text([np.arange(3) + 1]), values_text([])
    (False, '')
    """
    import xxhash
    digest = xxhash.xxh3_64()
    n = update_with_values(digest, values)
    return f", values given (digest {digest.hexdigest()[:8]})" if n else ""
