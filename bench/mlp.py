"""The benchmark MLP (784-1024-1024-10, ReLU, softmax cross-entropy) as a PyTensor graph."""

import numpy as np

SIZES = (784, 1024, 1024, 10)
LR, MOMENTUM = 0.01, 0.9


def init_params(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        params += [(rng.normal(size=(n_in, n_out)) * np.sqrt(2 / n_in)).astype("float32"),
                   np.zeros(n_out, "float32")]
    return params


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, SIZES[0])).astype("float32"), rng.integers(0, SIZES[-1], n).astype("int32")


def pytensor_graph(sizes=SIZES):
    """Return (x, y, loss, params) with float32 shared parameters, computing in float32."""
    import pytensor
    import pytensor.tensor as pt

    from synkhronos.platform.jax_init import set_precision
    # optimizer constants in float32 too, and JAX in 32 bits: PyTensor turns JAX's 64-bit mode on
    # when its JAX backend is imported under the default floatX (float64), and then computes the
    # float64-accumulated parts of the backward pass, dots included, in float64 (seen in the HLO)
    set_precision("float32")
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    params = [pytensor.shared(v, name=f"p{i}") for i, v in enumerate(init_params(sizes=sizes))]
    h = x
    for i in range(0, len(params) - 2, 2):
        h = pt.maximum(h @ params[i] + params[i + 1], 0)
    logits = h @ params[-2] + params[-1]
    logp = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    # the target's log-probability picked by a one-hot mask: take_along_axis builds an int64 index
    # (arange over the rows), which JAX in 32 bits truncates with a warning at every trace
    picked = pt.switch(pt.eq(y[:, None], pt.arange(sizes[-1], dtype="int32")), logp, 0)
    loss = -pt.mean(pt.sum(picked, axis=1))
    return x, y, loss, params
