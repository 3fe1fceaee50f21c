"""The native lines synkhronos drops from a process's output, and that it drops nothing else
(in-process: no runtime)."""

import os

import pytest
from helpers import run_script

from synkhronos.platform.native_output import TASK_WATCH_CANCELLED, TASK_WATCH_DETAIL, native_lines_dropped

#: what a close() on one GPU printed (JAX 0.11.2 with its CUDA plugin): the backend's watch of the
#: coordination service's tasks, cancelled, then failing once the service was gone
GPU_TASK_WATCH = "\n".join([
    ('E0101 00:00:00.000000    1040 coordination_service_agent.cc:369] WatchTasksAsync failed fo'
     'r task 0: CANCELLED: Cancelled'),
    ('Additional GRPC error information from remote target coordination_service while calling /x'
     'la.coordination.CoordinationService/WatchTasks:'),
    ":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']",
    '=== Source Location Trace: === ',
    'external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89',
    '',
    ('W0101 00:00:01.741165    4552 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: UNAV'
     'AILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49477: Fa'
     'iled to connect to remote host: Connection refused'),
    ('Additional GRPC error information from remote target coordination_service while calling /x'
     'la.coordination.CoordinationService/WatchTasks:'),
    (':UNAVAILABLE:failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:49477'
     ': Failed to connect to remote host: Connection refused'),
    '=== Source Location Trace: === ',
    'external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89',
    '',
    '',
])

#: what the user's own code may print in the same moment (a finalizer run by close()'s collection)
USERS_OWN = ("USER: order 42 CANCELLED by customer\n\nUSER: other line\nW: a warning of the user's\n"
             ":TODO: a line of the user's\n\nsrc/xla/mything.cc:12\n"
             "W0101 00:00:00.000000 1234 my.py:1] job CANCELLED by user\n")


def _through_the_filter(capfd, text):
    with native_lines_dropped(2, TASK_WATCH_CANCELLED, continued_by=TASK_WATCH_DETAIL):
        os.write(2, text.encode())
    return capfd.readouterr().err


def test_the_gpu_backends_task_watch_lines_are_dropped_whole(capfd):
    assert _through_the_filter(capfd, GPU_TASK_WATCH) == ""


def test_the_users_own_lines_are_kept_even_beside_them(capfd):
    assert _through_the_filter(capfd, USERS_OWN) == USERS_OWN
    assert _through_the_filter(capfd, GPU_TASK_WATCH + USERS_OWN + GPU_TASK_WATCH) == USERS_OWN


@pytest.mark.slow
@pytest.mark.parametrize("first", ["train.run", "a call"])
def test_a_run_on_gloo_prints_only_what_the_script_prints(first):
    """Gloo says "[Gloo] Rank r is connected" on stdout as the ranks first meet, whether in a
    collective of its own or inside a training step's program."""
    out = run_script("""
        import sys
        import numpy as np, pytensor, pytensor.tensor as pt
        import synkhronos as synk
        from synkhronos.extensions import train, updates
        synk.fork(2, collectives="jax")
        x, y = pt.matrix("x"), pt.vector("y")
        w = pytensor.shared(np.full(3, 0.1), name="w")
        step = train.make_train_function(((x @ w - y) ** 2).mean(), [w], x, y, updates.sgd,
                                         learning_rate=0.1)
        X, Y = synk.data(np.arange(48.0).reshape(16, 3) / 50), synk.data(np.ones(16))
        if sys.argv[1] == "a call":
            print("loss", round(float(step(X, Y)), 6))
        train.run(step, X, Y, batch_size=4, steps=3, shuffle=False)
        print("w", np.round(w.get_value(), 6).tolist())
        synk.close()
    """, args=[first])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[0] for line in out.stdout.splitlines()] == \
        (["loss"] if first == "a call" else []) + ["w"], out.stdout
    assert out.stderr == ""
