"""Random generators in data-parallel functions: advanced by every call, one stream per device.

A graph that draws random numbers (``pytensor.tensor.random``, a
``RandomStream``, pytensor-ml's ``Dropout``) reads shared generators.
synkhronos threads the next state of every generator a function draws from
into its updates, as ``pytensor_ml.pytensorf.function`` does, so each call
draws new numbers (a new dropout mask every step). Each device draws from a
stream of its own: the device ``k`` ranks after the master (in rank order,
wrapping around) uses the master's generator jumped ``k`` times
(``bit_generator.jumped(k)``: 2**127 draws apart for PCG64), so the master's
own draws are those of the user's generator, and every run from the same
seed draws the same numbers on every device.

In JAX mode PyTensor compiles each function with a private copy of its
generators' state (as it does in a single process): two functions drawing
from one generator advance their own copies.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from pytensor.tensor.random.type import RandomType

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

__all__ = ["is_generator", "generator_updates", "device_stream"]


def is_generator(var: object) -> bool:
    """True if ``var`` is a random generator (a shared ``RandomType`` variable, for instance)."""
    return isinstance(getattr(var, "type", None), RandomType)


def generator_updates(inputs: Iterable[Variable], read_variables: Sequence[Variable],
                      written: Container[SharedVariable]) -> list[tuple[SharedVariable, Variable]]:
    """The next-state update of every shared generator the graphs of ``read_variables`` draw from.

    What ``pytensor_ml.pytensorf.function`` threads in, through its own
    collector; and like it, a generator that is drawn from but that nothing
    advances (two draws off one generator, none threaded through the other) is
    refused: every call would repeat the same values.

    Parameters
    ----------
    inputs : list of Variable
        The function's inputs (no updates are collected above them).
    read_variables : list of Variable
        Outputs, update values and givens' values.
    written : collection of SharedVariable
        Generators the user updates explicitly (their update wins).

    Returns
    -------
    list of (SharedVariable, Variable)

    Raises
    ------
    ValueError
        For a generator drawn from that nothing advances.
    """
    import warnings

    from pytensor_ml.pytensorf.rng import collect_default_updates, find_generators_drawn_from
    if not read_variables:
        return []
    with warnings.catch_warnings():
        # a generator read by two draws has no single next state; the check below names it
        warnings.simplefilter("ignore", UserWarning)
        updates = collect_default_updates(inputs=list(inputs), outputs=list(read_variables))
    frozen = [g for g in find_generators_drawn_from(list(read_variables))
              if g not in updates and g not in written]
    if frozen:
        raise ValueError(
            f"the graph draws from {[str(g.name or g) for g in frozen]}, which nothing advances, so "
            f"every call would repeat the same values (as pytensor-ml refuses it): two draws off one "
            f"generator are the cause; give each draw its own generator, or thread one through with "
            f"`next_rng, draw = pt.random.normal(rng=rng, return_next_rng=True)` and update it")
    return [(rng, nxt) for rng, nxt in updates.items() if rng not in written]


def device_stream(generator: np.random.Generator, offset: int) -> np.random.Generator:
    """Generator ``offset`` streams after ``generator`` (a copy of it for ``offset=0``).

    Examples
    --------
    >>> g = np.random.default_rng(0)
    >>> float(device_stream(g, 0).random()) == float(np.random.default_rng(0).random())
    True
    >>> float(device_stream(g, 1).random()) == float(np.random.default_rng(0).random())
    False
    """
    generator = copy.deepcopy(generator)
    if offset == 0:
        return generator
    bit_generator = generator.bit_generator
    if hasattr(bit_generator, "jumped"):
        return np.random.Generator(bit_generator.jumped(offset))
    # no jump ahead (SFC64, say): a child seed from this generator's next draws and the offset
    seed = np.random.SeedSequence(entropy=[int(v) for v in bit_generator.random_raw(4)],
                                  spawn_key=(offset,))
    return np.random.Generator(type(bit_generator)(seed))
