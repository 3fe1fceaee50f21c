"""Graphs of any depth reach the workers; a graph that cannot travel fails alone, at once."""

import threading

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close, reference
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos.extensions import updates

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_a_thousand_chained_operations_ship_and_compute_exactly(synk2, rng):
    x = pt.matrix("x")
    h = x
    for _ in range(350):                  # 1050 nodes in one chain
        h = pt.tanh(h * 1.01 + 0.1)
    f = synk.function([x], [(h.sum(), "sum"), (h, "gather")])
    X = rng.normal(size=(7, 3))
    for got, want in zip(f(X), reference(f, X)):
        close(got, want)


@pytest.mark.slow
def test_an_80_layer_mlp_with_its_gradient_trains_exactly(synk2, rng):
    x = pt.matrix("x")
    params, h = [], x
    for i in range(80):
        w = pytensor.shared(rng.normal(size=(6, 6)) / np.sqrt(6), name=f"deep_w{i}")
        b = pytensor.shared(np.zeros(6), name=f"deep_b{i}")
        params += [w, b]
        h = pt.tanh(h @ w + b)
    loss = (h ** 2).mean()
    grad_updates, param_updates, grad_shared = updates.sgd(loss, params, learning_rate=0.1)
    f_grad = synk.function([x], (loss, "avg"), updates=grad_updates)
    f_step = synk.function([], updates=param_updates)
    synk.distribute()
    X = rng.normal(size=(10, 6))          # even: all_reduce "avg" weights the ranks equally
    start = [p.get_value() for p in params]
    want_loss = float(pytensor.function([x], loss, mode="JAX")(X))
    grads = pytensor.function([x], pytensor.grad(loss, params), mode="JAX")(X)
    close(f_grad(X), want_loss)
    synk.all_reduce(grad_shared, op="avg")
    f_step()
    # the step as one vector, to a tolerance relative to its largest entry: the first layers'
    # gradients have vanished to ~1e-8 through 80 tanh layers, where summing 5 + 5 rows instead
    # of 10 moves the last digits
    want = np.concatenate([-0.1 * g.ravel() for g in grads])
    scale = np.abs(want).max()
    for rank in (0, 1):
        got = np.concatenate([(synk.get_value(rank, p) - p0).ravel() for p, p0 in zip(params, start)])
        close(got, want, rtol=0, atol=1e-7 * scale)


class HoldsALock(Op):
    """An op that cannot be pickled (it holds a lock)."""

    __props__ = ()

    def __init__(self):
        self.lock = threading.Lock()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = inputs[0]


def test_a_function_that_cannot_be_pickled_fails_alone_and_stays_unregistered(synk2):
    x = pt.matrix("x")
    good = synk.function([x], (x.sum(), "sum"))
    close(good(np.ones((4, 2))), 8.0)
    n_functions = len(synk2.registry.specs)
    with pytest.raises(TypeError, match="cannot be sent to the workers.*lock"):
        synk.function([x], (HoldsALock()(x).sum(), "sum"), name="locked")
    assert len(synk2.registry.specs) == n_functions
    close(good(np.ones((4, 2))), 8.0)                       # shipped ones keep working
    later = synk.function([x], (x.max(), "max"))            # and new ones ship
    synk.distribute()
    close(later(np.arange(8.0).reshape(4, 2)), 7.0)


@pytest.mark.slow
def test_graphs_of_many_thousand_nodes_pickle_without_recursing_along_them():
    """No processes: 1500 chained steps and their gradient (~15k nodes) through the workers' pickling."""
    import sys

    from synkhronos.compile import shipping
    x = pt.vector("x")
    w = pytensor.shared(np.ones(3), name="w_pickled")
    h = x
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 100_000))       # PyTensor's own grad recurses along the graph
    try:
        for _ in range(1500):
            h = pt.tanh(h * w + 0.1)
        g = pytensor.grad(h.sum(), w)
    finally:
        sys.setrecursionlimit(limit)
    blob = shipping.dumps([h, g], [h, g], lambda obj: 0 if obj is w else None)
    h2, g2 = shipping.loads(blob, {0: w})
    x2 = next(v for v in pytensor.graph.graph_inputs([h2]) if v.name == "x")
    assert len(list(pytensor.graph.traversal.toposort([h2, g2]))) > 10_000
    assert w in set(pytensor.graph.graph_inputs([g2]))          # the shared variable by reference
    assert x2 is not x
