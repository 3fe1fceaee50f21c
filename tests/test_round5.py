"""What a careless user met in the fifth outside round, each against ``pytensor.function``: a call
whose output cannot be reduced changes nothing; Python scalars are taken as ``pytensor.function``
takes them; every output is an array the caller owns. On 1, 2 and 3 devices."""

import contextlib
import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import test_programs
from helpers import run_script

import synkhronos as synk

pytestmark = pytest.mark.timeout(300)

#: the fixtures of every device count (one fork per count)
device_count, devices = test_programs.device_count, test_programs.devices


@pytest.mark.parametrize("mode", ["sum", "avg", "max"])
def test_a_call_whose_output_does_not_reduce_keeps_no_update(devices, mode):
    """``x.T`` has no row axis first: on several devices its parts do not add up. The call raises
    and every rank's ``w`` stays where it was, retry after retry."""
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(2), name=f"w_unreducible_{mode}")
    f = synk.function([x], (x.T, mode), updates=[(w, w + 1)])
    X = np.arange(15.0).reshape(5, 3)
    if devices.n_parallel == 1:          # nothing to combine: it runs as pytensor.function does
        np.testing.assert_allclose(f(X), X.T)
        assert w.get_value()[0] == 1
        return
    for _ in range(3):
        with pytest.raises(ValueError):
            f(X)
        assert w.get_value()[0] == 0
    assert [float(v[0]) for v in synk.gather(w)] == [0.0] * devices.n_parallel
    ok = synk.function([x], (x.sum(0), mode), updates=[(w, w + 1)])
    ok(X)                                # the runtime is usable, and updates apply once
    assert w.get_value()[0] == 1


def test_python_scalars_fit_narrow_0d_inputs_as_in_pytensor(devices):
    i, k = pt.iscalar("i"), pt.scalar("k", dtype="int16")
    x = pt.vector("x")
    f = synk.function([x], (x * i + k, "gather"), bcast_inputs=[i, k])
    ref = pytensor.function([x, i, k], x * i + k)
    X = np.arange(6.0)
    np.testing.assert_array_equal(f(X, 3, 2), ref(X, 3, 2))
    with pytest.raises(TypeError, match="allow_input_downcast"):
        f(X, 2 ** 40, 1)                 # an int that does not fit: pytensor.function refuses it too
    with pytest.raises((TypeError, OverflowError)):
        ref(X, 2 ** 40, 1)


def test_givens_index_given_a_python_int(devices):
    """The Theano tutorials' minibatch index: ``index = pt.iscalar()``, called as ``f(1)``."""
    X = np.arange(40.0).reshape(20, 2)
    data = pytensor.shared(X, name="tut_data")
    index, x = pt.iscalar("index"), pt.matrix("x")
    f = synk.function([index], (x.sum(), "sum"), givens={x: data[index * 10:(index + 1) * 10]})
    assert float(f(1)) == pytest.approx(X[10:20].sum(), rel=1e-12)
    assert float(f(np.int64(1))) == pytest.approx(X[10:20].sum(), rel=1e-12)   # as pytensor.function


def test_a_givens_index_found_again_selects_and_refuses_as_the_first_time(devices):
    """The rows an index selects are kept by the index as given: a value found again, of any of
    the int types, selects the same rows, reads the data as it is now, and one that did not fit the
    scalar is refused every time, as pytensor.function refuses it."""
    X = np.arange(40.0).reshape(20, 2)
    data = pytensor.shared(X, name="memo_data")
    index, x = pt.iscalar("index"), pt.matrix("x")
    f = synk.function([index], (x.sum(), "sum"), givens={x: data[index * 10:(index + 1) * 10]})
    ref = pytensor.function([index], x.sum(), givens={x: data[index * 10:(index + 1) * 10]})
    for value in [1, np.int64(1), np.int32(1), 0, 1, np.int64(0), True]:
        assert float(f(value)) == pytest.approx(float(ref(value)), rel=1e-12), value
    data.set_value(X[::-1].copy())              # the same index, another value of the data
    assert float(f(1)) == pytest.approx(X[::-1][10:20].sum(), rel=1e-12)
    for _ in range(2):
        with pytest.raises(TypeError, match="allow_input_downcast"):
            f(2 ** 40)
        with pytest.raises(ValueError, match="select no rows"):
            f(5)                                # rows 50:60 of 20


def test_a_float_learning_rate_under_float32(devices):
    """``f(X, 0.1)`` with ``floatX=float32``: a Python float fits a floatX input, as in PyTensor."""
    with pytensor.config.change_flags(floatX="float32"):
        x, lr = pt.vector("x"), pt.scalar("lr")
        f = synk.function([x], (x * lr, "gather"), bcast_inputs=[lr])
        ref = pytensor.function([x, lr], x * lr)
        X = np.arange(6, dtype="float32")
        np.testing.assert_array_equal(f(X, 0.1), ref(X, 0.1))
    with pytest.raises(TypeError, match="allow_input_downcast"):
        f(X, 0.1)          # under float64 a float32 input keeps refusing 0.1, as pytensor.function does


@pytest.mark.parametrize("mode", [None, "sum", "avg", "max", "gather"])
def test_every_output_is_an_array_the_caller_owns(devices, mode):
    x = pt.matrix("x")
    out = x * 2 if mode in (None, "gather") else (x * 2).sum(0)
    f = synk.function([x], (out, mode))
    X = np.arange(12.0).reshape(6, 2)
    first = [f(X), f.as_pytensor(X)]
    want = [a.copy() for a in first]
    for got, w in zip(first, want):
        assert got.flags.writeable and got.flags.owndata
        got -= 1                         # the usual in-place edit
        np.testing.assert_array_equal(got, w - 1)
    # nothing the runtime or PyTensor keeps was edited with them
    np.testing.assert_array_equal(f(X), want[0])
    np.testing.assert_array_equal(f.as_pytensor(X), want[1])


_INTERRUPTED_CALLS = """
    import os, subprocess, sys, numpy as np, pytensor, pytensor.tensor as pt
    import synkhronos as synk
    n = int(sys.argv[1])
    for attempt in range(4):
        synk.fork(n)
        x = pt.vector("x")
        w = pytensor.shared(np.zeros(200000), name="w")              # 1.6 MB: donated
        f = synk.function([x], (x.sum(), "sum"), updates=[(w, w * 0.5 + x.mean())])
        X = np.ones(64)
        f(X)
        subprocess.Popen(["sh", "-c", f"sleep {0.7 + 0.23 * attempt}; kill -INT {os.getpid()}"])
        try:
            while True:
                f(X)
        except KeyboardInterrupt:
            print("interrupted")
        value = w.get_value()
        print("readable", value.shape, bool(np.all(value == value[0])), 0 < value[0] <= 2)
        synk.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
def test_ctrl_c_in_a_donating_call_keeps_every_value(n):
    """Ctrl-C landing anywhere in a loop of calls that donate their updated value: always
    KeyboardInterrupt, the value readable at a completed call's, and fork() works again."""
    out = run_script(_INTERRUPTED_CALLS, args=(str(n),), timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("interrupted") == 4, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("readable (200000,) True True") == 4, out.stdout


# ------------------------------------------------------------------------------------------------
# Strangers at the elastic rendezvous (node 0's launcher)
# ------------------------------------------------------------------------------------------------

def _joins(server):
    """Whether a launcher can still join ``server`` and be given a round."""
    from synkhronos.launch.rendezvous import RendezvousClient
    client = RendezvousClient(server.address, node_rank=0, timeout=5)
    try:
        client.join()
        return client.next_message(5)["nnodes"] == 1
    finally:
        client.close()


def test_an_unbounded_line_is_dropped_and_the_rendezvous_serves_on():
    import socket

    from synkhronos.launch.rendezvous import MAX_LINE_BYTES, RendezvousServer
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=1, settle=0.0)
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as flood:
            sent, dropped = 0, False
            try:
                while sent < 64 * MAX_LINE_BYTES:          # 4 MiB and no newline
                    flood.sendall(b"x" * (1 << 16))
                    sent += 1 << 16
                flood.settimeout(5)
                dropped = flood.recv(1) == b""
            except OSError:                                # reset by the server: dropped too
                dropped = True
        assert dropped
        assert _joins(server)
    finally:
        server.close()


@contextlib.contextmanager
def _strangers_at_a_rendezvous(count, join_seconds):
    """A rendezvous for one node, and ``count`` connections to it that never join; every one is
    closed after the block, and the server too."""
    import socket

    from synkhronos.launch.rendezvous import RendezvousServer
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=1, settle=0.0,
                              join_seconds=join_seconds)
    host, port = server.address.rsplit(":", 1)
    strangers = []
    try:
        for _ in range(count):
            strangers.append(socket.create_connection((host, int(port))))
        yield server, strangers
    finally:
        for s in strangers:
            s.close()
        server.close()


def test_idle_strangers_are_dropped_and_a_flood_is_bounded():
    import time

    from synkhronos.launch.rendezvous import SPARE_CONNECTIONS
    # past the bound: the extra ones closed at once
    with _strangers_at_a_rendezvous(SPARE_CONNECTIONS + 40, join_seconds=1.0) as (server, _):
        time.sleep(0.5)
        assert server._open <= 2 + SPARE_CONNECTIONS
        time.sleep(1.5)                                    # past join_seconds: every idle one dropped
        assert server._open == 0
        assert _joins(server)


@pytest.mark.slow
def test_strangers_sending_a_byte_at_a_time_are_cut_off_at_the_join_time():
    """A per-receive timeout alone would keep them forever (a "slowloris")."""
    import time

    from synkhronos.launch.rendezvous import SPARE_CONNECTIONS
    with _strangers_at_a_rendezvous(2 + SPARE_CONNECTIONS, join_seconds=1.0) as (server, slow):
        for s in slow:
            s.sendall(b"{")
        start = time.monotonic()
        while time.monotonic() - start < 2.5:              # a byte each 0.3 s, past the join time
            for s in slow:
                try:
                    s.sendall(b" ")
                except OSError:
                    pass
            time.sleep(0.3)
        assert server._open == 0
        assert _joins(server)


def test_a_launcher_in_a_flood_hears_why_and_close_ends_every_connection():
    import time

    from synkhronos.launch.rendezvous import SPARE_CONNECTIONS, RendezvousClient
    with _strangers_at_a_rendezvous(2 + SPARE_CONNECTIONS, join_seconds=30.0) as (server, _):
        time.sleep(0.5)
        client = RendezvousClient(server.address, node_rank=0, timeout=5)
        try:
            message = client.next_message(5)
        finally:
            client.close()
        assert message["kind"] == "refused" and "connections open at once" in message["why"], message
        assert message["busy"] is True      # not a refusal of this launcher: it may try again
        server.close()                      # long before the join time: the strangers are cut off
        time.sleep(0.5)
        assert server._open == 0


@pytest.mark.slow
def test_a_launcher_refused_by_a_busy_rendezvous_tries_again_and_runs_its_round(tmp_path):
    """A flood of strangers' connections fills the rendezvous: a launcher arriving then is told it
    is busy, tries again once the strangers are dropped (their join time), and runs its script."""
    import io
    import socket

    from synkhronos.launch import LaunchSpec
    from synkhronos.launch.agent import ElasticAgent
    from synkhronos.launch.rendezvous import SPARE_CONNECTIONS, RendezvousServer
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    # node 1 of up to 2 (node 0's launcher, the rendezvous, is the server here)
    spec = LaunchSpec(str(script), node_rank=1, min_nodes=1, max_nodes=2, max_restarts=1, join_timeout=20.0)
    # (strangers dropped only after 4 s: the launcher with the short join time meets them, however
    # slow the machine)
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=2, settle=0.0, job=spec.job,
                              join_seconds=4.0)
    host, port = server.address.rsplit(":", 1)
    strangers = [socket.create_connection((host, int(port))) for _ in range(4 + SPARE_CONNECTIONS)]
    try:
        impatient = io.StringIO()          # a join time shorter than the flood: it says why it ends
        short = LaunchSpec(**{**spec.__dict__, "coordinator": server.address, "join_timeout": 0.3})
        assert ElasticAgent(short, out=impatient).run() == 1
        said = impatient.getvalue()
        assert "no round started within 0.3 s" in said and ("stayed busy" in said or "was busy" in said), said
        said = io.StringIO()
        spec = LaunchSpec(**{**spec.__dict__, "coordinator": server.address})
        assert ElasticAgent(spec, out=said).run() == 0, said.getvalue()
    finally:
        for stranger in strangers:
            stranger.close()
        server.close()
    assert "is busy" in said.getvalue() and "trying again" in said.getvalue(), said.getvalue()


@pytest.mark.slow
def test_a_joined_launcher_that_reads_nothing_is_dropped_and_the_rendezvous_serves_on():
    """A stopped launcher's buffers fill up: the rendezvous, which tells its launchers things while
    holding its lock, drops it after its send time instead of stalling every other launcher."""
    import json
    import socket

    from synkhronos.launch.rendezvous import Kind, RendezvousClient, RendezvousServer
    job = "t.py --nnodes 2:2"
    server = RendezvousServer("127.0.0.1:0", min_nodes=2, max_nodes=2, settle=0.0, job=job,
                              send_seconds=0.5)
    host, port = server.address.rsplit(":", 1)
    stopped = socket.socket()
    stopped.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stopped.connect((host, int(port)))
    live = RendezvousClient(server.address, node_rank=0, timeout=5, job=job)
    joined_again = None
    try:
        join = (json.dumps({"kind": "join", "node_rank": 1, "job": job}) + "\n").encode()
        for cycles in range(1, 200):
            with contextlib.suppress(OSError):  # refused once dropped
                stopped.sendall(join)
            live.join()
            message = live.next_message(3)      # a drop takes about twice the send time
            if message is None:
                assert server._open < 2, "the rendezvous stalled"
                break                           # the stopped one was dropped: no round of 2
            assert message["kind"] == Kind.ROUND and message["nnodes"] == 2, message
            live.tell(Kind.FAILED, why="x" * 60_000)     # each restart tells the stopped one 60 kB
            message = live.next_message(5)
            assert message is not None and message["kind"] == Kind.RESTART, message
        else:
            raise AssertionError("a launcher that reads nothing was never dropped")
        assert cycles > 1                       # its buffers took a restart or more first
        joined_again = RendezvousClient(server.address, node_rank=1, timeout=5, job=job)
        joined_again.join()
        live.join()
        rounds = [client.next_message(5) for client in (live, joined_again)]
        assert [(m["kind"], m["node_rank"], m["nnodes"]) for m in rounds] == [
            (Kind.ROUND, 0, 2), (Kind.ROUND, 1, 2)], rounds
    finally:
        stopped.close()
        live.close()
        if joined_again is not None:
            joined_again.close()
        server.close()


def test_a_launcher_joining_a_rendezvous_that_is_gone_hears_it_is_lost():
    """A launcher whose script failed joins the next round; the rendezvous may be gone by then:
    that is the loss the agent reports, not a BrokenPipeError out of the launcher."""
    import time

    from synkhronos.launch.rendezvous import RendezvousClient, RendezvousLost, RendezvousServer
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=1, settle=0.0)
    client = RendezvousClient(server.address, node_rank=0, timeout=5)
    try:
        client.join()
        assert client.next_message(5)["kind"] == "round"
        server.close()
        with pytest.raises(RendezvousLost):
            client.next_message(5)
        with pytest.raises(RendezvousLost, match="the rendezvous"):
            for _ in range(20):             # the first send may still go out before the reset
                client.join()
                time.sleep(0.05)
    finally:
        client.close()
        server.close()


_OUT_OF_DESCRIPTORS = """
    import resource, socket, time
    from synkhronos.launch.rendezvous import RendezvousClient, RendezvousServer
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=1, settle=0.0)
    host, port = server.address.rsplit(":", 1)
    held = []
    try:
        while True:                        # a stranger takes every descriptor the process has
            held.append(socket.create_connection((host, int(port)), timeout=2))
    except OSError:
        pass
    time.sleep(0.5)                        # the server's accept fails for want of descriptors
    for s in held:
        s.close()
    time.sleep(0.5)
    client = RendezvousClient(server.address, node_rank=0, timeout=5)
    client.join()
    print("joined", client.next_message(5)["nnodes"])
    client.close(); server.close()
"""


@pytest.mark.slow
def test_the_rendezvous_serves_on_after_running_out_of_descriptors():
    out = run_script(_OUT_OF_DESCRIPTORS, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "joined 1" in out.stdout


# ------------------------------------------------------------------------------------------------
# A value set in the one script is every device's (ports: dropout flags, use_noise)
# ------------------------------------------------------------------------------------------------

def test_set_value_in_the_script_reaches_every_device(devices):
    """Theano-MPI's SetDropoutOff() and Platoon's use_noise: ``flag.set_value(0)`` before validation
    means every device, as in one process (a 0-d value included)."""
    x = pt.matrix("x")
    flag = pytensor.shared(np.float64(1.0), name="flag_noise")
    scale = pytensor.shared(np.ones(3), name="scale_noise")
    f = synk.function([x], ((x * flag * scale).sum(), "sum"))
    ref = pytensor.function([x], (x * flag * scale).sum())
    X = np.arange(15.0).reshape(5, 3)
    assert float(f(X)) == pytest.approx(float(ref(X)))
    flag.set_value(0.0)
    scale.set_value(np.array([1.0, 2.0, 3.0]))
    assert float(f(X)) == pytest.approx(float(ref(X)))       # 0: no device kept the old flag
    flag.set_value(1.0)
    assert float(f(X)) == pytest.approx(float(ref(X)))
    assert [float(v) for v in synk.gather(flag)] == [1.0] * devices.n_parallel
    np.testing.assert_array_equal(synk.gather(scale), [[1.0, 2.0, 3.0]] * devices.n_parallel)


@pytest.mark.parametrize("how", ["own function, default mode", "own function, FAST_COMPILE",
                                 "own function, JAX", "edit of the borrowed value",
                                 "edit of a borrowed value held over calls"])
def test_a_value_the_script_changes_in_place_reaches_every_device(devices, how):
    """PyTensor's default mode updates a shared variable in place, in the numpy array synkhronos
    gave the variable (a learning-rate decay of the Theano tutorials: ``theano.function([],
    updates={lr: lr * decay})``), and so does an edit of ``get_value(borrow=True)``: a change of
    the one script, every device's at the next call, as a ``set_value`` is; so is the new JAX
    array a ``mode="JAX"`` function leaves."""
    x = pt.matrix("x")
    lr = pytensor.shared(np.float64(0.5), name="lr_decay")
    w = pytensor.shared(np.ones(3), name="w_in_place")
    f = synk.function([x], ((x @ w * lr).sum(), "sum"))
    ref = pytensor.function([x], (x @ w * lr).sum(), mode="FAST_COMPILE")
    X = np.arange(21.0).reshape(7, 3)
    assert float(f(X)) == pytest.approx(float(ref(X)), rel=1e-12)
    held_lr, held_w = lr.get_value(borrow=True), w.get_value(borrow=True)
    for _ in range(2):
        if how == "edit of the borrowed value":
            lr.get_value(borrow=True)[...] *= 0.5
            w.get_value(borrow=True)[1] += 2.0            # one element of one row
        elif how == "edit of a borrowed value held over calls":   # as plain PyTensor: still the value
            held_lr[...] *= 0.5
            held_w[1] += 2.0
        else:
            mode = {"default mode": None, "FAST_COMPILE": "FAST_COMPILE", "JAX": "JAX"}[how.split(", ")[1]]
            pytensor.function([], [], updates=[(lr, lr * 0.5)], mode=mode)()
            pytensor.function([], [], updates=[(w, pt.inc_subtensor(w[1], 2.0))], mode=mode)()
        assert float(f(X)) == pytest.approx(float(ref(X)), rel=1e-12)
        assert [float(v) for v in synk.gather(lr)] == [float(lr.get_value())] * devices.n_parallel
        np.testing.assert_array_equal(synk.gather(w), [np.asarray(w.get_value())] * devices.n_parallel)
    assert float(lr.get_value()) == 0.125 and np.asarray(w.get_value()).tolist() == [1.0, 5.0, 1.0]


def test_values_synkhronos_set_per_device_stay_per_device(devices):
    """synk.set_value(rank, ...) and a broadcast are synkhronos's own: the next call keeps each
    device's value (as Average's and EASGD's per-device parameters are kept)."""
    if devices.n_parallel == 1:
        pytest.skip("one device: nothing per device")
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(3), name="w_per_device")
    f = synk.function([x], ((x * w).sum(), "sum"))
    synk.set_value(1, w, np.ones(3))
    X = np.ones((6, 3))
    f(X)
    want = [[0.0] * 3, [1.0] * 3] + [[0.0] * 3] * (devices.n_parallel - 2)
    np.testing.assert_array_equal(synk.gather(w), want)


@pytest.mark.parametrize("rank", [-1, 2, 10**9, True, 1.0, None])
def test_the_rendezvous_refuses_a_node_rank_outside_the_run(rank):
    """A join with the run's job but a node rank the run cannot have (a crafted one: the command
    line refuses it) is refused, and does not take a place in the next round."""
    from synkhronos.launch.rendezvous import Kind, RendezvousClient, RendezvousServer
    server = RendezvousServer("127.0.0.1:0", min_nodes=1, max_nodes=2, settle=0.0, job="t.py --nnodes 1:2")
    try:
        stranger = RendezvousClient(server.address, rank, 5, job="t.py --nnodes 1:2")
        stranger.join()
        refused = stranger.next_message(5)
        said = "--node-rank from 0 to 1" if type(rank) is int else f"a whole number, not {rank!r}"
        assert refused["kind"] == Kind.REFUSED and said in refused["why"], refused
        stranger.close()
        member = RendezvousClient(server.address, 0, 5, job="t.py --nnodes 1:2")
        member.join()
        started = member.next_message(5)
        assert started["kind"] == Kind.ROUND and started["node_rank"] == 0 and started["nnodes"] == 1
        member.close()
    finally:
        server.close()


def test_an_assertion_of_the_users_graph_is_said_to_go_unchecked_once_naming_it(synk2):
    """A compiled JAX program cannot raise, and PyTensor's JAX backend drops ``Assert``: the
    function says so when built, naming the assertion, instead of skipping it without a word."""
    import warnings

    from pytensor.raise_op import Assert
    y = pt.vector("y")
    checked = Assert("the rows must be non-negative")(y, pt.all(y >= 0))
    with pytest.warns(synk.SynkWarning, match="'the rows must be non-negative' .* is not checked on the "
                                              "devices") as said:
        f = synk.function([y], (checked.sum(), "sum"))
    assert len(said) == 1 and said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # PyTensor's own notice is not said again at the call
        assert float(f(np.array([1.0, 2.0, 3.0, -4.0]))) == 2.0
        synk.function([y], (y.sum(), "sum"))    # a graph without an assertion says nothing


@pytest.mark.slow
def test_float32_parameters_under_float64_floatx_train_and_keep_their_dtype(devices):
    """PyTensor's JAX backend computes a float32 parameter's gradient in float64 under the default
    floatX (float64): every update keeps its variable's dtype, the flat gradient's all-reduce among
    them (it once found its buffer too small), and the steps equal one process's."""
    from synkhronos.extensions import train, updates
    rng = np.random.default_rng(0)
    # (2 MB of parameters: their gradient in float64 would overflow the all-reduce's buffer)
    X = rng.normal(size=(24, 700)).astype("float32")
    Y = rng.integers(0, 700, size=24).astype("int32")
    W0 = (rng.normal(size=(700, 700)) * 0.03).astype("float32")

    def model():
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        W = pytensor.shared(W0.copy(), name="W_f32")
        b = pytensor.shared(np.zeros(700, "float32"), name="b_f32")
        p = pt.special.softmax(x @ W + b, axis=1)
        return x, y, W, b, -pt.mean(pt.log(p[pt.arange(y.shape[0]), y]))
    x, y, W, b, loss = model()
    step = train.make_train_function(loss, [W, b], x, y, updates.sgd, learning_rate=0.5)
    rx, ry, rW, rb, rloss = model()
    g = pytensor.grad(rloss, [rW, rb])
    ref = pytensor.function([rx, ry], rloss, updates=[(rW, rW - 0.5 * g[0]), (rb, rb - 0.5 * g[1])])
    for i in range(3):                   # the first call, then the one-program step
        rows = slice(8 * i, 8 * i + 8)
        assert float(step(X[rows], Y[rows])) == pytest.approx(float(ref(X[rows], Y[rows])), rel=1e-5)
    for ours, theirs in ((W, rW), (b, rb)):
        assert np.asarray(ours.get_value()).dtype == np.float32
        np.testing.assert_allclose(np.asarray(ours.get_value()), theirs.get_value(), rtol=1e-5, atol=1e-6)
        assert {np.asarray(v).dtype for v in synk.gather(ours)} == {np.dtype("float32")}


@pytest.fixture
def own_runtime():
    """A 2-device runtime of the test's own, which the test may shut down (the module's is closed
    first, and forked again by the next test that needs it)."""
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2)
    yield
    synk.close()


def _counted_step(name):
    """A training step whose gradient function stores a state update (a step counter): ``(build,
    w, count)``, ``build()`` making the step in the runtime there is."""
    from synkhronos.extensions import train, updates
    x, y = pt.matrix("x"), pt.vector("y")
    w = pytensor.shared(np.full(3, 0.1), name=f"w_{name}")
    count = pytensor.shared(np.float64(0), name=f"count_{name}")

    def build():
        return train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd,
                                         learning_rate=0.1, state_updates=[(count, count + 1)])
    return build, w, count


@pytest.mark.slow
def test_a_ctrl_c_between_a_steps_gradient_and_its_update_leaves_the_state_of_a_whole_step(own_runtime):
    """A step of several commands (the gradient function, the all-reduce, the update) stores its
    state updates (a step counter) with the gradient: a Ctrl-C landing before the update stored
    puts the master's counter back, so that the values the script keeps are a whole step's."""
    from synkhronos.runtime import session
    build, w, count = _counted_step("half")
    step = build()
    X, Y = np.arange(12.0).reshape(4, 3) / 10, np.ones(4)
    for _ in range(3):
        step(X, Y)
    w_before, count_before = np.array(w.get_value()), float(count.get_value())
    context = session.current().context
    tail_of = context.step_tail

    def interrupted_tail(*args):
        tail_of(*args)

        def run() -> None:
            raise KeyboardInterrupt         # the gradient function has stored; nothing else has
        return run
    context.step_tail = interrupted_tail
    with pytest.raises(KeyboardInterrupt):
        step(X, Y)
    assert float(count.get_value()) == count_before == 3.0
    np.testing.assert_array_equal(np.asarray(w.get_value()), w_before)
    synk.fork(2)                            # and the run goes on from there
    build()(X, Y)
    assert [float(c) for c in synk.gather(count)] == [4.0, 4.0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", ["shm", pytest.param("jax", marks=pytest.mark.slow)])
@pytest.mark.parametrize("failing_step", [pytest.param(8, marks=pytest.mark.slow), 5])
def test_a_rank_failing_in_a_loop_step_leaves_the_masters_state_of_the_last_whole_step(collectives, failing_step):
    """A step of train.run fails on rank 1 (a host check of its rows) while the master waits in the
    all-reduce, its counter stored: the runtime is shut down, and the values the script keeps are
    those of the whole steps before, as one process stepping alone would have them. The last step,
    and the fifth (under "jax" the loop would run steps 2 to 5 as one block, stored whole or not at
    all: with host code, which can fail inside a block, it takes the steps one at a time)."""
    from helpers import RaiseIfNegative

    from synkhronos.errors import WorkerError
    from synkhronos.extensions import train, updates
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2, collectives=collectives)
    try:
        x = pt.matrix("x")
        w = pytensor.shared(np.zeros(2), name="w_failing_loop")
        count = pytensor.shared(np.float64(0), name="count_failing_loop")
        step = train.make_train_function((RaiseIfNegative()(x) @ w).mean(), [w], x, None, updates.sgd,
                                         learning_rate=1.0, state_updates=[(count, count + 1)])
        X = np.random.default_rng(0).random((64, 2)) + 0.5
        X[8 * failing_step - 4:8 * failing_step] = -1.0         # the failing step's rows on rank 1
        with pytest.raises(WorkerError, match="negative value"):
            train.run(step, synk.data(X), batch_size=8, epochs=1, shuffle=False)
        assert float(count.get_value()) == failing_step - 1
        with pytest.raises(RuntimeError, match=r"shut down by an error in train.run \(WorkerError"):
            train.run(step, synk.data(X), batch_size=8, epochs=1, shuffle=False)
        v = pytensor.shared(np.zeros(2))
        alone = pytensor.function([x], [], updates=[(v, v - x.mean(axis=0))])
        for k in range(failing_step - 1):
            alone(X[8 * k:8 * k + 8])
        np.testing.assert_allclose(w.get_value(), v.get_value(), rtol=1e-12)
    finally:
        synk.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", [pytest.param("shm", marks=pytest.mark.slow), "jax"])
def test_a_fault_the_teardown_meets_itself_tears_down_once(collectives):
    """A teardown asks the workers to stop and waits for them; a worker it killed a moment before
    (after a Ctrl-C) is seen dead by that wait, a fault of its own: it goes on once, and neither
    puts back nor releases twice (the comm released twice raised AttributeError in place of the
    interrupt)."""
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2, collectives=collectives)
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(3), name=f"w_teardown_{collectives}")
    f = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1.0)])
    f(np.ones((4, 3)))
    state = session.current()
    stop_workers, released = state.channel.stop_workers, []
    release = state.channel.release

    def meets_a_fault() -> None:
        state.channel.on_fault()        # what its wait does on seeing a worker dead
        stop_workers()

    def counted_release() -> None:
        released.append(1)
        release()
    state.channel.stop_workers, state.channel.release = meets_a_fault, counted_release
    synk.close()
    assert released == [1] and session.active() is None
    np.testing.assert_array_equal(w.get_value(), [1.0, 1.0, 1.0])
    synk.fork(2, collectives=collectives)
    try:
        assert float(synk.function([x], (x.sum(), "sum"))(np.ones((4, 3)))) == 12.0
    finally:
        synk.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", ["shm", "jax"])
@pytest.mark.slow
def test_a_ctrl_c_while_a_steps_update_runs_in_a_thread_keeps_a_whole_step(collectives):
    """A step called by the script: with collectives="jax" its all-reduce and update run in a thread
    of the master while the main thread watches, and a Ctrl-C lands in the main thread. The thread's
    update is let end before the teardown, so the counter its gradient stored is not put back under
    an update that then stores (counter one step behind the weights); with "shm" the update runs in
    the main thread and the Ctrl-C stops it, and the counter is put back."""
    import signal
    import time

    from synkhronos.extensions import train, updates
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2, collectives=collectives)
    try:
        build, w, count = _counted_step(f"threaded_step_{collectives}")
        step = build()
        X, Y = np.arange(12.0).reshape(4, 3) / 10, np.ones(4)
        update = session.current().registry.compiled[step.functions[1].spec.fid]
        run = update.run

        def interrupted(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)             # the main thread takes the Ctrl-C meanwhile
            return run(*args, **kwargs)
        update.run = interrupted
        with pytest.raises(KeyboardInterrupt):
            step(X, Y)                  # the first call: its gradient, the all-reduce, its update
        steps = int(float(count.get_value()))
        assert steps == (1 if collectives == "jax" else 0)
        v = pytensor.shared(np.full(3, 0.1))
        x, y = pt.matrix("x"), pt.vector("y")
        alone = train.make_single_process_train_function(((x @ v - y) ** 2).mean(), [v], x, y, updates.sgd,
                                                         learning_rate=0.1, mode="FAST_COMPILE")
        for _ in range(steps):
            alone(X, Y)
        np.testing.assert_allclose(w.get_value(), v.get_value(), rtol=1e-12)
    finally:
        synk.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("presses", [1, 2])
@pytest.mark.slow
def test_a_ctrl_c_while_the_loop_runs_in_a_thread_ends_it_after_a_whole_step(presses):
    """With collectives="jax" the master's loop runs in a thread of its own while the main thread
    watches the workers, and a Ctrl-C lands in the main thread: the loop ends after the step it is
    in (here between its gradient and its update), then the runtime is torn down. A second Ctrl-C
    while the step ends (an impatient user) does not cut that short."""
    import signal
    import time

    from synkhronos.extensions import train, updates
    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2, collectives="jax")
    try:
        build, w, count = _counted_step(f"threaded_loop{presses}")
        step = build()
        X = synk.data(np.arange(21.0).reshape(7, 3) / 50)
        Y = synk.data(np.ones(7))
        update = session.current().registry.compiled[step.functions[1].spec.fid]
        run, calls = update.run, []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:             # the third step: its gradient stored, its update not
                for _ in range(presses):
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.1)
                time.sleep(0.5)             # the main thread takes the Ctrl-C meanwhile
            return run(*args, **kwargs)
        update.run = interrupted
        with pytest.raises(KeyboardInterrupt) as pressed:
            train.run(step, X, Y, batch_size=7, steps=50, shuffle=False)   # 7 rows: a step at a time
        assert "Ctrl-C inside train.run" in " ".join(pressed.value.__notes__)
        assert float(count.get_value()) == 3.0
        v, n = pytensor.shared(np.full(3, 0.1)), pytensor.shared(np.float64(0))
        x, y = pt.matrix("x"), pt.vector("y")
        alone = train.make_single_process_train_function(((x @ v - y) ** 2).mean(), [v], x, y, updates.sgd,
                                                         learning_rate=0.1, state_updates=[(n, n + 1)],
                                                         mode="FAST_COMPILE")
        for _ in range(3):
            alone(np.arange(21.0).reshape(7, 3) / 50, np.ones(7))
        np.testing.assert_allclose(w.get_value(), v.get_value(), rtol=1e-12)
    finally:
        synk.close()


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_a_call_hands_the_values_back_is_named_and_shuts_the_runtime_down():
    """The values go back to the script after the command, in the call's last lines: a Ctrl-C
    there is one inside the call (named, the runtime shut down, the next call says so), not a bare
    interrupt leaving the values half handed back."""
    from conftest import child_pids, synk_segments

    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2)
    try:
        w = pytensor.shared(np.float64(0), name="w_handed_back")
        x = pt.vector("handback_x")
        f = synk.function([x], (x.sum(), "sum"), updates=[(w, w + 1)], name="handback")
        f(np.ones(3))
        state = session.current()
        workers, hand_back = list(state.worker_pids.values()), state.registry.values_to_user

        def pressed_meanwhile(*args, **kwargs):
            hand_back(*args, **kwargs)
            raise KeyboardInterrupt
        state.registry.values_to_user = pressed_meanwhile
        with pytest.raises(KeyboardInterrupt) as pressed:
            f(np.ones(3))
        assert "Ctrl-C inside a call of the function 'handback'" in " ".join(pressed.value.__notes__)
        with pytest.raises(RuntimeError, match=r"shut down \(Ctrl-C inside a call of the function"):
            f(np.ones(3))
        assert float(w.get_value()) == 2.0                                 # both calls' updates
        assert not set(workers) & {pid for pid, _ in child_pids()}
        assert not [name for name in synk_segments() if name.startswith(state.prefix)]
    finally:
        synk.close()


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_during_the_teardown_keeps_the_reason_for_the_next_call():
    """A Ctrl-C that lands outside the master's waits (here while it plans a call) tears the runtime
    down itself; a second one meanwhile is held until the teardown has run, then raised. Both
    interrupts carry the note, and the next call still says the runtime was shut down by a Ctrl-C
    (not that synkhronos "is not running"). Nothing is left behind."""
    import signal
    import time

    from conftest import child_pids, synk_segments

    from synkhronos.runtime import session
    if session.active() is not None:
        synk.close()
    synk.fork(2)
    try:
        x = pt.vector("pressed_twice_x")
        f = synk.function([x], (x.sum(), "sum"), name="pressed_twice")
        state = session.current()
        workers, kill = list(state.worker_pids.values()), state._kill_workers

        def killing_after_another_press() -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)                     # (held: raised once the teardown has run)
            kill()

        def planning(*args, **kwargs):
            raise KeyboardInterrupt             # the first Ctrl-C, while the master plans the call
        state._kill_workers = killing_after_another_press
        f._plan = planning
        with pytest.raises(KeyboardInterrupt) as pressed:
            f(np.ones(4))
        where = "Ctrl-C inside a call of the function 'pressed_twice'"
        assert where in " ".join(getattr(pressed.value, "__notes__", []))
        assert pressed.value.__context__ is not None        # the second press, raised after the first
        with pytest.raises(RuntimeError, match=rf"shut down \({where}"):
            f(np.ones(4))
        assert session.active() is None
        assert not set(workers) & {pid for pid, _ in child_pids()}
        assert not [name for name in synk_segments() if name.startswith(state.prefix)]
    finally:
        synk.close()


@pytest.mark.slow
def test_a_rank_failing_in_a_loop_says_only_the_error_and_leaves_no_segment():
    """The fault's teardown kills the workers, whose resource trackers then find their result
    segments gone: nothing of theirs reaches the user's stderr, and /dev/shm keeps nothing."""
    out = run_script("""
        import os
        import numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        from helpers import RaiseIfNegative
        from synkhronos.errors import WorkerError
        from synkhronos.extensions import train, updates
        synk.fork(2)
        x = pt.matrix("x")
        w = pytensor.shared(np.zeros(2), name="w")
        step = train.make_train_function((RaiseIfNegative()(x) @ w).mean(), [w], x, None, updates.sgd,
                                         learning_rate=1.0)
        X = np.ones((16, 2)); X[12:] = -1.0
        try:
            train.run(step, synk.data(X), batch_size=8, epochs=1, shuffle=False)
        except WorkerError as e:
            print("RAISED", os.getpid())
    """)
    assert out.returncode == 0 and "RAISED" in out.stdout, out.stderr[-3000:]
    assert out.stderr == ""
    pid = out.stdout.split("RAISED")[1].split()[0]
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{pid}_")] == []


def test_a_ctrl_c_between_a_loop_steps_gradient_and_its_update_leaves_the_state_of_a_whole_step(own_runtime):
    """The same in ``train.run``, whose master steps on its own device in the main thread."""
    from synkhronos.extensions import train
    from synkhronos.runtime import session
    build, w, count = _counted_step("half_loop")
    step = build()
    X, Y = synk.data(np.arange(48.0).reshape(16, 3) / 50), synk.data(np.ones(16))
    train.run(step, X, Y, batch_size=4, steps=3, shuffle=False)
    w_before, count_before = np.array(w.get_value()), float(count.get_value())
    update = session.current().registry.compiled[step.functions[1].spec.fid]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt             # the gradient function has stored; nothing else has
    update.run = interrupted
    with pytest.raises(KeyboardInterrupt):
        train.run(step, X, Y, batch_size=4, steps=2, shuffle=False)
    assert float(count.get_value()) == count_before == 3.0
    np.testing.assert_array_equal(np.asarray(w.get_value()), w_before)
