"""Test helpers: a reference run that leaves the master's state alone, and a failing op."""

import jax
import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.dispatch import jax_funcify
import pytensor.tensor as pt


def reference(f, *arrays):
    """``f.as_pytensor(*arrays)`` with the master's shared values restored afterwards."""
    targets = [s for s, _, _ in f.spec.updates]
    saved = [np.array(s.get_value()) for s in targets]
    try:
        return f.as_pytensor(*arrays)
    finally:
        for s, v in zip(targets, saved):
            s.set_value(v)


def close(a, b, rtol=1e-10, atol=1e-12):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _check_rows(values):
    if np.any(np.asarray(values) < 0):
        raise ValueError("RaiseIfNegative saw a negative value")
    return np.asarray(values)


def _warn_rows(values):
    import warnings
    warnings.warn(f"WarnRows saw {len(values)} rows", UserWarning)
    return np.asarray(values)


def _host_identity(name, host_fn, doc):
    """An identity op that runs ``host_fn`` on its input in the host (a JAX callback under JAX)."""
    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = host_fn(inputs[0])
    op = type(name, (Op,), {"__props__": (), "__doc__": doc, "__module__": __name__,
                            "make_node": make_node, "perform": perform})

    @jax_funcify.register(op)
    def _jax(op, **kwargs):
        def call(x):
            return jax.pure_callback(host_fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return call
    return op


RaiseIfNegative = _host_identity("RaiseIfNegative", _check_rows,
                                 "Identity that raises ValueError when its input holds a negative value.")
WarnRows = _host_identity("WarnRows", _warn_rows,
                          "Identity that warns (UserWarning) with the number of rows it sees.")


def run_script(code, timeout=120, env=None):
    """Run ``code`` (dedented) in a fresh Python with this checkout importable; return the result.

    For what must happen in a process of its own: a script's exit, os.fork(),
    a small /dev/shm. ``env`` adds variables; a value of None removes one.
    """
    import os
    import subprocess
    import sys
    import textwrap
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environ = dict(os.environ, PYTHONPATH=root, **(env or {}))
    environ = {k: v for k, v in environ.items() if v is not None}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=environ)
