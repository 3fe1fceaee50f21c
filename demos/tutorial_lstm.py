"""The Theano tutorial's LSTM sentiment classifier (``lstm.py``), ported as a new user would.

The original lays each minibatch out time-major, ``(time, samples)``, padded to
the minibatch's own longest sequence with a mask, runs a ``scan`` over time,
mean-pools the hidden states under the mask and trains with adadelta, whose
gradient and update are two functions::

    f_grad_shared = theano.function([x, mask, y], cost, updates=zgup + rg2up)
    f_update = theano.function([lr], [], updates=ru2up + param_up)

``--variant single`` is that script on PyTensor in one process. ``--variant
synk`` changes what the user guide's porting section says: ``synk.fork()``
first; the inputs split along their sample axis (``split_axes={x: 1, mask: 1}``);
the gradient function stores each device's gradient, ``synk.all_reduce(...,
by_rows=True)`` averages it (weighing each device by its samples, which split
unevenly over 3 devices), and the adadelta statistics and the parameters are updated from the average on
every device. Both print the same costs, batch by batch, on any number of
devices. Data: synthetic IMDB-shaped reviews
(word ids under a vocabulary, lengths from 10 to ``--maxlen``), whose label is
whether more of their words come from the first half of the vocabulary.

Examples
--------
    python demos/tutorial_lstm.py --variant synk --devices 2
    python demos/tutorial_lstm.py --variant single
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt


def synthetic_imdb(n, vocab=400, maxlen=60, seed=123):
    """``n`` reviews (lists of word ids) and their labels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, maxlen + 1, size=n)
    seqs = [list(rng.integers(1, vocab, size=k)) for k in lengths]
    labels = [int(np.mean(np.asarray(s) < vocab // 2) > 0.5) for s in seqs]
    return seqs, labels


def prepare_data(seqs, labels, length=None):
    """The tutorial's ``prepare_data``: ``x`` and ``mask`` (time, samples), padded to the longest
    sequence (or to ``length``), and the labels."""
    length = length or max(len(s) for s in seqs)
    x = np.zeros((length, len(seqs)), "int64")
    mask = np.zeros((length, len(seqs)), pytensor.config.floatX)
    for j, s in enumerate(seqs):
        x[:len(s), j] = s
        mask[:len(s), j] = 1.0
    return x, mask, np.asarray(labels, "int64")


def ortho_weight(ndim, rng):
    u, _, _ = np.linalg.svd(rng.normal(size=(ndim, ndim)))
    return u.astype(pytensor.config.floatX)


def init_params(vocab, dim, ydim, seed=1234):
    """The tutorial's parameters: embedding, one LSTM layer, a softmax classifier."""
    rng = np.random.default_rng(seed)
    floatx = pytensor.config.floatX
    params = OrderedDict()
    params["Wemb"] = (0.01 * rng.random((vocab, dim))).astype(floatx)
    params["lstm_W"] = np.concatenate([ortho_weight(dim, rng) for _ in range(4)], axis=1)
    params["lstm_U"] = np.concatenate([ortho_weight(dim, rng) for _ in range(4)], axis=1)
    params["lstm_b"] = np.zeros(4 * dim, floatx)
    params["U"] = (0.01 * rng.normal(size=(dim, ydim))).astype(floatx)
    params["b"] = np.zeros(ydim, floatx)
    return OrderedDict((k, pytensor.shared(v, name=k)) for k, v in params.items())


def lstm_layer(tparams, state_below, mask, dim):
    """The tutorial's ``lstm_layer``: a scan over time under the mask."""
    nsteps, n_samples = state_below.shape[0], state_below.shape[1]

    def _slice(_x, n):
        return _x[:, n * dim:(n + 1) * dim]

    def _step(m_, x_, h_, c_):
        preact = pt.dot(h_, tparams["lstm_U"]) + x_
        i = pt.sigmoid(_slice(preact, 0))
        f = pt.sigmoid(_slice(preact, 1))
        o = pt.sigmoid(_slice(preact, 2))
        c = pt.tanh(_slice(preact, 3))
        c = f * c_ + i * c
        c = m_[:, None] * c + (1.0 - m_)[:, None] * c_
        h = o * pt.tanh(c)
        h = m_[:, None] * h + (1.0 - m_)[:, None] * h_
        return h, c

    state_below = pt.dot(state_below, tparams["lstm_W"]) + tparams["lstm_b"]
    zeros = pt.alloc(np.asarray(0.0, pytensor.config.floatX), n_samples, dim)
    h, _ = pytensor.scan(_step, sequences=[mask, state_below], outputs_info=[zeros, zeros],
                         n_steps=nsteps, return_updates=False)
    return h


def build_model(tparams, dim):
    """The tutorial's ``build_model`` (without dropout): inputs, cost and predicted probabilities."""
    x, mask, y = pt.matrix("x", dtype="int64"), pt.matrix("mask"), pt.vector("y", dtype="int64")
    n_timesteps, n_samples = x.shape[0], x.shape[1]
    emb = tparams["Wemb"][x.flatten()].reshape([n_timesteps, n_samples, dim])
    proj = lstm_layer(tparams, emb, mask, dim)
    proj = (proj * mask[:, :, None]).sum(axis=0) / mask.sum(axis=0)[:, None]
    pred = pt.special.softmax(pt.dot(proj, tparams["U"]) + tparams["b"], axis=1)
    cost = -pt.log(pred[pt.arange(n_samples), y] + 1e-8).mean()
    return x, mask, y, cost, pred


def adadelta_parts(tparams, grads):
    """The tutorial's adadelta, as the shared variables it keeps and the updates of its two steps:
    storing the gradient, and (from the stored gradient) the statistics and the parameters."""
    floatx = pytensor.config.floatX

    def zeros_like(p, tag):
        return pytensor.shared(p.get_value() * np.asarray(0.0, floatx), name=f"{p.name}_{tag}")
    zipped = [zeros_like(p, "grad") for p in tparams.values()]
    up2 = [zeros_like(p, "rup2") for p in tparams.values()]
    grads2 = [zeros_like(p, "rgrad2") for p in tparams.values()]
    store = [(zg, g) for zg, g in zip(zipped, grads)]
    rg2up = [(rg2, 0.95 * rg2 + 0.05 * (zg ** 2)) for rg2, zg in zip(grads2, zipped)]
    updir = [-pt.sqrt(ru2 + 1e-6) / pt.sqrt(rg2_new + 1e-6) * zg
             for zg, ru2, (_, rg2_new) in zip(zipped, up2, rg2up)]
    ru2up = [(ru2, 0.95 * ru2 + 0.05 * (ud ** 2)) for ru2, ud in zip(up2, updir)]
    param_up = [(p, p + ud) for p, ud in zip(tparams.values(), updir)]
    return zipped, store, rg2up + ru2up + param_up


def minibatches(n, size, rng):
    """Shuffled minibatches of indices, as the tutorial's ``get_minibatches_idx``."""
    order = rng.permutation(n)
    return [order[i:i + size] for i in range(0, n - size + 1, size)]


def lengths_by_epoch(epochs=3, n=320, batch_size=16, vocab=400, maxlen=60, **_):
    """The length each minibatch is padded to, epoch by epoch, in :func:`train`'s order."""
    seqs, _labels = synthetic_imdb(n, vocab, maxlen)
    rng = np.random.default_rng(7)
    return [[max(len(seqs[i]) for i in idx) for idx in minibatches(n, batch_size, rng)]
            for _ in range(epochs)]


def train(variant="synk", devices=2, epochs=3, n=320, batch_size=16, vocab=400, dim=16, maxlen=60,
          pad_to_maxlen=False, log=print):
    """Train as the tutorial does; return per-epoch costs (the mean over batches) and seconds.

    ``pad_to_maxlen`` pads every minibatch to ``maxlen`` instead of its own longest sequence.
    """
    seqs, labels = synthetic_imdb(n, vocab, maxlen)
    tparams = init_params(vocab, dim, 2)
    x, mask, y, cost, _ = build_model(tparams, dim)
    grads = pytensor.grad(cost, wrt=list(tparams.values()))
    zipped, store, update = adadelta_parts(tparams, grads)
    if variant == "synk":
        import synkhronos as synk
        synk.fork(devices)
        f_grad_shared = synk.function([x, mask, y], (cost, "avg"), updates=store, local_updates=True,
                                      split_axes={x: 1, mask: 1}, name="f_grad_shared")
        f_update = synk.function([], updates=update, name="f_update")
        synk.distribute()

        def step(xb, mb, yb):
            c = f_grad_shared(xb, mb, yb)
            synk.all_reduce(zipped, op="avg", by_rows=True)   # the devices' gradients, by their samples
            f_update()
            return c
    else:
        f_grad = pytensor.function([x, mask, y], cost, updates=store, mode="FAST_RUN")
        f_up = pytensor.function([], [], updates=update, mode="FAST_RUN")

        def step(xb, mb, yb):
            c = f_grad(xb, mb, yb)
            f_up()
            return c
    rng = np.random.default_rng(7)
    history = []
    try:
        for epoch in range(epochs):
            start, costs = time.perf_counter(), []
            for idx in minibatches(n, batch_size, rng):
                xb, mb, yb = prepare_data([seqs[i] for i in idx], [labels[i] for i in idx],
                                          maxlen if pad_to_maxlen else None)
                costs.append(float(step(xb, mb, yb)))
            seconds = time.perf_counter() - start
            history.append((float(np.mean(costs)), seconds, costs))
            log(f"epoch {epoch}: cost {np.mean(costs):.10f} ({seconds:.2f} s)")
    finally:
        if variant == "synk":
            synk.close()
    return history


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["synk", "single"], default="synk")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--pad-to-maxlen", action="store_true",
                   help="pad every minibatch to the longest review, not to its own longest")
    args = p.parse_args(argv)
    pytensor.config.floatX = "float64"
    train(args.variant, args.devices, args.epochs, pad_to_maxlen=args.pad_to_maxlen)


if __name__ == "__main__":
    main()
