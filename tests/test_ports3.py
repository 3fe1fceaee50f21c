"""Programs written elsewhere, third round: the idioms of DeepLearningTutorials, Theano-MPI,
Platoon and PyMC as their authors wrote them. Every result is compared with single-process
PyTensor on the same data."""

import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import DEVICE_COUNTS, close, forked

import synkhronos as synk
from synkhronos.runtime import session

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=DEVICE_COUNTS, ids=lambda n: f"{n}dev")
def device_count(request):
    """Module-scoped so that pytest runs every test of one device count together (one fork)."""
    return request.param


@pytest.fixture
def devices(device_count):
    yield forked(device_count)


# ------------------------------------------------------------------------------------------------
# A flat parameter vector, sliced and reshaped (DeepLearningTutorials' logistic_cg.py)
# ------------------------------------------------------------------------------------------------

def flat_theta_model(X, Y, batch_size):
    """logistic_cg.py's model: W and b are slices of one flat shared ``theta``, rows come by givens."""
    n_in, n_out = X.shape[1], 3
    theta = pytensor.shared(np.zeros(n_in * n_out + n_out), name="theta")
    W = theta[0:n_in * n_out].reshape((n_in, n_out))
    b = theta[n_in * n_out:n_in * n_out + n_out]
    data_x = pytensor.shared(X, name="data_x")
    data_y = pt.cast(pytensor.shared(Y.astype(float), name="data_y"), "int32")
    offset, x, y = pt.lscalar("offset"), pt.matrix("x"), pt.ivector("y")
    p_y = pt.special.softmax(x @ W + b, axis=-1)
    cost = -pt.mean(pt.log(p_y)[pt.arange(y.shape[0]), y])
    givens = {x: data_x[offset:offset + batch_size], y: data_y[offset:offset + batch_size]}
    return theta, offset, cost, pt.grad(cost, theta), givens


@pytest.mark.slow
def test_a_slice_of_a_flat_parameter_vector_reshaped_trains_as_in_one_process(devices, rng):
    """The gradient of ``theta[0:k].reshape(...)`` reshapes by ``min(k, len(theta))``: JAX traces
    that only if the length of ``theta`` is a constant in the graph."""
    X, Y = rng.normal(size=(60, 4)), rng.integers(0, 3, size=60)
    theta, offset, cost, grad, givens = flat_theta_model(X, Y, 20)
    ours = synk.function([offset], [cost, grad], givens=givens)
    theirs = pytensor.function([offset], [cost, grad], givens=givens)
    value = rng.normal(size=theta.get_value().shape)
    for step in range(3):
        theta.set_value(value)
        for o in (0, 20, 40):
            for a, b in zip(ours(o), theirs(o)):
                close(a, b, rtol=1e-10)
        value = value - 0.5 * theirs(0)[1]


def test_an_update_function_without_inputs_on_a_flat_vector_runs(synk2, rng):
    """No argument brings rows, and the graph still needs the parameter's length as a constant."""
    theta = pytensor.shared(rng.normal(size=7), name="theta_alone")
    square = (theta[0:6].reshape((2, 3)) ** 2).sum()
    step = synk.function([], square, updates=[(theta, theta - 0.25 * pt.grad(square, theta))])
    reference = theta.get_value().copy()
    for _ in range(3):
        expected = (reference[:6] ** 2).sum()
        close(step(), expected)
        reference[:6] -= 0.25 * 2 * reference[:6]
    close(theta.get_value(), reference)
    # a new length is a new graph, not a stale constant
    longer = rng.normal(size=9)
    theta.set_value(longer)
    close(step(), (longer[:6] ** 2).sum())
    close(theta.get_value()[6:], longer[6:])


# ------------------------------------------------------------------------------------------------
# A broadcast sequence a scan runs over (Platoon's LSTM, one sentence per call)
# ------------------------------------------------------------------------------------------------

def masked_recurrence():
    """Platoon's LSTM example in small: a masked recurrence over time-major ``x``, its length
    ``x.shape[0]`` given as ``n_steps``, its state allocated from ``x.shape[1]``."""
    x, mask, y = pt.tensor3("x_seq"), pt.matrix("mask"), pt.ivector("y_seq")
    U = pytensor.shared(np.eye(3) * 0.5, name="U_rec")

    def step(m, x_t, h):
        return m[:, None] * pt.tanh(h @ U + x_t) + (1 - m)[:, None] * h
    h = pytensor.scan(step, sequences=[mask, x], outputs_info=[pt.alloc(np.float64(0), x.shape[1], 3)],
                      n_steps=x.shape[0], return_updates=False)
    proj = (h * mask[:, :, None]).sum(axis=0) / mask.sum(axis=0)[:, None]
    cost = -pt.log(pt.special.softmax(proj, axis=-1)[pt.arange(y.shape[0]), y]).mean()
    return x, mask, y, U, cost


@pytest.mark.slow
def test_a_broadcast_sequence_of_any_length_runs_a_scan_as_in_one_process(devices, rng):
    """The gradient of a scan over a broadcast input allocates by its length: each length is a graph."""
    x, mask, y, U, cost = masked_recurrence()
    ours = synk.function([], [cost, pt.grad(cost, U)], bcast_inputs=[x, mask, y])
    theirs = pytensor.function([x, mask, y], [cost, pt.grad(cost, U)])
    for length in (5, 7, 5):
        X, M = rng.normal(size=(length, 4, 3)), (rng.random((length, 4)) < 0.8).astype(float)
        M[0] = 1
        Y = rng.integers(0, 3, size=4).astype("int32")
        for a, b in zip(ours(X, M, Y), theirs(X, M, Y)):
            close(a, b, rtol=1e-10)


# ------------------------------------------------------------------------------------------------
# Each cause of a shape JAX cannot compile gets its own fix
# ------------------------------------------------------------------------------------------------

def test_a_givens_selection_along_another_axis_is_refused_when_built(synk2, rng):
    """Theano-MPI's crop through givens: ``data[:, :, :, i:i + k]`` cannot be split, nor compiled."""
    data = pytensor.shared(rng.normal(size=(6, 2, 4, 8)), name="images")
    i, x = pt.lscalar("i"), pt.tensor4("x")
    with pytest.raises(TypeError, match=r"along axis 3 of a shared variable.*axis first.*synk\.data"):
        synk.function([i], x.sum(), givens={x: data[:, :, :, i:i + 4]})
    f = synk.function([i], (x.sum(), "sum"), givens={x: data[i:i + 3]})    # the runtime goes on
    close(f(2), data.get_value()[2:5].sum())


def test_a_crop_at_computed_offsets_is_named_with_a_constant_length_range(synk2, rng):
    x, i, j = pt.tensor4("x"), pt.lscalar("i"), pt.lscalar("j")
    X = rng.normal(size=(6, 2, 8, 8))
    f = synk.function([x, i, j], (x[:, :, i:i + 4, j:j + 4] ** 2).sum())
    with pytest.raises(synk.WorkerError) as raised:
        f(X, 1, 2)
    assert "the slice Subtensor{:, :, start:stop, start:stop} of x has bounds computed from values" \
        in raised.value.hint and "pt.arange" in raised.value.hint
    rows, cols = i + pt.arange(4), j + pt.arange(4)
    g = synk.function([x, i, j], ((x[:, :, rows[:, None], cols[None, :]] ** 2).sum(), "sum"))
    close(g(X, 1, 2), (X[:, :, 1:5, 2:6] ** 2).sum())


def test_a_shape_computed_from_a_value_is_not_blamed_on_the_inputs_axes(synk2, rng):
    x, n = pt.matrix("x"), pt.lscalar("n")
    f = synk.function([x, n], pt.arange(n).sum() + x.sum())
    with pytest.raises(synk.WorkerError) as raised:
        f(rng.normal(size=(4, 3)), 3)
    assert "computed from a value" in raised.value.hint and "declare" not in raised.value.hint


# ------------------------------------------------------------------------------------------------
# Small things a port meets
# ------------------------------------------------------------------------------------------------

def test_an_integer_output_under_avg_names_every_mode_that_fits(synk2):
    x = pt.matrix("x")
    with pytest.raises(TypeError, match=r"'gather'.*predictions.*None.*'sum'.*cast"):
        synk.function([x], pt.argmax(x, axis=1))
    predict = synk.function([x], (pt.argmax(x, axis=1), "gather"))
    X = np.eye(5)[[1, 3, 0, 4, 2]]
    np.testing.assert_array_equal(predict(X), [1, 3, 0, 4, 2])


def test_a_model_holding_functions_deep_copies_with_handles_on_the_same_functions(synk2, rng):
    import copy
    x = pt.matrix("x")
    W = pytensor.shared(rng.normal(size=(3, 2)), name="W_copy")
    model = {"W": W, "predict": synk.function([x], (x @ W, "gather"))}
    twin = copy.deepcopy(model)
    X = rng.normal(size=(5, 3))
    assert twin["predict"] is not model["predict"]
    close(twin["predict"](X), X @ W.get_value())
    close(model["predict"](X), X @ W.get_value())


@pytest.mark.slow
def test_fork_prints_nothing_when_jax_was_imported_first(tmp_path):
    """XLA's log level cannot reach a process that loaded JAX already: the service's notice that its
    tasks are recoverable is taken off the process's own stderr."""
    import subprocess
    import sys
    script = tmp_path / "quiet.py"
    script.write_text("import jax, pytensor\nimport synkhronos as synk\nsynk.fork(2)\nsynk.close()\n"
                      "print('done')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n" and done.stderr == "", done.stderr


@pytest.mark.slow
def test_a_float32_program_prints_no_truncation_notice_and_a_float64_cast_is_said_once(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "f32.py"
    script.write_text(
        "import warnings, numpy as np, pytensor, pytensor.tensor as pt\n"
        "pytensor.config.floatX = 'float32'\n"
        "import synkhronos as synk\n"
        "synk.fork(2)\n"
        "x, y = pt.matrix('x'), pt.ivector('y')\n"
        "W = pytensor.shared(np.zeros((5, 3), 'float32'), name='W')\n"
        "cost = -pt.mean(pt.log(pt.special.softmax(x @ W, axis=-1))[pt.arange(y.shape[0]), y])\n"
        "f = synk.function([x, y], cost, updates=[(W, W - 0.1 * pt.grad(cost, W))], local_updates=True)\n"
        "X, Y = np.ones((8, 5), 'float32'), np.arange(8, dtype='int32') % 3\n"
        "print(round(float(f(X, Y)), 4))\n"
        "g = synk.function([x], (x.astype('float64').sum(), 'sum'))\n"
        "h = synk.function([x], (x.astype('float64').mean(), 'avg'))\n"
        "print(g(X), h(X))\n"
        "synk.close()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1.0986", "40.0 1.0"], done.stdout
    said = [line for line in done.stderr.splitlines() if "Warning" in line]
    assert len(said) == 1 and "Cast{float64} of x computes in float32" in said[0], done.stderr
    assert "truncated" not in done.stderr


def test_local_updates_name_an_unnamed_parameter_by_its_place_and_shape(synk2):
    x = pt.matrix("x")
    kernel = pytensor.shared(np.zeros((3, 2)))
    with pytest.warns(synk.LocalUpdatesWarning, match=r"the unnamed 2-d shared variable of shape "
                                                      r"\(3, 2\) \(update 1\)"):
        synk.function([x], [], updates=[(kernel, kernel + x[:3, :2])])


# ------------------------------------------------------------------------------------------------
# Parameter groups: Theano-MPI's momentum, 2x the rate for biases and weight decay on weights only
# ------------------------------------------------------------------------------------------------

def theano_mpi_momentum(loss, params, lr, mu, lr_scales, decays):
    """Theano-MPI's own update, written as it is: ``v <- mu v - lr * lr_m * (g + eta p); p <- p + v``."""
    updates = []
    for p, lr_m, eta in zip(params, lr_scales, decays):
        v = pytensor.shared(np.zeros_like(p.get_value()), name=f"vel_{p.name}")
        g = pytensor.grad(loss, p)
        v_next = mu * v - lr * lr_m * (g + eta * p)
        updates += [(v, v_next), (p, p + v_next)]
    return updates


@pytest.mark.slow
def test_parameter_groups_train_as_theano_mpis_momentum_with_biases_at_twice_the_rate(devices, rng):
    from synkhronos.extensions import train, updates
    X, Y = rng.normal(size=(40, 5)), rng.integers(0, 3, size=40).astype("int32")
    start = [rng.normal(size=(5, 4)) * 0.5, rng.normal(size=4) * 0.1, rng.normal(size=(4, 3)) * 0.5,
             rng.normal(size=3) * 0.1]

    def model(tag):
        W1, b1, W2, b2 = (pytensor.shared(v.copy(), name=f"{n}_{tag}")
                          for n, v in zip(["W1", "b1", "W2", "b2"], start))
        x, y = pt.matrix("x"), pt.ivector("y")
        p = pt.special.softmax(pt.tanh(x @ W1 + b1) @ W2 + b2, axis=-1)
        return x, y, -pt.mean(pt.log(p)[pt.arange(y.shape[0]), y]), [W1, b1, W2, b2]

    x, y, loss, (W1, b1, W2, b2) = model("synk")
    groups = [{"params": [W1, W2], "weight_decay": 5e-3}, {"params": [b1, b2], "lr_scale": 2.0}]
    step = train.make_train_function(loss, groups, x, y, updates.momentum, learning_rate=0.1, momentum=0.9)
    rx, ry, rloss, rparams = model("ref")
    reference = pytensor.function([rx, ry], rloss, updates=theano_mpi_momentum(
        rloss, rparams, 0.1, 0.9, [1.0, 2.0, 1.0, 2.0], [5e-3, 0.0, 5e-3, 0.0]))
    x_dat, y_dat = synk.data(X), synk.data(Y)
    for batch in np.split(np.arange(40), 4) * 2:
        close(step(x_dat, y_dat, batch=batch), reference(X[batch], Y[batch]), rtol=1e-9)
    for ours, theirs in zip([W1, b1, W2, b2], rparams):
        close(ours.get_value(), theirs.get_value(), rtol=1e-9, atol=1e-12)
    # the same groups in the device loop
    for p, v in zip([W1, b1, W2, b2], start):
        p.set_value(v.copy())
    for p, v in zip(rparams, start):
        p.set_value(v.copy())
    for s in step.optimizer_state:
        s.set_value(np.zeros_like(s.get_value()))
    reference2 = pytensor.function([rx, ry], rloss, updates=theano_mpi_momentum(
        rloss, rparams, 0.1, 0.9, [1.0, 2.0, 1.0, 2.0], [5e-3, 0.0, 5e-3, 0.0]))
    train.run(step, x_dat, y_dat, batch_size=10, epochs=1, shuffle=False)
    for i in range(4):
        reference2(X[i * 10:(i + 1) * 10], Y[i * 10:(i + 1) * 10])
    for ours, theirs in zip([W1, b1, W2, b2], rparams):
        close(ours.get_value(), theirs.get_value(), rtol=1e-9, atol=1e-12)


def test_a_parameter_group_with_a_torch_lr_is_refused_naming_lr_scale(synk2):
    from synkhronos.extensions import train, updates
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.zeros(3), name="w_group")
    loss = ((x @ w - y) ** 2).mean()
    with pytest.raises(TypeError, match="lr_scale"):
        train.make_train_function(loss, [{"params": [w], "lr": 0.2}], x, y, updates.sgd, 0.1)
    with pytest.raises(TypeError, match="listed twice"):
        train.make_train_function(loss, [w, {"params": [w], "weight_decay": 0.1}], x, y, updates.sgd, 0.1)


# ------------------------------------------------------------------------------------------------
# Waits spin only while spinning costs nobody
# ------------------------------------------------------------------------------------------------

def test_a_wait_preempted_while_spinning_stops_spinning_for_a_while():
    """Busy processes on the waiting thread's own core: its spin is preempted, and the process's
    waits then block without spinning (the busy processes get the core)."""
    import ctypes
    import subprocess
    import sys
    import threading
    import time

    from synkhronos.ipc import semaphores
    cell = ctypes.create_string_buffer(semaphores.SEMAPHORE_BYTES)
    sem = semaphores.Semaphore(ctypes.addressof(cell))
    sem.init()
    core = sorted(os.sched_getaffinity(0))[0]
    busy = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                              "while True: pass"]) for _ in range(2)]
    saved = os.sched_getaffinity(0)
    try:
        time.sleep(0.3)                                    # the busy processes are running on it
        os.sched_setaffinity(0, {core})
        poster = threading.Timer(0.5, sem.post)
        poster.start()
        semaphores._spin_from[0], semaphores._back_off_s[0] = 0.0, semaphores.BACK_OFF_S[0]
        start = time.perf_counter()
        sem.wait(lambda: None, spin=0.4)                   # spins into the busy processes' slices
        poster.join()
        # preempted within the spin: waits block for the shortest back-off from then, the next one longer
        shortest = semaphores.BACK_OFF_S[0]
        assert start + shortest < semaphores._spin_from[0] < start + 0.4 + shortest
        assert semaphores._back_off_s[0] == 2 * shortest
        os.sched_setaffinity(0, saved)
        for b in busy:
            b.kill()
            b.wait()
        time.sleep(2 * shortest)
        sem.post()
        sem.wait(lambda: None, spin=0.4)                   # acquired spinning: the back-off starts over
        assert semaphores._back_off_s[0] == shortest
    finally:
        os.sched_setaffinity(0, saved)
        for b in busy:
            b.kill()
            b.wait()
        semaphores._spin_from[0] = 0.0


@pytest.mark.slow
def test_a_worker_that_aborts_in_native_code_is_named_with_where_it_was():
    """A C++ abort (NUTS's std::bad_cast once) ends a worker by SIGABRT: the error names the Python
    frame that called into native code, and carries every thread's stack."""
    from helpers import AbortOnHost
    if session.active() is not None:
        synk.close()
    synk.fork(2)
    try:
        x = pt.vector("x")
        f = synk.function([x], (AbortOnHost()(x).sum(), "sum"))
        with pytest.raises(synk.WorkerError) as raised:
            f(np.ones(4))
        error = raised.value
        assert error.exc_type == "killed by SIGABRT" and error.how == "died"
        assert "in native code called from" in str(error) and "_abort" in str(error)
        assert "Current thread" in error.worker_traceback
    finally:
        synk.close()


@pytest.mark.slow
def test_fork_works_without_a_stderr(tmp_path):
    """A daemon's stderr: None in Python, or file descriptor 2 closed."""
    import subprocess
    import sys
    for prelude in ("import sys\nsys.stderr = None\n", "import os\nos.close(2)\n"):
        script = tmp_path / "no_stderr.py"
        script.write_text(prelude + "import numpy as np, pytensor.tensor as pt\nimport synkhronos as synk\n"
                          "synk.fork(2)\nx = pt.vector('x')\n"
                          "print(float(synk.function([x], (x.sum(), 'sum'))(np.ones(6))))\nsynk.close()\n")
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == "6.0\n", (prelude, done.stdout, done.stderr)


def test_an_integer_index_beside_a_computed_range_is_not_blamed():
    from synkhronos.api.function_parts.hints import _slice_at_computed_bounds
    from synkhronos.wire.spec import FunctionSpec
    x, k, n = pt.matrix("x"), pt.lscalar("k"), pt.lscalar("n")
    out = x[:, k].sum() + pt.arange(n).sum()
    spec = FunctionSpec(0, "f", [x], [k, n], [(out, "avg")], [], [], [])
    assert _slice_at_computed_bounds(spec) is None
    crop = FunctionSpec(0, "g", [x], [k], [(x[:, k:k + 3].sum(), "avg")], [], [], [])
    assert _slice_at_computed_bounds(crop) == "Subtensor{:, start:stop} of x"


def test_a_group_may_name_one_parameter_alone():
    from synkhronos.extensions.updates import parameter_groups
    W = pytensor.shared(np.zeros(2), name="W_alone")
    params, scale, decay = parameter_groups([{"params": W, "lr_scale": 2.0}])
    assert params == [W] and scale == {W: 2.0} and decay == {}


@pytest.mark.slow
def test_a_float64_parameter_under_float32_is_said_once(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "wide.py"
    script.write_text(
        "import numpy as np, pytensor, pytensor.tensor as pt\npytensor.config.floatX = 'float32'\n"
        "import synkhronos as synk\nsynk.fork(2)\nx = pt.matrix('x')\n"
        "W = pytensor.shared(np.full((3, 1), 1 + 1e-12), name='W')\n"
        "f = synk.function([x], ((x @ W).sum(), 'sum'))\ng = synk.function([x], ((x @ W).mean(), 'avg'))\n"
        "print(float(f(np.ones((4, 3), 'float32'))))\nsynk.close()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "Warning" in line]
    assert len(said) == 1 and "W is float64, and on the devices it computes and is kept in float32" in said[0]


@pytest.mark.slow
def test_a_training_step_takes_wider_data_with_allow_input_downcast_as_pytensor_function_does(devices, rng):
    """The tutorials' ``theano.function(..., allow_input_downcast=True)``: int64 labels into an
    ivector and float64 rows into a float32 model, narrowed; without it the step names the
    option (it once went to the update rule, which raised a TypeError naming rmsprop)."""
    from synkhronos.extensions import train, updates
    x, y = pt.fmatrix("x_downcast"), pt.ivector("y_downcast")
    X, Y = rng.normal(size=(30, 4)), rng.integers(0, 3, size=30)        # float64, int64

    def model(seed):
        w = pytensor.shared(np.random.default_rng(seed).normal(size=(4, 3)).astype("float32"),
                            name=f"w_downcast{seed}")
        loss = -pt.log(pt.special.softmax(x @ w, axis=-1)[pt.arange(y.shape[0]), y]).mean()
        return loss, w
    loss, w = model(1)
    with pytest.raises(TypeError, match="allow_input_downcast=True"):
        train.make_train_function(loss, [w], x, y, updates.rmsprop, learning_rate=0.01)(X, Y)
    step = train.make_train_function(loss, [w], x, y, updates.rmsprop, learning_rate=0.01,
                                     allow_input_downcast=True)
    loss_alone, v = model(1)
    alone = train.make_single_process_train_function(loss_alone, [v], x, y, updates.rmsprop,
                                                     learning_rate=0.01, allow_input_downcast=True)
    for _ in range(3):
        close(step(X, Y), alone(X, Y), rtol=1e-5)
    close(w.get_value(), v.get_value(), rtol=1e-5)
    assert w.get_value().dtype == np.float32
