"""What travels to every process to compile a function: its symbolic graphs and options.

A :class:`FunctionSpec` is cloudpickled to the workers (:mod:`synkhronos.compile.shipping`);
every process compiles it for its own device
(:class:`synkhronos.rank.compiled.CompiledFunction`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.traversal import ancestors

from .digests import update_with_values, without_addresses

if TYPE_CHECKING:
    from pytensor.compile.mode import Mode
    from pytensor.graph.basic import Constant, Variable

__all__ = ["FunctionSpec", "shared_variables", "JAX_MODE", "SHAPES_KEPT"]

#: the PyTensor mode of the single-process reference (and the default a user's mode replaces)
JAX_MODE = "JAX"
#: graphs a function keeps compiled per argument shape on each device, by default
#: (``synk.function(shapes_kept=...)``): enough for every bucket length of a padded sequence model
SHAPES_KEPT = 256


def _constants_within(graph_vars: Iterable[Variable]) -> Iterator[Constant]:
    """Every constant of the graphs of ``graph_vars``, those of their ops' inner graphs too (an
    OpFromGraph's, a scan's), in a stable order."""
    from pytensor.graph.basic import Constant
    from pytensor.graph.op import HasInnerGraph
    seen: set[int] = set()
    for var in ancestors(graph_vars):
        if isinstance(var, Constant):
            yield var
        elif var.owner is not None and isinstance(var.owner.op, HasInnerGraph) and id(var.owner) not in seen:
            seen.add(id(var.owner))
            yield from _constants_within(var.owner.op.inner_outputs)


def shared_variables(graph_vars: Iterable[Variable]) -> list[SharedVariable]:
    """All shared variables the graph of ``graph_vars`` depends on, in a stable order."""
    return [v for v in ancestors(graph_vars) if isinstance(v, SharedVariable)]


@dataclass
class FunctionSpec:
    """Everything a process needs to compile a Function; this is what gets shipped."""

    fid: int
    name: str
    inputs: list
    bcast_inputs: list
    outputs: list          # [(var, mode)]
    updates: list          # [(shared, value, mode)]
    givens: list
    sliceable_shareds: list
    kwargs: dict = field(default_factory=dict)
    #: (generator, next state): every random generator the graphs draw from (see .randomness)
    generator_updates: list = field(default_factory=list)
    #: whether the graph traces only on concrete shapes (True: every rank compiles it per row count),
    #: or on free rows (False), as an earlier run found; None when not known (every rank finds out)
    by_rows: bool | None = None
    #: graphs built for concrete shapes that each device keeps, the most recently used
    shapes_kept: int = SHAPES_KEPT
    #: per scattered input, the axis its rows lie along as declared (``split_axes``), None if undeclared
    input_axes: list = field(default_factory=list)
    #: per output, the axis a ``"gather"`` concatenates the ranks' and the slices' results along
    gather_axes: list = field(default_factory=list)
    #: per update, whether it is its variable plus a change combined by "sum": over slices, the
    #: changes are summed onto the value before the call (see api.function_parts.sliced_updates)
    sums_changes: list = field(default_factory=list)

    def input_axis(self, i: int) -> int | None:
        """The axis scattered input ``i`` is declared split along, or None (a Data's own, else 0)."""
        return self.input_axes[i] if self.input_axes else None

    def sums_changes_of(self, i: int) -> bool:
        """Whether update ``i``'s slices sum their changes onto its value before the call."""
        return bool(self.sums_changes) and self.sums_changes[i]

    def gather_axis(self, i: int) -> int:
        """The axis output ``i`` is gathered along (0 unless ``split_axes`` names the output)."""
        return self.gather_axes[i] if self.gather_axes else 0

    @property
    def all_inputs(self) -> list[Variable]:
        return self.inputs + self.bcast_inputs

    def pytensor_kwargs(self, default_mode: str | Mode = JAX_MODE) -> dict[str, Any]:
        """Keyword arguments for a ``pytensor.function`` built from this spec.

        A ``mode`` the user gave is used as it is; otherwise ``default_mode``
        (PyTensor's own JAX mode for the single-process reference, or
        synkhronos's for a device: :func:`synkhronos.compile.rewrites.compile_mode`).
        """
        kwargs = dict(self.kwargs)
        kwargs.setdefault("mode", default_mode)
        kwargs.setdefault("on_unused_input", "ignore")
        return kwargs

    def graph_vars(self) -> list[Variable]:
        return ([v for v, _ in self.outputs] + [u[1] for u in self.updates]
                + [g[1] for g in self.givens] + [nxt for _, nxt in self.generator_updates])

    def digest(self) -> str:
        """A digest of what decides how this function's graph compiles, the same in every run of
        the same script: its graphs (as PyTensor prints them, types included), inputs, givens,
        options and floatX, and the versions of PyTensor and JAX."""
        import importlib.metadata
        parts = self._described()
        parts += [importlib.metadata.version(name) for name in ("pytensor", "jax", "jaxlib")]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def compared_text(self, uid_of: Callable[[SharedVariable], int]) -> str:
        """What the masters of several nodes compare of this function: a digest of its graphs, as
        :meth:`digest` reads them, and of every constant's whole value (PyTensor prints a large one
        abbreviated) and the shared variables it reads, writes, replaces by givens and slices, by
        ``uid_of`` (their ids in the runtime).

        Nodes that built a function of one name from other graphs (another learning rate, another
        layer) would mix what their devices compute silently.

        Examples
        --------
        >>> import numpy as np, pytensor.tensor as pt
        >>> x = pt.vector("x")
        >>> def spec(rate):
        ...     return FunctionSpec(0, "f", [x], [], [(x * rate, "sum")], [], [], [])
        >>> spec(0.1).compared_text(id) == spec(0.1).compared_text(id)
        True
        >>> spec(0.1).compared_text(id) == spec(0.2).compared_text(id)
        False
        """
        import xxhash
        digest = xxhash.xxh3_64("\n".join(self._described()).encode())
        update_with_values(digest, (var.data for var in _constants_within(self.graph_vars())))
        replaced = [uid_of(var) if isinstance(var, SharedVariable) else None for var, _ in self.givens]
        digest.update(repr([[uid_of(var) for var in self.shared_variables()], replaced,
                            [uid_of(var) for var in self.sliceable_shareds]]).encode())
        return f"graph digest {digest.hexdigest()[:8]}"

    def _described(self) -> list[str]:
        """What decides how the graph compiles, in words the same in every process that built it
        from the same script (memory addresses left out)."""
        import pytensor
        from pytensor.printing import debugprint
        parts = [pytensor.config.floatX, repr(sorted(self.kwargs.items(), key=str)),
                 repr([(v.name, str(v.type)) for v in self.all_inputs + self.sliceable_shareds]),
                 repr([(s.name, m) for s, _, m in self.updates]), repr([m for _, m in self.outputs]),
                 repr([(str(var), str(var.type)) for var, _ in self.givens]),
                 repr((self.input_axes, self.gather_axes))]
        graphs = self.graph_vars()
        parts.append(str(debugprint(graphs, file="str", print_type=True)) if graphs else "")
        return [without_addresses(part) for part in parts]

    def shared_variables(self) -> list[SharedVariable]:
        """Every shared variable the function reads or updates (the workers must hold them)."""
        return shared_variables(self.graph_vars()) + [s for s, _, _ in self.updates]
