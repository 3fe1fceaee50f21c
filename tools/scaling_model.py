"""The step-time model of docs/scaling.md: N nodes x 8 GPUs, ring all-reduces, no overlap.

    python tools/scaling_model.py      # prints the table docs/scaling.md shows
"""

#: published link figures (see docs/scaling.md for the sources)
NVLINK_BUSBW = 230e9          # B/s: NCCL all-reduce bus bandwidth among the 8 A100s of a DGX A100
IB_PER_NODE = 8 * 25e9 * 0.8  # B/s: 8 HDR InfiniBand NICs of 200 Gb/s at 80% of line rate
ALPHA_NVLINK = 5e-6           # s per ring step within a node
ALPHA_IB = 10e-6              # s per ring step between nodes
GPUS = 8
#: synkhronos's coordination of one training step across nodes: the masters' exchanges through the
#: coordination service (the gradient call's results, the all-reduce's agreement, the update call),
#: each a write and a read of every other node's key (bench §9 measures one exchange on two nodes)
EXCHANGES_PER_STEP = 3
EXCHANGE_FIXED = 0.35e-3      # s
EXCHANGE_PER_NODE = 0.2e-3    # s per other node read

MODELS = {
    # name: (gradient bytes, per-device compute seconds, where the compute time comes from)
    "benchmark MLP (784-1024-1024-10, 512 rows/device)": (7_454_760, 0.034,
                                                          "measured: one CPU device of bench §3"),
    "ResNet-50 (256 images/GPU, fp32 gradient)": (25_557_032 * 4, 256 / 2600,
                                                  "published: ~2,600 images/s per A100 (AMP)"),
}


def all_reduce_seconds(nbytes, nodes, gpus=GPUS):
    """Hierarchical ring all-reduce: reduce-scatter + all-gather over NVLink within the node, and
    a ring all-reduce of each GPU's shard between the nodes (the 8 NICs in parallel)."""
    within = 2 * (gpus - 1) / gpus * nbytes / NVLINK_BUSBW + 2 * (gpus - 1) * ALPHA_NVLINK
    between = 0.0
    if nodes > 1:
        between = 2 * (nodes - 1) / nodes * nbytes / IB_PER_NODE + 2 * (nodes - 1) * ALPHA_IB
    return within + between


def coordination_seconds(nodes):
    """The masters' exchanges of one step (none on one node)."""
    if nodes == 1:
        return 0.0
    return EXCHANGES_PER_STEP * (EXCHANGE_FIXED + EXCHANGE_PER_NODE * (nodes - 1))


def speedup(nbytes, compute, nodes, gpus=GPUS, coordination=True):
    """Speed-up over one GPU when every step computes, then all-reduces (synkhronos's order)."""
    extra = coordination_seconds(nodes) if coordination else 0.0
    return nodes * gpus * compute / (compute + all_reduce_seconds(nbytes, nodes, gpus) + extra)


def table():
    nodes = (1, 2, 8, 64)
    rows = ["| model | compute / step | all-reduce (ms) at 1, 2, 8, 64 nodes | coordination (ms) "
            "| speed-up, collectives only | speed-up with synkhronos's coordination |",
            "|---|---|---|---|---|---|"]
    for name, (nbytes, compute, source) in MODELS.items():
        ar = ", ".join(f"{all_reduce_seconds(nbytes, n) * 1e3:.2f}" for n in nodes)
        co = ", ".join(f"{coordination_seconds(n) * 1e3:.1f}" for n in nodes)
        cols = []
        for coordination in (False, True):
            cols.append(", ".join(
                f"{speedup(nbytes, compute, n, coordination=coordination):.1f}× "
                f"({speedup(nbytes, compute, n, coordination=coordination) / (GPUS * n):.0%})"
                for n in nodes))
        rows.append(f"| {name} | {compute * 1e3:.1f} ms ({source}) | {ar} | {co} | {cols[0]} | {cols[1]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    nbytes, compute, _ = MODELS["benchmark MLP (784-1024-1024-10, 512 rows/device)"]
    print("MLP if a GPU computed its step in 1 ms:",
          ", ".join(f"{speedup(nbytes, 0.001, n):.1f}×" for n in (1, 2, 8, 64)))
