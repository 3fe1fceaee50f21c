"""Baseline (d): the MLP step in one JAX process over 2 host devices with shard_map + psum.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.common import emit
from bench.mlp import LR, MOMENTUM, data, init_params


def loss_fn(params, x, y):
    h = x
    for i in range(0, len(params) - 2, 2):
        h = jax.nn.relu(h @ params[i] + params[i + 1])
    logp = jax.nn.log_softmax(h @ params[-2] + params[-1])
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def main(batches, steps):
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def local_step(params, velocity, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "d")
        velocity = [MOMENTUM * v + g for v, g in zip(velocity, grads)]
        params = [p - LR * v for p, v in zip(params, velocity)]
        return params, velocity, jax.lax.pmean(loss, "d")

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                 out_specs=(P(), P(), P())))
    result = {}
    for b in batches:
        params = [jnp.asarray(p) for p in init_params()]
        velocity = [jnp.zeros_like(p) for p in params]
        X, Y = data(b)
        X = jax.device_put(X, NamedSharding(mesh, P("d")))
        Y = jax.device_put(Y, NamedSharding(mesh, P("d")))
        for _ in range(3):
            params, velocity, loss = step(params, velocity, X, Y)
        loss.block_until_ready()
        t = time.perf_counter()
        for _ in range(steps):
            params, velocity, loss = step(params, velocity, X, Y)
        loss.block_until_ready()
        result[str(b)] = b * steps / (time.perf_counter() - t)
    emit(result)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]))
