"""Distributed functions against the single-process PyTensor function (as_pytensor)."""

import time
import warnings

import jax
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from helpers import close, reference

import synkhronos as synk
from synkhronos.platform.device_arrays import device_face
from synkhronos.rank.jitted import jitted_call

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def model(synk2, rng):
    """Scattered x, broadcast b; every output mode."""
    x = pt.matrix("x")
    b = pt.vector("b")
    z = x @ b
    outputs = [(z.mean(), "avg"), (x.sum(0), "sum"), ((1 + 0.1 * x).prod(0), "prod"),
               (x.min(0), "min"), (x.max(0), "max"), (z, "gather"), (z.mean(), None)]
    f = synk.function([x], outputs, bcast_inputs=[b], name="modes")
    X = rng.normal(size=(7, 3))
    B = rng.normal(size=3)
    return f, X, B


def check_all_but_none(out, ref):
    for got, want in zip(out[:-1], ref[:-1]):
        close(got, want)


@pytest.mark.slow
def test_every_output_mode_on_an_uneven_split(model):
    f, X, B = model
    out = f(synk.data(X), synk.data(B))
    check_all_but_none(out, reference(f, X, B))
    # 7 rows on 2 devices: the master (rank 0) computed rows [0, 3).
    close(out[-1], reference(f, X[:3], B)[-1])
    # An equally weighted average of the two ranks' means would be wrong by far more than the tolerance.
    z = X @ B
    assert abs((z[:3].mean() + z[3:].mean()) / 2 - out[0]) > 1e-3


@pytest.mark.parametrize("batch", [5, slice(2, 7), [6, 0, 3, 3, 1], np.array([4, 1, 2, 6, 5, 0, 3])],
                         ids=["int", "slice", "list", "shuffled"])
def test_batch_forms(model, batch):
    f, X, B = model
    rows = np.arange(len(X))[slice(0, batch) if isinstance(batch, int) else batch]
    out = f(synk.data(X), synk.data(B), batch=batch)
    check_all_but_none(out, reference(f, X[rows], B))


def test_repeated_plans_read_the_current_indices_and_values(model, rng):
    """Workers reuse a decoded plan when the call looks the same; what it points to may not be."""
    f, X, B = model
    x_dat, b_dat = synk.data(X), synk.data(B)
    for _ in range(3):                    # same count of indices: the same plan each time
        idx = rng.permutation(len(X))[:5]
        check_all_but_none(f(x_dat, b_dat, batch=idx), reference(f, X[idx], B))
    X2 = rng.normal(size=X.shape)         # same shape: same segment, same plan, new values
    x_dat.set_value(X2)
    check_all_but_none(f(x_dat, b_dat), reference(f, X2, B))


def test_a_reused_plan_follows_the_data_it_was_made_for(model, rng):
    """The master reuses a validated plan for a repeated call; any change to the Data must show."""
    f, X, B = model
    x_dat, b_dat = synk.data(X), synk.data(B)
    check_all_but_none(f(x_dat, b_dat), reference(f, X, B))
    check_all_but_none(f(x_dat, b_dat, batch=4), reference(f, X[:4], B))
    bigger = rng.normal(size=(11, 3))                 # reallocated: a new segment generation
    x_dat.set_value(bigger, oversize=2)
    check_all_but_none(f(x_dat, b_dat), reference(f, bigger, B))
    check_all_but_none(f(x_dat, b_dat, batch=4), reference(f, bigger[:4], B))
    smaller = rng.normal(size=(5, 3))                 # same segment, fewer rows
    x_dat.set_value(smaller)
    check_all_but_none(f(x_dat, b_dat), reference(f, smaller, B))
    with pytest.raises(IndexError, match="out of range"):
        f(x_dat, b_dat, batch=6)
    other = synk.data(rng.normal(size=(5, 3)))        # another Data of the same shape
    check_all_but_none(f(other, b_dat), reference(f, other.data, B))
    x_dat.free_memory()
    with pytest.raises(TypeError, match="holds no value"):
        f(x_dat, b_dat)
    x_dat.set_value(X)
    check_all_but_none(f(x_dat, b_dat), reference(f, X, B))


def test_a_reused_index_plan_checks_every_new_index_set(model, rng):
    """Calls with as many explicit indices share a plan; each index set is still validated."""
    f, X, B = model
    x_dat, b_dat = synk.data(X), synk.data(B)
    for idx in (np.array([6, 0, 3, 3, 1]), np.array([2, 2, 5, 4, 0])):
        check_all_but_none(f(x_dat, b_dat, batch=idx), reference(f, X[idx], B))
    with pytest.raises(IndexError, match="index 7 is out of range"):
        f(x_dat, b_dat, batch=np.array([0, 1, 7, 2, 3]))
    with pytest.raises(IndexError, match="-1 is negative"):
        f(x_dat, b_dat, batch=np.array([0, 1, -1, 2, 3]))
    with pytest.raises(TypeError, match="list or array of ints"):
        f(x_dat, b_dat, batch=np.array([0., 1, 2, 2, 3]))
    idx = np.array([5, 6, 0, 1, 1])
    check_all_but_none(f(x_dat, b_dat, batch=idx), reference(f, X[idx], B))
    other = synk.data(rng.normal(size=(5, 3)))        # other Data: checked against its 5 rows
    with pytest.raises(IndexError, match="out of range"):
        f(other, b_dat, batch=idx)
    check_all_but_none(f(other, b_dat, batch=idx - 2 * (idx > 4)),
                       reference(f, other.data[idx - 2 * (idx > 4)], B))


def test_index_sets_into_minibatch_data_each_take_their_own_offset(model):
    """A minibatch Data's row 0 stands for the batch's lowest index, which moves from call to call."""
    f, X, B = model
    big = np.vstack([X, X * 2, X * 3])
    mb = synk.data(big[7:14], minibatch=True)
    b_dat = synk.data(B)
    for idx in ([13, 8, 9, 7], [12, 13, 10, 11]):     # lowest 7, then 10 (rows 10.. from row 0)
        held = big[min(idx):min(idx) + 7]
        mb.set_value(held)
        check_all_but_none(f(mb, b_dat, batch=np.array(idx)), reference(f, big[idx], B))


def test_results_and_updates_never_share_memory_with_gathered_rows(synk2, rng):
    """Each device gathers a call's rows into the buffer it used the call before; nothing that
    outlives a call (a returned output, an updated shared variable) may be a view of it."""
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros((3, 2)), name="w")
    f = synk.function([x], [(x, None), (w.sum(), "sum")], updates=[(w, x)], name="echo",
                      local_updates=True)
    X = rng.normal(size=(40, 2))
    x_dat = synk.data(X)
    idx1, idx2 = rng.permutation(40)[:6], rng.permutation(40)[:6]
    rows1, total = f(x_dat, batch=idx1)
    close(total, 0.0)
    rows2, total = f(x_dat, batch=idx2)
    close(rows1, X[idx1[:3]])                    # the master's rows of the first call, unchanged
    close(rows2, X[idx2[:3]])
    # the second call summed w as the first call left it: each device's rows of idx1
    close(total, X[idx1].sum())
    for rank in range(2):
        close(synk.get_value(rank, w), X[idx2[3 * rank:3 * rank + 3]])


def test_more_plans_than_the_cache_holds(synk2, rng):
    x = pt.vector("x")
    f = synk.function([x], [(x.sum(), "sum")], name="many_plans")
    X = rng.normal(size=40)
    x_dat = synk.data(X)
    with pytest.warns(synk.SynkWarning, match="many_plans has been called with 16") as said:
        for n in list(range(2, 40)) + [2, 3, 39]:     # 38 distinct plans (16 kept), then old ones again
            close(f(x_dat, batch=n), X[:n].sum())
    assert {w.filename for w in said} == {__file__}      # the user's line, from deep in a call


def test_a_warning_the_scripts_filters_make_an_error_is_raised_as_itself_and_the_call_changes_nothing(synk2):
    """Under ``-W error`` the shapes warning, given in this process's share of a call, reaches the
    script as the SynkWarning it is (not a WorkerError); the call changes no rank, and the next runs."""
    x = pt.vector("x")
    w = pytensor.shared(np.zeros(()), name="w_warned")
    f = synk.function([x], [(x.sum(), "sum")], updates=[(w, w + x.sum())], local_updates=True, name="warned")
    synk.distribute()
    added = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", synk.SynkWarning)
        with pytest.raises(synk.SynkWarning, match="warned has been called with 16"):
            for n in range(2, 40):
                f(np.ones(n))
                added += n
    assert sum(synk.get_value(rank, w) for rank in range(2)) == added    # the failed call added nothing
    close(f(np.ones(5)), 5.0)
    assert sum(synk.get_value(rank, w) for rank in range(2)) == added + 5


@pytest.mark.parametrize("num_slices", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_an_accumulating_update_over_slices_counts_its_value_once(synk2, rng, num_slices):
    """``s + x.sum(0)`` and ``seen + x.shape[0]`` under "sum" are accumulators: over slices their
    changes add up, as in a call in one slice; a sum over the rows alone and a running maximum too."""
    def made(tag):
        s = pytensor.shared(np.full(3, 10.0), name=f"s_{tag}")
        seen = pytensor.shared(np.int64(100), name=f"seen_{tag}")
        batch_sum = pytensor.shared(np.zeros(3), name=f"batch_sum_{tag}")
        top = pytensor.shared(np.full(3, -np.inf), name=f"top_{tag}")
        first = pytensor.shared(np.zeros(3), name=f"first_{tag}")
        narrow = pytensor.shared(np.ones(3, dtype="float32"), name=f"narrow_{tag}")
        x = pt.matrix("x")
        f = synk.function([x], [(x.sum(), "sum")], local_updates=True, name=f"accumulating_{tag}",
                          updates=[(s, s + x.sum(0), "sum"), (seen, seen + x.shape[0], "sum"),
                                   (batch_sum, x.sum(0), "sum"), (top, pt.maximum(top, x.max(0)), "max"),
                                   (first, pt.inc_subtensor(first[0], x[:, 0].sum()), "sum"),
                                   (narrow, pt.cast(narrow - (-x.sum(0)), "float32"), "sum")])
        return f, [s, seen, batch_sum, top, first, narrow]
    (sliced, held), (whole, truth) = made(f"sliced{num_slices}"), made(f"whole{num_slices}")
    synk.distribute()
    X = rng.normal(size=(7, 3))
    close(sliced(X, num_slices=num_slices), X.sum())
    close(whole(X), X.sum())
    for rank in range(2):
        for ours, theirs in zip(held, truth):
            close(synk.get_value(rank, ours), synk.get_value(rank, theirs), rtol=1e-6 if ours is held[-1] else 1e-13)
    close(sum(synk.get_value(rank, held[0]) - 10.0 for rank in range(2)), X.sum(0))
    assert sum(synk.get_value(rank, held[1]) - 100 for rank in range(2)) == 7


@pytest.mark.parametrize("update, mode, said", [
    ("0.9 * s + x.sum(0)", "sum", r"reads s otherwise than as s \+ change.* once per slice"),
    ("s * x.prod(0)", "prod", r"reads s itself.* once per slice"),
    ("s + x.sum(0) + 1", "sum", r"is combined over slices by 'sum' and adds .*, which reads none of the rows")])
def test_an_update_whose_slices_cannot_be_combined_is_refused_when_built(synk2, update, mode, said):
    s, x = pytensor.shared(np.ones(3), name="s"), pt.matrix("x")
    with pytest.raises(ValueError, match=r"the update of s " + said):
        synk.function([x], (x.sum(), "sum"), updates=[(s, eval(update), mode)], local_updates=True)
    close(synk.function([x], (x.sum(), "sum"))(np.ones((4, 3))), 12.0)


def test_repeated_numpy_calls_reuse_their_plan_and_compute_each_calls_values(synk2, rng):
    """numpy arguments of a repeated shape skip validation (their plan is kept), and are staged
    anew at every call: other values, shapes that come back after another, a Python scalar for a
    0-d input, a value that needs a cast (the full path) and a buffer edited in place between
    calls are each computed as numpy computes them."""
    x, s = pt.matrix("x"), pt.scalar("s")
    f = synk.function([x], [(x.sum() * s, "sum")], bcast_inputs=[s], name="numpy_plans")
    buffer = rng.normal(size=(6, 2))
    for shape in [(6, 2), (6, 2), (4, 2), (6, 2), (9, 2), (4, 2)]:
        X, scale = rng.normal(size=shape), float(rng.uniform(1, 2))
        close(f(X, scale), X.sum() * scale)
        close(f(X.astype("float32"), np.float64(scale)), X.astype("float32").sum() * scale, rtol=1e-6)
        buffer *= -1.5                                   # the same array object, new values
        close(f(buffer, 2.0), buffer.sum() * 2.0)
    with pytest.raises(TypeError, match="ndim"):         # still validated where the key differs
        f(np.ones(3), 1.0)
    close(f(np.ones((6, 2)), 1.0), 12.0)


@pytest.mark.slow
@pytest.mark.parametrize("num_slices", [1, 3, 4])
def test_num_slices_on_outputs(model, num_slices, rng):
    f, _, B = model
    X = rng.normal(size=(23, 3))
    idx = rng.permutation(23)[:19]
    out = f(synk.data(X), synk.data(B), batch=idx, num_slices=num_slices)
    check_all_but_none(out, reference(f, X[idx], B))


def test_minibatch_data(model):
    f, X, B = model
    big = np.vstack([X, X * 2, X * 3])           # the full data set, 21 rows
    mb = synk.data(big[7:14], minibatch=True)     # holds only rows 7..13
    out = f(mb, synk.data(B), batch=slice(7, 14))
    check_all_but_none(out, reference(f, big[7:14], B))
    idx = [13, 8, 9, 7]
    out = f(mb, synk.data(B), batch=idx)
    check_all_but_none(out, reference(f, big[idx], B))


def test_numpy_arguments_and_names(model):
    f, X, B = model
    ref = reference(f, X, B)
    check_all_but_none(f(X, B), ref)
    check_all_but_none(f(b=B, x=X), ref)
    check_all_but_none(f(synk.data(X), b=B), ref)
    # a float32 array up-casts safely to the float64 input
    check_all_but_none(f(X.astype("float32"), B), reference(f, X.astype("float32").astype("float64"), B))


def test_output_subset_and_bare_output(synk2, rng):
    x = pt.matrix("x")
    f = synk.function([x], [(x.sum(), "sum"), (x.max(), "max"), (x.mean(), "avg")])
    X = rng.normal(size=(9, 2))
    s, m = f(X, output_subset=[0, 2])
    close(s, X.sum())
    close(m, X.mean())
    g = synk.function([x], (x.sum(0), "sum"))
    out = g(X)
    assert isinstance(out, np.ndarray) and out.shape == (2,)
    close(out, X.sum(0))
    h = synk.function([x], x.mean())
    close(h(X), X.mean())


@pytest.mark.parametrize("batch", [None, 1, [5, 5, 0]])
def test_scalar_results_of_every_dtype_and_mode(synk2, rng, batch):
    """Scalar outputs return through the control block's records: mixed dtypes, every mode.

    ``batch=1`` leaves the master without rows (rank 1 computes alone); the
    float32/int/bool results must keep their declared dtypes and weights.
    """
    x = pt.matrix("x", dtype="float32")
    k = pt.vector("k", dtype="int64")
    outputs = [(x.sum(), "sum"), (x.mean(), "avg"), ((1 + 0.01 * x).prod(), "prod"),
               (k.max(), "max"), (k.min(), "min"), ((k > 2).any(), "max"), (k.sum(), "sum"),
               (x.mean(), None)]
    f = synk.function([x, k], outputs, name="scalars")
    X = rng.normal(size=(7, 3)).astype("float32")
    K = rng.integers(-5, 6, size=7)
    out = f(synk.data(X), synk.data(K), batch=batch)
    rows = np.arange(7)[slice(None) if batch is None else slice(batch) if isinstance(batch, int)
                        else batch]
    ref = reference(f, X[rows], K[rows])
    for got, want, var in zip(out[:-1], ref[:-1], [v for v, _ in f.spec.outputs]):
        assert got.dtype == var.type.dtype and got.shape == ()
        close(got, want, rtol=1e-5, atol=1e-6)
    master_rows = rows[:len(rows) // 2] if len(rows) > 1 else rows    # mode None: the master's own
    close(out[-1], X[master_rows].mean(), rtol=1e-5)


def test_results_too_large_for_a_record_are_packed(synk2, rng):
    """Forty float64 scalars (320 bytes) and a scalar beside a vector take the packed path."""
    x = pt.matrix("x")
    many = synk.function([x], [(x[:, 0].sum() * i, "sum") for i in range(40)], name="many_scalars")
    mixed = synk.function([x], [(x.sum(), "sum"), (x.sum(0), "sum")], name="mixed_results")
    X = rng.normal(size=(9, 2))
    close(np.array(many(X)), X[:, 0].sum() * np.arange(40))
    s, v = mixed(X)
    close(s, X.sum())
    close(v, X.sum(0))
    assert mixed(X, output_subset=[0])[0].shape == ()        # a scalar subset of a mixed function


def _two_output_step(w):
    x = pt.vector("x", dtype="float32")
    fn = pytensor.function([x], [(x * 2 + 1).sum() + w.sum(), x * w.sum()],
                           updates=[(w, 0.5 * w + x[:4])], mode="JAX")
    fn.trust_input = True
    return fn


def test_jitted_call_matches_pytensor_and_lets_go_of_its_inputs(synk2, rng):   # (JAX after fork)
    """The direct call of a function's jitted graph returns and updates what PyTensor's call does.

    Its input cells are empty after every call (they hold views of shared
    memory, which must not outlive the call), also after an error, which
    comes from PyTensor's own call; the function stays usable.
    """
    init = np.arange(4, dtype="float32")
    ref_w, w = pytensor.shared(init.copy(), name="w_ref"), pytensor.shared(init.copy(), name="w_jit")
    ref, fn = _two_output_step(ref_w), _two_output_step(w)
    call = jitted_call(fn)
    assert call is not None and call.fn is fn
    for n in (6, 6, 9):
        X = rng.normal(size=n).astype("float32")
        for got, want in zip(call(X), ref(X), strict=True):
            close(got, want, rtol=1e-6)
        close(w.get_value(), ref_w.get_value(), rtol=1e-6)
        assert fn.vm.inputs[0][0] is None
    with pytest.raises(Exception, match="shape|size|index"):
        call(np.zeros(2, "float32"))                   # x[:4] of 2 rows cannot update 4 weights
    assert fn.vm.inputs[0][0] is None
    close(call(np.ones(4, "float32"))[0], ref(np.ones(4, "float32"))[0], rtol=1e-6)


def test_jitted_call_declines_what_it_cannot_run(synk2):     # (JAX after fork)
    x = pt.vector("x")
    assert jitted_call(pytensor.function([x], [x * 2], mode="FAST_COMPILE")) is None   # not JAX
    assert jitted_call(pytensor.function([x], [], mode="JAX", on_unused_input="ignore")) is None


def test_a_call_has_read_its_inputs_when_it_returns(synk2):
    """The user may write the next batch into a Data as soon as a call returns.

    JAX dispatches a computation and returns before it runs; this function
    reads ``x`` again after ~50 ms of work, so a call that returned before
    its computation ended (as one with only updates once did) would sum the
    zeros written after it.
    """
    x = pt.matrix("x", dtype="float32")
    w = pytensor.shared(np.zeros((), "float32"), name="w_late_read")
    weights = pytensor.shared(np.full((512, 512), 1e-3, "float32"), name="w_heavy")
    h = x
    for _ in range(6):
        h = pt.tanh(h @ weights)
    late = (x * (1 + 1e-30 * h.mean())).sum()          # reads x only once h is done
    f = synk.function([x], updates=[(w, (w + late).astype("float32"))], name="late_read",
                      local_updates=True)
    synk.distribute()
    X = np.ones((2048, 512), "float32")
    x_dat = synk.data(X)
    for _ in range(3):
        x_dat.set_value(X)
        f(x_dat)
        x_dat.data[:] = 0                              # the next batch, written in place
    for rank in range(synk2.n_parallel):
        close(synk.get_value(rank, w), 3 * X.sum() / synk2.n_parallel)


def test_state_evolves_identically_on_every_rank(synk2):
    w = pytensor.shared(np.array([1.0, -2.0, 0.5]), name="w_state")
    v = pytensor.shared(np.zeros(3), name="v_state")
    step = synk.function([], updates=[(v, 0.9 * v + w), (w, w - 0.1 * (0.9 * v + w))])
    synk.distribute()
    w_np, v_np = np.array([1.0, -2.0, 0.5]), np.zeros(3)
    for _ in range(5):
        step()
        v_np = 0.9 * v_np + w_np
        w_np = w_np - 0.1 * v_np
    for rank in range(synk2.n_parallel):
        close(synk.get_value(rank, w), w_np)
        close(synk.get_value(rank, v), v_np)
    # the master's copy stays on the device between calls: user code sees a numpy face over it
    face = w.container.storage[0]
    assert isinstance(face, np.ndarray) and isinstance(device_face(face), jax.Array)
    # every call ran the jitted graph directly (see test_jitted_call_matches_pytensor_...)
    assert step.compiled.calls_jit_directly


@pytest.mark.parametrize("num_slices", [1, 3, 4])
def test_updates_with_slices_apply_once_from_original_values(synk2, rng, num_slices):
    x = pt.matrix("x")
    v_avg = pytensor.shared(np.ones(2), name="v_avg")
    v_sum = pytensor.shared(np.ones(2), name="v_sum")
    v_rows = pytensor.shared(np.ones(2), name="v_rows")
    v_max = pytensor.shared(np.ones(2), name="v_max")
    g = x.mean(0)
    f = synk.function([x], (x.sum(), "sum"),
                      updates=[(v_avg, 0.9 * v_avg + g, "avg"), (v_sum, v_sum + 0.5 * x.sum(0), "sum"),
                               (v_rows, (x ** 2).sum(0), "sum"), (v_max, 0.9 * v_max + x.max(0), "max")],
                      local_updates=True)
    X = rng.normal(size=(11, 2))
    f(X, num_slices=num_slices)
    for rank, (lo, hi) in enumerate([(0, 5), (5, 11)]):
        rows = X[lo:hi]
        slices = [rows[(len(rows) * k) // num_slices:(len(rows) * (k + 1)) // num_slices]
                  for k in range(num_slices)]
        slices = [s for s in slices if len(s)]
        close(synk.get_value(rank, v_avg), 0.9 + rows.mean(0))
        assert len(slices) == min(num_slices, len(rows))
        close(synk.get_value(rank, v_sum), 1 + 0.5 * rows.sum(0))     # its value once, the slices' changes
        close(synk.get_value(rank, v_rows), (rows ** 2).sum(0))
        close(synk.get_value(rank, v_max), 0.9 + rows.max(0))


def test_functions_after_distribute_share_state(synk2, rng):
    w = pytensor.shared(np.zeros(2), name="w_late")
    x = pt.matrix("x")
    inc = synk.function([], updates=[(w, w + 1)])
    synk.distribute()
    inc()
    inc()
    # built after distribute(): shipped on its first call, and it sees the same w on every rank
    read = synk.function([x], [(x.sum() * 0 + w.sum(), "avg")])
    X = rng.normal(size=(4, 2))
    close(read(X), 4.0)  # each of 2 ranks holds w = [2, 2]
    fresh = pytensor.shared(np.full(2, 5.0), name="fresh_late")
    late = synk.function([], [(fresh.sum() + w.sum(), "avg")])
    close(late(), 14.0)


def test_distribute_again_syncs_master_values(synk2):
    w = pytensor.shared(np.zeros(3), name="w_sync")
    inc = synk.function([], updates=[(w, w + 1)])
    synk.distribute()
    inc()
    synk.set_value(1, w, np.full(3, 7.0))
    close(synk.get_value(1, w), 7.0)
    w.set_value(np.full(3, -1.0))
    synk.distribute()
    close(synk.get_value(1, w), -1.0)


def test_givens_dict_updates_and_kwargs(synk2, rng):
    x = pt.matrix("x")
    scale = pt.scalar("scale")
    w = pytensor.shared(np.ones(2), name="w_givens")
    from collections import OrderedDict
    f = synk.function([x], (x.sum(0) * scale, "sum"), givens={scale: w.sum()},
                      updates=OrderedDict([(w, w * 2)]), name="given", on_unused_input="ignore")
    assert f.name == "given" and f.output_modes == ["sum"] and f.update_modes == ["avg"]
    X = rng.normal(size=(6, 2))
    close(f(X), X.sum(0) * 2)
    close(f(X), X.sum(0) * 4)          # w doubled on both ranks
    close(synk.get_value(1, w), 4.0)


def test_a_function_compiles_once(synk2, rng):
    """The first call compiles; later calls with the same shapes do not (optimizer state included)."""
    import jax.monitoring

    from synkhronos.extensions import train, updates
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(rng.normal(size=(3, 4)), name="w_once")
    v = pytensor.shared(rng.normal(size=4), name="v_once")
    loss = ((pt.tanh(x @ w) @ v - y) ** 2).mean()
    step = train.make_train_function(loss, [w, v], x, y, updates.adam, learning_rate=1e-2)
    synk.distribute()
    X, Y = synk.data(rng.normal(size=(40, 3))), synk.data(rng.normal(size=40))
    step(X, Y, batch=np.arange(8))
    assert compiles, "the listener saw no compilation"
    for start in (8, 16, 24):
        before = len(compiles)
        step(X, Y, batch=np.arange(start, start + 8))
        assert len(compiles) == before, f"compiled again at the step from row {start}"


def _momentum_updates(w, v, c):
    """A heavy-ball step on ``w`` with velocity ``v`` and gradient ``c``: an optimizer's update pass."""
    v_new = 0.9 * v + c
    return [(v, v_new), (w, w - 0.1 * v_new)]


def _twin_shareds(n, rng, name):
    start = rng.normal(size=n), rng.normal(size=n)
    ours = [pytensor.shared(a.copy(), name=f"{name}_{i}") for i, a in enumerate(start)]
    theirs = [pytensor.shared(a.copy(), name=f"{name}_ref_{i}") for i, a in enumerate(start)]
    return ours, theirs


def _buffer_of(var):
    """Where the master's value of ``var`` lives (no reference to it is kept)."""
    return device_face(var.container.storage[0]).unsafe_buffer_pointer()


def test_updates_are_computed_into_the_old_values_buffers_with_pytensors_results(synk2, rng):
    """A shared variable whose value nobody else holds gets its new value in its old buffer
    (XLA buffer donation), on every device, and the values are PyTensor's."""
    n = 100_000                                       # past DONATE_MIN_BYTES
    (w, v), (w_ref, v_ref) = _twin_shareds(n, rng, "inplace")
    c = pt.vector("c")
    f = synk.function([], bcast_inputs=[c], updates=_momentum_updates(w, v, c), name="inplace")
    g = pytensor.function([c], [], updates=_momentum_updates(w_ref, v_ref, c), mode="JAX")
    buffers = []
    for _ in range(4):
        C = rng.normal(size=n)
        f(C)
        g(C)
        buffers.append((_buffer_of(w), _buffer_of(v)))
    # the first call starts from values placed on the device; from then on the buffers stay
    assert buffers[1] == buffers[2] == buffers[3]
    for rank in range(synk2.n_parallel):
        close(synk.get_value(rank, w), w_ref.get_value())
        close(synk.get_value(rank, v), v_ref.get_value())


def test_a_value_someone_else_holds_is_left_intact_by_an_update(synk2, rng):
    """``get_value(borrow=True)`` hands out a face over the device array itself: the update must
    not reuse that array's memory."""
    n = 100_000                                       # past DONATE_MIN_BYTES
    (w, v), (w_ref, v_ref) = _twin_shareds(n, rng, "held")
    c = pt.vector("c")
    f = synk.function([], bcast_inputs=[c], updates=_momentum_updates(w, v, c), name="held")
    g = pytensor.function([c], [], updates=_momentum_updates(w_ref, v_ref, c), mode="JAX")
    for _ in range(2):
        C = rng.normal(size=n)
        f(C), g(C)
    held = w.get_value(borrow=True)
    expected = np.array(held)
    C = rng.normal(size=n)
    f(C), g(C)
    assert not device_face(held).is_deleted()
    close(held, expected)
    close(w.get_value(), w_ref.get_value())


def test_a_variable_a_call_leaves_alone_keeps_its_face_and_a_held_view_keeps_its_values(synk2, rng):
    """Between calls user code sees numpy faces of the device arrays: a call that leaves a
    variable's array in place hands back the very same face (as a plain PyTensor function would
    leave it), a donating update still reuses the buffer of a value nobody holds, and a view of
    a face, held across the update, keeps its values."""
    n = 100_000                                       # past DONATE_MIN_BYTES
    (w, v), (w_ref, v_ref) = _twin_shareds(n, rng, "faces")
    untouched = pytensor.shared(rng.normal(size=n), name="faces_untouched")
    c = pt.vector("c")
    f = synk.function([], bcast_inputs=[c], updates=_momentum_updates(w, v, c), name="faces")
    reads = synk.function([], [(untouched.sum(), "avg")], name="faces_reads")
    g = pytensor.function([c], [], updates=_momentum_updates(w_ref, v_ref, c), mode="JAX")
    face = untouched.get_value(borrow=True)
    expected_sum = face.sum()
    buffers = []
    for _ in range(4):
        C = rng.normal(size=n)
        f(C), g(C)
        buffers.append(_buffer_of(w))
        assert untouched.get_value(borrow=True) is face
    assert buffers[1] == buffers[2] == buffers[3]          # donated: nothing held w's face
    close(reads(), expected_sum)
    assert untouched.get_value(borrow=True) is face        # read by a call, not replaced
    view = w.get_value(borrow=True)[10:20]
    expected = view.copy()
    C = rng.normal(size=n)
    f(C), g(C)
    np.testing.assert_array_equal(view, expected)
    close(w.get_value(), w_ref.get_value())
    close(v.get_value(), v_ref.get_value())
    del view
    for _ in range(2):                                     # the view gone, donation resumes
        C = rng.normal(size=n)
        f(C), g(C)
        buffers.append(_buffer_of(w))
    assert buffers[-1] == buffers[-2]
    close(w.get_value(), w_ref.get_value())


def test_a_face_set_back_or_reshaped_in_place_is_what_the_next_call_reads(synk2):
    """A face given back with set_value(borrow=True) stays the variable's array; one whose shape
    was set in place is read with that shape, as PyTensor reads it."""
    W = pytensor.shared(np.arange(12.0).reshape(3, 4), name="faces_reshaped")
    f = synk.function([], (W.sum(axis=0), "avg"), name="faces_reshaped_sum")
    g = pytensor.function([], W.sum(axis=0), mode="JAX")
    close(f(), g())
    face = W.get_value(borrow=True)
    W.set_value(face, borrow=True)
    close(f(), g())
    assert W.get_value(borrow=True) is face
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # (NumPy deprecates setting shape)
        face.shape = (4, 3)
    synk.broadcast(W)                                           # (the master's value: to every device)
    close(f(), g())
    close(f(), [18.0, 22.0, 26.0])
    assert W.get_value().shape == (4, 3)


def test_an_update_after_an_all_reduce_leaves_the_other_reduced_values_alone(synk2, rng):
    """All-reduced values are adopted from one shared result region; updating one of them in
    place must not write into the region the other variables (and the other rank) still read."""
    n = 300_000                                       # large enough for a shared result region
    w = pytensor.shared(np.zeros(n), name="reduced_w")
    u = pytensor.shared(np.zeros(n), name="reduced_u")
    f = synk.function([], updates=[(w, w * 2 + 1)], name="after_reduce")
    synk.function([], (u[0], "sum"), name="holds_u")
    per_rank = [rng.normal(size=(2, n)) for _ in range(synk2.n_parallel)]
    for rank, (a, b) in enumerate(per_rank):
        synk.set_value(rank, [w, u], [a, b])
    for _ in range(2):
        synk.all_reduce([w, u], op="avg")
        w_avg = np.mean([a for a, _ in per_rank], axis=0)
        u_avg = np.mean([b for _, b in per_rank], axis=0)
        f(), f()
        for rank in range(synk2.n_parallel):
            close(synk.get_value(rank, u), u_avg)
            close(synk.get_value(rank, w), (w_avg * 2 + 1) * 2 + 1)
        per_rank = [(np.full(n, float(rank)), u_avg) for rank in range(synk2.n_parallel)]
        for rank, (a, b) in enumerate(per_rank):
            synk.set_value(rank, [w, u], [a, b])


def test_more_slices_than_rows_means_one_row_a_slice(synk2, rng):
    """num_slices=10**9 on 10 rows computes one row a slice, at once."""
    x = pt.matrix("x")
    f = synk.function([x], [(x.sum(), "sum"), (x.max(), "max")], name="many_slices")
    X = rng.normal(size=(10, 3))
    start = time.perf_counter()
    for ours, theirs in zip(f(X, num_slices=10**9), f(X, num_slices=5)):
        close(ours, theirs)
    assert time.perf_counter() - start < 30


def test_what_pytensor_refuses_in_a_graph_is_raised_when_the_function_is_built(synk2, rng):
    """The graph on free rows is built at a call (see test_shapes), yet a missing input or an update
    of another type is refused by synk.function, before any worker runs, and nothing is registered."""
    from pytensor.graph.utils import MissingInputError
    x, y = pt.matrix("x"), pt.matrix("y")
    w = pytensor.shared(np.ones(3), name="w_refused")
    n_functions = len(synk2.registry.specs)
    with pytest.raises(MissingInputError, match="y"):
        synk.function([x], ((x + y).sum(), "sum"))
    with pytest.raises(TypeError, match="w_refused"):
        synk.function([x], (x.sum(), "sum"), updates=[(w, x.sum(0).astype("int32"))], local_updates=True)
    assert len(synk2.registry.specs) == n_functions
    f = synk.function([x], ((x @ w).sum(), "sum"))                 # and the runtime goes on
    X = rng.normal(size=(5, 3))
    close(f(X), reference(f, X))


def test_a_program_without_arguments_is_compiled_before_its_first_call(synk2, rng, tmp_path):
    """An update function's shapes are known when it is built: XLA compiles it then, on another thread,
    once for the host (the worker loads the master's program, or the master the worker's)."""
    import json

    from synkhronos.platform.compile_spans import COMPILED, LOADED
    W = rng.normal(size=(50, 40))
    w = pytensor.shared(W.copy(), name="w_ahead")
    m = pytensor.shared(np.zeros((50, 40)), name="m_ahead")
    path = tmp_path / "trace.json"
    with synk.timeline(path):
        f = synk.function([], [], updates=[(m, 0.9 * m + w), (w, w - 0.1 * m)], name="ahead")
        synk.distribute()
        time.sleep(1.0)                    # the master's own work meanwhile
        f()
        f()
    m1, w1 = W, W.copy()                               # step 1 from m = 0: m = w, w unchanged
    m2, w2 = 0.9 * m1 + w1, w1 - 0.1 * m1              # step 2
    for rank in (0, 1):
        close(synk.get_value(rank, m), m2)
        close(synk.get_value(rank, w), w2)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    programs = [e for e in events if e.get("cat") == "compile" and e["name"] in (COMPILED, LOADED)]
    first_call = min(e["ts"] for e in events if e.get("ph") == "X" and e["name"] == "ahead")
    assert programs
    for e in programs:                   # every rank had its program before the first call began
        assert e["ts"] + e["dur"] <= first_call, (e, first_call)
    graphs = [e["name"] for e in programs if e["args"]["program"] == "jit(jax_funcified_fgraph)"]
    assert sorted(graphs) == [COMPILED, LOADED]                             # one compile for the host


def test_an_updated_variable_shaped_like_the_calls_rows_warns_once(synk2):
    """The RBM tutorial's persistent chain (one row per example) becomes one chain per device: a
    LocalUpdatesWarning names it once; local_updates=True means one each is meant."""
    import warnings
    x = pt.matrix("x")
    chain = pytensor.shared(np.zeros((8, 3)), name="persistent_chain")
    total = pytensor.shared(np.zeros(3), name="not_batch_shaped")
    f = synk.function([x], (x.sum(), "sum"), updates=[(chain, chain * 0.5 + 1), (total, total + 1)],
                      name="pcd")
    X = synk.data(np.ones((8, 3)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            f(X)
            f(np.ones((8, 3)))
        f(X, batch=6)                      # other rows than the chain's: nothing to say
    said = [str(w.message) for w in seen if issubclass(w.category, synk.LocalUpdatesWarning)]
    assert len(said) == 1 and "persistent_chain" in said[0] and "(8)" in said[0], said
    assert "not_batch_shaped" not in said[0]
    chain2 = pytensor.shared(np.zeros((8, 3)), name="one_each")
    g = synk.function([x], (x.sum(), "sum"), updates=[(chain2, chain2 + 1)], local_updates=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", synk.LocalUpdatesWarning)
        g(X)


def test_an_update_computed_from_the_givens_rows_is_said_once_and_not_as_batch_shaped(synk2):
    """The tutorials' givens idiom: an update computed from the rows a minibatch index selects is
    the literal port's LocalUpdatesWarning; a bias as long as the batch is not a persistent chain."""
    import warnings
    x, index = pt.matrix("x"), pt.lscalar("index")
    data = pytensor.shared(np.ones((40, 4)), name="data_sh")
    bias = pytensor.shared(np.zeros(4), name="bias_as_long_as_the_batch")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f = synk.function([index], ((x + bias).sum(), "sum"), updates=[(bias, bias - 0.1 * x.mean(0))],
                          givens={x: data[index * 4:(index + 1) * 4]}, name="givens_bias")
        for i in range(3):
            f(i)
    said = [str(w.message) for w in seen if issubclass(w.category, synk.LocalUpdatesWarning)]
    assert len(said) == 1 and "each device's own rows" in said[0], said


def test_a_call_hands_over_only_its_own_shared_variables(synk2):
    """A call takes to the devices, and gives back as numpy, only its own function's shared
    variables: another function's keep the very arrays user code holds, and a value the user sets
    on one of them is what that function's next call reads."""
    a = pytensor.shared(np.arange(4.0), name="a_own")
    others = [pytensor.shared(np.full(3, float(i)), name=f"other_{i}") for i in range(5)]
    bump_a = synk.function([], [(a.sum(), None)], updates=[(a, a + 1)], name="bump_a")
    double = synk.function([], [(pt.add(*[o.sum() for o in others]), None)],
                           updates=[(o, o * 2) for o in others], name="double_others")
    synk.distribute()
    assert float(double()[0]) == 3 * sum(range(5))
    held = [o.get_value(borrow=True) for o in others]
    assert all(type(h) is np.ndarray for h in held)
    for expected in (6.0, 10.0, 14.0):
        assert float(bump_a()[0]) == expected
    assert all(o.get_value(borrow=True) is h for o, h in zip(others, held))   # not touched
    assert type(a.get_value(borrow=True)) is np.ndarray
    np.testing.assert_array_equal(a.get_value(), np.arange(4.0) + 3)
    others[0].set_value(np.full(3, 100.0))       # the master's value: its own share reads it
    assert float(double()[0]) == 300.0 + 3 * sum(2.0 * i for i in range(1, 5))
    np.testing.assert_array_equal(others[0].get_value(), np.full(3, 200.0))
    np.testing.assert_array_equal(synk.get_value(1, others[1]), np.full(3, 4.0))    # the worker's
    assert all(type(o.get_value(borrow=True)) is np.ndarray for o in others)
