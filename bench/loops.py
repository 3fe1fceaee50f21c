"""Device-driven loops (``train.run``) against the master-driven loop and PyTorch DDP, and the rules'
time to 95% digits accuracy. Runs in the bench process with a 2-device runtime of its own."""

import os
import time

import numpy as np

from bench.common import HERE, per_round_ratios, run_json, spread
from bench.mlp import SIZES, data, pytensor_graph

DIGITS_SIZES = (64, 128, 10)
DIGITS_BATCH = 128
TARGET = 0.95


def _digits():
    import sys

    from bench.common import ROOT
    sys.path.insert(0, ROOT)
    from demos.mnist import load_data
    d = load_data()
    return {k: (v.astype("float32") if k.startswith("x") else v.astype("int32"))
            for k, v in d.items() if k != "side"}


def _trainer(sizes, lr):
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    x, y, loss, params = pytensor_graph(sizes)
    step = train.make_train_function(loss, params, x, y, updates.momentum, learning_rate=lr)
    import pytensor.tensor as pt
    correct = pt.mean(pt.eq(pt.argmax(_logits(x, params), axis=1), y))
    evaluate = synk.function([x, y], [(loss, "avg"), (correct, "avg")], name="bench_evaluate")
    synk.distribute()
    init = [p.get_value() for p in params]
    state = [s for s in step.functions[1].get_shared() if all(s is not p for p in params)]
    return step, evaluate, params, init, state


def _logits(x, params):
    import pytensor.tensor as pt
    h = x
    for i in range(0, len(params) - 2, 2):
        h = pt.maximum(h @ params[i] + params[i + 1], 0)
    return h @ params[-2] + params[-1]


def _reset(params, init, state):
    import synkhronos as synk
    for p, v in zip(params, init):
        p.set_value(v)
    for s in state:
        s.set_value(np.zeros_like(s.get_value()))
    synk.broadcast(list(params) + list(state))


def _master_loop(step, x_d, y_d, batch, steps, seed=0):
    """``steps`` master-driven steps over the same orders as ``train.run``; returns seconds."""
    from synkhronos.extensions import train
    n = len(x_d)
    per_epoch = train.steps_per_epoch(n, batch)
    start = time.perf_counter()
    for k in range(steps):
        epoch, i = divmod(k, per_epoch)
        order = train.epoch_order(n, epoch, seed)
        step(x_d, y_d, batch=order[i * batch:(i + 1) * batch])
    return time.perf_counter() - start


def _device_loop(step, x_d, y_d, batch, steps):
    from synkhronos.extensions import train
    start = time.perf_counter()
    train.run(step, x_d, y_d, batch, steps=steps)
    return time.perf_counter() - start


def step_rates(rounds, torch_python, quick):
    """Steps per second of the digits MLP (batch 128) and samples/s of the benchmark MLP."""
    import synkhronos as synk
    small = {"device": [], "master": [], "torch": []}
    d = _digits()
    step, _, params, init, state = _trainer(DIGITS_SIZES, 0.05)
    x_d, y_d = synk.data(d["x_train"]), synk.data(d["y_train"])
    n_device, n_master, n_torch = (600, 300, 500) if quick else (3000, 1000, 2000)
    _device_loop(step, x_d, y_d, DIGITS_BATCH, 50), _master_loop(step, x_d, y_d, DIGITS_BATCH, 50)
    for _ in range(rounds):
        small["device"].append(n_device / _device_loop(step, x_d, y_d, DIGITS_BATCH, n_device))
        small["master"].append(n_master / _master_loop(step, x_d, y_d, DIGITS_BATCH, n_master))
        if torch_python:
            out = run_json([torch_python, os.path.join(HERE, "torch_ddp.py"), str(DIGITS_BATCH),
                            str(n_torch), ",".join(map(str, DIGITS_SIZES))])
            small["torch"].append(out[str(DIGITS_BATCH)] / DIGITS_BATCH if "error" not in out
                                  else float("nan"))
    big = {}
    step, _, params, init, state = _trainer(SIZES, 0.01)
    n_big = 5 if quick else 20
    for batch in (1024, 4096):
        X, Y = data(4 * batch)
        x_d, y_d = synk.data(X), synk.data(Y)
        _device_loop(step, x_d, y_d, batch, 3), _master_loop(step, x_d, y_d, batch, 3)
        rows = {"device": [], "master": []}
        for _ in range(rounds):
            rows["device"].append(batch * n_big / _device_loop(step, x_d, y_d, batch, n_big))
            rows["master"].append(batch * n_big / _master_loop(step, x_d, y_d, batch, n_big))
        big[batch] = rows
    return dict(small=small, big=big)


def rules():
    from synkhronos.extensions import sync
    return [("AllReduce()", sync.AllReduce()), ("Average(every=4)", sync.Average(every=4)),
            ("EASGD(0.5, every=4)", sync.EASGD(0.5, every=4)),
            ("EASGD(0.5, every=4, asynchronous=True)", sync.EASGD(0.5, every=4, asynchronous=True)),
            ("Downpour(every=2)", sync.Downpour(every=2)),
            ("RateLimited(every_n_batches=2, max_rate=0.5)", sync.RateLimited(2, max_rate=0.5))]


def time_to_accuracy(max_epochs=80):
    """Per rule (and the master-driven loop): training seconds and epochs until 95% test accuracy."""
    import synkhronos as synk
    from synkhronos.extensions import train
    d = _digits()
    step, evaluate, params, init, state = _trainer(DIGITS_SIZES, 0.05)
    x_d, y_d = synk.data(d["x_train"]), synk.data(d["y_train"])
    x_t, y_t = synk.data(d["x_test"]), synk.data(d["y_test"])
    # compiled before anything is timed: every rank meets every row count (a graph per count), also
    # those only an asynchronous rule's claims give it
    train.run(step, x_d, y_d, DIGITS_BATCH, epochs=1)
    for _ in range(3):
        train.run(step, x_d, y_d, DIGITS_BATCH, epochs=2, sync=rules()[4][1])
    evaluate(x_t, y_t)
    results = []
    for name, rule in rules():
        _reset(params, init, state)
        curve = []

        def on_check(history):
            curve.append((history[-1].time, float(evaluate(x_t, y_t)[1])))
            return curve[-1][1] >= TARGET
        history = train.run(step, x_d, y_d, DIGITS_BATCH, epochs=max_epochs, sync=rule, seed=1,
                            on_check=on_check)
        results.append(_reached(name, curve, [c.epoch for c in history]))
    _reset(params, init, state)
    curve, spent = [], 0.0
    per_epoch = train.steps_per_epoch(len(d["x_train"]), DIGITS_BATCH)
    for epoch in range(max_epochs):
        spent += _master_loop_epoch(step, x_d, y_d, epoch, per_epoch)
        curve.append((spent, float(evaluate(x_t, y_t)[1])))
        if curve[-1][1] >= TARGET:
            break
    results.append(_reached("master-driven loop (AllReduce's steps)", curve,
                            list(range(1, len(curve) + 1))))
    return results


def _master_loop_epoch(step, x_d, y_d, epoch, per_epoch):
    from synkhronos.extensions import train
    order = train.epoch_order(len(x_d), epoch, 1)
    start = time.perf_counter()
    for i in range(per_epoch):
        step(x_d, y_d, batch=order[i * DIGITS_BATCH:(i + 1) * DIGITS_BATCH])
    return time.perf_counter() - start


def _reached(name, curve, epochs):
    hit = next((i for i, (_, acc) in enumerate(curve) if acc >= TARGET), None)
    return dict(rule=name, curve=curve, reached=hit is not None,
                seconds=curve[hit][0] if hit is not None else float("nan"),
                epochs=epochs[hit] if hit is not None else float("nan"), accuracy=curve[-1][1])


def measure(rounds, torch_python, quick):
    import synkhronos as synk
    synk.fork(2)
    try:
        return dict(rates=step_rates(rounds, torch_python, quick), accuracy=time_to_accuracy())
    finally:
        synk.close()


def _median_ratio(a, b):
    return float(np.median(np.asarray(a) / np.asarray(b)))


def section(results):
    """Section 6 of RESULTS.md."""
    small, big = results["rates"]["small"], results["rates"]["big"]
    dev, mst, tch = (float(np.median(small[k])) if small[k] else float("nan")
                     for k in ("device", "master", "torch"))
    vs_master = _median_ratio(small["device"], small["master"])
    vs_torch = _median_ratio(small["device"], small["torch"]) if small["torch"] else float("nan")
    spread_master = spread(per_round_ratios(small["device"], small["master"]), unit="×")
    L = ["## 6. Device-driven loops (`train.run`): step rate and time to accuracy", "",
         f"Steps per second, digits MLP {'-'.join(map(str, DIGITS_SIZES))}, batch {DIGITS_BATCH}, "
         "2 devices, SGD momentum:", "",
         "| `run(AllReduce())` | master-driven `make_train_function` loop | PyTorch DDP Gloo | "
         "run / master (goal ≥ 3×) | its spread | run / DDP (goal ≥ 1.5×) |", "|---|---|---|---|---|---|",
         f"| {dev:,.0f} | {mst:,.0f} | {tch:,.0f} | {vs_master:.2f}× "
         f"({'met' if vs_master >= 3 else 'not met'}) | {spread_master} | {vs_torch:.2f}× "
         f"({'met' if vs_torch >= 1.5 else 'not met'}) |", "",
         f"Samples/s, the benchmark MLP {'-'.join(map(str, SIZES))} (section 3), SGD momentum:", "",
         "| global batch | `run(AllReduce())` | master-driven loop | run / master (goal ≥ 1) | its spread |",
         "|---|---|---|---|---|"]
    for batch, rows in big.items():
        ratio = _median_ratio(rows["device"], rows["master"])
        L.append(f"| {batch} | {np.median(rows['device']):,.0f} | {np.median(rows['master']):,.0f} | "
                 f"{ratio:.2f}× ({'met' if ratio >= 1 else 'not met'}) | "
                 f"{spread(per_round_ratios(rows['device'], rows['master']), unit='×')} |")
    L += ["", "The variants alternate within each round. A device-driven step is the master-driven one "
          "without its command: each device gathers its rows, runs the gradient program, all-reduces "
          "the flat gradient into the update program's input and runs the update program.", "",
          f"Time to {TARGET:.0%} test accuracy on the digits (the same MLP, batch {DIGITS_BATCH}, "
          "learning rate 0.05, momentum 0.9, 2 devices; training time, validation excluded; one run):", "",
          "| rule | ms | epochs | reached | final accuracy |", "|---|---|---|---|---|"]
    for r in results["accuracy"]:
        L.append(f"| {r['rule']} | {1000 * r['seconds']:.1f} | {r['epochs']:.0f} | "
                 f"{'yes' if r['reached'] else 'no'} | {r['accuracy']:.3f} |")
    L += ["", "An epoch is the same number of rows for every rule; the asynchronous rules step on each "
          "device's own gradient and exchange with the center every few steps.", "",
          "![time to accuracy](loops.png)", ""]
    return L


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results["accuracy"]:
        t, acc = zip(*r["curve"])
        ax.plot(t, acc, marker=".", label=r["rule"])
    ax.axhline(TARGET, color="grey", linestyle=":")
    ax.set_xlabel("training time (s)"), ax.set_ylabel("test accuracy"), ax.set_ylim(0.5, 1.0)
    ax.legend(fontsize=7), ax.set_title("digits MLP, 2 devices: time to accuracy per rule")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "loops.png"), dpi=100)
    plt.close(fig)
