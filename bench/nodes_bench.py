"""Several nodes, simulated on this machine: two nodes x 1 device against one node x 2 devices.

Each node runs ``python -m synkhronos.launch ... -m bench.nodes_bench``'s node part in a mount
namespace of its own with a private /dev/shm (needs root for ``unshare -m``). Reported: the
benchmark MLP's training samples/s both ways, and the cross-node all-reduce of its flat gradient
against a bare jitted ``psum`` of the same size over the same JAX runtime, timed in alternating
blocks in the same processes.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from bench.common import HERE, ROOT, block_ratios, interleaved_medians, python, spread

NODE_SCRIPT = os.path.join(HERE, "nodes_bench.py")


def node_part(out, batches, steps, rounds):
    """What every node runs: training samples/s, then synkhronos's all-reduce vs a bare psum."""
    import synkhronos as synk
    from bench import synk_bench
    synk.fork()
    result = dict(nodes=synk.n_nodes(), devices=synk.local_devices(),
                  training=synk_bench.training(batches, steps))
    if synk.n_nodes() > 1:
        result.update(_all_reduce_against_psum(rounds))
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
                                      env=dict(os.environ, PYTHONPATH=ROOT),
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
    return L


if __name__ == "__main__":
    if sys.argv[1] == "node":
        node_part(sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4]),
                  int(sys.argv[5]))
