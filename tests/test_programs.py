"""Programs written elsewhere: pytensor-ml models with batch norm, plain PyTensor beside
synkhronos, the Theano tutorials' idioms. Every result is compared with the single-process
run (pytensor-ml's ``optim.compile_train`` or ``pytensor.function``) on the same data."""

import importlib.util
import pickle
import traceback
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import DEVICE_COUNTS, close, forked
from pytensor_ml import optim
from pytensor_ml.activations import ReLU
from pytensor_ml.layers import BatchNorm, Linear, Sequential
from pytensor_ml.loss import CrossEntropy, supervised_loss
from pytensor_ml.params import StepCounter
from pytensor_ml.pytensorf import (
    collect_non_trainable_params,
    collect_non_trainable_updates,
    collect_trainable_params,
)

import synkhronos as synk
from synkhronos.extensions import sync, train, updates

pytestmark = pytest.mark.timeout(300)

#: rows of every step: uneven over 2 and 3 devices
BATCHES = [13, 8, 11, 13]


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def device_count(request):
    """Module-scoped so that pytest runs every test of one device count together (one fork)."""
    return request.param


@pytest.fixture
def devices(device_count):
    yield forked(device_count)


def bn_model(seed, momentum=0.1):
    """A pytensor-ml MLP with batch norm; returns (x, y, loss, params, statistics, initial values)."""
    x = pt.matrix("x")
    net = Sequential(Linear(f"fc_{seed}", n_in=6, n_out=8), BatchNorm(f"bn_{seed}", n_in=8, momentum=momentum),
                     ReLU(), Linear(f"out_{seed}", n_in=8, n_out=3))
    loss, y = supervised_loss(net(x), CrossEntropy(expect_logits=True))
    params, stats = collect_trainable_params(loss), collect_non_trainable_params(loss)
    rng = np.random.default_rng(seed)
    for p in params:
        p.set_value(rng.normal(scale=0.5, size=p.get_value().shape))
    for s in stats:       # statistics that are not the layer's defaults: their old value matters
        s.set_value(np.abs(rng.normal(size=s.get_value().shape)) + 0.5)
    initial = [np.array(v.get_value()) for v in params + stats]
    return x, y, loss, params, stats, initial


def digits(rng, n):
    # shifted features: the devices' batch means differ, so the variance's between-device part matters
    return rng.normal(size=(n, 6)) * 2 + 3, rng.integers(0, 3, size=n)


def reference_run(seed, batches, rule=lambda: optim.sgd(0.1)):
    """pytensor-ml's own training step in one process over ``batches``: parameters and statistics."""
    x, y, loss, params, stats, _ = bn_model(seed)
    step = optim.compile_train(loss, rule(), inputs=[x, y], compile_kwargs=dict(mode="JAX"))
    for bx, by in batches:
        step(bx, by)
    return [np.array(v.get_value()) for v in params + stats]


@pytest.mark.slow
def test_batch_norm_statistics_equal_pytensor_mls_step_over_the_global_batch(devices, rng):
    """After every step every device holds pytensor-ml's statistics for the whole global batch
    (its step from the same values). The forward pass normalizes each device's rows by their own
    statistics, as under DDP without SyncBatchNorm, so the parameters equal the single-process
    run's only on one device."""
    x, y, loss, params, stats, _ = bn_model(11)
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.1)
    synk.distribute()
    twin_x, twin_y, twin_loss, twin_params, twin_stats, _ = bn_model(11)
    statistics_step = optim.compile_train(twin_loss, optim.sgd(0.0), inputs=[twin_x, twin_y],
                                          compile_kwargs=dict(mode="JAX"))
    batches = [digits(rng, n) for n in BATCHES]
    for bx, by in batches:
        for twin, ours in zip(twin_params + twin_stats, params + stats):
            twin.set_value(np.array(ours.get_value()))
        step(bx, by)
        statistics_step(bx, by)
        for rank in range(devices.n_parallel):
            for s, expected in zip(stats, twin_stats):
                close(synk.get_value(rank, s), expected.get_value(), rtol=1e-9, atol=1e-11)
    if devices.n_parallel == 1:
        theirs = reference_run(11, batches, lambda: optim.sgd(0.1, momentum=0.9))
        for a, b in zip([np.array(v.get_value()) for v in params + stats], theirs):
            close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_the_variance_is_that_of_the_whole_batch_not_the_mean_of_the_devices(rng):
    """With the devices' batch means far apart, averaging the devices' variances would miss the
    spread between them; the carried second moment does not."""
    forked(2)
    x, y, loss, params, stats, _ = bn_model(12, momentum=1.0)     # the statistics = the batch's own
    normalized = collect_non_trainable_updates(loss)[stats[0]].owner.inputs[0]
    features = pytensor.function([x], normalized, mode="JAX")     # what batch norm normalizes
    step = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.0)
    synk.distribute()
    bx, by = digits(rng, 10)
    bx[5:] += 10.0                                 # the second device's rows sit far away
    step(bx, by)
    h = np.asarray(features(bx))
    mean, var = (next(s for s in stats if word in s.name) for word in ("mean", "var"))
    close(mean.get_value(), h.mean(0), rtol=1e-9)
    close(var.get_value(), h.var(0), rtol=1e-9)
    within = (h[:5].var(0) + h[5:].var(0)) / 2
    # averaging the devices' variances would give ``within``: short of the batch's, here by far
    assert np.all(var.get_value() >= within) and np.max(var.get_value() / within) > 5


def schedule():
    return optim.sgd(optim.cosine_schedule(0.1, 10))          # the rate reads a training clock


@pytest.mark.slow
def test_clocks_advance_once_per_step_and_schedules_move(devices, rng):
    if devices.n_parallel != 1:
        pytest.skip("one device: the whole run is pytensor-ml's (batch norm's forward pass too)")
    x, y, loss, params, stats, _ = bn_model(13)
    step = train.make_train_function(loss, params, x, y, lambda cost, ps: updates.from_optim(schedule(), cost, ps))
    synk.distribute()
    batches = [digits(rng, n) for n in BATCHES]
    for bx, by in batches:
        step(bx, by)
    ours = [np.array(v.get_value()) for v in params + stats]
    for a, b in zip(ours, reference_run(13, batches, schedule)):
        close(a, b, rtol=1e-9, atol=1e-11)
    clocks = [s for s in step.optimizer_state if isinstance(s, StepCounter)]
    assert clocks and all(int(c.get_value()) == len(BATCHES) for c in clocks)


def test_a_rule_that_leaves_a_parameter_unwritten_is_refused(synk2):
    x, y, loss, params, _, _ = bn_model(14)
    with pytest.raises(ValueError, match="No update reaches"):
        updates.from_optim(lambda grads, ps: {ps[0]: ps[0] - grads[0]}, loss, params)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [sync.AllReduce(), sync.Average(every=2), sync.EASGD(0.5, every=2),
                                  sync.EASGD(0.5, every=2, asynchronous=True), sync.Downpour(every=2),
                                  sync.RateLimited(every_n_batches=2, max_rate=1.0)], ids=repr)
def test_every_rule_leaves_every_device_the_same_moved_statistics(synk2, rng, rule):
    x, y, loss, params, stats, initial = bn_model(15)
    step = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.05)
    synk.distribute()
    bx, by = digits(rng, 60)
    train.run(step, bx, by, 12, steps=10, sync=rule)
    for s, start in zip(stats, initial[len(params):]):
        final = [synk.get_value(rank, s) for rank in range(synk2.n_parallel)]
        close(final[1], final[0], rtol=0, atol=0)
        assert np.abs(final[0] - start).max() > 1e-3, s.name


@pytest.mark.slow
def test_allreduce_loop_equals_the_master_driven_steps_statistics_included(synk2, rng):
    bx, by = digits(rng, 50)
    x, y, loss, params, stats, _ = bn_model(16)
    looped = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.1)
    x2, y2, loss2, params2, stats2, _ = bn_model(16)
    driven = train.make_train_function(loss2, params2, x2, y2, updates.sgd, learning_rate=0.1)
    synk.distribute()
    train.run(looped, bx, by, 13, steps=8, seed=3)
    per_epoch = train.steps_per_epoch(50, 13)
    for i in range(8):
        epoch, j = divmod(i, per_epoch)
        rows = train.epoch_order(50, epoch, 3)[j * 13:(j + 1) * 13]
        driven(bx, by, batch=rows)
    for ours, theirs in zip(params + stats, params2 + stats2):
        close(ours.get_value(), theirs.get_value(), rtol=1e-12, atol=1e-13)


@pytest.mark.slow
def test_synk_function_threads_write_backs_and_clocks_as_pytensor_ml_does(devices):
    """A literal port (the rule's updates in one synk.function) on one device is pytensor-ml's step."""
    if devices.n_parallel != 1:
        pytest.skip("one device: a literal port is pytensor-ml's step only there")
    x, y, loss, params, stats, _ = bn_model(17)
    f = synk.function([x, y], loss, updates=optim.sgd(0.1)(loss, params), local_updates=True)
    synk.distribute()
    rng = np.random.default_rng(0)
    batches = [digits(rng, n) for n in BATCHES]
    for bx, by in batches:
        f(bx, by)
    for a, b in zip([np.array(v.get_value()) for v in params + stats], reference_run(17, batches)):
        close(a, b, rtol=1e-9, atol=1e-11)
    # a validation pass observes the statistics and leaves them alone
    before = [np.array(s.get_value()) for s in stats]
    synk.function([x, y], loss)(*batches[0])
    for s, b in zip(stats, before):
        close(s.get_value(), b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Plain PyTensor beside synkhronos
# ------------------------------------------------------------------------------------------------

def test_plain_pytensor_functions_work_on_the_shared_variables_in_any_mode(synk2, rng):
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(5), name="w_plain")
    loss = ((x @ w - y) ** 2).mean()
    compiled_before = pytensor.function([x], x @ w)                  # the default (numba) mode
    step = train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
    synk.distribute()
    X, Y = rng.normal(size=(40, 5)), rng.normal(size=40)
    step(X, Y)
    trained = np.array(w.get_value())
    for fn in (compiled_before, pytensor.function([x], x @ w),
               pytensor.function([x], x @ w, mode="FAST_COMPILE"), pytensor.function([x], x @ w, mode="JAX")):
        close(fn(X), X @ trained)
    copy = pickle.loads(pickle.dumps(w))
    close(pytensor.function([x], x @ copy)(X), X @ trained)
    # an edit in place of the borrowed value is the master's new value, for plain PyTensor and
    # for synkhronos; like any change made in the master's script, every device takes it
    held = w.get_value(borrow=True)
    held += 1.0
    close(compiled_before(X), X @ (trained + 1.0))
    check = synk.function([x], (x @ w, "gather"))
    close(check(X), X @ (trained + 1.0))
    # plain PyTensor updates in the master (in place, in the default mode), then synkhronos again
    pytensor.function([], [], updates=[(w, w * 2)])()
    close(check(X), X @ ((trained + 1.0) * 2))
    step(X, Y)
    close(compiled_before(X), X @ w.get_value())


def test_updates_from_each_devices_rows_warn_naming_the_data_parallel_step(synk2):
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(3), name="w_literal")
    loss = ((x @ w - y) ** 2).mean()
    sgd = [(w, w - 0.1 * pytensor.grad(loss, w))]
    with pytest.warns(synk.LocalUpdatesWarning, match="make_train_function") as caught:
        synk.function([x, y], loss, updates=sgd)
    assert len(caught) == 1 and caught[0].filename == __file__      # points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synk.function([x, y], loss, updates=sgd, local_updates=True)        # meant: no word
        synk.function([x, y], loss, updates=[(w, w * 0.5)])                  # not from the rows
        train.make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)   # the step
    assert issubclass(synk.LocalUpdatesWarning, synk.SynkWarning)


def autoencoder(seed):
    """The Theano tutorials' autoencoder (tied weights, sigmoid, cross-entropy reconstruction)."""
    rng = np.random.default_rng(seed)
    x = pt.matrix("x")
    W = pytensor.shared(rng.normal(scale=0.3, size=(6, 4)), name=f"W_ae{seed}")
    b = pytensor.shared(np.zeros(4), name=f"b_ae{seed}")
    b_prime = pytensor.shared(np.zeros(6), name=f"bp_ae{seed}")
    z = pt.sigmoid(pt.sigmoid(x @ W + b) @ W.T + b_prime)
    cost = -(x * pt.log(z) + (1 - x) * pt.log(1 - z)).sum(axis=1).mean()
    return x, cost, [W, b, b_prime]


@pytest.mark.slow
def test_an_unsupervised_model_trains_with_the_helper_and_the_loop(devices):
    X = np.random.default_rng(5).uniform(size=(39, 6))
    x, cost, params = autoencoder(1)
    step = train.make_train_function(cost, params, x, None, updates.sgd, learning_rate=0.5)
    x2, cost2, params2 = autoencoder(1)
    looped = train.make_train_function(cost2, params2, x2, None, updates.sgd, learning_rate=0.5)
    x3, cost3, params3 = autoencoder(1)
    single = train.make_single_process_train_function(cost3, params3, x3, None, updates.sgd,
                                                      learning_rate=0.5)
    synk.distribute()
    for i in range(5):
        rows = train.epoch_order(39, 0, i)[:13]
        losses = step(X, batch=rows), single(X[rows])
        close(*losses, rtol=1e-10)
    for ours, theirs in zip(params, params3):
        close(ours.get_value(), theirs.get_value(), rtol=1e-10, atol=1e-12)
    train.run(looped, X, None, 13, steps=5, shuffle=False)
    x4, cost4, params4 = autoencoder(1)
    single = train.make_single_process_train_function(cost4, params4, x4, None, updates.sgd,
                                                      learning_rate=0.5)
    for i in range(5):                            # in order: three steps an epoch
        single(X[(i % 3) * 13:(i % 3 + 1) * 13])
    for ours, theirs in zip(params2, params4):
        close(ours.get_value(), theirs.get_value(), rtol=1e-10, atol=1e-12)


def test_several_inputs_and_targets_train_as_in_one_process(synk2, rng):
    """A masked regression: inputs [x, mask], targets [y]."""
    def model():
        x, mask, y = pt.matrix("x"), pt.matrix("mask"), pt.vector("y")
        w = pytensor.shared(np.linspace(-1, 1, 5), name="w_masked")
        loss = ((((x * mask) @ w) - y) ** 2).mean()
        return [x, mask], [y], loss, [w]
    X, M, Y = rng.normal(size=(23, 5)), (rng.uniform(size=(23, 5)) > 0.3) * 1.0, rng.normal(size=23)
    xs, ys, loss, params = model()
    step = train.make_train_function(loss, params, xs, ys, updates.momentum, learning_rate=0.05)
    xs2, ys2, loss2, params2 = model()
    single = train.make_single_process_train_function(loss2, params2, xs2, ys2, updates.momentum,
                                                      learning_rate=0.05)
    synk.distribute()
    for i in range(4):
        rows = train.epoch_order(23, i, 0)[:11]
        close(step(X, M, Y, batch=rows), single(X[rows], M[rows], Y[rows]), rtol=1e-10)
    close(params[0].get_value(), params2[0].get_value(), rtol=1e-10)
    xs3, ys3, loss3, params3 = model()
    looped = train.make_train_function(loss3, params3, xs3, ys3, updates.momentum, learning_rate=0.05)
    with pytest.raises(TypeError, match="takes 3 data"):
        train.run(looped, X, Y, 12, steps=2)
    train.run(looped, [X, M], [Y], 12, steps=2, shuffle=False)


# ------------------------------------------------------------------------------------------------
# The Theano tutorials' givens idiom
# ------------------------------------------------------------------------------------------------

def tutorial_model(X, Y, batch_size):
    """The logistic regression of the Theano tutorials, fed through givens and an index."""
    train_set_x = pytensor.shared(X, name="train_set_x")
    shared_y = pytensor.shared(Y.astype(pytensor.config.floatX), name="shared_y")
    train_set_y = pt.cast(shared_y, "int32")
    index, x, y = pt.lscalar("index"), pt.matrix("x"), pt.ivector("y")
    W = pytensor.shared(np.zeros((X.shape[1], 3)), name="W_tut")
    b = pytensor.shared(np.zeros(3), name="b_tut")
    p_y = pt.special.softmax(x @ W + b, axis=1)
    cost = -pt.mean(pt.log(p_y)[pt.arange(y.shape[0]), y])
    errors = pt.mean(pt.neq(pt.argmax(p_y, axis=1), y))
    window = slice(index * batch_size, (index + 1) * batch_size)
    givens = {x: train_set_x[window], y: train_set_y[window]}
    return dict(index=index, x=x, y=y, W=W, b=b, cost=cost, errors=errors, givens=givens,
                train_set_x=train_set_x)


@pytest.mark.slow
def test_the_tutorials_givens_idiom_equals_pytensor_function(devices, rng):
    X, Y = rng.normal(size=(95, 5)), rng.integers(0, 3, size=95)
    m = tutorial_model(X, Y, 20)                      # the last batch has 15 rows
    m["W"].set_value(rng.normal(size=(5, 3)))
    errors = synk.function([m["index"]], [m["errors"], (m["cost"], "avg")], givens=m["givens"])
    reference = pytensor.function([m["index"]], [m["errors"], m["cost"]], givens=m["givens"])
    synk.distribute()
    for i in range(5):
        for ours, theirs in zip(errors(i), reference(i)):
            close(ours, theirs, rtol=1e-12)
        for ours, theirs in zip(errors.as_pytensor(i), reference(i)):
            close(ours, theirs, rtol=1e-12)
    # a new value of the shared data is what the next call reads
    m["train_set_x"].set_value(X[::-1].copy())
    for ours, theirs in zip(errors(1), reference(1)):
        close(ours, theirs, rtol=1e-12)


def test_the_tutorials_training_with_the_step_helper_equals_one_process(synk2, rng):
    X, Y = rng.normal(size=(100, 5)), rng.integers(0, 3, size=100)
    m = tutorial_model(X, Y, 20)
    step = train.make_train_function(m["cost"], [m["W"], m["b"]], m["x"], m["y"], updates.sgd,
                                     learning_rate=0.1, givens=m["givens"])
    r = tutorial_model(X, Y, 20)
    gW, gb = pytensor.grad(r["cost"], [r["W"], r["b"]])
    single = pytensor.function([r["index"]], r["cost"], givens=r["givens"],
                               updates=[(r["W"], r["W"] - 0.1 * gW), (r["b"], r["b"] - 0.1 * gb)])
    synk.distribute()
    for epoch in range(2):
        for i in range(5):
            close(step(i), single(i), rtol=1e-12)
    close(m["W"].get_value(), r["W"].get_value(), rtol=1e-10, atol=1e-13)
    for rank in range(2):
        close(synk.get_value(rank, m["b"]), r["b"].get_value(), rtol=1e-10, atol=1e-13)


def test_givens_that_cannot_be_split_are_refused_with_the_recipe(synk2, rng):
    X = rng.normal(size=(30, 4))
    data_sh = pytensor.shared(X, name="data_sh")
    i, x, rows = pt.lscalar("i"), pt.matrix("x"), pt.lvector("rows")
    for given in [{x: data_sh[i:i + 1][:, ::-1]},          # not a row slice
                  {x: data_sh[i * 2:i * 2 + 4:2]},         # a step
                  {x: data_sh[pt.arange(i, i + 3)]},       # indices computed from a scalar
                  {x: data_sh[i:i + 3].sum(0, keepdims=True)}]:    # rows picked, then summed
        with pytest.raises(TypeError, match="synk.data"):
            synk.function([i], x.sum(), givens=given)
    # indices that are a scattered input split like any input: each device takes its share
    by_rows = synk.function([rows], (x.sum(), "sum"), givens={x: data_sh[rows]})
    close(by_rows(np.array([3, 7, 1, 0, 9])), X[[3, 7, 1, 0, 9]].sum())
    with pytest.raises(TypeError, match="make those bcast_inputs"):
        synk.function([i, x], x.sum(), givens={pt.matrix("z"): data_sh[i:i + 2]})
    f = synk.function([i], (x.sum(), "sum"), givens={x: data_sh[i:i + 4]})
    close(f(3), X[3:7].sum())
    with pytest.raises(TypeError, match="batch= does not apply"):
        f(3, batch=2)
    with pytest.raises(ValueError, match="no rows"):
        f(40)
    with pytest.raises(ValueError, match="x is rows -1:3 of data_sh, which has 30"):
        f(-1)                 # named as the call's scalars give the bounds, not as numpy reads them
    j = pt.lscalar("j")
    y = pt.matrix("y")
    g = synk.function([i, j], (x.sum() + y.sum(), "sum"), givens={x: data_sh[i:i + 4], y: data_sh[j:j + 4]})
    with pytest.raises(ValueError, match="different rows"):
        g(0, 1)
    close(g(2, 2), 2 * X[2:6].sum())
    # bounds from a broadcast input, and the runtime is usable after every refusal
    k = pt.lscalar("k")
    h = synk.function([], (x.sum(), "sum"), bcast_inputs=[k], givens={x: data_sh[k:]})
    close(h(25), X[25:].sum())
    # bounds read from a shared variable: refused when built, naming it (JAX cannot compile them)
    offset = pytensor.shared(np.int64(2), name="offset")
    with pytest.raises(TypeError, match=r"shared variables \['offset'\]: pass them as scalar inputs"):
        synk.function([], (x.sum(), "sum"), givens={x: data_sh[offset:offset + 4]})
    # an index that is not a number is named as the input that selects the rows
    for wrong in (None, "1", np.array(["a"])):
        with pytest.raises(TypeError, match="input 'i' selects the rows of the givens' slices"):
            f(wrong)
    close(f(np.int16(3)), X[3:7].sum())


@pytest.mark.slow
def test_givens_read_every_refill_and_in_place_edit_of_the_shared_data(devices, rng):
    """The tutorials' chunked loading: one buffer refilled and given again with borrow=True."""
    buf = np.zeros((12, 3), "float32")
    X_sh = pytensor.shared(buf, name="X_chunk", borrow=True)
    i, x = pt.lscalar("i"), pt.fmatrix("x")
    given = {x: X_sh[i * 4:(i + 1) * 4]}
    outputs = [(x.sum(), "sum"), (x.mean(0), "avg"), (x * 2, "gather")]
    f = synk.function([i], outputs, givens=given)
    reference = pytensor.function([i], [o for o, _ in outputs], givens=given)
    synk.distribute()

    def agree(*indices):
        for j in indices:
            expected = reference(j)
            for ours in (f(j), f.as_pytensor(j)):
                for a, b in zip(ours, expected):
                    close(a, b, rtol=1e-5, atol=1e-5)

    for chunk in range(1, 4):                          # the same buffer, refilled
        buf[...] = 10.0 * chunk + rng.normal(size=buf.shape)
        X_sh.set_value(buf, borrow=True)
        assert float(f(1)[0]) == pytest.approx(float(reference(1)[0]), rel=1e-5), chunk
        agree(0, 1, 2)
    X_sh.get_value(borrow=True)[4:8] *= -3             # an edit of the borrowed value, in place
    agree(1)
    buf[8:] = 7.0                                      # an edit through the caller's own array
    agree(2, 1)
    X_sh.set_value(rng.normal(size=(7, 3)).astype("float32"))    # a new value with fewer rows
    agree(0, 1)


def no_rows_case(name, rng):
    """A function whose givens read a shared variable and a scalar but select no rows.

    Returns ``(inputs, bcast_inputs, givens, outputs, calls)``: ``calls`` are argument lists in
    the order ``inputs + bcast_inputs``.
    """
    X, T = rng.normal(size=(10, 3)), rng.normal(size=(5, 3))
    X_sh = pytensor.shared(X, name=f"X_{name}")
    base, table = pytensor.shared(T[0], name=f"base_{name}"), pytensor.shared(T, name=f"table_{name}")
    i, x, s, z = pt.lscalar("i"), pt.matrix("x"), pt.vector("s"), pt.matrix("z")
    window = X_sh[i * 3:(i + 1) * 3]
    alone = [(s.sum(), "avg"), (s * 2, "avg")]
    beside = [((x * s).sum(), "sum"), (x @ s, "gather"), ((x * s).mean(), "avg")]
    indices = [0, 1, 3]                                # 3: the last window has one row
    Z = rng.normal(size=(7, 3))
    return {
        "scaled-alone-scattered": ([i], [], {s: base * (i + 1)}, alone, [[j] for j in indices]),
        "scaled-alone-bcast": ([], [i], {s: base * (i + 1)}, alone, [[j] for j in indices]),
        "row-alone-scattered": ([i], [], {s: table[i]}, alone, [[j] for j in indices]),
        "row-alone-bcast": ([], [i], {s: table[i]}, alone, [[j] for j in indices]),
        "rows-difference-alone-bcast": ([], [i], {s: table[i + 1] - table[i]}, alone,
                                        [[j] for j in indices]),
        "scaled-beside-a-slice": ([i], [], {x: window, s: base * (i + 1)}, beside, [[j] for j in indices]),
        "row-beside-a-slice-bcast": ([], [i], {x: window, s: table[i]}, beside, [[j] for j in indices]),
        "row-of-the-sliced-data": ([i], [], {x: window, s: X_sh[i]}, beside, [[j] for j in indices]),
        "beside-scattered-rows": ([i, z], [], {s: table[i]}, [((z * s).sum(), "sum"), (z @ s, "gather")],
                                  [[j, Z[:5 + j]] for j in indices]),
    }[name]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["scaled-alone-scattered", "scaled-alone-bcast", "row-alone-scattered",
                                  "row-alone-bcast", "rows-difference-alone-bcast", "scaled-beside-a-slice",
                                  "row-beside-a-slice-bcast", "row-of-the-sliced-data",
                                  "beside-scattered-rows"])
def test_givens_that_select_no_rows_equal_pytensor_function(devices, rng, case):
    inputs, bcast_inputs, givens, outputs, calls = no_rows_case(case, rng)
    f = synk.function(inputs, outputs, bcast_inputs=bcast_inputs, givens=givens)
    user = inputs + bcast_inputs
    reference = pytensor.function(user, [o for o, _ in outputs], givens=givens)
    synk.distribute()
    for args in calls:
        expected = reference(*args)
        by_name = {v.name: a for v, a in zip(user, args)}
        for ours in (f(*args), f(**by_name), f.as_pytensor(*args)):
            for a, b in zip(ours, expected):
                close(a, b, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# Graphs that need concrete shapes; errors a porting user meets first
# ------------------------------------------------------------------------------------------------

def lasagne_mlp(seed, dropout):
    """Lasagne's MNIST MLP input: images as a 4-d tensor, flattened, (dropout,) a dense layer."""
    from pytensor_ml.layers import Dropout
    x4, y = pt.tensor4("x4"), pt.lvector("y")
    h = x4.flatten(2)
    if dropout:
        h = Dropout(p=0.2, random_state=seed)(h)
    out = Linear(f"dense_{seed}_{dropout}", n_in=16, n_out=3)(h)
    loss = -pt.mean(pt.log(pt.special.softmax(out, axis=1))[pt.arange(y.shape[0]), y])
    return x4, y, loss, collect_trainable_params(loss)


@pytest.mark.slow
def test_lasagnes_flattened_input_trains_compiled_per_row_count(synk2, rng):
    X, Y = rng.uniform(size=(21, 1, 4, 4)), rng.integers(0, 3, size=21)
    x4, y, loss, params = lasagne_mlp(1, dropout=False)
    f = synk.function([x4, y], [(loss, "avg")] + [(g, "avg") for g in pytensor.grad(loss, params)])
    for ours, theirs in zip(f(X, Y), f.as_pytensor(X, Y)):
        close(ours, theirs, rtol=1e-12)
    # the dropout mask drawn for the flattened shape needs it concrete: compiled per row count
    x4, y, loss, params = lasagne_mlp(2, dropout=True)
    step = train.make_train_function(loss, params, x4, y, updates.sgd, learning_rate=0.5)
    losses = [float(step(X, Y)) for _ in range(60)]
    # one step's loss moves with its dropout mask: compare means over several steps
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:3])
    assert np.isfinite(float(step(X[:15], Y[:15])))         # other rows: the free graph fails, and
    assert step.functions[0].compiled.by_rows               # each row count gets its own graph


def test_a_worker_error_is_one_short_report_with_the_graph_line_and_a_hint(synk2, monkeypatch):
    x = pt.matrix("x")
    lenet_style = synk.function([x], x.reshape((20, 1, 4, 4)).sum(), name="lenet_reshape")
    with pytest.raises(synk.WorkerError) as info:
        lenet_style(np.ones((20, 16)))
    report = str(info.value)
    assert report.count("cannot reshape") == 1 and len(report.splitlines()) <= 5, report
    assert report.startswith("ranks 0 and 1 raised TypeError")
    assert "in the graph: Reshape{4}(x, [20  1  4  4])" in report
    assert "each device gets 10 of the call's 20 rows: write -1 or x.shape[0]" in report
    assert "Traceback" in info.value.worker_traceback and info.value.ranks == [0, 1]
    # the user's line and the one frame that re-raised it: none of synkhronos's internals
    assert info.value.__cause__ is None and len(list(traceback.walk_tb(info.value.__traceback__))) == 2
    monkeypatch.setenv("SYNK_VERBOSE", "1")
    with pytest.raises(synk.WorkerError) as info:
        lenet_style(np.ones((20, 16)))
    assert "--- traceback in rank 0 ---" in str(info.value)
    monkeypatch.delenv("SYNK_VERBOSE")
    close(synk.function([x], (x.reshape((-1, 1, 4, 4)).sum(), "sum"))(np.ones((20, 16))), 320.0)


@pytest.mark.skipif(importlib.util.find_spec("numpyro") is not None,
                    reason="with numpyro installed, PyTensor's JAX backend draws binomials")
def test_an_op_without_a_jax_implementation_is_refused_when_the_function_is_built(synk2):
    x = pt.matrix("x")
    rng = pytensor.shared(np.random.default_rng(0), name="rng_binomial")
    mask = pt.random.binomial(n=1, p=0.7, size=x.shape, rng=rng)
    with pytest.raises(NotImplementedError, match="binomial.*rng.uniform"):
        synk.function([x], (x * mask).sum())
    close(synk.function([x], (x.sum(), "sum"))(np.ones((4, 2))), 8.0)
