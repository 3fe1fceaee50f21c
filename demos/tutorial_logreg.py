"""The Theano tutorial's logistic regression (``logistic_sgd.py``), ported as a new user would.

The original feeds its data through ``givens`` and a minibatch ``index``::

    train_model = theano.function([index], cost, updates=updates, givens={
        x: train_set_x[index * batch_size:(index + 1) * batch_size],
        y: train_set_y[index * batch_size:(index + 1) * batch_size]})

``--variant single`` is that script on PyTensor (one process). ``--variant synk`` changes
only what the porting section of the user guide says: ``synk.fork()`` first,
``synk.function`` for ``theano.function``, and the training step from
``make_train_function`` (the gradient all-reduced between devices), fed by the
same ``givens``. Both print the same numbers, epoch by epoch. At the end both
pickle the trained model and ``predict()`` with a plain ``pytensor.function``,
as the tutorial does. Data: scikit-learn's bundled 8x8 digits.

Examples
--------
    python demos/tutorial_logreg.py --variant synk --devices 2
    python demos/tutorial_logreg.py --variant single
"""

import argparse
import os
import pickle
import sys
import tempfile

import numpy as np
import pytensor
import pytensor.tensor as pt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from demos.mnist import load_data  # noqa: E402


class LogisticRegression:
    """Multi-class logistic regression, as in the tutorial (``W`` and ``b`` start at zero)."""

    def __init__(self, input, n_in, n_out):
        self.W = pytensor.shared(np.zeros((n_in, n_out), dtype=pytensor.config.floatX), name="W")
        self.b = pytensor.shared(np.zeros(n_out, dtype=pytensor.config.floatX), name="b")
        # Theano's T.nnet.softmax normalized each row; PyTensor's softmax needs the axis
        self.p_y_given_x = pt.special.softmax(pt.dot(input, self.W) + self.b, axis=1)
        self.y_pred = pt.argmax(self.p_y_given_x, axis=1)
        self.params = [self.W, self.b]
        self.input = input

    def negative_log_likelihood(self, y):
        return -pt.mean(pt.log(self.p_y_given_x)[pt.arange(y.shape[0]), y])

    def errors(self, y):
        return pt.mean(pt.neq(self.y_pred, y))


def shared_dataset(x, y):
    """The tutorial's ``shared_dataset``: labels stored as floatX, cast to int32 where used."""
    shared_x = pytensor.shared(np.asarray(x, dtype=pytensor.config.floatX), borrow=True)
    shared_y = pytensor.shared(np.asarray(y, dtype=pytensor.config.floatX), borrow=True)
    return shared_x, pt.cast(shared_y, "int32")


def sgd_optimization(variant="single", learning_rate=0.13, n_epochs=20, batch_size=100, devices=2,
                     model_path=None, out=print):
    """Train as the tutorial does (minus its early stopping: a fixed number of epochs).

    Returns the per-epoch records and the test error of ``predict()`` on the pickled model.
    """
    if variant == "synk":
        import synkhronos as synk
        from synkhronos.extensions import train, updates
        synk.fork(devices)
    data = load_data()
    train_set_x, train_set_y = shared_dataset(data["x_train"], data["y_train"])
    valid_set_x, valid_set_y = shared_dataset(data["x_val"], data["y_val"])
    n_train_batches = len(data["x_train"]) // batch_size
    n_valid_batches = len(data["x_val"]) // batch_size or 1
    valid_size = min(batch_size, len(data["x_val"]))

    index, x, y = pt.lscalar("index"), pt.matrix("x"), pt.ivector("y")
    classifier = LogisticRegression(input=x, n_in=data["x_train"].shape[1], n_out=10)
    cost = classifier.negative_log_likelihood(y)

    def window(size):
        return slice(index * size, (index + 1) * size)
    valid_givens = {x: valid_set_x[window(valid_size)], y: valid_set_y[window(valid_size)]}
    train_givens = {x: train_set_x[window(batch_size)], y: train_set_y[window(batch_size)]}
    if variant == "synk":
        validate_model = synk.function([index], classifier.errors(y), givens=valid_givens)
        train_model = train.make_train_function(cost, classifier.params, x, y, updates.sgd,
                                                learning_rate=learning_rate, givens=train_givens)
        synk.distribute()
    else:
        validate_model = pytensor.function([index], classifier.errors(y), givens=valid_givens)
        g_W, g_b = pytensor.grad(cost, [classifier.W, classifier.b])
        train_model = pytensor.function(
            [index], cost, givens=train_givens,
            updates=[(classifier.W, classifier.W - learning_rate * g_W),
                     (classifier.b, classifier.b - learning_rate * g_b)])

    records = []
    for epoch in range(1, n_epochs + 1):
        costs = [float(train_model(i)) for i in range(n_train_batches)]
        error = float(np.mean([validate_model(i) for i in range(n_valid_batches)]))
        records.append((epoch, float(np.mean(costs)), error))
        out(f"epoch {epoch:3d}, minibatch avg cost {np.mean(costs):.10f}, "
            f"validation error {error * 100:.6f} %")

    model_path = model_path or os.path.join(tempfile.mkdtemp(), "best_model.pkl")
    with open(model_path, "wb") as f:
        pickle.dump(classifier, f)
    if variant == "synk":
        synk.close()
    test_error = predict(model_path, data["x_test"], data["y_test"])
    out(f"test error of the pickled model {test_error * 100:.6f} %")
    return records, test_error


def predict(model_path, x_test, y_test):
    """The tutorial's ``predict()``: load the pickled model, compile a plain PyTensor function."""
    with open(model_path, "rb") as f:
        classifier = pickle.load(f)
    predict_model = pytensor.function([classifier.input], classifier.y_pred)   # the default mode
    return float(np.mean(predict_model(x_test.astype(pytensor.config.floatX)) != y_test))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("single", "synk"), default="synk")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=0.13)
    args = parser.parse_args(argv)
    sgd_optimization(args.variant, args.learning_rate, args.epochs, args.batch_size, args.devices)


if __name__ == "__main__":
    main()
