"""Run on every node (``python -m synkhronos.launch ... same_results.py OUT``): calls, collectives and
training steps; each node writes what it got, and the single-process references, to OUT/node<R>.npz."""

import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import sync, train, updates

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_extensions import mlp  # noqa: E402  (a pytensor-ml model)

out = {}
n = synk.fork()
node, n_local = synk.node_rank(), synk.local_devices()
rng = np.random.default_rng(0)
X = rng.normal(size=(23, 4))
x = pt.matrix("x")
w = pytensor.shared(rng.normal(size=(4, 3)), name="w")
z = x @ w
f = synk.function([x], [(z.sum(), "sum"), (z.mean(), "avg"), (z.max(), "max"), (z.min(), "min"),
                        (pt.prod(1 + 0.01 * z[:, 0]), "prod"), (z, "gather")], name="f")
s = pytensor.shared(np.zeros(5), name="s")
lengths = pytensor.shared(np.zeros((1, 2)), name="lengths")
scattered = pytensor.shared(np.zeros((1, 2)), name="scattered")
g = synk.function([], [], updates=[(s, s), (lengths, lengths), (scattered, scattered)], name="g")
stream = pytensor.shared(np.random.default_rng(7), name="stream")
draws = synk.function([x], [(pt.random.normal(size=(x.shape[0],), rng=stream), "gather")],
                      name="draws")

model_x, model_y, loss, params, init = mlp(seed=5)
step = train.make_train_function(loss, params, model_x, model_y, updates.momentum, learning_rate=0.1)
reference = train.make_single_process_train_function(loss, params, model_x, model_y, updates.momentum,
                                                      learning_rate=0.1)
# fresh optimizer states for the steps on sharded Data
sharded_step = train.make_train_function(loss, params, model_x, model_y, updates.momentum,
                                         learning_rate=0.1)
sharded_reference = train.make_single_process_train_function(loss, params, model_x, model_y,
                                                              updates.momentum, learning_rate=0.1)
synk.distribute()

# --- calls: the whole Data, global batch indices, slices, num_slices --------------------------------
x_data = synk.data(X)
perm = np.random.default_rng(1).permutation(23)
for name, batch, slices in [("all", None, 1), ("indices", perm[:17], 1), ("slice", slice(3, 20), 1),
                            ("num_slices", perm, 2)]:
    got = f(x_data, batch=batch, num_slices=slices)
    rows = X if batch is None else X[batch]
    for mode, a, b in zip(["sum", "avg", "max", "min", "prod", "gather"], got, f.as_pytensor(rows)):
        out[f"call_{name}_{mode}"], out[f"ref_call_{name}_{mode}"] = np.asarray(a), np.asarray(b)

# --- sharded Data: each node its own rows, batch= indices into its shard ----------------------------
n_nodes = synk.n_nodes()
shards = np.array_split(np.arange(23), n_nodes)               # node k holds rows shards[k] of X
own = shards[node]
x_shard = synk.data(X[own], sharded=True)
local_batches = [np.array([5, 1, 0, 3]) % len(s) for s in shards]   # each node's own indices
union = np.concatenate([shard[b] for shard, b in zip(shards, local_batches)])
for name, batch, rows in [("whole", None, np.arange(23)), ("indices", local_batches[node], union)]:
    got = f(x_shard, batch=batch)
    for mode, a, b in zip(["sum", "avg", "max", "min", "prod", "gather"], got, f.as_pytensor(X[rows])):
        out[f"sharded_{name}_{mode}"], out[f"ref_sharded_{name}_{mode}"] = np.asarray(a), np.asarray(b)

# --- random draws: every device its own stream, as on one node with as many devices ---------------
out["draws_first"], out["draws_second"] = draws(x_data)[0], draws(x_data)[0]

# --- collectives over global ranks -------------------------------------------------------------------
# every node makes the same calls: set_value(rank) is applied by the node holding the rank,
# get_value(rank) returns that rank's value on every node
def every_rank():
    return range(n)

def set_everywhere(var, value_of):
    for rank in every_rank():
        synk.set_value(rank, var, value_of(rank))

expect_rank_values = np.stack([np.arange(5.0) + 10 * r + 1 for r in range(n)])
for op in ["sum", "avg", "max", "min", "prod"]:
    set_everywhere(s, lambda r: np.arange(5.0) + 10 * r + 1)
    out[f"reduce_{op}"] = synk.reduce(s, op=op, in_place=False)
    out[f"ref_reduce_{op}"] = getattr(np, "mean" if op == "avg" else op)(expect_rank_values, axis=0)
set_everywhere(s, lambda r: np.arange(5.0) + 10 * r + 1)
synk.all_reduce(s, op="sum")
out["all_reduce_sum_every_rank"] = np.stack([synk.get_value(r, s) for r in every_rank()])
out["ref_all_reduce_sum_every_rank"] = np.stack([expect_rank_values.sum(axis=0)] * n)
set_everywhere(s, lambda r: np.arange(5.0) + 10 * r + 1)       # read back across nodes
out["get_value_every_rank"] = np.stack([synk.get_value(r, s) for r in every_rank()])
out["ref_get_value_every_rank"] = expect_rank_values

set_everywhere(s, lambda r: np.arange(5.0) + 10 * r + 1)
out["gather"], out["ref_gather"] = synk.gather(s), expect_rank_values
set_everywhere(lengths, lambda r: np.full((r + 1, 2), float(r)))
out["gather_lengths"] = synk.gather(lengths, nd_up=0)
out["ref_gather_lengths"] = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(n)])
out["get_lengths"], out["ref_get_lengths"] = np.array(synk.get_lengths(lengths)), np.arange(1, n + 1)
synk.all_gather(s)
out["all_gather"], out["ref_all_gather"] = synk.get_value(n - 1, s), expect_rank_values.ravel()

s.set_value(np.full(5, 100.0 + node))          # node 0's master's value is the one broadcast
synk.broadcast(s)
out["broadcast_every_rank"] = np.stack([synk.get_value(r, s) for r in every_rank()])
out["ref_broadcast_every_rank"] = np.full((n, 5), 100.0)

full = np.arange(2.0 * (2 * n + 3)).reshape(-1, 2)
synk.scatter(scattered, full)
out["scatter_gathered"], out["ref_scatter_gathered"] = synk.gather(scattered, nd_up=0), full

# --- five training steps -------------------------------------------------------------------------------
XM = np.random.default_rng(2).normal(size=(29, 6))
YM = np.random.default_rng(3).integers(0, 3, 29)
xm, ym = synk.data(XM), synk.data(YM)
order = np.random.default_rng(4).permutation(29)
batches = [order[k * 9:(k + 1) * 9] for k in range(3)] + [order[23:], order[:13]]   # uneven splits
for p, v in zip(params, init):
    p.set_value(v)
synk.broadcast(params)
out["train_losses"] = np.array([step(xm, ym, batch=b) for b in batches])
trained = [p.get_value() for p in params]
for p, v in zip(params, init):
    p.set_value(v)
out["ref_train_losses"] = np.array([reference(XM[b], YM[b]) for b in batches])
for i, (a, b) in enumerate(zip(trained, [p.get_value() for p in params])):
    out[f"train_param{i}"], out[f"ref_train_param{i}"] = a, b

# --- a checkpoint: written once (node 0), a per-rank value from every node, restored on every node --
for p, v in zip(params, trained):                                    # the five steps' parameters
    p.set_value(v)
synk.broadcast(params)
set_everywhere(s, lambda r: np.arange(5.0) + r)                      # differs between ranks
path = os.path.join(sys.argv[1], "checkpoint.safetensors")
synk.checkpoint.save(path, list(params) + [s], step=5)
meta, _, tensors = synk.checkpoint.read(path)
for i, (entry, p) in enumerate(zip(meta["variables"], params)):   # a value once, or rank 0's
    out[f"checkpoint_param{i}"] = tensors[entry["key"] + ("@0" if entry["per_rank"] else "")]
out["checkpoint_per_rank"] = np.stack([tensors[f"{meta['variables'][-1]['key']}@{r}"] for r in range(n)])
out["ref_checkpoint_per_rank"] = np.stack([np.arange(5.0) + r for r in range(n)])
saved = [p.get_value() for p in params]
for p in params:
    p.set_value(np.zeros_like(p.get_value()))
synk.broadcast(params)
set_everywhere(s, lambda r: np.zeros(5))
synk.checkpoint.restore(path, list(params) + [s])
out["restored_params"] = np.array(all(np.array_equal(a, p.get_value()) for a, p in zip(saved, params)))
out["restored_every_rank"] = np.stack([synk.get_value(r, s) for r in every_rank()])
out["ref_restored_every_rank"] = np.stack([np.arange(5.0) + r for r in every_rank()])
if n_nodes > 1:       # a checkpoint node 1 does not find: every node raises alike, naming node 1
    here = path if node == 0 else path + ".elsewhere"
    for name, use in [("exists", synk.checkpoint.exists), ("restore", synk.checkpoint.restore)]:
        try:
            use(here)
            out[f"lacking_{name}"] = np.array("no error")
        except (FileNotFoundError, ValueError) as e:
            out[f"lacking_{name}"] = np.array(f"{type(e).__name__}: {e}")

# --- a device-driven loop under the synchronous rules ----------------------------------------------------
for p, v in zip(params, init):
    p.set_value(v)
synk.broadcast(params)
history = train.run(step, xm, ym, 10, steps=6, shuffle=True, seed=3, check_every=3)
out["run_losses"] = np.array(history["loss"])
out["run_rows"] = np.array(history[-1].rows_per_device)
for name, rule in [("diloco", sync.DiLoCo(every=4, outer_lr=0.7)), ("easgd", sync.EASGD(0.5, every=2))]:
    for p, v in zip(params, init):            # rules that start from node 0's master's parameters
        p.set_value(v)
    synk.broadcast(params)
    train.run(step, xm, ym, 10, steps=6, shuffle=True, seed=3, sync=rule)
    for i, p in enumerate(params):
        out[f"{name}_param{i}"] = np.stack([synk.get_value(r, p) for r in every_rank()])

# --- training steps on sharded Data: every node's batch of its own rows, one step over all of them --
XS, YS = XM[:27], YM[:27]
model_shards = np.array_split(np.arange(27), n_nodes)
xs, ys = synk.data(XS[model_shards[node]], sharded=True), synk.data(YS[model_shards[node]], sharded=True)
for p, v in zip(params, init):
    p.set_value(v)
synk.broadcast(params)
losses, ref_losses = [], []
for k in range(2):
    picks = [shard[np.array([0, 2, 4, 6, 8][: 5 - k]) + k] for shard in model_shards]
    mine = picks[node] - model_shards[node][0]                       # indices into this node's shard
    losses.append(sharded_step(xs, ys, batch=mine))
out["sharded_train_losses"] = np.array(losses)
out["sharded_train_params"] = np.concatenate([p.get_value().ravel() for p in params])
for p, v in zip(params, init):
    p.set_value(v)
for k in range(2):
    rows = np.concatenate([shard[np.array([0, 2, 4, 6, 8][: 5 - k]) + k] for shard in model_shards])
    ref_losses.append(sharded_reference(XS[rows], YS[rows]))
out["ref_sharded_train_losses"] = np.array(ref_losses)
out["ref_sharded_train_params"] = np.concatenate([p.get_value().ravel() for p in params])

np.savez(os.path.join(sys.argv[1], f"node{node}.npz"), **out)
synk.close()
