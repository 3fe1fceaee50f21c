"""What a block of code makes JAX launch in this process: compiled programs, each by name.

On a GPU every program launched from the host (a jitted step, or one
primitive run eagerly, ``x[indices]`` on a device array) costs a dispatch,
and an eager one is a program of its own. :func:`count_launches` records the
block with JAX's profiler and counts its top-level program launches by name
(an eager primitive shows as its own name: ``gather``, ``add``); it is how
the test suite checks that a steady training step launches one program and
nothing else, on the CPU as on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["count_launches", "Launches"]

_PREFIX = "PjitFunction("


class Launches(collections.Counter[str]):
    """Program launches by the name of the jitted function (an eager primitive: its own name).

    Examples
    --------
    >>> launches = Launches({"synk_step": 3, "gather": 1})
    >>> launches.total(), launches.others("synk_step")
    (4, {'gather': 1})
    """

    def others(self, *names: str) -> dict[str, int]:
        """The launches of programs not named ``names`` (what should not be there)."""
        return {k: v for k, v in self.items() if k not in names}


@contextlib.contextmanager
def count_launches() -> Iterator[Launches]:
    """Count the programs JAX launches in this process within the block (profiled: slow; a check,
    not a measure).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> step = jax.jit(lambda x: x * 2)
    >>> x = jnp.ones(3)
    >>> _ = step(x)                       # compiled before the block
    >>> with count_launches() as launches:
    ...     y = step(step(x))
    ...     z = y[jnp.arange(2)]          # eager indexing: programs of their own
    >>> launches["<lambda>"], launches.total() > 2
    (2, True)
    """
    import jax
    from jax._src import profiler
    found = Launches()
    with tempfile.TemporaryDirectory() as where:
        with jax.profiler.trace(where):
            yield found
            jax.effects_barrier()
        files = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
        data = profiler.ProfileData.from_file(files[0]) if files else None
    if data is not None:
        found.update(_top_level_launches(data))


def _top_level_launches(data: Any) -> collections.Counter[str]:
    """The launch events of a profile not nested in another launch event of the same thread."""
    counted: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            events = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events
                            if e.name.startswith(_PREFIX))
            open_until = -1.0
            for start, end, name in events:
                if start >= open_until:
                    counted[name[len(_PREFIX):-1]] += 1
                    open_until = end
                else:
                    open_until = max(open_until, end)
    return counted
