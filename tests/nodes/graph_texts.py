"""Print what the masters of several nodes compare of the graphs of a few models (``python
graph_texts.py``): pytensor-ml layers (batch norm, a convolution) trained by Adam, a function drawing
random numbers, and one built with a PyTensor Mode object. Every process that runs this script
must print the same lines, whatever its hash seed."""

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode
from pytensor_ml.activations import ReLU
from pytensor_ml.layers import BatchNorm, Conv2D, Input, Linear, MaxPool2D, Sequential
from pytensor_ml.loss import CrossEntropy, supervised_loss
from pytensor_ml.pytensorf import collect_trainable_params

import synkhronos as synk
from synkhronos.extensions import train, updates

synk.fork(1)
x = Input("x", shape=(None, 64))
net = Sequential(Linear("h0", n_in=64, n_out=16), BatchNorm("bn0", n_in=16), ReLU(),
                 Linear("out", n_in=16, n_out=10))
loss, y = supervised_loss(net(x), CrossEntropy(expect_logits=True))
mlp = train.make_train_function(loss, collect_trainable_params(loss), x, y, updates.adam,
                                learning_rate=0.01)
image = Input("image", shape=(None, 64))
conv = Sequential(Conv2D("conv", in_channels=1, out_channels=4, kernel_size=3, padding="same"),
                  ReLU(), MaxPool2D("pool", kernel_size=2))
features = synk.function([image], [(conv(image.reshape((-1, 8, 8, 1))).sum(), "sum")], name="conv")
noise = pt.random.normal(size=(3,), rng=pytensor.shared(np.random.default_rng(3)))
drawn = synk.function([], [(noise.sum(), "sum")], name="drawn")
w = pytensor.shared(np.ones(3), name="w")
by_mode = synk.function([], [(w.sum(), "sum")], mode=Mode(linker="jax", optimizer="fast_run"),
                        name="by_mode")
for fn in (*mlp.functions, features, drawn, by_mode):
    print(fn.name, fn.graph_compared())
synk.close()
