"""Random numbers: new draws every call, a stream of its own per device, reproducible from the seed."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close
from pytensor.tensor.random.utils import RandomStream
from pytensor_ml.layers import Dropout

import synkhronos as synk
from synkhronos.compile.randomness import device_stream

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:RandomStream is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Setting default_update is deprecated"),
              pytest.mark.filterwarnings("ignore:RandomVariable Ops will stop hiding")]


def single_process_draws(generator, shapes):
    """What plain PyTensor (JAX mode) draws from ``generator``, one call per shape."""
    rng = pytensor.shared(generator)
    x = pt.matrix("x")
    nxt, draw = pt.random.normal(size=x.shape, rng=rng, return_next_rng=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        f = pytensor.function([x], draw, updates={rng: nxt}, mode="JAX")
    return [f(np.zeros(shape)) for shape in shapes]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["RandomStream", "shared generator"])
def test_each_device_draws_its_own_stream_and_every_call_draws_anew(synk2, api):
    x = pt.matrix("x")
    if api == "RandomStream":
        draw = RandomStream(seed=7).normal(size=x.shape)
        seed_generator = None           # the stream seeds its generators its own way
    else:
        _, draw = pt.random.normal(size=x.shape, rng=pytensor.shared(np.random.default_rng(7)),
                                   return_next_rng=True)
        seed_generator = np.random.default_rng(7)
    f = synk.function([x], (draw, "gather"))
    first, second = f(np.zeros((5, 2))), f(np.zeros((5, 2)))     # rows 2 + 3
    assert not np.allclose(first, second)                         # the generators advanced
    assert not np.allclose(first[:2], first[2:4])                 # the devices differ
    if seed_generator is not None:                                # exactly which numbers
        master = single_process_draws(device_stream(seed_generator, 0), [(2, 2), (2, 2)])
        worker = single_process_draws(device_stream(seed_generator, 1), [(3, 2), (3, 2)])
        close(first, np.concatenate([master[0], worker[0]]))
        close(second, np.concatenate([master[1], worker[1]]))


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["traces on free rows", "needs concrete shapes"])
def test_the_stream_goes_on_when_the_row_count_changes(synk2, graph):
    """A function runs a graph per row count (and one on free rows, one deferring its updates for
    slices), each with PyTensor's private copy of the generator: the draws still continue the one
    stream, exactly the numbers one process draws call after call."""
    x = pt.tensor("x", shape=(None, 2, 1))
    # a size computed from a flatten: JAX traces that only on concrete shapes
    size = x.flatten(2).shape if graph == "needs concrete shapes" else x.shape[:2]
    _, draw = pt.random.normal(size=size, rng=pytensor.shared(np.random.default_rng(5)),
                               return_next_rng=True)
    f = synk.function([x], (draw, "gather"))
    calls = [((8, 2), 1), ((12, 2), 1), ((8, 2), 2), ((8, 2), 1), ((6, 2), 1)]
    got = [f(np.zeros((*shape, 1)), num_slices=slices) for shape, slices in calls]
    assert f.compiled.by_rows is (graph == "needs concrete shapes")
    master_shapes = []                          # the master's share of each call, slice by slice
    for (rows, cols), slices in calls:
        share = rows // 2
        master_shapes += [(share // slices, cols)] * slices
    want = single_process_draws(np.random.default_rng(5), master_shapes)
    at = 0
    for ((rows, _), slices), result in zip(calls, got):
        close(np.asarray(result)[:rows // 2], np.concatenate(want[at:at + slices]))
        at += slices


def test_dropout_draws_a_new_mask_every_call_slice_and_device_reproducibly(synk2):
    def masks(seed):
        x = pt.matrix("x")
        f = synk.function([x], (Dropout(p=0.5, random_state=seed)(x), "gather"))
        return [f(np.ones((8, 16)), num_slices=n) for n in (1, 1, 2)]
    one, two, sliced = masks(3)
    for mask in (one, two, sliced):
        assert set(np.unique(mask)) == {0.0, 2.0}                 # kept values rescaled by 1/(1-p)
        assert not np.array_equal(mask[:4], mask[4:])             # master and worker differ
    assert not np.array_equal(one, two)                           # a new mask every call
    assert not np.array_equal(sliced[:2], sliced[2:4])            # and every slice
    again = masks(3)                                              # the same seed, the same masks
    for a, b in zip((one, two, sliced), again):
        np.testing.assert_array_equal(a, b)


def test_explicit_generator_updates_are_accepted(synk2):
    rng = pytensor.shared(np.random.default_rng(11), name="explicit_rng")
    x = pt.matrix("x")
    nxt, draw = pt.random.uniform(size=x.shape, rng=rng, return_next_rng=True)
    f = synk.function([x], (draw.sum(), "sum"), updates=[(rng, nxt)])
    assert f(np.zeros((4, 3))) != f(np.zeros((4, 3)))


def test_collectives_refuse_a_generator(synk2):
    rng = pytensor.shared(np.random.default_rng(1), name="refused_rng")
    x = pt.matrix("x")
    _, draw = pt.random.normal(size=x.shape, rng=rng, return_next_rng=True)
    synk.function([x], (draw.sum(), "sum"))
    with pytest.raises(TypeError, match="random generator"):
        synk.broadcast(rng)
    with pytest.raises(TypeError, match="random generator"):
        synk.get_value(1, "refused_rng")


def test_a_generator_nothing_advances_is_refused_as_pytensor_ml_refuses_it(synk2):
    """Two draws off one generator: no single next state, so every call would repeat its draws."""
    import pytensor
    import pytensor.tensor as pt
    x = pt.matrix("x")
    rng = pytensor.shared(np.random.default_rng(0), name="rng_twice")
    a = pt.random.normal(size=x.shape, rng=rng)
    b = pt.random.uniform(size=x.shape, rng=rng)
    with pytest.raises(ValueError, match="rng_twice.*nothing advances"):
        synk.function([x], ((x * a + b).sum(), "sum"))
    close(synk.function([x], (x.sum(), "sum"))(np.ones((4, 2))), 8.0)
