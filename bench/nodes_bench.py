"""Several nodes, simulated on this machine: two nodes x 1 device against one node x 2 devices.

Each node runs ``python -m synkhronos.launch ... -m bench.nodes_bench``'s node part in a mount
namespace of its own with a private /dev/shm (needs root for ``unshare -m``). Reported: the
benchmark MLP's training samples/s both ways; the time every sync rule takes to bring the digits
MLP to 95% test accuracy both ways; the cross-node all-reduce of the flat gradient against a bare
jitted ``psum`` of the same size over the same JAX runtime; and one exchange of the digits MLP's
parameters with node 0's center from node 1 against a bare ZeroMQ round trip of the same bytes,
each pair timed in alternating blocks in the same processes.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from bench.common import HERE, ROOT, block_ratios, interleaved_medians, python, source_env, spread

NODE_SCRIPT = os.path.join(HERE, "nodes_bench.py")


def node_part(out, batches, steps, rounds):
    """What every node runs: training samples/s, then synkhronos's all-reduce vs a bare psum."""
    import synkhronos as synk
    from bench import synk_bench
    synk.fork()
    result = dict(nodes=synk.n_nodes(), devices=synk.local_devices(),
                  training=synk_bench.training(batches, steps))
    result["to_accuracy"] = _time_to_accuracy()
    if synk.n_nodes() > 1:
        result.update(_all_reduce_against_psum(rounds))
        result["exchange"] = {spec: _exchange_against_round_trip(rounds, spec) for spec in EXCHANGED}
    if synk.node_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    synk.close()


def _all_reduce_against_psum(rounds):
    """The flat gradient's all-reduce across nodes (one device each) against a bare jitted psum."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import synkhronos as synk
    from bench.mlp import pytensor_graph
    from synkhronos.extensions import train, updates
    from synkhronos.runtime import session
    x, y, loss, params = pytensor_graph()
    step = train.make_train_function(loss, params, x, y, updates.sgd, learning_rate=0.01)
    synk.distribute()
    grad = step.grad_shared
    value = np.asarray(grad.get_value())
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    mesh, spec = Mesh(np.array(devices), ("d",)), PartitionSpec("d")
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=spec,
                                 out_specs=spec))
    local = jax.device_put(value.reshape(1, -1), jax.local_devices()[0])
    whole = jax.make_array_from_single_device_arrays((len(devices), value.size),
                                                     NamedSharding(mesh, spec), [local])
    nodes = session.current().nodes
    # the third: one exchange of the masters through the key-value store alone, the cost of the
    # agreement that precedes every cross-node collective
    blocks = []
    t_synk, t_bare, t_agree, ratio = interleaved_medians(
        [lambda: synk.all_reduce(grad, op="sum"), lambda: psum(whole).block_until_ready(),
         lambda: nodes.exchange("an exchange alone", True)],
        rounds, calls=10, warmup=5, blocks=blocks)
    return dict(grad_bytes=int(value.nbytes), all_reduce_ms=t_synk * 1e3, psum_ms=t_bare * 1e3,
                agreement_ms=t_agree * 1e3, all_reduce_over_psum=ratio, ratios=block_ratios(blocks))


#: every rule, with the epochs it gets (the asynchronous rules' devices step on stale parameters)
RULES_TO_ACCURACY = [("AllReduce()", 30), ("Average(every=4)", 30), ("DiLoCo(every=8)", 30),
                     ("EASGD(0.5, every=4)", 30), ("EASGD(0.5, every=4, asynchronous=True)", 40),
                     ("Downpour(every=2)", 40),
                     ("RateLimited(every_n_batches=2, max_rate=0.5)", 40)]
#: the test accuracy the runs are timed to
ACCURACY_GOAL = 0.95


def _time_to_accuracy():
    """Seconds of training each rule takes to bring the digits MLP to :data:`ACCURACY_GOAL`.

    Every check (one an epoch) node 0's master evaluates the center (or its
    own parameters for a rule without one) in one process; the History's time
    excludes it. Returns {rule: (seconds and epochs to the goal or None, epochs run, final
    accuracy)}.
    """
    import pytensor

    import synkhronos as synk
    from demos.mnist import build_model, load_data
    from synkhronos.extensions import sync, train, updates
    data = load_data()
    make_graph, params, _ = build_model("custom_mlp:1,128", data["side"])
    x, y, loss, accuracy = make_graph()
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.05)
    inputs = [p.type() for p in params]
    test_accuracy = pytensor.function([x, y] + inputs, accuracy, givens=list(zip(params, inputs)),
                                      mode="FAST_COMPILE")
    synk.distribute()
    init = [p.get_value() for p in params]
    state = [s for s in step.functions[1].get_shared() if all(s is not p for p in params)]
    x_train, y_train = synk.data(data["x_train"]), synk.data(data["y_train"])
    # every program compiled before anything is timed, also the row counts only claims give
    train.run(step, x_train, y_train, 128, epochs=1)
    train.run(step, x_train, y_train, 128, epochs=2, sync=sync.Downpour())
    results = {}
    for text, epochs in RULES_TO_ACCURACY:
        for p, v in zip(params, init):
            p.set_value(v)
        for s in state:
            s.set_value(np.zeros_like(s.get_value()))
        synk.broadcast(params + state)
        reached = []

        def check(history):
            if synk.node_rank() == 0 and not reached:
                got = float(test_accuracy(data["x_test"], data["y_test"], *history.center_values()))
                if got >= ACCURACY_GOAL:
                    reached.append((history[-1].time, history[-1].epoch))
            return False
        history = train.run(step, x_train, y_train, 128, epochs=epochs, seed=1, on_check=check,
                            sync=eval(text, vars(sync)))
        final = float(test_accuracy(data["x_test"], data["y_test"], *[p.get_value() for p in params]))
        results[text] = (*(reached[0] if reached else (None, None)), history[-1].epoch, final)
    return results


#: the models whose parameters one exchange moves: the digits MLP, and a wider one
EXCHANGED = ["custom_mlp:1,128", "custom_mlp:2,512"]


def _exchange_against_round_trip(rounds, spec):
    """Node 1: one exchange (``Downpour``'s push and pull) of model ``spec``'s parameters with
    node 0's center, against a bare ZeroMQ round trip of the same bytes each way to node 0."""
    import threading

    import zmq

    import synkhronos as synk
    from demos.mnist import build_model, load_data
    from synkhronos.extensions import sync
    from synkhronos.runtime import session
    from synkhronos.runtime.centers.process import CenterServer
    from synkhronos.runtime.centers.server import RemoteCenter
    from synkhronos.runtime.centers.shared import Center
    state = session.current()
    _, params, _ = build_model(spec, load_data()["side"])
    values = [np.asarray(p.get_value()) for p in params]
    shapes, dtypes = [v.shape for v in values], [v.dtype for v in values]
    host = state.topology.coordinator.rsplit(":", 1)[0]
    node = synk.node_rank()
    if node == 0:
        name = f"{state.prefix}_bench_center{EXCHANGED.index(spec)}"
        center = Center(name, shapes, dtypes, initial=values, merge=sync.Downpour().merge)
        server = CenterServer(host)
        where = server.serve(name, shapes, dtypes, sync.Downpour())
        echo = zmq.Context.instance().socket(zmq.ROUTER)
        port = echo.bind_to_random_port(f"tcp://{host}")
        stop = threading.Event()

        def serve_echo():
            while not stop.is_set():
                if echo.poll(100):
                    echo.send_multipart(echo.recv_multipart(copy=False), copy=False)
        thread = threading.Thread(target=serve_echo, daemon=True)
        thread.start()
        state.nodes.exchange(("bench: center", spec), (where, f"tcp://{host}:{port}"))
        result = state.nodes.exchange(("bench: exchanged", spec), None)[1]
        stop.set()
        thread.join()
        echo.close()
        server.stop()
        center.close()
        return result
    where, echo_at = state.nodes.exchange(("bench: center", spec), None)[0]
    remote = RemoteCenter(where, shapes, dtypes)
    bare = zmq.Context.instance().socket(zmq.DEALER)
    bare.connect(echo_at)
    updates = [np.zeros_like(v) for v in values]

    def round_trip():
        bare.send_multipart(updates, copy=False)
        return bare.recv_multipart(copy=False)
    blocks = []
    t_exchange, t_bare, ratio = interleaved_medians(
        [lambda: remote.exchange(updates, np.asarray), round_trip], rounds, calls=50, warmup=20, blocks=blocks)
    remote.close()
    bare.close()
    result = dict(param_bytes=int(sum(v.nbytes for v in values)), exchange_ms=t_exchange * 1e3,
                  round_trip_ms=t_bare * 1e3, exchange_over_round_trip=ratio,
                  exchange_ratios=block_ratios(blocks))
    state.nodes.exchange(("bench: exchanged", spec), result)
    return result


def _namespaces():
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -m needs root: {probe.stderr.strip()}"


def _run_nodes(n_nodes, per_node, batches, steps, rounds, tmp):
    from synkhronos.runtime.processes import free_port
    port, procs = free_port(), []
    out = os.path.join(tmp, f"nodes{n_nodes}x{per_node}.json")
    for node in range(n_nodes):
        cmd = [python(), "-m", "synkhronos.launch", "--nnodes", str(n_nodes), "--node-rank", str(node),
               "--coordinator", f"127.0.0.1:{port}", "--devices-per-node", str(per_node), NODE_SCRIPT,
               "node", out, ",".join(map(str, batches)), str(steps), str(rounds)]
        inner = "mount -t tmpfs tmpfs /dev/shm && exec " + " ".join(f"'{c}'" for c in cmd)
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", inner], cwd=ROOT,
                                      env=source_env(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            err = "timed out"
        if p.returncode:
            errors.append((err or "failed").strip().splitlines()[-1:])
    if errors or not os.path.exists(out):
        return {"error": str(errors[0] if errors else "no result")}
    with open(out) as f:
        return json.load(f)


def measure(batches, steps, rounds):
    """Both layouts, one after the other, in one run."""
    why = _namespaces()
    if why:
        return {"error": why}
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        two = _run_nodes(2, 1, batches, steps, rounds, tmp)
        one = _run_nodes(1, 2, batches, steps, rounds, tmp)
    return {"two_nodes": two, "one_node": one, "batches": batches}


def section(r):
    """Section 9 of RESULTS.md."""
    L = ["## 9. Several nodes: two simulated nodes × 1 device against one node × 2 devices", ""]
    if "error" in r:
        return L + [f"Not measured: {r['error']}.", ""]
    two, one = r["two_nodes"], r["one_node"]
    if "error" in two or "error" in one:
        return L + [f"Failed: {two.get('error') or one.get('error')}.", ""]
    L += ["| global batch | 1 node × 2 devices (samples/s) | 2 nodes × 1 device (samples/s) | ratio |",
          "|---|---|---|---|"]
    for b in map(str, r["batches"]):
        a, c = one["training"][b], two["training"][b]
        L.append(f"| {b} | {a:,.0f} | {c:,.0f} | {c / a:.2f} |")
    L += ["", f"| flat gradient all-reduce across nodes ({two['grad_bytes'] / 2**20:.1f} MB, ms) | bare "
          "jitted `psum` over the same JAX runtime (ms) | ratio | spread over rounds | "
          "goal ≤ 1.1× | the masters' agreement alone (ms) |", "|---|---|---|---|---|---|",
          f"| {two['all_reduce_ms']:.2f} | {two['psum_ms']:.2f} | {two['all_reduce_over_psum']:.2f}× | "
          f"{spread(two.get('ratios', []), unit='×')} | "
          f"{'met' if two['all_reduce_over_psum'] <= 1.1 else 'not met'} | {two['agreement_ms']:.2f} |", "",
          "Each node is a `python -m synkhronos.launch` process tree in a mount namespace of its own with a "
          "private /dev/shm, both on this machine (the masters' Gloo all-reduce over loopback and the "
          "coordination service's key-value store replace shared memory); the three collectives alternate "
          "in blocks of 10 in the same processes.", ""]
    return L + _accuracy_table(one, two) + _exchange_table(two)


def _seconds(entry):
    seconds, at_epoch, epochs, final = entry
    if seconds is None:
        return f"not reached in {epochs:g} epochs ({final:.3f})"
    return f"{seconds:.2f} ({at_epoch:g} epoch{'s' if at_epoch != 1 else ''})"


def _accuracy_table(one, two):
    L = [f"### Time to {ACCURACY_GOAL:.0%} test accuracy on digits, every rule", "",
         "| rule | 1 node × 2 devices (s) | 2 nodes × 1 device (s) | ratio |", "|---|---|---|---|"]
    for rule, _ in RULES_TO_ACCURACY:
        a, b = one["to_accuracy"][rule], two["to_accuracy"][rule]
        ratio = f"{b[0] / a[0]:.2f}" if a[0] and b[0] else "–"
        L.append(f"| `{rule}` | {_seconds(a)} | {_seconds(b)} | {ratio} |")
    return L + ["", "Seconds of training (the History's time, evaluation excluded; the programs compiled "
                "beforehand) until node 0's master first finds the center (or its parameters) at the "
                "goal, checked every epoch (the epochs it took in brackets); the "
                "digits MLP (`custom_mlp:1,128`, momentum 0.05, global batch 128). Plot: "
                "[nodes_accuracy.png](nodes_accuracy.png).", ""]


def _exchange_table(two):
    L = ["### One exchange with node 0's center from node 1", "",
         "| model | parameters (each way) | `Downpour` exchange (ms) | bare ZeroMQ round trip of the "
         "same bytes (ms) | ratio | spread over rounds | goal ≤ 1.2× |", "|---|---|---|---|---|---|---|"]
    for spec, e in two["exchange"].items():
        ratio = e["exchange_over_round_trip"]
        L.append(f"| `{spec}` | {e['param_bytes'] / 2**10:,.0f} KiB | {e['exchange_ms']:.3f} | "
                 f"{e['round_trip_ms']:.3f} | {ratio:.2f}× | {spread(e['exchange_ratios'], unit='×')} | "
                 f"{'met' if ratio <= 1.2 else 'not met'} |")
    return L + ["", "The exchange goes to node 0's center server process (merged into the shared-memory "
                "center under each block's mutex); the round trip to an echo on node 0's master; "
                "alternating blocks of 50. The goal is set for the digits MLP (the first row).", ""]


def plot_accuracy(r, path):
    """Bars of every rule's time to the accuracy goal, both layouts, to ``path``."""
    if "error" in r or "error" in r["two_nodes"] or "error" in r["one_node"]:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rules = [rule for rule, _ in RULES_TO_ACCURACY]
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, (key, label) in enumerate([("one_node", "1 node × 2 devices"), ("two_nodes", "2 nodes × 1 device")]):
        times = [r[key]["to_accuracy"][rule][0] or 0.0 for rule in rules]
        ax.barh(np.arange(len(rules)) + 0.4 * k, times, height=0.4, label=label)
    ax.set_yticks(np.arange(len(rules)) + 0.2, [rule.split("(")[0] + ("(async)" if "asynchronous" in rule else "")
                                                 for rule in rules])
    ax.set_xlabel(f"seconds of training to {ACCURACY_GOAL:.0%} test accuracy (digits)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1] == "node":
        node_part(sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4]),
                  int(sys.argv[5]))
