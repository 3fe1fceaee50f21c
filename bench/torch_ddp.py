"""Baseline (c): the MLP step with PyTorch DistributedDataParallel, Gloo, 2 processes.

Runs in its own virtualenv (PyTorch is not a dependency of synkhronos).
"""

import json
import socket
import sys
import time


def worker(rank, world, port, batches, steps, queue, sizes=(784, 1024, 1024, 10)):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    result = {}
    for b in batches:
        layers = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        local = b // world
        rng = np.random.default_rng(rank)
        x = torch.from_numpy(rng.normal(size=(local, sizes[0])).astype("float32"))
        y = torch.from_numpy(rng.integers(0, sizes[-1], local))
        loss_fn = nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
        for _ in range(3):
            step()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        result[str(b)] = b * steps / (time.perf_counter() - t)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main(batches, steps, sizes=(784, 1024, 1024, 10)):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, batches, steps, queue, sizes)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join()
    import torch
    result["torch"] = torch.__version__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sizes = tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else (784, 1024, 1024, 10)
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]), sizes)
