"""Declared (static) shapes: a declared batch is the whole call's, and nothing may contradict a declaration."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import close, reference

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def declared(synk2):
    """A loss over a batch declared as 7 rows (split 3 + 4), with an update and a gathered output."""
    x = pt.tensor("x", shape=(7, 3), dtype="float64")
    w = pytensor.shared(np.zeros(3), name="w_declared")
    loss = ((x - w) ** 2).sum(axis=1).mean()
    rows = pt.cast(x.shape[0], "float64")
    f = synk.function([x], [(loss, "avg"), (rows, "sum"), (x * 2, "gather")],
                      updates=[(w, w + x.mean(0))], name="declared")
    synk.distribute()
    return f, w


@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_a_declared_batch_is_the_calls_whole_batch(declared, rng, num_slices):
    f, w = declared
    X = rng.normal(size=(7, 3))
    want = reference(f, X)
    w0 = w.get_value()
    got = f(X, num_slices=num_slices)
    for g, r in zip(got, want):
        close(g, r)
    assert float(got[1]) == 7.0                                     # x.shape[0] is each device's own
    for rank in (0, 1):                                             # the update saw each device's rows
        share = X[:3] if rank == 0 else X[3:]
        close(synk.get_value(rank, w), w0 + share.mean(0))


def test_a_declared_batch_from_indices_into_larger_data(declared, rng):
    f, _ = declared
    X = rng.normal(size=(20, 3))
    idx = rng.permutation(20)[:7]
    want = reference(f, X[idx])
    got = f(synk.data(X), batch=idx)
    for g, r in zip(got, want):
        close(g, r)


def test_a_batch_other_than_the_declared_one_is_refused(declared, rng):
    f, _ = declared
    with pytest.raises(TypeError, match=r"declared with shape \(7, 3\).*7 rows.*has 6.*None"):
        f(rng.normal(size=(6, 3)))
    with pytest.raises(TypeError, match="has 5"):
        f(synk.data(rng.normal(size=(20, 3))), batch=5)
    close(f(np.ones((7, 3)))[1], 7.0)                               # still usable


def test_declared_non_row_axes_are_checked(synk2, rng):
    x = pt.tensor("x", shape=(None, 1), dtype="float64")
    b = pt.tensor("b", shape=(3,), dtype="float64")
    f = synk.function([x], (x.sum() + b.sum(), "sum"), bcast_inputs=[b])
    with pytest.raises(TypeError, match=r"'x' is declared with shape \(None, 1\).*\(4, 3\)"):
        f(np.ones((4, 3)), np.ones(3))
    with pytest.raises(TypeError, match=r"'x' is declared with shape \(None, 1\)"):
        f(synk.data(np.ones((4, 3))), np.ones(3))
    with pytest.raises(TypeError, match=r"'b' is declared with shape \(3,\).*\(4,\)"):
        f(np.ones((4, 1)), np.ones(4))
    close(f(np.ones((4, 1)), np.ones(3)), 4.0 + 2 * 3.0)           # each device adds b.sum()


def test_collectives_respect_a_declared_shape(synk2, rng):
    fixed = pytensor.shared(np.zeros((4, 3)), shape=(4, 3), name="fixed_shape")
    x = pt.matrix("x")
    synk.function([x], (x.sum() + fixed.sum(), "sum"))
    with pytest.raises(ValueError, match=r"scatter would give .* shape \(2, 3\).*\(4, 3\).*None"):
        synk.scatter(fixed, rng.normal(size=(4, 3)))
    with pytest.raises(ValueError, match=r"all_gather would give .* shape \(8, 3\)"):
        synk.all_gather(fixed)
    with pytest.raises(ValueError, match=r"set_value\(1, ...\) would give"):
        synk.set_value(1, fixed, np.zeros((2, 3)))
    synk.broadcast(fixed, np.ones((4, 3)))                           # what fits still works
    close(synk.get_value(1, fixed), np.ones((4, 3)))


def test_a_cnn_with_a_declared_batch(synk2, rng):
    """pytensor-ml's convolution under JAX needs static shapes; each device gets its own batch size."""
    from pytensor_ml.layers import Conv2D
    x = pt.tensor("images", shape=(6, 5, 5, 1), dtype="float64")     # channels last
    conv = Conv2D("conv", in_channels=1, out_channels=2, kernel_size=3)
    out = conv(x)
    params = [v for v in pytensor.graph.graph_inputs([out])
              if isinstance(v, pytensor.compile.SharedVariable)]
    for p in params:
        p.set_value(rng.normal(size=p.get_value().shape))
    f = synk.function([x], [((out ** 2).mean(), "avg"), (out, "gather")])
    X = rng.normal(size=(6, 5, 5, 1))
    for got, want in zip(f(X, num_slices=2), reference(f, X)):
        close(got, want)
