"""An average of what a call left on every device from its rows can weigh each device by its rows:
the contract's loop (gradient function, ``all_reduce(grad_shared, "avg")``, update) does by itself,
and the tutorials' gradient stores with ``by_rows=True``; both step as one process does on batches
that split unevenly. A plain mean of values of unequal rows says so once. On 1, 2 and 3 devices."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import test_programs

import synkhronos as synk
from synkhronos.extensions import updates

pytestmark = pytest.mark.timeout(300)

#: the fixtures of every device count (one fork per count)
device_count, devices = test_programs.device_count, test_programs.devices

#: rows of every step: uneven over 2 and 3 devices (7: 3/4 and 2/2/3)
BATCHES = [np.arange(0, 7), np.arange(7, 17), np.arange(17, 22), np.arange(30, 43)]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(50, 3)), rng.normal(size=50)


def _regression(name):
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(3), name=name)
    return x, y, w, ((x @ w - y) ** 2).mean()


def _gradient_at_zero():
    """Plain PyTensor's gradient of the regression's loss at w = 0 (a variable of its own: on a GPU,
    or with SYNK_HOST_FACES=0, synkhronos's variables hold JAX arrays that only a JAX-mode
    function reads)."""
    x, y, w, loss = _regression("w_reference")
    return pytensor.function([x, y], pytensor.grad(loss, w))


def _one_process(X, Y, batches, lr=0.1):
    """Plain PyTensor SGD on the same rows: the parameters after each step."""
    x, y, w, loss = _regression("w_alone")
    step = pytensor.function([x, y], [], updates=[(w, w - lr * pytensor.grad(loss, w))])
    for idx in batches:
        step(X[idx], Y[idx])
    return w.get_value()


def test_the_contracts_loop_steps_as_one_process_on_uneven_batches(devices):
    X, Y = _data()
    x, y, w, loss = _regression("w_contract")
    grad_updates, param_updates, grad_shared = updates.sgd(loss, [w], learning_rate=0.1)
    f_grad = synk.function([x, y], (loss, "avg"), updates=grad_updates)
    f_upd = synk.function([], updates=param_updates)
    synk.distribute()
    x_dat, y_dat = synk.data(X), synk.data(Y)
    for idx in BATCHES:
        f_grad(x_dat, y_dat, batch=idx)
        synk.all_reduce(grad_shared, op="avg")
        f_upd()
    want = _one_process(X, Y, BATCHES)
    for rank in range(devices.n_parallel):
        np.testing.assert_allclose(synk.get_value(rank, w), want, rtol=1e-12, atol=1e-15)


def test_a_gradient_a_call_stores_per_device_averages_over_the_calls_rows(devices):
    """The Theano tutorials' ``zipped_grads`` (``lstm.py``): each device stores its gradient
    (``local_updates=True``); averaged ``by_rows=True``, it is the gradient of all the call's rows."""
    X, Y = _data(1)
    x, y, w, loss = _regression("w_stored")
    g = pytensor.shared(np.zeros(3), name="g_stored")
    f = synk.function([x, y], (loss, "avg"), updates=[(g, pytensor.grad(loss, w))], local_updates=True)
    synk.distribute()
    whole = _gradient_at_zero()
    for idx in BATCHES:
        f(X[idx], Y[idx])
        per_device = [synk.get_value(r, g) for r in range(devices.n_parallel)]
        np.testing.assert_allclose(synk.reduce(g, op="avg", in_place=False, by_rows=True),
                                   whole(X[idx], Y[idx]), rtol=1e-12, atol=1e-15)
        for rank, value in enumerate(per_device):           # (a reduction that returns keeps them)
            np.testing.assert_array_equal(synk.get_value(rank, g), value)
        synk.all_reduce(g, op="avg", by_rows=True)
        for rank in range(devices.n_parallel):
            np.testing.assert_allclose(synk.get_value(rank, g), whole(X[idx], Y[idx]), rtol=1e-12, atol=1e-15)


def test_the_tutorials_givens_rows_weigh_as_scattered_rows(devices):
    """``givens={x: x_sh[i * b:(i + 1) * b]}`` with a minibatch index: the same weighting."""
    X, Y = _data(2)
    x_sh, y_sh = pytensor.shared(X, name="x_givens"), pytensor.shared(Y, name="y_givens")
    x, y, w, loss = _regression("w_givens")
    g = pytensor.shared(np.zeros(3), name="g_givens")
    i = pt.lscalar("i")
    f = synk.function([i], (loss, "avg"), updates=[(g, pytensor.grad(loss, w))], local_updates=True,
                      givens={x: x_sh[i * 7:(i + 1) * 7], y: y_sh[i * 7:(i + 1) * 7]})
    synk.distribute()
    whole = _gradient_at_zero()
    for index in range(3):
        f(index)
        synk.all_reduce(g, op="avg", by_rows=True)
        rows = slice(index * 7, (index + 1) * 7)
        np.testing.assert_allclose(g.get_value(), whole(X[rows], Y[rows]), rtol=1e-12, atol=1e-15)


def test_values_set_since_the_call_average_alike(devices):
    """Once something else wrote the variable (a value per device, a broadcast), its average is
    the plain mean over the devices again."""
    n = devices.n_parallel
    X, Y = _data(3)
    x, y, w, loss = _regression("w_set")
    g = pytensor.shared(np.zeros(3), name="g_set")
    f = synk.function([x, y], [], updates=[(g, pytensor.grad(loss, w))], local_updates=True)
    synk.distribute()
    f(X[:7], Y[:7])
    for rank in range(n):
        synk.set_value(rank, g, np.full(3, float(rank)))
    synk.all_reduce(g, op="avg")
    np.testing.assert_allclose(g.get_value(), np.full(3, (n - 1) / 2), rtol=1e-15)
    f(X[:7], Y[:7])
    synk.broadcast(g, np.ones(3))
    synk.all_reduce(g, op="avg")
    np.testing.assert_array_equal(g.get_value(), np.ones(3))
    f(X[:7], Y[:7])
    per_device = [synk.get_value(r, g) for r in range(n)]
    synk.all_reduce(g, op="sum")                    # only an average weighs
    np.testing.assert_allclose(g.get_value(), np.sum(per_device, axis=0), rtol=1e-12)


def test_a_plain_mean_of_values_of_unequal_rows_says_so_once_and_stays_plain(devices):
    """Without ``by_rows`` a variable of the script's own averages plainly: a sum over rows (or a
    sum of several calls) is no mean over rows. ``by_rows=False`` says nothing."""
    n = devices.n_parallel
    X, Y = _data(4)
    x, y, w, _ = _regression("w_summed")
    summed = ((x @ w - y) ** 2).sum()
    g = pytensor.shared(np.zeros(3), name="g_summed")
    f = synk.function([x, y], [], updates=[(g, pytensor.grad(summed, w))], local_updates=True)
    synk.distribute()
    for _ in range(2):
        f(X[:7], Y[:7])
        per_device = [synk.get_value(r, g) for r in range(n)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mean = synk.reduce(g, op="avg", in_place=False)
        np.testing.assert_allclose(mean, np.mean(per_device, axis=0), rtol=1e-12)
        said = [str(c.message) for c in caught if issubclass(c.category, synk.SynkWarning)]
        if n > 1 and _ == 0:
            assert len(said) == 1 and "by_rows=True" in said[0] and "g_summed" in said[0], said
            assert caught[0].filename == __file__           # it points at the script's line
        else:
            assert not said, said
    f(X[:7], Y[:7])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synk.all_reduce(g, op="avg", by_rows=False)
    with pytest.raises(TypeError, match="by_rows must be None, True or False"):
        synk.all_reduce(g, op="avg", by_rows="rows")


def test_a_sum_over_calls_and_a_refused_average_are_never_weighed_or_said_for_nothing(devices):
    """An update that reads its own variable (a gradient summed over calls) holds more than one
    call's rows: no row weights, even for a gradient vector. A plain mean said under an error
    filter did not happen: it is said again next time; so after an average refused for another
    reason (an integer variable beside it)."""
    n = devices.n_parallel
    X, Y = _data(5)
    x, y, w, loss = _regression("w_summed_calls")
    grad_updates, _, grad_shared = updates.sgd(loss, [w], learning_rate=0.1)
    (_, flat), = grad_updates
    acc = synk.function([x, y], [], updates=[(grad_shared, grad_shared + flat)])
    g = pytensor.shared(np.zeros(3), name="g_refused")
    counts = pytensor.shared(np.zeros(3, "int64"), name="counts_refused")
    store = synk.function([x, y], [], updates=[(g, pytensor.grad(loss, w))], local_updates=True)
    synk.function([], updates=[(counts, counts + 1)])
    synk.distribute()
    acc(X[:7], Y[:7])
    acc(X[7:17], Y[7:17])
    per_device = [synk.get_value(r, grad_shared) for r in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(synk.reduce(grad_shared, op="avg", in_place=False),
                                   np.mean(per_device, axis=0), rtol=1e-12)
    if n == 1:
        return
    store(X[:7], Y[:7])
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(synk.SynkWarning, match="reduce.op='avg'. of g_refused"):
                synk.reduce(g, op="avg", in_place=False)
    with pytest.raises(TypeError):
        synk.all_reduce([g, counts], op="avg")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        synk.all_reduce(g, op="avg")
    assert [str(c.message)[:25] for c in caught] == ["all_reduce(op='avg') of g"], caught
