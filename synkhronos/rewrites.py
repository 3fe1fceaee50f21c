"""Graph rewrites synkhronos adds when it compiles a function for a CPU device.

XLA's CPU backend multiplies ``A.T @ B`` (a contraction over the first axis of
both operands, the form of every weight gradient ``h.T @ delta``) about a third
slower than ``A @ B`` of the same size: on one core, 2048x1024 by 2048x1024 ran
at 60-64 GFLOP/s against 81-86 GFLOP/s for ``A @ B`` and ``B @ W.T``
(measured; PyTorch runs all three forms at full speed). Copying the transpose
first costs a few milliseconds and runs the product at full speed; an MLP
training step (784-1024-1024-10, batch 2048) took 0.76-0.93x the time.

PyTensor folds transposes into ``Dot`` and XLA folds them back into the dot's
dimension numbers, so the copy is kept by an optimization barrier, an XLA
identity that nothing is folded through. GPUs take transposed operands
natively; there the rewrite is left out (see :func:`compile_mode`).
"""

import numpy as np
from pytensor.compile.mode import get_mode, optdb
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.jax.dispatch import jax_funcify
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.math import Dot

__all__ = ["Materialize", "materialize", "compile_mode", "REWRITE_TAG"]

#: the optimizer tag under which synkhronos registers its CPU rewrites (off unless included)
REWRITE_TAG = "synk_cpu_dots"


class Materialize(Op):
    """Identity whose value the backend must compute as an array of its own.

    In JAX it is :func:`jax.lax.optimization_barrier`: XLA cannot fold the
    layout of its input (a transpose) into the operation that reads it.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> x = pt.matrix("x")
    >>> materialize(x.T).owner.op
    Materialize()
    """

    __props__ = ()

    def make_node(self, x):
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.ascontiguousarray(inputs[0])

    def pullback(self, inputs, outputs, cotangents):
        return [cotangents[0]]

    def __str__(self):
        return "Materialize"


materialize = Materialize()


@jax_funcify.register(Materialize)
def _jax_materialize(op, **kwargs):
    from jax import lax

    def materialize_(x):
        return lax.optimization_barrier(x)
    return materialize_


def _is_transpose(var):
    node = var.owner
    return (node is not None and isinstance(node.op, DimShuffle)
            and node.op.input_ndim == 2 and tuple(node.op.new_order) == (1, 0))


@node_rewriter([Dot])
def materialize_transposed_lhs(fgraph, node):
    """``dot(A.T, B)`` -> ``dot(materialize(A.T), B)`` for matrices."""
    lhs, rhs = node.inputs
    if lhs.ndim != 2 or rhs.ndim != 2 or not _is_transpose(lhs):
        return None
    return [node.op(materialize(lhs), rhs)]


# After every PyTensor rewrite has put the transposes where they stay, before the final merge.
optdb.register("synk_materialize_transposed_lhs", in2out(materialize_transposed_lhs),
               REWRITE_TAG, position=99)


def compile_mode(platform):
    """The PyTensor mode synkhronos compiles with on ``platform`` ("cpu", "gpu", ...).

    Examples
    --------
    >>> compile_mode("cpu").provided_optimizer.include >= {"synk_cpu_dots"}
    True
    """
    mode = get_mode("JAX")
    return mode.including(REWRITE_TAG) if platform == "cpu" else mode
