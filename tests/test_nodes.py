"""Several nodes, simulated on this machine: each node a script started by ``python -m synkhronos.launch``
in a mount namespace of its own with a private /dev/shm, so nothing can cross nodes through shared memory."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import segments_left_behind, synk_segments
from helpers import source_env

from synkhronos.api import checkpoint
from synkhronos.platform.cluster import find_node
from synkhronos.runtime.processes import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "nodes")
pytestmark = pytest.mark.nodes


def _namespaces_work():
    if shutil.which("unshare") is None:
        return "the unshare command is missing (util-linux)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -m with a tmpfs /dev/shm needs root: {probe.stderr.strip()}"
    return None


NO_NAMESPACES = _namespaces_work()
needs_namespaces = pytest.mark.skipif(NO_NAMESPACES is not None, reason=str(NO_NAMESPACES))


def start_nodes(script, args, n_nodes, per_node, logs, private_shm=True, only=None, pin=False,
                nnodes=None, launcher=(), port=None):
    """Start ``script`` on ``n_nodes`` simulated nodes of ``per_node`` devices; return the processes.

    With ``private_shm`` each node runs in a mount namespace of its own with a tmpfs /dev/shm;
    without, the nodes share /dev/shm (each runtime's segments have a prefix of their own).
    ``only`` starts just those nodes (the others never come). ``pin``: node k runs on core
    k only, as on machines of their own (a node that sleeps lends no core to another).
    ``nnodes`` (default ``n_nodes``) and ``launcher`` (more options) go to the launcher; ``port``:
    the coordinator's (default: a free one).
    """
    port = free_port() if port is None else port
    procs = []
    for node in (range(n_nodes) if only is None else only):
        launch = [sys.executable, "-m", "synkhronos.launch", "--nnodes", str(nnodes or n_nodes),
                  "--node-rank", str(node), "--coordinator", f"127.0.0.1:{port}",
                  "--devices-per-node", str(per_node), *launcher, script] + [str(a) for a in args]
        if pin:
            cores = sorted(os.sched_getaffinity(0))
            launch = ["taskset", "-c", str(cores[node % len(cores)])] + launch
        if private_shm:
            inner = "mount -t tmpfs tmpfs /dev/shm && exec " + " ".join(f"'{a}'" for a in launch)
            launch = ["unshare", "-m", "sh", "-c", inner]
        log = open(os.path.join(logs, f"node{node}.log"), "w")
        env = source_env(HERE, SYNK_TEST_NODES=str(logs))
        procs.append(subprocess.Popen(launch, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    return procs


def wait_all(procs, logs, timeout):
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the nodes did not finish within {timeout} s:\n" + read_logs(logs))
    return codes


def read_logs(logs):
    text = []
    for name in sorted(os.listdir(logs)):
        if name.endswith(".log"):
            lines = [line for line in open(os.path.join(logs, name)) if line[:2] not in ("W1", "I1")]
            text.append(f"--- {name}\n" + "".join(lines[-40:]))
    return "\n".join(text)


def run_same_results(tmp_path, n_nodes, per_node, private_shm=True):
    out = tmp_path / f"{n_nodes}x{per_node}"
    out.mkdir()
    procs = start_nodes(os.path.join(SCRIPTS, "same_results.py"), [out], n_nodes, per_node, out,
                        private_shm)
    codes = wait_all(procs, out, timeout=240)
    assert codes == [0] * n_nodes, read_logs(out)
    return [dict(np.load(out / f"node{node}.npz")) for node in range(n_nodes)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("per_node,private_shm", [
    pytest.param(1, True, marks=needs_namespaces),   # the cross-node step alone
    pytest.param(2, True, marks=needs_namespaces),   # shared memory within each node too
    pytest.param(1, False, marks=pytest.mark.skipif(   # no namespaces: a segment prefix per node
        NO_NAMESPACES is None, reason="namespaces work: the private /dev/shm runs cover this"))])
def test_two_nodes_compute_what_one_node_computes(tmp_path, per_node, private_shm):
    nodes = run_same_results(tmp_path, 2, per_node, private_shm)
    one = run_same_results(tmp_path, 1, 2 * per_node, private_shm)[0]
    for key in one:
        if key.startswith("ref_"):
            continue
        for node, got in enumerate(nodes):     # every master gets the same result, the one-node one
            if not key.startswith("sharded_"):     # (node shards: each layout its own rows)
                np.testing.assert_allclose(got[key], one[key], rtol=1e-10, atol=1e-12,
                                           err_msg=f"{key} on node {node}")
            if f"ref_{key}" in got:            # and the single-process PyTensor function's
                np.testing.assert_allclose(got[key], got[f"ref_{key}"], rtol=1e-9, atol=1e-12,
                                           err_msg=f"{key} on node {node} against one process")
    for node, got in enumerate(nodes):
        assert bool(got["restored_params"]), f"node {node} restored other parameters"
        assert str(got["lacking_exists"]).startswith("FileNotFoundError: no checkpoint is found by node 1 at ")
        assert str(got["lacking_restore"]).startswith("ValueError: node 1 cannot read the checkpoint")
        for key in ("all_reduce_sum_every_rank", "broadcast_every_rank", "restored_every_rank",
                    "get_value_every_rank"):
            np.testing.assert_array_equal(got[key], got[f"ref_{key}"], err_msg=f"{key} on node {node}")


def test_the_launcher_variables_place_the_node():
    place = find_node({"SYNK_NNODES": "3", "SYNK_NODE_RANK": "2", "SYNK_COORDINATOR": "10.1.2.3:999",
                       "SYNK_DEVICES_PER_NODE": "4"})
    assert (place.n_nodes, place.node_rank, place.coordinator, place.devices_per_node) == \
        (3, 2, "10.1.2.3:999", 4)
    with pytest.raises(ValueError, match="SYNK_COORDINATOR is not set"):
        find_node({"SYNK_NNODES": "2", "SYNK_NODE_RANK": "0"})
    for address in ("127.0.0.1:99999", "127.0.0.1:0", "nohost", "host:port"):
        with pytest.raises(ValueError, match="a port from 1 to 65535"):
            find_node({"SYNK_NNODES": "2", "SYNK_NODE_RANK": "0", "SYNK_COORDINATOR": address})
    refused = subprocess.run([sys.executable, "-m", "synkhronos.launch", "--nnodes", "2",
                              "--node-rank", "0", "--coordinator", "127.0.0.1:99999", "x.py"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert refused.returncode == 2 and "a port from 1 to 65535" in refused.stderr


def test_multi_node_timeline_tracks_name_their_node_and_rank(tmp_path):
    from synkhronos.tracing import trace
    def recorded():
        trace.start()
        trace.begin("call", "f")
        trace.end("compute")
        return trace.stop()
    spans = {2: recorded(), 3: recorded()}
    trace.write_chrome_trace(tmp_path / "t.json", spans, master_rank=2, node=1)
    events = __import__("json").load(open(tmp_path / "t.json"))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {2: "rank 2 (node 1, master)", 3: "rank 3 (node 1, worker)"}
    assert {e["pid"] for e in events if e.get("ph") == "X"} <= set(names)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_taken_coordinator_port_is_named_and_fork_works_after(tmp_path):
    """Node 0 cannot serve the coordination service on a port in use: fork() raises naming the
    address, leaves nothing behind, and a one-node fork() works after it."""
    script = tmp_path / "taken.py"
    script.write_text(
        "import os, socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "address = f'127.0.0.1:{s.getsockname()[1]}'\n"
        "node = dict(SYNK_NNODES='2', SYNK_NODE_RANK='0', SYNK_COORDINATOR=address)\n"
        "os.environ.update(node)\n"
        "import synkhronos as synk\n"
        "try:\n"
        "    synk.fork(1)\n"
        "    print('forked')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', address in str(e), e)\n"
        "for var in node:\n"
        "    del os.environ[var]\n"
        "print('AGAIN', synk.fork(2))\n"
        "synk.close()\n")
    before = set(synk_segments())
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                         cwd=ROOT, env=source_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert "RAISED True" in run.stdout and "is the port in use" in run.stdout, run.stdout
    assert "AGAIN 2" in run.stdout, run.stdout
    assert not segments_left_behind(before)


def test_slurm_is_detected_through_jax(monkeypatch):
    """The variables srun sets for task 1 of a two-node job: JAX's detection gives node and coordinator."""
    for var in ("SYNK_NNODES", "SYNK_NODE_RANK", "SYNK_COORDINATOR", "JAX_COORDINATOR_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[017-018]")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    place = find_node()
    assert place.source == "SlurmCluster"
    assert (place.n_nodes, place.node_rank) == (2, 1)
    host, port = place.coordinator.split(":")
    assert host == "gpu017" and int(port) == 4242 % 4096 + 65535 - 4096 + 1


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(180)
@pytest.mark.parametrize("doing,per_node,victim", [("call", 1, 1), ("all_reduce", 1, 1),
                                                   ("all_reduce", 2, 1), ("call", 1, 0),
                                                   ("all_reduce", 2, 0), ("run", 1, 1)])
def test_a_killed_node_is_named_on_the_other_within_ten_seconds(tmp_path, doing, per_node, victim):
    """Node ``victim``'s master kills itself; the other node names it. Node 0 also serves the
    coordination service, so its death takes that with it."""
    procs = start_nodes(os.path.join(SCRIPTS, "killed_node.py"), [tmp_path, doing, victim], 2,
                        per_node, tmp_path)
    codes = wait_all(procs, tmp_path, timeout=120)
    survivor = 1 - victim
    assert codes[survivor] == 0 and codes[victim] != 0, read_logs(tmp_path)
    result = __import__("json").load(open(tmp_path / "result.json"))
    assert result["error"] is not None, result
    assert result["node"] == victim and result["how"] == "died", result
    assert f"node {victim}" in result["error"], result
    assert result["seconds"] < 10, result
    assert result["closed"] and result["segments"] == [], result
    pids = [p for node in (0, 1) for p in __import__("json").load(open(tmp_path / f"pids{node}.json"))]
    deadline = time.time() + 10
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes of the nodes are left"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stalled_node_is_named_on_the_other_and_leaves_nothing_when_it_wakes(tmp_path):
    """Node 1's master stops (SIGSTOP); node 0 names it within 10 s, then wakes it (SIGCONT).

    The woken node finds itself declared lost: JAX's coordination client ends it (its own fatal
    error; the missed-heartbeat callback that would avoid it cannot be set from Python), or it
    raises naming node 0. Either way every process ends and no segment of either node is left:
    both nodes share this machine's /dev/shm here, so the test sees the stalled node's segments.
    """
    procs = start_nodes(os.path.join(SCRIPTS, "killed_node.py"), [tmp_path, "call", 1, "stall"],
                        2, 1, tmp_path, private_shm=False)
    codes = wait_all(procs, tmp_path, timeout=120)
    assert codes[0] == 0, read_logs(tmp_path)
    result = __import__("json").load(open(tmp_path / "result.json"))
    assert result["node"] == 1 and result["how"] == "died" and "node 1" in result["error"], result
    assert result["seconds"] < 10 and result["closed"] and result["segments"] == [], result
    woke = tmp_path / "woke.json"
    if codes[1] == 0:          # it ran Python again: it must have raised naming node 0
        woke = __import__("json").load(open(woke))
        assert woke["node"] == 0 and woke["closed"] and woke["segments"] == [], woke
    prefixes = [open(tmp_path / f"prefix{node}.txt").read() for node in (0, 1)]
    pids = [p for node in (0, 1) for p in __import__("json").load(open(tmp_path / f"pids{node}.json"))]
    deadline = time.time() + 15
    while time.time() < deadline and (any(_alive(p) for p in pids)
                                      or _segments_with(prefixes)):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "processes of the nodes are left"
    assert not _segments_with(prefixes), _segments_with(prefixes)


def _segments_with(prefixes):
    return [n for n in os.listdir("/dev/shm") if n.startswith(tuple(prefixes))]


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(300)
def test_the_demo_on_two_nodes_trains_as_on_one(tmp_path):
    demo = os.path.join(ROOT, "demos", "mnist.py")
    args = ["--devices", "1", "--epochs", "3", "--plot", tmp_path / "two.png"]
    procs = start_nodes(demo, args, 2, 1, tmp_path)
    assert wait_all(procs, tmp_path, timeout=240) == [0, 0], read_logs(tmp_path)
    printed = open(tmp_path / "node0.log").read().replace("\r", "\n").splitlines()
    two = [line for line in printed if line.startswith("test accuracy")]
    assert not [line for line in open(tmp_path / "node1.log") if line.startswith("test accuracy")]
    one = subprocess.run([sys.executable, demo, "--devices", "2", "--epochs", "3", "--plot",
                          str(tmp_path / "one.png")], capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    one = [line for line in one.stdout.splitlines() if line.startswith("test accuracy")]
    assert len(two) == 1 and len(one) == 1, (two, one)
    assert two[0].split()[2] == one[0].split()[2], (two, one)      # the same test accuracy


@needs_namespaces
@pytest.mark.timeout(180)
@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1, 2])
def test_nodes_making_different_calls_both_raise_naming_them(tmp_path, per_node):
    """Each node raises NodesDiverged, naming both calls, and its ranks go on with the next call
    together (with several devices a node's workers, which prepared the collective the nodes
    disagreed on, skip it)."""
    procs = start_nodes(os.path.join(SCRIPTS, "diverged.py"), [tmp_path, per_node], 2, per_node, tmp_path)
    assert wait_all(procs, tmp_path, timeout=120) == [0, 0], read_logs(tmp_path)
    runs = []
    for node in (0, 1):
        got = __import__("json").load(open(tmp_path / f"node{node}.json"))
        assert got["error"] is not None, got
        assert "a call of f" in got["error"] and "a call of g" in got["error"], got
        assert "same synkhronos calls in the same order" in got["error"], got
        assert got["after"] == 12.0, got           # the next identical call works on both
        # the same function on other rows, other indices or other Data: named, on both nodes
        rows, indices, data = (got["errors"][k] for k in ("rows", "indices", "data"))
        assert "rows 0:5" in rows and "rows 0:2" in rows, got
        assert indices and "3 indices (digest" in indices, got
        assert data and "data" in data, got
        # and the same function on other values given whole (numpy rows, a broadcast scalar, the
        # rows a givens index selects): every device would take its share of each node's own
        for what in ("values", "scalar", "givens", "scatter", "scatter rows"):
            assert got["errors"][what] and "values given (digest" in got["errors"][what], (what, got)
        reduced, by_op = got["errors"]["all_reduce"], got["errors"]["all_reduce op"]
        assert reduced and "all_reduce of held" in reduced and "all_reduce of other" in reduced, got
        assert by_op and "op sum" in by_op and "op max" in by_op, got
        assert got["alike"] == np.arange(24.0)[8:16].sum(), got
        assert set(got["next_calls"].values()) == {12.0}, got   # the call after each, whole
        # a call refused on node 1 before it ran: node 0's same call raises, naming it
        refused = got["errors"]["refused"]
        assert refused.startswith("TypeError" if node == 1 else "NodesDiverged"), got
        assert node == 1 or "refused on its node before it ran" in refused, got
        refused_set = got["errors"]["set_value refused"]
        assert refused_set.startswith("TypeError" if node == 1 else "NodesDiverged"), got
        assert node == 1 or "set_value (refused on its node before it ran)" in refused_set, got
        for what in ("set_value", "get_value"):
            assert "of held" in got["errors"][what] and "of other" in got["errors"][what], (what, got)
        assert "checkpoint: digests of" in got["errors"]["save"], got
        # a restore whose variables node 1's checkpoint does not hold: refused there, named on node 0
        restored = got["errors"]["restore"]
        assert restored.startswith("ValueError" if node == 1 else "NodesDiverged"), got
        assert node == 1 or "restore (refused on its node before it ran)" in restored, got
        # a step whose update each node built with another learning rate: its graphs differ
        rate = got["errors"]["learning rate"]
        assert rate and rate.startswith("NodesDiverged") and "graph digest" in rate, got
        run_rate = got["errors"]["train.run rate"]
        assert run_rate and "train.run of" in run_rate and "graph digest" in run_rate, got
        assert got["unstepped"] == [[0.0, 0.0]] * (2 * per_node), got
        assert got["errors"]["keywords"] is None and got["errors"]["index type"] is None, got
        assert np.isfinite(got["first_step"]), got
        # a run of other batch sizes is refused before any step; the same run then trains alike
        run = got["errors"]["train.run"]
        assert run and "train.run of 8 rows a step" in run and "of 4 rows a step" in run, got
        assert got["untrained"] == [0.0, 0.0] and got["trained"][0] != [0.0, 0.0], got
        assert all(t == got["trained"][0] for t in got["trained"]), got
        runs.append(got["trained"])
        checked = got["errors"]["on_check"]         # the nodes agree on each check's decision
        assert checked and checked.startswith("NodesDiverged") and "on_check at step 4" in checked, got
        assert all(c == got["checked"][0] for c in got["checked"]), got
        runs.append(got["checked"])
        # a scatter is compared before any node runs it; the same scatter then runs as on one node
        n, rows = 2 * per_node, np.arange(8.0).reshape(4, 2)
        assert got["kept"] == [np.zeros((2, 2)).tolist()] * n, got
        assert got["scattered"] == [rows[r * 4 // n:(r + 1) * 4 // n].tolist() for r in range(n)], got
    assert runs[:2] == runs[2:]             # (each node's trained, then checked, weights)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_what_nodes_compare_of_graphs_is_the_same_in_processes_of_other_hash_seeds():
    """Nodes compare a function's graphs by a digest that must not depend on the process: pytensor-ml
    layers, Adam, random draws and a Mode object print alike under two hash seeds."""
    printed = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "graph_texts.py")], timeout=150,
                              capture_output=True, text=True, env=source_env(PYTHONHASHSEED=seed))
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.splitlines())
    assert len(printed[0]) == 5 and all("graph digest" in line for line in printed[0]), printed
    assert printed[0] == printed[1], printed
    assert len({line.split()[-1] for line in printed[0]}) == 5, printed      # each its own


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("present", [0, 1])
def test_a_node_whose_peer_never_starts_raises_in_time_and_leaves_nothing(tmp_path, present):
    """Node 0 (which serves the coordination service) or node 1 alone: fork() raises a SynkError
    naming the node that did not join, within its timeout and a few seconds."""
    before = set(synk_segments())
    procs = start_nodes(os.path.join(SCRIPTS, "alone.py"), [tmp_path, 3], 2, 1, tmp_path,
                        private_shm=False, only=[present])
    assert wait_all(procs, tmp_path, timeout=60) == [0], read_logs(tmp_path)
    got = __import__("json").load(open(tmp_path / f"node{present}.json"))
    assert got["type"] == "SynkError" and f"node {1 - present} did not join" in got["error"], got
    assert got["seconds"] < 3 + 8, got           # JAX's client gives up 5 s after its deadline
    assert not segments_left_behind(before)
    assert not processes_running("synkhronos/platform/coordination.py")


def processes_running(text, started_for=None):
    """PIDs of the processes whose command line holds ``text``; with ``started_for`` (a test's logs
    folder), only those its nodes started (their environment names it: another test's are not
    this test's business, in parallel runs)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() not in fh.read():
                    continue
            if started_for is not None:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if f"SYNK_TEST_NODES={started_for}".encode() not in fh.read().split(b"\0"):
                        continue
            found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


# ------------------------------------------------------------------------------------------------
# The asynchronous rules across nodes: node 0 serves the center
# ------------------------------------------------------------------------------------------------

def _exchange(name, center, x):
    """One device's exchange at learning rate 0 under the rules of nodes/asynchronous.py: the new
    center and device values."""
    if name == "easgd":                          # EASGD(0.5): d = alpha (x - c)
        d = 0.5 * (x - center)
        return center + d, x - d
    if name == "downpour":                       # nothing learned since the last pull: no update
        return center, center
    blended = 0.3 * center + 0.6 * x             # RateLimited(alpha=0.3, beta=0.6)
    return blended, blended


def _centers_after(name, starts, exchanges):
    """Every center the devices can leave, from their ``starts``, each making ``exchanges[r]``
    exchanges in any interleaving; the center starts at device 0's (node 0's master's) values."""
    outcomes = []

    def walk(center, values, left):
        if not any(left):
            outcomes.append(center)
            return
        for r, k in enumerate(left):
            if k:
                c, x = _exchange(name, center, values[r])
                walk(c, values[:r] + [x] + values[r + 1:], left[:r] + [k - 1] + left[r + 1:])
    walk(starts[0], list(starts), list(exchanges))
    return outcomes


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(240)
@pytest.mark.parametrize("per_node", [1, 2])
def test_the_asynchronous_rules_train_across_nodes_on_node_zeros_center(tmp_path, per_node):
    procs = start_nodes(os.path.join(SCRIPTS, "asynchronous.py"), [tmp_path], 2, per_node, tmp_path)
    assert wait_all(procs, tmp_path, 200) == [0, 0], read_logs(tmp_path)
    nodes = [dict(np.load(tmp_path / f"node{node}.npz")) for node in range(2)]
    n = 2 * per_node
    starts = [(r + 1) * np.array([1.0, 2.0, 3.0]) for r in range(n)]
    for name in ("easgd", "downpour", "rate_limited"):
        for node, got in enumerate(nodes):
            # one exchange per unit of work (4 rows each), by whichever device claimed it
            exchanges = [int(rows) // 4 for rows in got[f"{name}_exchange_rows"]]
            assert sum(exchanges) == n, (name, exchanges)
            center = got[f"{name}_center"]
            assert (center == center[0]).all(), f"{name}: every device holds the center"
            possible = _centers_after(name, starts, exchanges)
            assert any(np.allclose(center[0], c, rtol=1e-12) for c in possible), \
                f"{name} on node {node}: {center[0]} is none of the rule's {possible}"
            assert got[f"{name}_accuracy"] >= 0.95, (name, per_node, got[f"{name}_accuracy"])
            assert bool(got[f"{name}_same_everywhere"]) and got[f"{name}_epochs"] == 40
            assert min(got[f"{name}_rows"]) > 0, f"{name}: every device of every node trained"
        np.testing.assert_array_equal(nodes[0][f"{name}_center"], nodes[1][f"{name}_center"])
    for got in nodes:        # resumed at step 4 of 8: steps 4 to 7 only, 10 rows each
        assert got["resume_steps"].tolist() == [2, 4, 6, 8], got["resume_steps"]
        assert got["resume_rows"].tolist() == [20, 20, 20, 20], got["resume_rows"]
    assert not processes_running("synkhronos.runtime.centers", tmp_path), "node 0's center server is left"


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", [1, 0])
def test_an_asynchronous_run_goes_on_without_a_lost_node_but_not_without_node_zero(tmp_path, victim):
    procs = start_nodes(os.path.join(SCRIPTS, "lost_node.py"), [tmp_path, victim], 2, 1, tmp_path)
    codes = wait_all(procs, tmp_path, 150)
    survivor = 1 - victim
    assert codes[survivor] == 0 and codes[victim] == -signal.SIGKILL, read_logs(tmp_path)
    seen = json.load(open(tmp_path / "survivor.json"))
    if victim == 1:      # node 0 trains on: the run ends, names the loss, and the model is trained
        assert [node for _, node in seen["lost_nodes"]] == [1], seen
        assert len(seen["warnings"]) == 1 and "node 1 was lost" in seen["warnings"][0], seen
        assert seen["epochs"] == 40 and seen["accuracy"] >= 0.95, seen
    else:                # node 0 serves the center: the other node's run ends, naming it
        killed_at = float(open(tmp_path / "killed_at.txt").read())
        assert (seen["node"], seen["how"]) == (0, "died"), seen
        assert seen["at"] - killed_at < 10, seen
    assert seen["closed"] is True, seen
    pids = [p for node in range(2) for p in json.load(open(tmp_path / f"pids{node}.json"))]
    deadline = time.time() + 15          # a coordination service outlives its killed master a while
    while time.time() < deadline and [p for p in pids if _alive(p)]:
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "processes of the nodes are left"
    assert not processes_running("synkhronos.runtime.centers", tmp_path), "node 0's center server is left"


@pytest.mark.serial
@pytest.mark.slow
@needs_namespaces
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                    reason="needs a core for each of two nodes, and taskset to pin them")
@pytest.mark.timeout(200)
def test_node_zero_outpaces_allreduce_under_downpour_when_node_one_straggles(tmp_path):
    # each node on a core of its own, as on machines of their own: the straggler's sleep lends
    # no core to node 0
    procs = start_nodes(os.path.join(SCRIPTS, "straggler.py"), [tmp_path], 2, 1, tmp_path, pin=True)
    assert wait_all(procs, tmp_path, 150) == [0, 0], read_logs(tmp_path)
    rates = json.load(open(tmp_path / "rates.json"))
    print("node 0's rows/s with node 1 straggling:", rates)
    assert rates["Downpour"] >= 1.3 * rates["AllReduce"], rates


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(200)
def test_an_asynchronous_run_across_nodes_killed_and_resumed_continues_its_steps_and_rows(tmp_path):
    script = os.path.join(SCRIPTS, "killed_resume.py")
    killed = start_nodes(script, [tmp_path, 6, 0], 2, 1, tmp_path)
    assert wait_all(killed, tmp_path, 100) == [-signal.SIGKILL] * 2, read_logs(tmp_path)
    resumed = start_nodes(script, [tmp_path, 0, 1], 2, 1, tmp_path)
    assert wait_all(resumed, tmp_path, 100) == [0, 0], read_logs(tmp_path)
    for node in range(2):
        checks = [json.loads(line) for line in open(tmp_path / f"checks{node}.jsonl")]
        # killed at the check of step 6 (its checkpoint written): steps 6 to 11 again from there,
        # 10 rows each, no more
        assert checks == [[2, 20], [4, 20], [6, 20], [8, 20], [10, 20], [12, 20]], checks
    deadline = time.time() + 15          # the killed run's coordination service stays a while
    while time.time() < deadline and processes_running("synkhronos.runtime.centers", tmp_path):
        time.sleep(0.5)
    assert not processes_running("synkhronos.runtime.centers", tmp_path), "node 0's center server is left"


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(120)
def test_a_center_node_zero_cannot_serve_is_named_on_every_node_and_a_rule_of_ones_own_merges_there(tmp_path):
    procs = start_nodes(os.path.join(SCRIPTS, "unservable.py"), [tmp_path], 2, 1, tmp_path)
    assert wait_all(procs, tmp_path, 100) == [0, 0], read_logs(tmp_path)
    for node in range(2):
        seen = json.load(open(tmp_path / f"node{node}.json"))
        assert seen["node"] == 0 and "could not serve the center" in seen["error"], seen
        assert "made to fail by the test" in seen["error"], seen
        assert seen["after"] < 0.1, seen            # the runtime trains on after the refusal
        assert seen["own_merge"] == [42.0, 42.0, 42.0], seen     # the script's own merge, on node 0


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(300)
def test_strangers_at_node_zeros_center_change_nothing_of_the_run(tmp_path):
    """While both nodes train under Downpour, a process that is not part of the run sends node 0's
    center server junk, wrong tokens, malformed requests (a pickle among them) and frames of
    128 MiB: the server drops each before parsing it, unpickles nothing, stays small and serves
    on, and the run ends with the model it would have learned anyway."""
    procs = start_nodes(os.path.join(SCRIPTS, "center_attacked.py"), [tmp_path], 2, 1, tmp_path)
    assert wait_all(procs, tmp_path, 240) == [0, 0], read_logs(tmp_path)
    nodes = [json.load(open(tmp_path / f"node{node}.json")) for node in range(2)]
    stranger = json.load(open(tmp_path / "stranger.json"))
    assert nodes[0]["stranger_code"] == 0, read_logs(tmp_path)
    for node, seen in enumerate(nodes):
        assert seen["error"] is None, (node, seen)
        np.testing.assert_allclose(seen["w"], [[1.0, 2.0, 3.0]] * 2, atol=1e-6,
                                   err_msg=f"node {node}")
    assert nodes[0]["server_alive"] and stranger["alive"], stranger
    for probe in ("hello", "wrong_password", "wrong_token", "wrong_token_old_format",
                  "big_wrong_token"):
        assert stranger[probe] is None, (probe, stranger)        # a stranger gets no answer
    for probe, reply in stranger["malformed"].items():           # ours, malformed: refused
        assert reply is None or reply[0] == "!error", (probe, reply)
    assert not stranger["unpickled"], stranger
    assert stranger["big_right_token"] is None, stranger
    assert stranger["raw_endless"].startswith("closed"), stranger
    assert stranger["hwm_after"] - stranger["hwm_before"] < 32 << 20, stranger
    assert stranger["values"] is not None and stranger["values"][0] != "!error", stranger
    assert not processes_running("synkhronos.runtime.centers", tmp_path), "node 0's center server is left"


@pytest.mark.slow
@needs_namespaces
@pytest.mark.timeout(200)
@pytest.mark.parametrize("per_node", [1, 2])
def test_a_killed_center_server_is_named_on_every_node_within_ten_seconds(tmp_path, per_node):
    """Node 0 SIGKILLs its center server mid-run: node 0 notices, tells the other node through the
    coordination service, and both raise naming the server within 10 s; nothing is left."""
    procs = start_nodes(os.path.join(SCRIPTS, "center_killed.py"), [tmp_path], 2, per_node, tmp_path)
    assert wait_all(procs, tmp_path, 120) == [0, 0], read_logs(tmp_path)
    killed_at = float(open(tmp_path / "killed_at.txt").read())
    for node in range(2):
        seen = json.load(open(tmp_path / f"node{node}.json"))
        assert seen["error"] is not None, (node, seen)
        assert "center server" in seen["error"] and "died" in seen["error"], (node, seen)
        if per_node == 1:     # else a worker of either node, a client of the server too, may be first
            assert (seen["node"], seen["how"]) == (0, "died"), (node, seen)
        assert seen["at"] - killed_at < 10, (node, seen["at"] - killed_at)
        assert seen["closed"] is True, (node, seen)
    pids = [p for node in range(2) for p in json.load(open(tmp_path / f"pids{node}.json"))]
    deadline = time.time() + 15          # a coordination service outlives its killed master a while
    while time.time() < deadline and [p for p in pids if _alive(p)]:
        time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "processes of the nodes are left"
    assert not processes_running("synkhronos.runtime.centers", tmp_path), "node 0's center server is left"


# --- elastic runs: python -m synkhronos.launch --nnodes MIN:MAX --max-restarts K --------------------

def _elastic(tmp_path, name, rule, victim, launcher, pause=0.0, n_nodes=3, kill_at=60, again=-1, low=2):
    out = tmp_path / name
    out.mkdir()
    script = os.path.join(SCRIPTS, "elastic.py")
    port = free_port()
    procs = start_nodes(script, [out, out / "ckpt", rule, victim, kill_at, pause, 300, again], n_nodes, 1,
                        out, nnodes=f"{low}:{n_nodes}", launcher=launcher, port=port)
    return out, script, port, procs


def _checks(out, node):
    return [json.loads(line)[:2] for line in open(out / f"checks{node}.jsonl") if '"kill"' not in line]


def _killed_at(out, node):
    """When ``node`` killed its launcher (time.time()), or None."""
    return next((json.loads(line)[2] for line in open(out / f"checks{node}.jsonl") if '"kill"' in line), None)


def _finals(out, node):
    with np.load(out / f"final{node}.npz") as z:
        return [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]


def _accuracies(logs):
    return [float(line.split()[-1]) for line in logs.splitlines() if line.startswith("EVALUATED")]


def _resumed_on(tmp_path, name, script, checkpoint, rule, n_nodes, steps=300):
    """The uninterrupted run on ``n_nodes`` nodes resumed from ``checkpoint``: its output directory."""
    reference = tmp_path / name
    reference.mkdir()
    shutil.copytree(checkpoint, reference / "ckpt")
    codes = wait_all(start_nodes(script, [reference, reference / "ckpt", rule, -1, 0, 0, steps],
                                 n_nodes, 1, reference), reference, timeout=150)
    assert codes == [0] * n_nodes, read_logs(reference)
    return reference


def _nothing_left(out):
    deadline = time.time() + 10
    while processes_running(str(out)) and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_running(str(out))


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("rule", ["allreduce", "downpour"])
def test_an_elastic_run_goes_on_without_a_lost_node_and_trains_the_digits(tmp_path, rule):
    """3 nodes train the digits MLP; node 2 is killed (launcher, script, workers) at step 60. The
    survivors' launchers start the script again on 2 nodes, which resumes from the step-60
    checkpoint (Downpour: from its center, on 2 devices of the 3 it was written on), finishes at
    >= 95% test accuracy, evaluates and saves. Under AllReduce the parameters equal those of an
    uninterrupted 2-node run resumed from that checkpoint (1e-10)."""
    out, script, _, procs = _elastic(tmp_path, "elastic", rule, 2, ["--max-restarts", "2"])
    codes = wait_all(procs, out, timeout=300)
    logs = read_logs(out)
    assert codes[:2] == [0, 0] and codes[2] != 0, logs
    # node 0's own check of step 60 races with node 2's kill at its check of step 60
    assert _checks(out, 0) in ([[s, 3] for s in steps] + [[s, 2] for s in range(80, 301, 20)]
                               for steps in [(20, 40), (20, 40, 60)]), logs
    assert logs.count("round 1 ended (a node was lost); restart 1 of 2") == 2, logs
    assert logs.count("train.run: resumed at step 60 on 3 to 2 nodes, 3 to 2 devices") == 2, logs
    accuracies = _accuracies(logs)
    assert len(accuracies) == 2 and min(accuracies) >= 0.95, logs
    assert (out / "after.safetensors").exists(), logs
    assert all(np.array_equal(a, b) for a, b in zip(_finals(out, 0), _finals(out, 1)))
    if rule == "allreduce":
        reference = _resumed_on(tmp_path, "reference", script, out / "at_restart1", rule, 2)
        for node in (0, 1):
            for got, want in zip(_finals(out, node), _finals(reference, node)):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    _nothing_left(out)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim,again,message", [
    (2, 40, "--max-restarts 1 exhausted; giving up"),
    (0, -1, "node 0's launcher (the rendezvous) was lost; the run ends on every node"),
])
def test_an_elastic_run_ends_on_every_survivor_when_it_cannot_go_on(tmp_path, victim, again, message):
    """--max-restarts 1, --nnodes 1:3. Node 2 is lost at step 20, the run goes on on 2 nodes, and node 1
    is lost at step 40 of that round: restarts are exhausted, node 0 ends with exit code 1 and says so.
    Or node 0 (the rendezvous) is lost at step 20: both survivors end so. Within 15 s of the loss, and
    nothing is left behind."""
    out, _, _, procs = _elastic(tmp_path, f"ends{victim}", "allreduce", victim, ["--max-restarts", "1"],
                                kill_at=20, again=again, low=1)
    ended_at = {}
    deadline = time.time() + 150
    while len(ended_at) < 3 and time.time() < deadline:
        for node, p in enumerate(procs):
            if node not in ended_at and p.poll() is not None:
                ended_at[node] = time.time()
        time.sleep(0.05)
    codes = wait_all(procs, out, timeout=10)
    logs = read_logs(out)
    survivors = [0] if again > 0 else [1, 2]
    assert all(codes[node] == 1 for node in survivors), (codes, logs)
    assert all(codes[node] not in (0, 1) for node in range(3) if node not in survivors), (codes, logs)
    assert logs.count(message) == len(survivors) and "restart 2 of 1" not in logs, logs
    last_loss = _killed_at(out, 1) if again > 0 else _killed_at(out, victim)
    assert last_loss is not None, logs
    assert max(ended_at[node] for node in survivors) - last_loss < 15, (ended_at, last_loss, logs)
    _nothing_left(out)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_lost_node_started_again_rejoins_and_the_run_ends_on_every_node(tmp_path):
    """DiLoCo; node 2 is killed at step 60; its launch command, run again, joins the survivors' run,
    which starts again on 3 nodes from the latest checkpoint (its outer parameters and momentum
    with it); every node ends with the same parameters, at >= 95% test accuracy. The 2-node stretch
    equals an uninterrupted 2-node run from the step-60 checkpoint (1e-10)."""
    out, script, port, procs = _elastic(tmp_path, "rejoin", "diloco", 2, ["--max-restarts", "3"], pause=1.0)
    procs[2].wait(timeout=150)
    deadline = time.time() + 90           # the survivors train on 2 nodes before it comes back
    while not ((out / "checks0.jsonl").exists() and [80, 2] in _checks(out, 0)) and time.time() < deadline:
        time.sleep(0.1)
    again = start_nodes(script, [out, out / "ckpt", "diloco", 2, 60, 1.0], 3, 1, out, only=[2],
                        nnodes="2:3", launcher=["--max-restarts", "3"], port=port)
    codes = wait_all(procs[:2] + again, out, timeout=300)
    logs = read_logs(out)
    assert codes == [0, 0, 0], logs
    nodes_per_check = [n for step, n in _checks(out, 0) if step <= 80]   # (60: as in the test above)
    assert nodes_per_check in ([3, 3, 2], [3, 3, 3, 2]) and _checks(out, 0)[-1][1] == 3, (nodes_per_check, logs)
    assert _checks(out, 0)[-1] == [300, 3] and "a node joined" in logs, logs
    last_restart = [json.loads(open(out / f"checks{node}.jsonl").readlines()[-1])[2] for node in range(3)]
    assert last_restart == [2, 2, 2], last_restart        # SYNK_RESTART_COUNT: the run's, on every node
    finals = [_finals(out, node) for node in range(3)]
    assert all(np.array_equal(a, b) for f in finals[1:] for a, b in zip(finals[0], f))
    accuracies = _accuracies(logs)
    assert len(accuracies) == 3 and min(accuracies) >= 0.95, logs
    regrown_at = checkpoint.read(out / "at_restart2" / "checkpoint.safetensors")
    reference = _resumed_on(tmp_path, "reference", script, out / "at_restart1", "diloco", 2,
                            steps=regrown_at[0]["step"])
    got = checkpoint.read(reference / "ckpt" / "checkpoint.safetensors")
    assert got[0]["step"] == regrown_at[0]["step"] and sorted(got[2]) == sorted(regrown_at[2])
    for key, want in regrown_at[2].items():
        np.testing.assert_allclose(got[2][key], want, rtol=0, atol=1e-10, err_msg=key)
    _nothing_left(out)


def test_the_rendezvous_refuses_strangers_and_another_runs_launchers():
    """Garbage, a message before a join, or a join of another run ends that connection only: it is
    counted nowhere, and the run's own launchers get their round."""
    import socket

    from synkhronos.launch.rendezvous import RendezvousClient, RendezvousServer
    server = RendezvousServer("127.0.0.1:0", 1, 2, settle=0.2, job="train.py --nnodes 1:2")
    try:
        port = int(server.address.rsplit(":", 1)[1])
        for junk in (b"garbage\n", b'{"kind": "done"}\n', b'{"kind": "join", "node_rank": null, '
                                                          b'"job": "train.py --nnodes 1:2"}\n'):
            with socket.create_connection(("127.0.0.1", port)) as stranger:
                stranger.sendall(junk)
        other = RendezvousClient(server.address, 1, 5, job="other.py --nnodes 1:2")
        other.join()
        assert other.next_message(5)["kind"] == "refused"
        own = RendezvousClient(server.address, 0, 5, job="train.py --nnodes 1:2")
        own.join()
        assert own.next_message(5) | {"coordinator": None} == {
            "kind": "round", "round": 1, "node_rank": 0, "nnodes": 1, "coordinator": None}
        own.close()
        other.close()
    finally:
        server.close()
    deadline = time.time() + 5                # its connections' threads end with their sockets
    while any(t.name.startswith("synk-rendezvous") for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("synk-rendezvous")]


def test_the_elastic_launcher_names_a_full_run_a_taken_port_and_a_half_range(capsys):
    """A launcher joining a run that has its MAX nodes is refused (the run goes on); node 0's
    launcher on a taken port, or on an address not its machine's, says so and ends; ``--nnodes``
    takes ASCII whole numbers N or MIN:MAX only; a script that is not there is refused at once."""
    import io
    import socket

    from synkhronos.launch import LaunchSpec, parse_args
    from synkhronos.launch import main as launch_main
    from synkhronos.launch.agent import ElasticAgent
    from synkhronos.launch.rendezvous import RendezvousClient, RendezvousServer
    server = RendezvousServer("127.0.0.1:0", 1, 1, settle=0.0, job="train.py --nnodes 1:1")
    clients = []
    try:
        first = RendezvousClient(server.address, 0, 5, job="train.py --nnodes 1:1")
        clients.append(first)
        first.join()
        assert first.next_message(5)["kind"] == "round"
        extra = RendezvousClient(server.address, 0, 5, job="train.py --nnodes 1:1")
        clients.append(extra)
        extra.join()
        refused = extra.next_message(5)
        assert refused["kind"] == "refused" and "already has its 1 nodes" in refused["why"], refused
        assert first.next_message(0.5) is None          # its round goes on
    finally:
        for client in clients:
            client.close()
        server.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        said = io.StringIO()
        spec = LaunchSpec("train.py", coordinator=f"127.0.0.1:{taken.getsockname()[1]}", max_nodes=2,
                          max_restarts=1)
        code = ElasticAgent(spec, out=said).run()
    assert code == 1 and "cannot keep the rendezvous at" in said.getvalue(), said.getvalue()
    said = io.StringIO()      # an address that is not this machine's is named as such
    spec = LaunchSpec("train.py", coordinator="192.0.2.1:29400", max_nodes=2, max_restarts=1)
    assert ElasticAgent(spec, out=said).run() == 1
    assert "give --coordinator an address of this machine" in said.getvalue(), said.getvalue()
    for bad in ("2:", "1_0:2", " 2 : 3 ", "\uff12:\uff13", "2:3:4"):
        with pytest.raises(SystemExit):
            parse_args(["--nnodes", bad, "--node-rank", "0", "--coordinator", "127.0.0.1:1", "t.py"])
        assert "--nnodes must be N or MIN:MAX" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit) as ended:       # not tried at every restart
        launch_main(["--nnodes", "1:2", "--node-rank", "0", "--coordinator", "127.0.0.1:1",
                     "--max-restarts", "2", "no_such_script.py"])
    assert ended.value.code == 2 and "'no_such_script.py' is not a file" in capsys.readouterr().err
