"""Graph rewrites synkhronos adds when it compiles a function for a CPU device.

Every matrix product becomes a :class:`BlasDot`, which knows whether either
operand is transposed. In JAX, a large one runs in numpy's BLAS through a host
callback, reading transposed operands in place: XLA's CPU products run large
matrix products below the speed of an optimized BLAS, and ``A.T @ B`` (every
weight gradient ``h.T @ delta``) slower still, so a training step with its
products in numpy's BLAS runs at the speed of PyTorch's CPU kernels (see
bench/RESULTS.md). Smaller products stay in XLA, a transposed left operand
there through :class:`TransposedDot`'s tiled transposes (XLA runs a skinny
``A.T @ B``, an output layer's gradient, far slower than transposed first).

Whether that pays depends on the CPU: on some, XLA's products are the faster
ones. The master times both once (:func:`use_cpu_rewrite`) and every rank
compiles with the faster; the compile cache keeps the finding for later runs
on the host. The callback needs numpy's BLAS limited to this
process's share of the cores
(:func:`synkhronos.platform.cpu_blas.limit_blas_threads`); without that, products stay in
XLA. GPUs take transposed operands natively and multiply on the device; there
the rewrite is left out (see :func:`compile_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import numpy.typing as npt
import pytensor.tensor as pt
from pytensor.compile.mode import Mode, get_mode, optdb
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op, OutputStorageType
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.scalar import upcast
from pytensor.tensor.elemwise import CAReduce, DimShuffle
from pytensor.tensor.math import Dot

from ..platform import compile_cache
from ..platform.cpu_blas import blas_threads

if TYPE_CHECKING:
    import jax
    from pytensor.graph.fg import FunctionGraph

__all__ = ["BlasDot", "TransposedDot", "transposed_dot", "tiled_transpose", "compile_mode",
           "use_cpu_rewrite", "set_cpu_rewrite", "products_measured", "REWRITE_TAG",
           "HOST_BLAS_MIN_FLOPS", "raise_deferred_interrupt", "reduce_in_jax_precision", "PRECISION_TAG"]

#: products of at least this many flops run in numpy's BLAS (a host callback costs tens of µs)
HOST_BLAS_MIN_FLOPS = 1 << 24

#: the optimizer tag under which synkhronos registers its CPU rewrites (off unless included)
REWRITE_TAG = "synk_cpu_dots"


class BlasDot(Op):
    """``op(a) @ op(b)`` for matrices ``a`` and ``b``, ``op`` a transpose where asked.

    Parameters
    ----------
    transpose_a, transpose_b : bool
        Multiply by the transpose of ``a`` (of ``b``) instead of ``a`` (``b``).

    Notes
    -----
    In JAX a product of at least :data:`HOST_BLAS_MIN_FLOPS` runs in numpy's
    BLAS (``jax.pure_callback``; BLAS reads a transposed operand in place) once
    :func:`synkhronos.platform.cpu_blas.limit_blas_threads` has limited its threads;
    any other in XLA. Elsewhere it is ``numpy.dot``.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a, b = pt.matrix("a"), pt.matrix("b")
    >>> BlasDot(transpose_b=True)(a, b).owner.op
    BlasDot(transpose_a=False, transpose_b=True)
    """

    __props__ = ("transpose_a", "transpose_b")

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        self.transpose_a, self.transpose_b = bool(transpose_a), bool(transpose_b)

    def make_node(self, a: Any, b: Any) -> Apply:  # type: ignore[override]
        a, b = pt.as_tensor_variable(a), pt.as_tensor_variable(b)
        if a.ndim != 2 or b.ndim != 2:
            raise TypeError(f"{type(self).__name__} multiplies matrices")
        rows, _, cols = self.dims(a.type.shape, b.type.shape)
        out = pt.matrix(dtype=upcast(a.dtype, b.dtype), shape=(rows, cols))
        return Apply(self, [a, b], [out])

    def dims[D](self, a_shape: Sequence[D], b_shape: Sequence[D]) -> tuple[D, D, D]:
        """(rows, contracted, columns) of the product of operands of these shapes."""
        rows, k = a_shape[::-1] if self.transpose_a else a_shape
        cols = b_shape[0] if self.transpose_b else b_shape[1]
        return rows, k, cols

    def _operands(self, a: Any, b: Any) -> tuple[Any, Any]:
        return (a.T if self.transpose_a else a), (b.T if self.transpose_b else b)

    def multiply(self, a: np.ndarray, b: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
        """The product of numpy arrays ``a`` and ``b`` in numpy (its BLAS), as ``dtype``."""
        return np.asarray(np.dot(*self._operands(a, b)), dtype=dtype)

    def perform(self, node: Apply, inputs: Sequence[Any], outputs: OutputStorageType) -> None:
        outputs[0][0] = self.multiply(*inputs, node.outputs[0].type.dtype)  # type: ignore[call-arg]

    def pullback(self, inputs: Sequence[Variable], outputs: Sequence[Variable],
                 cotangents: Sequence[Variable]) -> list[Variable]:
        a, b = self._operands(*inputs)
        g = cotangents[0]
        grad_a, grad_b = g @ b.T, a.T @ g
        return [grad_a.T if self.transpose_a else grad_a, grad_b.T if self.transpose_b else grad_b]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(transpose_a={self.transpose_a}, transpose_b={self.transpose_b})"

    __str__ = __repr__


class TransposedDot(BlasDot):
    """``a.T @ b`` for matrices ``a`` (b x k) and ``b`` (b x n): the weight-gradient product.

    In XLA (a product below :data:`HOST_BLAS_MIN_FLOPS`, or no host BLAS) the
    smaller of the two operands is transposed into an array of its own, in
    cache-sized tiles, so XLA multiplies in the form it runs at full speed. An
    optimization barrier keeps XLA from folding the transpose back into the dot.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> a, b = pt.matrix("a"), pt.matrix("b")
    >>> transposed_dot(a, b).owner.op
    TransposedDot()
    """

    __props__: tuple = ()
    transpose_a, transpose_b = True, False

    def __init__(self) -> None:
        pass

    def __repr__(self) -> str:
        return "TransposedDot()"

    def __str__(self) -> str:
        return "TransposedDot"


transposed_dot = TransposedDot()

#: tile edges tried, largest first, for the transposes (one that divides both dimensions)
TILES = (32, 16, 8)


def tiled_transpose(x: jax.Array) -> jax.Array:
    """``x.T`` as an array of its own, moved tile by tile (JAX, inside a traced function).

    XLA's CPU transpose of a large matrix runs slower than moving it through
    32x32 tiles (bench/RESULTS.md). Falls back to a plain transpose when no tile edge
    divides both dimensions.
    """
    from jax import lax
    m, n = x.shape
    t = next((t for t in TILES if m % t == 0 and n % t == 0), None)
    if t is None:
        return lax.optimization_barrier(x.T)
    tiles = lax.optimization_barrier(x.reshape(m // t, t, n // t, t).transpose(0, 2, 1, 3))
    return lax.optimization_barrier(tiles.transpose(1, 3, 0, 2).reshape(n, m))


def _xla_product(transpose_a: bool, transpose_b: bool, a: jax.Array, b: jax.Array) -> jax.Array:
    """``op(a) @ op(b)`` in XLA, in the forms its CPU backend runs at full speed."""
    from jax import lax
    if transpose_a and transpose_b:
        return (b @ a).T
    if transpose_b:
        return a @ b.T
    if not transpose_a:
        return a @ b
    rows, k = a.shape
    n = b.shape[1]
    if rows * n + k * n < rows * k:
        # b is the smaller operand (a skinny gradient): (b.T @ a).T, transposing b and the result
        return lax.optimization_barrier(tiled_transpose(b) @ a).T
    return tiled_transpose(a) @ b


#: Ctrl-C that arrived while numpy multiplied for a jitted graph (see raise_deferred_interrupt)
_interrupts: list[bool] = []


def _host_product(op: BlasDot, dtype: npt.DTypeLike) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        try:
            return op.multiply(a, b, dtype)
        except KeyboardInterrupt:
            # Raised here, XLA would turn it into an error of the computation; finish the product
            # and let the caller raise it once the computation is done
            _interrupts.append(True)
            return op.multiply(a, b, dtype)
    return product


def raise_deferred_interrupt(error: BaseException | None = None) -> None:
    """Raise the KeyboardInterrupt that reached a host product, if one did.

    Call it after a computation that may have run :class:`BlasDot` products in
    numpy (the master's Ctrl-C lands in whatever Python code runs, and a host
    callback is Python code), and with the ``error`` a computation raised:
    an interrupt XLA carried out of a callback is raised as one.
    """
    if _interrupts or (error is not None and "KeyboardInterrupt" in str(error)):
        _interrupts.clear()
        raise KeyboardInterrupt from error


def _jax_blas_dot(op: BlasDot, node: Apply, **kwargs: Any) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """How PyTensor's JAX backend runs a :class:`BlasDot` (registered by :func:`compile_mode`)."""
    import jax
    dtype = node.outputs[0].type.dtype
    host = _host_product(op, dtype)

    def blas_dot(a: jax.Array, b: jax.Array) -> jax.Array:
        rows, k, cols = op.dims(a.shape, b.shape)
        if blas_threads() is not None and 2 * rows * k * cols >= HOST_BLAS_MIN_FLOPS:
            return jax.pure_callback(host, jax.ShapeDtypeStruct((rows, cols), dtype), a, b)
        return _xla_product(op.transpose_a, op.transpose_b, a, b).astype(dtype)
    return blas_dot


def _is_transpose(var: Variable) -> bool:
    node = var.owner
    return (node is not None and isinstance(node.op, DimShuffle)
            and node.op.input_ndim == 2 and tuple(node.op.new_order) == (1, 0))


@node_rewriter([Dot])
def blas_dots(fgraph: FunctionGraph, node: Apply) -> list[Variable] | None:
    """``dot(op(A), op(B))`` of matrices -> ``BlasDot`` of ``A`` and ``B`` (``TransposedDot`` for ``A.T @ B``)."""
    lhs, rhs = node.inputs
    if lhs.type.ndim != 2 or rhs.type.ndim != 2:
        return None
    transpose_a, transpose_b = _is_transpose(lhs), _is_transpose(rhs)
    a = lhs.owner.inputs[0] if transpose_a else lhs
    b = rhs.owner.inputs[0] if transpose_b else rhs
    op = TransposedDot() if (transpose_a and not transpose_b) else BlasDot(transpose_a, transpose_b)
    return [cast(Variable, op(a, b))]


_installed: list[bool] = []


#: the optimizer tag of the rewrite that reduces in JAX's precision (included without 64-bit JAX)
PRECISION_TAG = "synk_jax_precision"


@node_rewriter([CAReduce])
def reduce_in_jax_precision(fgraph: FunctionGraph, node: Apply) -> list[Variable] | Literal[False]:
    """A reduction accumulating wider than 32 bits accumulates in its output's type instead.

    PyTensor sums float32 in float64 by default; JAX without its 64-bit mode
    truncates the accumulator to float32 anyway (and warns at every trace). The
    result is the same; only the warning goes.
    """
    acc, out = getattr(node.op, "acc_dtype", None), node.outputs[0].type.dtype
    if acc is None or acc == out or np.dtype(acc).itemsize <= 4 or np.dtype(out).itemsize > 4:
        return False
    return node.op.clone(acc_dtype=out).make_node(*node.inputs).outputs


def _install() -> None:
    """Register the rewrites (each under its own tag, off in every mode that does not include it)
    and :class:`BlasDot`'s JAX implementation with PyTensor, once, when synkhronos first compiles."""
    if _installed:
        return
    from pytensor.link.jax.dispatch import jax_funcify
    jax_funcify.register(BlasDot)(_jax_blas_dot)
    # After every PyTensor rewrite has put the transposes where they stay, before the final merge.
    optdb.register("synk_blas_dots", in2out(blas_dots), REWRITE_TAG, position=99)
    optdb.register("synk_reduce_in_jax_precision", in2out(reduce_in_jax_precision), PRECISION_TAG,
                   position=99)
    _installed.append(True)


def compile_mode(platform: str) -> Mode:
    """The PyTensor mode synkhronos compiles with on ``platform`` ("cpu", "gpu", ...).

    On CPU the rewrite is included when :func:`use_cpu_rewrite` says it pays on
    this machine; without JAX's 64-bit mode, reductions accumulate in their
    output's type (:func:`reduce_in_jax_precision`). The first call registers
    synkhronos's rewrites with PyTensor, under tags no other mode includes.

    Examples
    --------
    >>> set_cpu_rewrite(True)
    >>> compile_mode("cpu").provided_optimizer.include >= {"synk_cpu_dots"}
    True
    >>> set_cpu_rewrite(None)
    """
    _install()
    mode = get_mode("JAX")
    if not _jax_has_64_bits():
        mode = mode.including(PRECISION_TAG)
    return mode.including(REWRITE_TAG) if platform == "cpu" and use_cpu_rewrite() else mode


def _jax_has_64_bits() -> bool:
    import jax
    return bool(jax.config.jax_enable_x64)


#: whether this process compiles with the CPU rewrite: None until decided (see use_cpu_rewrite)
_cpu_rewrite: bool | None = None
#: what the decision was made from (seconds per product), for reports
products_measured: dict[str, Any] = {}


def set_cpu_rewrite(on: bool | None) -> None:
    """Compile with the CPU rewrite (True), without it (False), or decide by measuring (None).

    Every rank of a runtime must decide alike: the master measures, and the
    workers are told (they receive the master's decision with the functions).
    """
    global _cpu_rewrite
    _cpu_rewrite = on


#: where a measured decision is kept for later runs on this host (the compile cache), or None
_kept_in: str | None = None
#: the compile cache's findings: which products were faster here
BLAS_FASTER, XLA_FASTER = "products-faster-in-blas", "products-faster-in-xla"


def keep_decision_in(directory: str | None) -> None:
    """Keep what :func:`use_cpu_rewrite` measures in ``directory`` (this host's compile cache), and
    take it from there in later runs instead of measuring again (None: measure in every process)."""
    global _kept_in
    _kept_in = directory


def use_cpu_rewrite() -> bool:
    """Whether CPU functions compile with the rewrite; measured once per process if undecided.

    Large products in numpy's BLAS beat XLA's CPU products on some CPUs and
    lose on others; the first call times one large product and its
    weight-gradient form (``h.T @ d``) both ways, on this process's share of
    the cores, and keeps the faster (:data:`products_measured` says what it
    found), in the compile cache too (:func:`keep_decision_in`): a later run
    on this host with the same libraries and threads takes it from there.
    Without a BLAS synkhronos can limit, the rewrite is left out.
    """
    global _cpu_rewrite
    if _cpu_rewrite is None:
        threads = blas_threads()
        if threads is None:
            _cpu_rewrite = False
            return _cpu_rewrite
        kept, key = _kept_in, _decision_key(threads)
        blas_faster = compile_cache.recalls(kept, BLAS_FASTER, key)
        if blas_faster or compile_cache.recalls(kept, XLA_FASTER, key):
            _cpu_rewrite = blas_faster
            return _cpu_rewrite
        products_measured.update(_time_products())
        _cpu_rewrite = products_measured["blas_s"] < products_measured["xla_s"]
        compile_cache.record(kept, BLAS_FASTER if _cpu_rewrite else XLA_FASTER, key)
    return _cpu_rewrite


def _decision_key(threads: int) -> str:
    """What the measurement depends on besides the host (the cache's directory is the host's): the
    libraries (numpy's wheel brings its BLAS) and the threads each side gets."""
    import hashlib
    import importlib.metadata
    versions = [importlib.metadata.version(name) for name in ("numpy", "jax", "jaxlib")]
    return hashlib.sha256(repr((versions, threads)).encode()).hexdigest()


def _time_products(rows: int = 512, k: int = 1024, cols: int = 1024, repeat: int = 3) -> dict[str, Any]:
    """Best-of-``repeat`` seconds of ``x @ w`` plus ``x.T @ d`` in XLA and in numpy's BLAS."""
    import time

    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    x, w, d = (rng.random(shape, dtype=np.float32) for shape in ((rows, k), (k, cols), (rows, cols)))
    xla = jax.jit(lambda x, w, d: (x @ w, x.T @ d))
    jx, jw, jd = (jnp.asarray(v) for v in (x, w, d))

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    return dict(xla_s=best(lambda: jax.block_until_ready(xla(jx, jw, jd))),
                blas_s=best(lambda: (np.dot(x, w), np.dot(x.T, d))),
                shape=(rows, k, cols))
