"""Training on one GPU: synkhronos's three ways beside raw JAX, plain PyTensor and PyTorch.

    python -m bench.gpu [--seconds S] [--only PART[,PART]]

The MLP of :mod:`bench.mlp` with SGD and momentum in float32, in samples/s, on
two sizes: "small" 784-1024-1024-10 at batch 4096 and "big"
784-4096-4096-4096-10 at batch 8192. Each way runs in a process of its own (its
own ``timeout``), one after the other on the one GPU:

- raw JAX: one jitted step (donated parameters), the data on the GPU, not
  waiting for the steps (``async``), and reading each step's loss;
- PyTorch with TF32 products (JAX's default float32 matmul precision on a GPU
  is TF32-like), not waiting for the steps;
- plain PyTensor (``mode="JAX"``): a numpy batch in, the loss out;
- synkhronos on one GPU: ``Data`` + ``batch=`` (the master loop), the data on
  the device (``make_device_train_function`` + ``batch_s``), each with the loss
  read at the end and read every step, and ``train.run(sync=AllReduce())``.

Without a GPU the section says it was skipped, and why. Writes a section of
bench/RESULTS.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.common import ROOT, emit, python, source_env, write_section

TITLE = "## 14. One GPU: synkhronos beside raw JAX, plain PyTensor and PyTorch"
MODELS = {"small": ((784, 1024, 1024, 10), 4096), "big": ((784, 4096, 4096, 4096, 10), 8192)}
#: rows of the training data each way draws its batches from
ROWS = 65536
LR, MOMENTUM = 0.01, 0.9
PARTS = ("jax", "torch", "pytensor", "synk", "counts")


def _data(batch):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(ROWS, 784)).astype("float32"),
            rng.integers(0, 10, ROWS).astype("int32"))


def _timed(step, seconds, finish=lambda: None, warmup=3):
    """Steps per second of ``step()`` over about ``seconds`` (after ``warmup`` steps)."""
    for _ in range(warmup):
        step()
    finish()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            step()
        n += 10
    finish()
    return n / (time.perf_counter() - start)


def raw_jax(sizes, batch, seconds):
    import jax
    import jax.numpy as jnp
    X, Y = _data(batch)
    x_dev, y_dev = jax.device_put(X), jax.device_put(Y)
    rng = np.random.default_rng(1)
    batches = [jax.device_put(rng.permutation(ROWS)[:batch].astype("int32")) for _ in range(16)]
    from bench.mlp import init_params
    params = [jnp.asarray(p) for p in init_params(sizes=sizes)]
    velocity = [jnp.zeros_like(p) for p in params]

    def loss_fn(params, x, y):
        h = x
        for w, b in zip(params[:-2:2], params[1:-2:2]):
            h = jax.nn.relu(h @ w + b)
        logits = h @ params[-2] + params[-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    @jax.jit
    def step(params, velocity, idx):
        loss, grads = jax.value_and_grad(loss_fn)(params, x_dev[idx], y_dev[idx])
        velocity = [MOMENTUM * v - LR * g for v, g in zip(velocity, grads)]
        return [p + v for p, v in zip(params, velocity)], velocity, loss
    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    state = {"p": params, "v": velocity, "i": 0, "loss": None}

    def one(read=False):
        state["p"], state["v"], loss = step(state["p"], state["v"], batches[state["i"] % 16])
        state["i"] += 1
        state["loss"] = float(loss) if read else loss

    def finish():
        jax.block_until_ready(state["p"])
    return {"async": batch * _timed(one, seconds, finish),
            "each loss": batch * _timed(lambda: one(True), seconds, finish)}


def torch_tf32(sizes, batch, seconds):
    import torch
    from torch import nn
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    X, Y = _data(batch)
    x, y = torch.from_numpy(X).cuda(), torch.from_numpy(Y.astype("int64")).cuda()
    rng = np.random.default_rng(1)
    batches = [torch.from_numpy(rng.permutation(ROWS)[:batch]).cuda() for _ in range(16)]
    loss_fn, state = nn.CrossEntropyLoss(), {"i": 0}

    def one():
        idx = batches[state["i"] % 16]
        state["i"] += 1
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return {"async": batch * _timed(one, seconds, torch.cuda.synchronize), "torch": torch.__version__}


def plain_pytensor(sizes, batch, seconds):
    import pytensor
    from pytensor_ml import optim

    from bench.mlp import pytensor_graph
    x, y, loss, params = pytensor_graph(sizes)
    step = pytensor.function([x, y], loss, updates=optim.sgd(LR, momentum=MOMENTUM)(loss, params),
                             mode="JAX")
    X, Y = _data(batch)
    rng = np.random.default_rng(1)
    batches = [rng.permutation(ROWS)[:batch] for _ in range(16)]
    state = {"i": 0}

    def one():
        idx = batches[state["i"] % 16]
        state["i"] += 1
        np.asarray(step(X[idx], Y[idx]))
    return {"each loss": batch * _timed(one, seconds)}


def _synk_steps(sizes, batch):
    """In a running runtime: the MLP's step on host data and on device data, and the host Data."""
    import pytensor

    import synkhronos as synk
    from bench.mlp import pytensor_graph
    from synkhronos.extensions import train, updates
    X, Y = _data(batch)
    x, y, loss, params = pytensor_graph(sizes)
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=LR,
                                     momentum=MOMENTUM)
    x_sh = pytensor.shared(np.zeros((1, 784), "float32"), name="x_sh")
    y_sh = pytensor.shared(np.zeros(1, "int32"), name="y_sh")
    device_step = train.make_device_train_function(loss, params, x, y, x_sh, y_sh, updates.momentum,
                                                   learning_rate=LR, momentum=MOMENTUM)
    synk.scatter([x_sh, y_sh], [X, Y])
    return step, device_step, synk.data(X), synk.data(Y)


def synkhronos_ways(sizes, batch, seconds, platform="gpu"):
    import synkhronos as synk
    from synkhronos.extensions import sync, train
    synk.fork(1, platform=platform)
    try:
        step, device_step, x_dat, y_dat = _synk_steps(sizes, batch)
        rng = np.random.default_rng(1)
        batches = [rng.permutation(ROWS)[:batch] for _ in range(16)]
        state = {"i": 0, "loss": None}

        def master(read):
            state["loss"] = step(x_dat, y_dat, batch=batches[state["i"] % 16])
            state["i"] += 1
            if read:
                float(state["loss"])

        def device(read):
            state["loss"] = device_step(batch_s=[batches[state["i"] % 16]])
            state["i"] += 1
            if read:
                float(state["loss"])

        def finish():
            if state["loss"] is not None:
                float(state["loss"])
        out = {name: batch * _timed(lambda: fn(read), seconds, finish)
               for name, fn, read in (("Data + batch=", master, False),
                                      ("Data + batch=, each loss", master, True),
                                      ("device data", device, False),
                                      ("device data, each loss", device, True))}
        steps = max(64, int(out["device data"] / batch * seconds * 2))
        # every block length (powers of two up to an epoch's steps) compiled before the timing
        per_epoch = ROWS // batch
        train.run(step, x_dat, y_dat, batch, steps=2 * per_epoch - 1, sync=sync.AllReduce(), shuffle=True)
        start = time.perf_counter()
        train.run(step, x_dat, y_dat, batch, steps=steps, sync=sync.AllReduce(), shuffle=True,
                  check_every=steps)
        out["train.run"] = batch * steps / (time.perf_counter() - start)
        return out
    finally:
        synk.close()


def launch_counts(sizes, batch, seconds, platform="gpu"):
    """What a steady step of each way launches on the device, and whether it moves anything
    between host and device implicitly (``jax.transfer_guard("disallow")`` raises if it does)."""
    import jax

    import synkhronos as synk
    from synkhronos.extensions import train
    from synkhronos.tracing.launches import count_launches
    synk.fork(1, platform=platform)
    try:
        step, device_step, x_dat, y_dat = _synk_steps(sizes, batch)
        idx = np.random.default_rng(1).permutation(ROWS)[:batch]
        ways = {"Data + batch=": lambda: step(x_dat, y_dat, batch=idx),
                "device data": lambda: device_step(batch_s=[idx]),
                "train.run, 8 steps": lambda: train.run(step, x_dat, y_dat, batch, steps=8,
                                                        check_every=8)}
        out = {}
        for name, way in ways.items():
            way(), way()
            try:
                with count_launches() as launches, jax.transfer_guard("disallow"):
                    way()
                out[name] = dict(launches)
            except Exception as e:           # noqa: BLE001 - reported in the table
                out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        return out
    finally:
        synk.close()


WAYS = {"jax": raw_jax, "torch": torch_tf32, "pytensor": plain_pytensor, "synk": synkhronos_ways,
        "counts": launch_counts}


def gpu_present():
    """(True, name) if JAX finds a GPU, else (False, why); asked in a process of its own."""
    code = "import jax; d = jax.devices('gpu'); print(d[0].device_kind)"
    try:
        out = subprocess.run([python(), "-c", code], capture_output=True, text=True, timeout=120,
                             env=source_env())
    except subprocess.TimeoutExpired:
        return False, "asking JAX for a GPU took over 120 s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no GPU"])[-1]
        return False, f"JAX finds no GPU ({last})"
    return True, out.stdout.strip().splitlines()[-1]


def measure(seconds, parts=PARTS, timeout=150):
    """Every way on both models, each in a process of its own; {model: {way: samples/s}}."""
    found, what = gpu_present()
    if not found:
        return {"skipped": what}
    import jax
    result: dict = {"gpu": what, "jax": jax.__version__}
    for part in parts:
        for model in (("small",) if part == "counts" else MODELS):
            cmd = [python(), "-m", "bench.gpu", "--part", part, "--model", model, "--seconds", str(seconds)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                     env=source_env())
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                got = json.loads(lines[-1]) if lines else \
                    {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
            except subprocess.TimeoutExpired:
                got = {"error": f"over {timeout} s"}
            print(part, model, got, file=sys.stderr, flush=True)
            result.setdefault(model, {}).update({f"{part}: {k}": v for k, v in got.items()})
    return result


ROWS_SHOWN = (("raw JAX, jitted step, not waiting", "jax: async"),
              ("raw JAX, reading each step's loss", "jax: each loss"),
              ("PyTorch, TF32, not waiting", "torch: async"),
              ("plain PyTensor (`mode=\"JAX\"`, numpy batch in, loss out)", "pytensor: each loss"),
              ("synkhronos `Data` + `batch=` (master loop)", "synk: Data + batch="),
              ("synkhronos `Data` + `batch=`, reading each loss", "synk: Data + batch=, each loss"),
              ("synkhronos data on the device (`batch_s`)", "synk: device data"),
              ("synkhronos data on the device, reading each loss", "synk: device data, each loss"),
              ("synkhronos `train.run(sync=AllReduce())`", "synk: train.run"))

GOALS = (("data on the device / raw JAX reading each loss", "synk: device data, each loss",
          "jax: each loss", 0.95),
         ("`train.run` / raw JAX not waiting", "synk: train.run", "jax: async", 0.95),
         ("`Data` + `batch=` / data on the device", "synk: Data + batch=", "synk: device data", 0.8),
         ("`train.run` / PyTorch", "synk: train.run", "torch: async", 1.0),
         ("slowest synkhronos way / PyTorch", None, "torch: async", 1.0))


def _ratio(row, a, b):
    x, y = row.get(a), row.get(b)
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def section(r):
    if "skipped" in r:
        kept = _measured_section()
        if kept is not None:          # a machine without a GPU keeps the figures of one with it
            print(f"bench.gpu skipped ({r['skipped']}); RESULTS.md keeps its measured section",
                  file=sys.stderr)
            return kept
        return [TITLE, "", f"Skipped: {r['skipped']}. `python -m bench.gpu` on a machine with a GPU "
                "(a JAX GPU plugin installed) measures this section.", ""]
    L = [TITLE, "", f"Measured by `python -m bench.gpu` on a machine with {os.cpu_count()} CPU cores, JAX "
         f"{r.get('jax', '?')}; every other section was measured on the "
         "CPU machine named at the top.", "",
         f"On one {r['gpu']}, samples/s. Small: MLP 784-1024-1024-10 at batch 4096; big: "
         "784-4096-4096-4096-10 at batch 8192; SGD with momentum, float32.", "",
         "| way | small | big |", "|---|---|---|"]
    fmt = (lambda v: f"{v / 1e6:.2f} M" if isinstance(v, (int, float)) else "—")
    for label, key in ROWS_SHOWN:
        L.append(f"| {label} | {fmt(r['small'].get(key))} | {fmt(r['big'].get(key))} |")
    L += ["", "| ratio | small | big | goal |", "|---|---|---|---|"]
    synk_keys = [key for _, key in ROWS_SHOWN if key.startswith("synk:")]
    for label, a, b, goal in GOALS:
        cells = []
        for model in ("small", "big"):
            row = r[model]
            if a is None:
                values = [row[k] for k in synk_keys if isinstance(row.get(k), (int, float))]
                ratio = min(values) / row[b] if values and isinstance(row.get(b), (int, float)) else None
            else:
                ratio = _ratio(row, a, b)
            cells.append("—" if ratio is None else f"{ratio:.2f}×")
        L.append(f"| {label} | {cells[0]} | {cells[1]} | ≥ {goal}× |")
    errors = {f"{m}: {k}": v for m in ("small", "big") for k, v in r[m].items() if k.endswith("error")}
    counts = {k[len("counts: "):]: v for k, v in r["small"].items() if k.startswith("counts: ")}
    if counts:
        L += ["", "Programs launched by one steady step of the small model (JAX's profiler; "
              "`jax.transfer_guard(\"disallow\")` on, so an implicit transfer would show as an error):", ""]
        L += [f"- {way}: {got}" for way, got in counts.items()]
    L += [""] + [f"- {k}: {v}" for k, v in errors.items()] + [
        "Each way in a process of its own, about the same number of seconds each. `Data` + `batch=` "
        "gathers every step's rows of a host-memory Data and sends them; the data on the device is "
        "gathered inside the step's program by its indices; `train.run` runs the steps between "
        "checks as one program each.", ""]
    return L


def _measured_section():
    """The lines of this section as bench/RESULTS.md holds it, if it holds figures; else None."""
    import re
    path = os.path.join(ROOT, "bench", "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else ""
    found = re.search(re.escape(TITLE) + r".*?(?=^## |\Z)", text, re.S | re.M)
    if found is None or "| way |" not in found.group(0):
        return None
    return found.group(0).rstrip("\n").split("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--part", choices=PARTS)
    p.add_argument("--model", choices=tuple(MODELS))
    p.add_argument("--only", default=",".join(PARTS))
    p.add_argument("--cpu", action="store_true", help="run --part synk on the CPU (to try it out)")
    args = p.parse_args(argv)
    if args.part:
        sizes, batch = MODELS[args.model]
        emit(WAYS[args.part](sizes, batch, args.seconds, **({"platform": "cpu"} if args.cpu else {})))
        return
    result = measure(args.seconds, args.only.split(","))
    lines = section(result)
    write_section(TITLE, lines)
    print("\n".join(lines))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
