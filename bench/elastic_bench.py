"""Elastic runs: the time one lost node costs, and the time a returning node takes to step again.

    python -m bench.elastic_bench [--rounds R]    # measure and write the section into RESULTS.md

Three simulated nodes (``python -m synkhronos.launch --nnodes 2:3 --max-restarts 3``, each in a
mount namespace of its own with a private /dev/shm; needs root for ``unshare -m``) train the demo's
digits MLP under AllReduce with a checkpoint every 20 steps and a check after every step. At step 60
node 2 kills its launcher (its whole node goes). Every node's script writes when it reached each
stage (started, forked, compiled, its first step) to a file; the survivors' first step on 2 nodes,
less the kill, is the time lost to the failure. Node 2's launch command is then started again; its
first step on 3 nodes, less its start, is the time a returning node takes. The survivors' scripts
are started again for it too: their own stages show where that time goes.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT, python, section_main, source_env

TITLE = "## 12. Elastic runs: the time a lost node and a returning node cost"
KILL_AT = 60


def node_part(out, checkpoints):
    """What every node's script runs (the elastic launcher's child)."""
    stamps = {"started": time.time()}
    import synkhronos as synk
    from demos.mnist import build_model, load_data
    from synkhronos.extensions import train, updates
    restart = int(os.environ.get("SYNK_RESTART_COUNT", "0"))
    synk.fork()
    stamps["forked"] = time.time()
    node, nodes = synk.node_rank(), synk.n_nodes()
    node_file = os.path.join(out, f"node{node}_restart{restart}.json")
    data = load_data()
    make_graph, params, _ = build_model("custom_mlp:1,128", data["side"])
    x, y, loss, _ = make_graph()
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=0.03)
    synk.distribute()
    stamps["compiled"] = time.time()

    def check(history):
        if "first_step" not in stamps:
            stamps.update(first_step=time.time(), first_step_number=history[-1].step, nodes=nodes)
            with open(node_file, "w") as f:
                json.dump(stamps, f)
        if restart == 0 and node == 2 and history[-1].step == KILL_AT:
            with open(os.path.join(out, "killed.json"), "w") as f:
                json.dump({"at": time.time()}, f)
            os.kill(os.getppid(), signal.SIGKILL)           # the launcher: the node goes with it
            signal.pause()
        if restart == 1 and history[-1].step == KILL_AT + 40:
            while not os.path.exists(os.path.join(out, "rejoined")):    # the returning node's window
                time.sleep(0.05)
        return False

    train.run(step, data["x_train"], data["y_train"], 64, steps=200, seed=1, checkpoint_dir=checkpoints,
              checkpoint_every=20, check_every=1, on_check=check, resume=True)
    synk.close()


def _launch(node, port, out, tmp):
    cmd = [python(), "-m", "synkhronos.launch", "--nnodes", "2:3", "--max-restarts", "3", "--node-rank",
           str(node), "--coordinator", f"127.0.0.1:{port}", "--devices-per-node", "1",
           os.path.abspath(__file__), "node", out, os.path.join(tmp, "ckpt")]
    inner = "mount -t tmpfs tmpfs /dev/shm && exec " + " ".join(f"'{c}'" for c in cmd)
    log = open(os.path.join(tmp, f"launcher{node}.log"), "a")
    return subprocess.Popen(["unshare", "-m", "sh", "-c", inner], cwd=ROOT,
                            env=source_env(), stdout=log, stderr=log)


def _wait_for(path, timeout):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{os.path.basename(path)} did not appear within {timeout} s")
        time.sleep(0.05)
    time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def one_round():
    """One failure and one return: the stages' times in seconds."""
    from synkhronos.runtime.processes import free_port
    tmp = tempfile.mkdtemp(prefix="synk-elastic-bench-")
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    port, procs = free_port(), []
    try:
        procs = [_launch(node, port, out, tmp) for node in range(3)]
        killed = _wait_for(os.path.join(out, "killed.json"), 300)["at"]
        survivor = _wait_for(os.path.join(out, "node0_restart1.json"), 120)
        returned_at = time.time()
        procs.append(_launch(2, port, out, tmp))
        returned = _wait_for(os.path.join(out, "node2_restart2.json"), 120)
        open(os.path.join(out, "rejoined"), "w").close()
        regrown = _wait_for(os.path.join(out, "node0_restart2.json"), 60)
        for p in procs[:2] + procs[3:]:
            p.wait(timeout=120)
        return {"lost": _stages(killed, survivor), "returning": _stages(returned_at, returned),
                "survivors_on_return": _stages(returned_at, regrown)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _stages(since, stamps):
    """Seconds from ``since`` to each stage, and each stage's own share."""
    return {"total": stamps["first_step"] - since,
            "until the script starts (detection, rendezvous, the old script stopped)": stamps["started"] - since,
            "fork (JAX's runtime on the new nodes)": stamps["forked"] - stamps["started"],
            "compile (from the compile cache)": stamps["compiled"] - stamps["forked"],
            "resume and the first step": stamps["first_step"] - stamps["compiled"]}


def measure(rounds):
    why = _namespaces()
    if why:
        return {"error": why}
    results = []
    for _ in range(rounds):
        try:
            results.append(one_round())
        except Exception as e:      # a benchmark reports what failed; it never fails CI
            return {"error": f"{type(e).__name__}: {e}", "rounds": results}
    return {"rounds": results}


def _namespaces():
    from bench.nodes_bench import _namespaces as probe
    return probe()


def section(r):
    L = [TITLE, ""]
    if "error" in r:
        return L + [f"Not measured: {r['error']}.", ""]
    rounds = r["rounds"]

    def median(kind, key):
        values = sorted(x[kind][key] for x in rounds)
        return values[len(values) // 2], values[0], values[-1]

    L += ["| seconds | a node lost: kill → the survivors' next step | a node back: its launch → its "
          "first step | the survivors' restart for it |", "|---|---|---|---|"]
    for key in rounds[0]["lost"]:
        cells = []
        for kind in ("lost", "returning", "survivors_on_return"):
            mid, low, high = median(kind, key)
            cells.append(f"{mid:.2f} ({low:.2f}–{high:.2f})" if len(rounds) > 1 else f"{mid:.2f}")
        L.append(f"| {key} | " + " | ".join(cells) + " |")
    worst = max(median("lost", "total")[0], median("returning", "total")[0])
    L += ["", f"Goal: ≤ 10 s each: {'met' if worst <= 10 else 'not met'} (medians over {len(rounds)} "
          f"round{'s' if len(rounds) != 1 else ''}, the range in brackets). Three simulated nodes × 1 "
          "device (`--nnodes 2:3 --max-restarts 3`, a private /dev/shm each) train the digits MLP under "
          "AllReduce, a checkpoint every 20 steps; node 2's launcher is killed at step 60 (its check), "
          "and its launch command is run again while the survivors train on 2 nodes. The detection is "
          "the rendezvous noticing the dropped connection (at once for a killed launcher); the "
          "survivors then stop their scripts (SIGTERM, then SIGKILL after 3 s) and start them again "
          "on the new round.", ""]
    return L


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_part(sys.argv[2], sys.argv[3])
    else:
        section_main(__doc__, TITLE, measure, section)
