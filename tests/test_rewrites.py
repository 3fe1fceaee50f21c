"""The CPU rewrite that copies a transposed left operand of a matrix product (synkhronos.rewrites)."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import close, reference
from synkhronos.rewrites import Materialize, compile_mode, materialize

pytestmark = pytest.mark.timeout(300)


def materialized_dots(fn):
    """For each Dot of a compiled PyTensor function: is its left operand a Materialize?"""
    return [node.inputs[0].owner is not None and isinstance(node.inputs[0].owner.op, Materialize)
            for node in fn.maker.fgraph.toposort() if type(node.op).__name__ == "Dot"]


def test_weight_gradient_products_are_materialized_and_exact(synk2, rng):
    x, g, w = pt.matrix("x"), pt.matrix("g"), pt.matrix("w")
    f = synk.function([x, g], [(x.T @ g, "sum"), (g @ w.T, "gather"), (x @ w, "gather")],
                      bcast_inputs=[w], name="three_products")
    X, G, W = rng.normal(size=(9, 4)), rng.normal(size=(9, 5)), rng.normal(size=(4, 5))
    out = f(X, G, W)
    for got, want in zip(out, reference(f, X, G, W)):
        close(got, want)
    # only x.T @ g has a transposed left operand; the master compiled for its CPU device
    assert sorted(materialized_dots(f.compiled._with_updates)) == [False, False, True]


def test_mlp_gradient_gets_one_copy_per_weight_gradient():
    x, y = pt.matrix("x"), pt.matrix("y")
    w1, w2 = pytensor.shared(np.ones((3, 4)), name="w1"), pytensor.shared(np.ones((4, 2)), name="w2")
    loss = ((pt.tanh(x @ w1) @ w2 - y) ** 2).sum()
    grads = pt.grad(loss, [w1, w2])
    cpu = pytensor.function([x, y], grads, mode=compile_mode("cpu"))
    plain = pytensor.function([x, y], grads, mode=compile_mode("gpu"))   # what a GPU compiles
    assert sum(materialized_dots(cpu)) == 2
    assert sum(materialized_dots(plain)) == 0
    X, Y = np.arange(15.).reshape(5, 3) / 10, np.ones((5, 2))
    for a, b in zip(cpu(X, Y), plain(X, Y)):
        close(a, b)


def test_materialize_is_an_identity_with_identity_gradient():
    x = pt.matrix("x")
    f = pytensor.function([x], [materialize(x.T), pt.grad((materialize(x) * 3).sum(), x)],
                          mode="FAST_COMPILE")
    X = np.arange(6.).reshape(2, 3)
    t, grad = f(X)
    assert t.flags.c_contiguous
    close(t, X.T)
    close(grad, np.full_like(X, 3))
