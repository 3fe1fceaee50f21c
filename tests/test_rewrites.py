"""The CPU rewrite of matrix products into BlasDot / TransposedDot (synkhronos.compile.rewrites)."""

import os

import jax
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close, reference, run_script

import synkhronos as synk
from synkhronos.compile import rewrites
from synkhronos.compile.rewrites import (
    HOST_BLAS_MIN_FLOPS,
    BlasDot,
    TransposedDot,
    compile_mode,
    tiled_transpose,
    transposed_dot,
)
from synkhronos.platform.cpu_blas import blas_threads
from synkhronos.platform.internals import jit_parts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True, scope="module")
def with_the_rewrite():
    """These tests are about the rewrite: on, whatever this machine's measurement chose."""
    chosen = rewrites._cpu_rewrite
    rewrites.set_cpu_rewrite(True)
    yield
    rewrites.set_cpu_rewrite(chosen)


def test_the_rewrite_is_chosen_by_timing_both_products(synk2):
    """The master times XLA's products and numpy's BLAS once and keeps the faster, for every rank."""
    chosen, kept = rewrites._cpu_rewrite, rewrites._kept_in
    try:
        rewrites.keep_decision_in(None)          # measured here, whatever the suite's cache keeps
        rewrites.set_cpu_rewrite(None)
        rewrites.products_measured.clear()
        decided = rewrites.use_cpu_rewrite()
        measured = rewrites.products_measured
        if blas_threads() is None:       # numpy with a BLAS synkhronos cannot limit: left out, untimed
            assert decided is False and not measured
            return
        assert measured["xla_s"] > 0 and measured["blas_s"] > 0
        assert decided == (measured["blas_s"] < measured["xla_s"])
        x, w = pt.matrix("x"), pt.matrix("w")
        f = synk.function([x], ((x @ w).sum(), "sum"), bcast_inputs=[w], name="chosen_products")
        assert ("BlasDot" in ops_of(f.compiled.function_for([(4, 3)]))) == decided
        X, W = np.ones((4, 3)), np.ones((3, 2))
        close(f(X, W), f.as_pytensor(X, W))
    finally:
        rewrites.set_cpu_rewrite(chosen)
        rewrites.keep_decision_in(kept)


def ops_of(fn):
    return [type(node.op).__name__ for node in fn.maker.fgraph.toposort()]


def test_weight_gradient_products_are_rewritten_and_exact(synk2, rng):
    x, g, w = pt.matrix("x"), pt.matrix("g"), pt.matrix("w")
    f = synk.function([x, g], [(x.T @ g, "sum"), (g @ w.T, "gather"), (x @ w, "gather")],
                      bcast_inputs=[w], name="three_products")
    X, G, W = rng.normal(size=(9, 4)), rng.normal(size=(9, 5)), rng.normal(size=(4, 5))
    out = f(X, G, W)
    for got, want in zip(out, reference(f, X, G, W)):
        close(got, want)
    # only x.T @ g has a transposed left operand; the master compiled for its CPU device
    master = f.compiled.function_for([X[:5].shape, G[:5].shape])      # the master's 5 of 9 rows
    ops = [node.op for node in master.maker.fgraph.toposort()]
    assert ops.count(TransposedDot()) == 1 and "Dot" not in ops_of(master)
    assert ops.count(BlasDot(False, True)) == 1 and ops.count(BlasDot(False, False)) == 1


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-10), ("float32", 1e-4)])
def test_large_products_run_in_numpys_blas_and_agree(synk2, rng, dtype, rtol):
    """Every form of a product large enough for the host BLAS, against plain PyTensor."""
    x, g, w = (pt.matrix(n, dtype=dtype) for n in ("x", "g", "w"))
    outputs = [(x.T @ g, "sum"), (g @ w.T, "gather"), (x @ w, "gather"),
               ((w.T @ x.T).sum(axis=1), "sum")]
    f = synk.function([x, g], outputs, bcast_inputs=[w], name=f"large_{dtype}")
    X, G = rng.normal(size=(512, 256)).astype(dtype), rng.normal(size=(512, 256)).astype(dtype)
    W = rng.normal(size=(256, 256)).astype(dtype)
    # each of the two ranks has its share of the cores
    assert 2 * 256 * 256 * 256 >= HOST_BLAS_MIN_FLOPS and blas_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    out = f(X, G, W)
    for got, want in zip(out, reference(f, X, G, W)):
        assert got.dtype == dtype
        close(got, want, rtol=rtol, atol=rtol)
    # the master's compiled graph calls back into numpy for them (one callback per product)
    parts = jit_parts(f.compiled.function_for([X[:256].shape, G[:256].shape]))
    jit, cells = parts.jit, [c[0] for c in parts.cells]
    hlo = jit.lower(X[:256], G[:256], W, *cells[3:]).as_text()
    assert hlo.count("callback") >= 4


def test_numpys_blas_is_limited_when_numpy_is_reached_through_a_link(tmp_path):
    """A venv reached through a symbolic link: the loader names numpy's BLAS by its real path."""
    import numpy
    site = os.path.dirname(os.path.dirname(os.path.realpath(numpy.__file__)))
    os.symlink(site, tmp_path / "linked-site")
    done = run_script("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import numpy
        from synkhronos.platform.cpu_blas import blas_threads, limit_blas_threads
        assert numpy.__file__.startswith(sys.argv[1]), numpy.__file__
        print(limit_blas_threads(1), blas_threads())
    """, args=[str(tmp_path / "linked-site")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1"]


@pytest.mark.parametrize("rows,k,n", [(64, 32, 48), (64, 48, 2), (30, 7, 5)])
def test_both_layouts_and_untiled_shapes_agree_with_numpy(rows, k, n, rng):
    """(64, 48, 2): the skinny right operand is the one transposed; (30, 7, 5): no tile fits."""
    a, b = pt.matrix("a", dtype="float32"), pt.matrix("b", dtype="float32")
    f = pytensor.function([a, b], transposed_dot(a, b), mode="JAX")
    A, B = rng.normal(size=(rows, k)).astype("float32"), rng.normal(size=(rows, n)).astype("float32")
    got = f(A, B)
    assert got.dtype == np.float32 and got.shape == (k, n)
    close(got, A.T.astype("float64") @ B, rtol=1e-5, atol=1e-5)
    X = rng.normal(size=(64, 96)).astype("float32")
    np.testing.assert_array_equal(np.asarray(jax.jit(tiled_transpose)(X)), X.T)


def test_mlp_gradient_gets_one_rewrite_per_weight_gradient():
    x, y = pt.matrix("x"), pt.matrix("y")
    w1, w2 = pytensor.shared(np.ones((3, 4)), name="w1"), pytensor.shared(np.ones((4, 2)), name="w2")
    loss = ((pt.tanh(x @ w1) @ w2 - y) ** 2).sum()
    grads = pt.grad(loss, [w1, w2])
    cpu = pytensor.function([x, y], grads, mode=compile_mode("cpu"))
    plain = pytensor.function([x, y], grads, mode=compile_mode("gpu"))   # what a GPU compiles
    assert ops_of(cpu).count("TransposedDot") == 2
    assert "TransposedDot" not in ops_of(plain) and "BlasDot" not in ops_of(plain)
    X, Y = np.arange(15.).reshape(5, 3) / 10, np.ones((5, 2))
    for a, b in zip(cpu(X, Y), plain(X, Y)):
        close(a, b)


def test_transposed_dot_python_implementation_and_gradient(rng):
    a, b = pt.matrix("a"), pt.matrix("b")
    out = transposed_dot(a, b)
    f = pytensor.function([a, b], [out] + pt.grad((out ** 2).sum(), [a, b]), mode="FAST_COMPILE")
    A, B = rng.normal(size=(6, 3)), rng.normal(size=(6, 4))
    value, ga, gb = f(A, B)
    close(value, A.T @ B)
    close(ga, 2 * B @ (A.T @ B).T)
    close(gb, 2 * A @ (A.T @ B))
    with pytest.raises(TypeError, match="matrices"):
        TransposedDot()(pt.vector("v"), b)


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, True)])
def test_blas_dot_python_implementation_and_gradient(rng, ta, tb):
    a, b = pt.matrix("a"), pt.matrix("b")
    out = BlasDot(ta, tb)(a, b)
    f = pytensor.function([a, b], [out] + pt.grad((out ** 2).sum(), [a, b]), mode="FAST_COMPILE")
    A = rng.normal(size=(3, 6) if ta else (6, 3))
    B = rng.normal(size=(4, 3) if tb else (3, 4))
    opa, opb = (A.T if ta else A), (B.T if tb else B)
    value, ga, gb = f(A, B)
    close(value, opa @ opb)
    grad_a, grad_b = 2 * (opa @ opb) @ opb.T, 2 * opa.T @ (opa @ opb)
    close(ga, grad_a.T if ta else grad_a)
    close(gb, grad_b.T if tb else grad_b)


@pytest.mark.slow
def test_a_float32_run_prints_no_float64_truncation_warning(tmp_path):
    """PyTensor accumulates float32 sums in float64; without JAX's 64-bit mode the compiled graph
    reduces in float32 instead of asking JAX for float64 (which it truncates, warning)."""
    out = run_script("""
        import warnings
        warnings.simplefilter("always")
        import numpy as np, pytensor
        pytensor.config.floatX = "float32"
        import pytensor.tensor as pt
        import synkhronos as synk
        from synkhronos.extensions import train, updates
        synk.fork(2)
        x, y = pt.matrix("x"), pt.vector("y")
        w = pytensor.shared(np.zeros(3, "float32"), name="w")
        step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.adam,
                                         learning_rate=0.1)
        X, Y = np.ones((20, 3), "float32"), np.ones(20, "float32")
        print("loss", step(X, Y))
        train.run(step, X, Y, 10, steps=2)
        synk.close()
    """)
    assert "loss" in out.stdout, out.stderr
    assert "float64" not in out.stderr, out.stderr
