"""The MLP step in one PyTorch process on one core (one thread): PyTorch's per-core speed.

    python bench/torch_single.py BATCHES STEPS

Runs in the PyTorch virtualenv, beside ``python -m bench.single_jax ... --one-core``.
"""

import json
import os
import sys
import time


def main(batches, steps):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    import numpy as np
    import torch
    from torch import nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    result = {}
    for b in batches:
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.normal(size=(b, 784)).astype("float32"))
        y = torch.from_numpy(rng.integers(0, 10, b))
        loss_fn = nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        for _ in range(3):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        result[str(b)] = b * steps / (time.perf_counter() - t)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]))
