"""``import synkhronos`` and a whole run leave numpy's and Python's global random states alone.

The Theano tutorials seed numpy at module level and then draw their data split and initial
weights; importing JAX (which ``fork()`` does) draws from numpy's global generator.
"""

import json

import pytest
from helpers import run_script

#: seeds both global generators, optionally runs synkhronos, prints both states and the next draws
_SCRIPT = """
import json, random, sys
import numpy as np
np.random.seed(1234)
random.seed(1234)
np.random.normal()              # leaves a cached gaussian in numpy's state
random.gauss(0, 1)              # and in random's
if sys.argv[1] == "synk":
    import pytensor, pytensor.tensor as pt
    import synkhronos as synk
    synk.fork(2)
    x = pt.vector("x")
    w = pytensor.shared(np.zeros(3), name="w")
    f = synk.function([x], (x.sum() + w.sum(), "avg"), updates=[(w, w + 1)], local_updates=True)
    synk.distribute()
    assert float(f(np.arange(4.0))) == 3.0
    synk.close()
kind, key, pos, has_gauss, cached = np.random.get_state()
print(json.dumps({"numpy": [kind, key.tolist(), pos, has_gauss, cached],
                  "random": random.getstate(),
                  "draws": [np.random.rand(4).tolist(), np.random.normal(), random.random(),
                            random.gauss(0, 1)]}))
"""


def _states(kind):
    out = run_script(_SCRIPT, timeout=240, args=(kind,))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_import_fork_function_call_close_leave_the_global_random_states_alone():
    plain, synk = _states("plain"), _states("synk")
    assert synk["numpy"][2] == plain["numpy"][2]          # the position first: the usual symptom
    assert synk["numpy"] == plain["numpy"]
    assert synk["random"] == plain["random"]
    assert synk["draws"] == plain["draws"]
