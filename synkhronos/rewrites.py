"""Graph rewrites synkhronos adds when it compiles a function for a CPU device.

XLA's CPU backend multiplies ``A.T @ B`` (a contraction over the first axis of
both operands, the form of every weight gradient ``h.T @ delta``) slower than
``A @ B`` of the same size: on one core, 2048x1024 by 2048x1024 ran at 60-64
GFLOP/s against 81-91 GFLOP/s for ``A @ B`` and ``B @ W.T``; with a skinny
``B`` (2048x10, an output layer's gradient) at 4-5 GFLOP/s (measured; PyTorch
runs these forms at full speed). :class:`TransposedDot` transposes the smaller
operand first, through cache-sized tiles, and multiplies in the fast form: an
MLP gradient step (784-1024-1024-10, batch 2048, one core) took 0.75-0.93x the
time of PyTensor's plain JAX mode.

GPUs take transposed operands natively; there the rewrite is left out (see
:func:`compile_mode`).
"""

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.mode import get_mode, optdb
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.jax.dispatch import jax_funcify
from pytensor.scalar import upcast
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.math import Dot

__all__ = ["TransposedDot", "transposed_dot", "tiled_transpose", "compile_mode", "REWRITE_TAG"]

#: the optimizer tag under which synkhronos registers its CPU rewrites (off unless included)
REWRITE_TAG = "synk_cpu_dots"


class TransposedDot(Op):
    """``a.T @ b`` for matrices ``a`` (b x k) and ``b`` (b x n): the weight-gradient product.

    In JAX the operand layout is chosen once the shapes are known (at trace
    time): the smaller of the two operands is transposed into an array of its
    own, in cache-sized tiles, so XLA multiplies in the form it runs at full
    speed. An optimization barrier keeps XLA from folding the transpose back
    into the dot. Elsewhere it is ``numpy.dot(a.T, b)``.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a, b = pt.matrix("a"), pt.matrix("b")
    >>> transposed_dot(a, b).owner.op
    TransposedDot()
    """

    __props__ = ()

    def make_node(self, a, b):
        a, b = pt.as_tensor_variable(a), pt.as_tensor_variable(b)
        if a.ndim != 2 or b.ndim != 2:
            raise TypeError("TransposedDot multiplies matrices")
        out = pt.matrix(dtype=upcast(a.dtype, b.dtype), shape=(a.type.shape[1], b.type.shape[1]))
        return Apply(self, [a, b], [out])

    def perform(self, node, inputs, outputs):
        a, b = inputs
        outputs[0][0] = np.asarray(np.dot(a.T, b), dtype=node.outputs[0].dtype)

    def pullback(self, inputs, outputs, cotangents):
        a, b = inputs
        g = cotangents[0]
        return [b @ g.T, a @ g]

    def __str__(self):
        return "TransposedDot"


transposed_dot = TransposedDot()

#: tile edges tried, largest first, for the transposes (one that divides both dimensions)
TILES = (32, 16, 8)


def tiled_transpose(x):
    """``x.T`` as an array of its own, moved tile by tile (JAX, inside a traced function).

    XLA's CPU transpose of a 2048x1024 float32 matrix took 5.6-7.9 ms on one
    core; through 32x32 tiles 3.2 ms (measured). Falls back to a plain
    transpose when no tile edge divides both dimensions.
    """
    from jax import lax
    m, n = x.shape
    t = next((t for t in TILES if m % t == 0 and n % t == 0), None)
    if t is None:
        return lax.optimization_barrier(x.T)
    tiles = lax.optimization_barrier(x.reshape(m // t, t, n // t, t).transpose(0, 2, 1, 3))
    return lax.optimization_barrier(tiles.transpose(1, 3, 0, 2).reshape(n, m))


@jax_funcify.register(TransposedDot)
def _jax_transposed_dot(op, node, **kwargs):
    from jax import lax
    dtype = node.outputs[0].dtype

    def transposed_dot_(a, b):
        rows, k = a.shape
        n = b.shape[1]
        if rows * n + k * n < rows * k:
            # b is the smaller operand (a skinny gradient): (b.T @ a).T, transposing b and the result
            product = lax.optimization_barrier(tiled_transpose(b) @ a)
            return product.T.astype(dtype)
        return (tiled_transpose(a) @ b).astype(dtype)
    return transposed_dot_


def _is_transpose(var):
    node = var.owner
    return (node is not None and isinstance(node.op, DimShuffle)
            and node.op.input_ndim == 2 and tuple(node.op.new_order) == (1, 0))


@node_rewriter([Dot])
def transposed_lhs_dot(fgraph, node):
    """``dot(A.T, B)`` -> ``transposed_dot(A, B)`` for matrices."""
    lhs, rhs = node.inputs
    if lhs.ndim != 2 or rhs.ndim != 2 or not _is_transpose(lhs):
        return None
    return [transposed_dot(lhs.owner.inputs[0], rhs)]


# After every PyTensor rewrite has put the transposes where they stay, before the final merge.
optdb.register("synk_transposed_lhs_dot", in2out(transposed_lhs_dot), REWRITE_TAG, position=99)


def compile_mode(platform):
    """The PyTensor mode synkhronos compiles with on ``platform`` ("cpu", "gpu", ...).

    Examples
    --------
    >>> compile_mode("cpu").provided_optimizer.include >= {"synk_cpu_dots"}
    True
    """
    mode = get_mode("JAX")
    return mode.including(REWRITE_TAG) if platform == "cpu" else mode
