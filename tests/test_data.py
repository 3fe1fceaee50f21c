"""Data: shared-memory arrays and every member of their interface."""

import numpy as np
import pytensor.tensor as pt
import pytest
from helpers import close

import synkhronos as synk

pytestmark = pytest.mark.timeout(120)


def test_dtype_and_ndim_sources(synk2):
    assert synk.data(np.zeros((3, 2), "float32")).dtype == np.float32
    d = synk.data(var=pt.ivector("i"), shape=(4,))
    assert (d.dtype, d.ndim, d.shape) == (np.int32, 1, (4,))
    assert np.all(d.data == 0)
    d = synk.data(dtype="int16", shape=(2, 5))
    assert (d.ndim, d.size, len(d)) == (2, 10, 2)
    with pytest.raises(TypeError, match="dtype"):
        synk.data()
    with pytest.raises(TypeError, match="dtype"):
        synk.data(dtype="float32")


def test_indexing_and_views(synk2):
    d = synk.data(np.arange(12.0).reshape(4, 3), name="grid")
    close(d[1], [3.0, 4.0, 5.0])
    d[2, :] = -1
    close(d.data[2], -1.0)
    assert d.name == "grid" and d.minibatch is False
    assert "grid" in repr(d)


def test_set_value_casting_rules(synk2):
    d = synk.data(np.zeros(3, "float64"))
    d.set_value(np.arange(3, dtype="int32"))        # safe up-cast
    close(d.data, [0, 1, 2])
    f = synk.data(np.zeros(3, "float32"))
    with pytest.raises(TypeError, match="force_cast"):
        f.set_value(np.ones(3, "float64"))
    f.set_value(np.full(3, 1.5, "float64"), force_cast=True)
    close(f.data, 1.5)
    with pytest.raises(TypeError, match="ndim"):
        f.set_value(np.ones((3, 1), "float32"))
    with pytest.raises(ValueError, match="oversize"):
        f.set_value(np.ones(3, "float32"), oversize=3)
    assert np.asarray(f.condition_data(np.ones(2, "float16"))).dtype == np.float32


def test_reallocation_writes_only_the_new_value(synk2):
    d = synk.data(np.ones((4, 2)))
    gen = d.gen
    d.set_value(np.full((2, 2), 3.0))                # fits: same segment, reshaped view
    assert d.gen == gen and d.shape == (2, 2) and d.alloc_size == 8
    d.set_value(np.full((10, 2), 5.0), oversize=1.5)  # grows: new segment of 30 items
    assert d.gen == gen + 1 and d.alloc_size >= 30
    close(d.data, 5.0)


def test_set_length_and_set_shape(synk2):
    d = synk.data(np.arange(6.0).reshape(3, 2))
    d.set_length(5)
    close(d.data[:3], np.arange(6.0).reshape(3, 2))
    close(d.data[3:], 0.0)
    d.set_length(2)
    close(d.data, [[0, 1], [2, 3]])
    d.set_shape((4, 4))
    assert d.shape == (4, 4) and np.all(d.data == 0)
    with pytest.raises(ValueError, match="ndim"):
        d.set_shape((16,))


def test_workers_see_data_changes(synk2, rng):
    x = pt.matrix("x")
    f = synk.function([x], (x.sum(0), "sum"))
    d = synk.data(rng.normal(size=(6, 2)))
    close(f(d), d.data.sum(0))
    d[:] = 1.0                                       # in-place write
    close(f(d), [6.0, 6.0])
    d.set_value(rng.normal(size=(50, 2)))            # reallocation, announced to workers
    close(f(d), d.data.sum(0))
    d.set_length(10)
    close(f(d), d.data.sum(0))


def test_free_memory(synk2):
    x = pt.vector("x")
    f = synk.function([x], (x.sum(), "sum"))
    d = synk.data(np.ones(8))
    close(f(d), 8.0)
    name = d.segment_name()
    d.free_memory()
    assert d.shape is None and d.data is None
    import os
    assert name not in os.listdir("/dev/shm")
    with pytest.raises(TypeError, match="no value"):
        f(d)
    d.set_value(np.full(4, 2.0))                     # usable again after free
    close(f(d), 8.0)
    d.free_memory()
    d.set_length(3)                                  # a vector's shape is its length
    close(f(d), 0.0)
    rows = synk.data(np.ones((50, 3)))
    rows.free_memory()
    with pytest.raises(ValueError, match=r"set_length\(\) keeps the shape past the rows.*holds no value"):
        rows.set_length(5)                           # (5, 0) once, silently
    rows.set_shape((5, 3))
    assert rows.shape == (5, 3)


def test_build_inputs(synk2, rng):
    x, b = pt.matrix("x"), pt.vector("b")
    f = synk.function([x], (x @ b, "gather"), bcast_inputs=[b])
    X, B = rng.normal(size=(5, 3)), rng.normal(size=3)
    xd, bd = f.build_inputs(X, B)
    close(f(xd, bd), X @ B)
    xd, bd = f.build_inputs(X[2:], B, minibatch=True)
    assert xd.minibatch and not bd.minibatch
    close(f(xd, bd, batch=[2, 4]), X[[2, 4]] @ B)


@pytest.mark.parametrize("cols", [3, 300])
def test_shuffled_rows_gathered_by_every_device_in_batch_order(synk2, rng, cols):
    """1200 shuffled indices (with repeats): 600 per device, in blocks when rows are 1200 bytes."""
    x = pt.matrix("x", dtype="float32")
    f = synk.function([x], [(x, "gather"), (x.sum(), "sum")], name=f"gather_{cols}")
    X = rng.normal(size=(5000, cols)).astype("float32")
    idx = rng.integers(0, 5000, size=1200)
    rows, total = f(synk.data(X), batch=idx)
    np.testing.assert_array_equal(rows, X[idx])
    close(total, X[idx].sum(dtype="float64"), rtol=1e-5)


def test_gather_rows_matches_fancy_indexing(rng):
    from synkhronos.rank.rows import GATHER_BLOCK, gather_rows
    for table in (rng.normal(size=(3000, 400)), rng.normal(size=(3000, 20, 20)),
                  rng.normal(size=(3000, 800))[:, ::2], rng.normal(size=3000)):
        idx = rng.integers(0, 3000, size=2 * GATHER_BLOCK + 7)
        out = gather_rows(table, idx, np.empty((len(idx),) + table.shape[1:]))
        np.testing.assert_array_equal(out, table[idx])
