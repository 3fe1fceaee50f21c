"""Training helpers built on the flattened-gradient rules of :mod:`.updates`.

:func:`make_train_function` builds one training step that the master drives
(one command a step on one node); :func:`run` runs many such steps on the devices
themselves, with the sync rules of :mod:`.sync`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, Unpack

import numpy as np

from ..api import collectives
from ..api.checkpoint import RunCheckpoints, next_multiple, order_record
from ..api.data import Data
from ..api.function_parts.batch import parse_batch_s
from ..api.function_parts.row_sums import sum_over_rows
from ..errors import is_whole, warn
from ..runtime.nodes import rows_of_every_node
from ..runtime.session import current, serialized
from ..seams.rule import check_rule, rule_record
from ..wire.batch import batch_from_spec
from ..wire.loop import epoch_order, steps_per_epoch
from .history import History, Resize, check_from_stats
from .run_options import Checkpointing, Checks, DataOrder, RunShorthands, options_of
from .single_process import make_single_process_train_function, make_train_function_theano
from .step_graph import build_step_graph, call_values, givens_scalars
from .step_graph import input_list as _input_list
from .sync import AllReduce, Rule
from .weighted_step import TrainStep, WeightedStep

if TYPE_CHECKING:
    from ..api.function import Function
    from ..wire.plan import InputRef

__all__ = ["TrainStep", "make_train_function", "make_device_train_function", "make_single_process_train_function",
           "make_train_function_theano", "run", "DataOrder", "Checks", "Checkpointing", "epoch_order",
           "steps_per_epoch"]


def make_train_function(loss: Any, params: Sequence[Any], x: Any, y: Any, update_rule: Callable,
                        *args: Any, givens: dict | None = None,
                        state_updates: Sequence[tuple] | dict | None = None,
                        consider_constant: Sequence[Any] | None = None, split_axes: dict | None = None,
                        allow_input_downcast: bool = False, **kwargs: Any) -> TrainStep:
    """Build ``train_minibatch(*data, *scalars, batch=None, num_slices=1)`` for all devices.

    One step is: every device computes its local gradient into the flat vector,
    ``all_reduce(grad_shared, "avg")`` in one collective, then the same update
    on every device; on one node the three run as one command
    (:class:`synkhronos.api.step.Step`). Returns the batch loss (row-weighted
    average). What pytensor-ml's ``optim.compile_train`` threads into a step
    is threaded in here: batch norm's running statistics (the same on every
    device after every step, those of the whole global batch) and the
    training clocks (see :func:`~synkhronos.extensions.updates.from_optim`).

    Each device scales its gradient by ``n_devices * its_rows / batch_rows``
    before the average, so the step equals the full-batch gradient step even
    when the batch does not split evenly across devices.

    Parameters
    ----------
    loss : TensorVariable
        Mean loss over the rows of the inputs.
    params : list of SharedVariable
    x : TensorVariable or list of TensorVariable
        The scattered inputs (one row per example each).
    y : TensorVariable, list of TensorVariable, or None
        The targets; None for an unsupervised model (an autoencoder).
    update_rule : callable
        A rule of :mod:`synkhronos.extensions.updates`, e.g. ``updates.adam``.
    *args, **kwargs
        Passed to ``update_rule`` (learning rate etc.). A 0-d symbolic input
        among them (``learning_rate=lr``, ``lr = pt.scalar("lr")``) is a scalar
        input of the step, as one the loss reads (see the notes).
    givens : dict, optional
        The Theano tutorials' idiom: ``{x: X_sh[i * bs:(i + 1) * bs], y: ...}``
        with ``i`` a scalar input (see :mod:`synkhronos.api.function_parts.givens`). The step
        then takes the scalars instead of data: ``train_minibatch(i)``.
    state_updates : list of (SharedVariable, expr) or (SharedVariable, expr, mode), or dict
        Applied with every step (a counter, the RBM's persistent chain), from
        the values before it, on every device (from rows, each its own).
        ``mode`` combines ``num_slices`` slices (default None: the last one's).
    consider_constant : list of Variable, optional
        Variables of the loss's graph the gradient treats as constants, as
        ``pytensor.grad(..., consider_constant=...)``.
    split_axes : dict, optional
        The axis of each input of ``x`` and ``y`` along which its examples lie,
        where it is not 0: ``{x: 1, mask: 1}`` for the Theano tutorials'
        time-major sequences ``(time, samples)``, as in :func:`synkhronos.function`.
        The step weighs each device by its examples along the first input's
        axis. :func:`run` takes no such step (it gives out rows along axis 0).
    allow_input_downcast : bool
        Take numpy data of a wider dtype than its input's (scikit-learn's
        int64 labels into an ``ivector``, float64 rows into a float32 model),
        narrowed at each call as ``pytensor.function(...,
        allow_input_downcast=True)`` does. A :class:`~synkhronos.Data` holds
        its input's dtype from the start: ``synk.data(value, var=x,
        force_cast=True)`` (what :func:`run` takes).

    Returns
    -------
    TrainStep
        ``train_minibatch(*data, *scalars, batch=None, num_slices=1)``: one
        :class:`~synkhronos.Data` or numpy array per input of ``x``, then per
        target of ``y`` (with ``givens``: one value per scalar of the slices'
        bounds, in the order they appear), then one value per scalar input
        (``step.scalars``). Any input may be given by its variable's name:
        ``train_minibatch(i, corruption=0.1, lr=0.05)``.

    Raises
    ------
    ValueError
        For a loss that sums over the rows and scales the sum by a constant
        (``cost.sum() / batch_size``), naming the fix (a mean: divide by
        ``x.shape[0]``); see :mod:`synkhronos.api.function_parts.row_sums`.

    Notes
    -----
    The step's scalar inputs are the 0-d symbolic inputs its loss, rule and
    state updates read besides its data (the SdA tutorial's corruption level
    and learning rate), in the order it computes with them (``step.inputs``),
    whole on every device (:mod:`.step_graph`). :func:`run` takes no step with them.

    Examples
    --------
    >>> from synkhronos.extensions import updates
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> loss = ((x.dot(w) - y) ** 2).mean()
    >>> train = make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
    >>> x_dat, y_dat = synk.data(np.ones((64, 3))), synk.data(np.ones(64))
    >>> for idx in np.split(np.arange(64), 4):
    ...     batch_loss = train(x_dat, y_dat, batch=idx)
    >>> float(batch_loss) < 0.1
    True
    >>> cost = (x.dot(w) ** 2).mean()                   # no targets: y is None
    >>> shrink = make_train_function(cost, [w], x, None, updates.sgd, 0.1)
    >>> float(shrink(x_dat, batch=np.arange(8))) > float(shrink(x_dat, batch=np.arange(8)))
    True
    """
    inputs = _input_list(x, "x") + _input_list(y, "y")
    _refuse_a_summed_loss(loss, split_axes if isinstance(split_axes, dict) else {}, inputs)
    downcast = {"allow_input_downcast": True} if allow_input_downcast else {}
    if givens:
        return _train_function_on_givens(loss, params, inputs, update_rule, args, kwargs, dict(givens),
                                         state_updates, consider_constant, downcast)
    axes = _split_axes(split_axes, inputs)
    graph = build_step_graph(loss, params, update_rule, args, kwargs, inputs, state_updates,
                             consider_constant)
    row_axis = axes[inputs[0]]              # the examples its weight counts
    step = WeightedStep(graph, inputs[0], inputs=inputs, split_axes=axes, row_axis=row_axis, **downcast)
    takes = inputs + graph.scalars

    def train_minibatch(*values: Any, batch: Any = None, num_slices: int = 1, **named: Any) -> Any:
        if len(values) < len(inputs) and not named:
            raise TypeError(f"the step takes {len(inputs)} data (one per input of x, then of y: "
                            f"{[str(v) for v in inputs]}), got {len(values)}")
        values = call_values(values, named, takes) if named or graph.scalars else values
        data = values[:len(inputs)]
        length = _length_along(data[0], row_axis)
        rows = length if batch is None else batch_from_spec(batch, length).total
        if getattr(data[0], "sharded", False):     # each node's batch of its own shard: all of them
            rows = rows_of_every_node(current().nodes, rows)
        return step(rows, *values, batch=batch, num_slices=num_slices)

    # what run() takes: rows along axis 0
    return step.expose(train_minibatch, takes, runs_on_devices=not any(axes.values()))


def _refuse_a_summed_loss(loss: Any, split_axes: dict, inputs: list[Any]) -> None:
    """Refuse a loss that sums over the rows of ``inputs`` (along ``split_axes``, else 0) and scales
    the sum by a constant (:mod:`synkhronos.api.function_parts.row_sums`): the step weighs the devices
    by their rows, which equals one process for a mean only."""
    found = sum_over_rows(loss, {var: split_axes.get(var, 0) for var in inputs if var is not None})
    if found is not None:
        raise ValueError(f"the loss is a sum over the rows ({found.owner.op} of {found.owner.inputs[0]}), "
                         f"scaled by constants at most: each device computes the loss on its own rows "
                         f"and the step weighs the devices by their rows, which equals one process for a "
                         f"mean over the rows only (this sum would give a gradient n_devices times too "
                         f"small); divide by the rows' count (x.shape[0]) in place of a constant batch "
                         f"size, or use .mean()")


def _split_axes(split_axes: dict | None, inputs: list[Any]) -> dict[Any, int]:
    """The declared axes of examples: the first input's (0 unless ``split_axes`` says), and the others
    ``split_axes`` names (an input not named takes its Data's axis, or 0)."""
    axes = {inputs[0]: 0}
    for var, axis in (split_axes or {}).items():
        if not any(var is v for v in inputs):
            raise ValueError(f"split_axes names {var}, which is not an input of x or y "
                             f"{[str(v) for v in inputs]}")
        if not is_whole(axis, at_least=0) or int(axis) >= var.type.ndim:
            raise ValueError(f"split_axes gives {var} (ndim {var.type.ndim}) the axis {axis!r}; give "
                             f"one of its axes, 0 to {var.type.ndim - 1}")
        axes[var] = int(axis)
    return axes


def _length_along(value: Any, axis: int) -> int:
    """How many examples ``value`` (a Data or an array) holds along ``axis``."""
    shape = value.shape if isinstance(value, Data) else np.shape(value)
    return int(shape[axis]) if shape is not None and len(shape) > axis else len(value)


def _train_function_on_givens(loss: Any, params: Sequence[Any], inputs: list[Any], update_rule: Callable,
                              args: Sequence[Any], kwargs: dict[str, Any], givens: dict,
                              state_updates: Sequence[tuple] | dict | None,
                              consider_constant: Sequence[Any] | None,
                              function_kwargs: dict[str, Any]) -> TrainStep:
    """:func:`make_train_function` in the tutorials' idiom: the step takes the slices' scalars."""
    bounds = givens_scalars(givens)
    graph = build_step_graph(loss, params, update_rule, args, kwargs, inputs + list(givens) + bounds,
                             state_updates, consider_constant)
    takes = bounds + graph.scalars
    step = WeightedStep(graph, inputs[0], inputs=bounds, givens=givens, **function_kwargs)

    def train_minibatch(*values: Any, num_slices: int = 1, **named: Any) -> Any:
        values = call_values(values, named, takes)
        window = step.f_grad.given_rows(*values, 0)
        return step(window.stop - window.start, *values, num_slices=num_slices)

    return step.expose(train_minibatch, takes)


def make_device_train_function(loss: Any, params: Sequence[Any], x: Any, y: Any, x_shared: Any,
                               y_shared: Any, update_rule: Callable, *args: Any, **kwargs: Any) -> TrainStep:
    """Like :func:`make_train_function`, on data kept on the devices.

    ``x_shared`` and ``y_shared`` hold each device's own rows (fill them with
    ``synk.scatter``); they replace ``x`` and ``y`` in the graph. Returns
    ``train_minibatch(batch_s=None, num_slices=1)``, where ``batch_s`` picks
    rows of each device's data (e.g. one shuffled index array per device).

    Examples
    --------
    >>> from synkhronos.extensions import updates
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> loss = ((x.dot(w) - y) ** 2).mean()
    >>> x_sh = pytensor.shared(np.zeros((1, 3)), name="x_sh")
    >>> y_sh = pytensor.shared(np.zeros(1), name="y_sh")
    >>> train = make_device_train_function(loss, [w], x, y, x_sh, y_sh, updates.sgd, 0.1)
    >>> synk.scatter([x_sh, y_sh], [np.ones((64, 3)), np.ones(64)])     # 32 rows on each device
    >>> rng = np.random.default_rng(0)
    >>> train(batch_s=[rng.permutation(32)[:8], rng.permutation(32)[:8]])
    array(1.)
    """
    _refuse_a_summed_loss(loss, {}, [x, y])
    graph = build_step_graph(loss, params, update_rule, args, kwargs, [x, y])
    if graph.scalars:
        raise TypeError(f"make_device_train_function's step takes no inputs, but the loss or the "
                        f"rule reads the scalar inputs {[str(v) for v in graph.scalars]}; make them "
                        f"shared variables (pytensor.shared)")
    step = WeightedStep(graph, x, givens=[(x, x_shared), (y, y_shared)],
                         sliceable_shareds=[x_shared, y_shared])

    def train_minibatch(batch_s: Any = None, num_slices: int = 1) -> Any:
        if type(batch_s) in (list, tuple) and batch_s and all(type(b) is np.ndarray for b in batch_s):
            rows = sum(len(b) for b in batch_s)        # (the step checks them against every rank)
        else:
            lengths = collectives.get_lengths([x_shared, y_shared])
            rows = sum(b.total for b in parse_batch_s(batch_s, lengths, ["x", "y"]))
        return step(rows, batch_s=batch_s, num_slices=num_slices)

    return step.expose(train_minibatch)


def run(train_fn: TrainStep, x_data: Any, y_data: Any = None, batch_size: int | None = None,
        steps: int | None = None, epochs: int | None = None, sync: Rule | None = None, *,
        order: DataOrder | None = None, checks: Checks | None = None,
        checkpointing: Checkpointing | None = None, **shorthands: Unpack[RunShorthands]) -> History:
    """Train on the devices themselves: many steps per command, synchronised by a rule of :mod:`.sync`.

    Each device draws its rows of every global step (``batch_size`` rows, split
    over the devices as in a call) from the epoch's seeded order
    (:func:`epoch_order`), gathers them from shared memory and steps without a
    command from the master per step. The master wakes every ``check_every``
    global steps, records a :class:`~.history.Check` and calls
    ``on_check(history)``; the devices are idle then, so it may call
    synkhronos functions (validation) and collectives, and returning True
    stops the run. When ``run`` returns, every device holds the same final
    parameters (the center, for the centred rules).

    With ``sync=AllReduce()`` the parameters equal, step for step, those of
    the master-driven loop ``train_fn(x_data, y_data, batch=order[i*B:(i+1)*B])``
    over the same orders. Under the other rules every device steps on the mean
    gradient of its own rows. Under the asynchronous rules the devices claim
    the minibatches (one device's part of a global step) from a shared
    counter, so a fast device trains on more of them than a slow one. On
    several nodes every rule spans them: the asynchronous rules' center stays
    on node 0, which serves it to the other nodes' devices, and such a run goes
    on without a lost node other than node 0 (``history.lost_nodes``, a
    :class:`~synkhronos.SynkWarning`).

    An error inside the loop (a device raising or dying, or no progress for
    ``stall_timeout``) shuts the runtime down, as a failed collective does:
    devices in the middle of a synchronous step cannot be brought back.

    Parameters
    ----------
    train_fn : callable
        What :func:`make_train_function` returns.
    x_data, y_data : Data, numpy.ndarray, or a list of them
        The training inputs and targets, as the step's ``x`` and ``y``: one per
        variable (``y_data=None`` for a step without targets). Numpy values are
        copied to shared memory once.
    batch_size : int
        Rows in one global step. The last step of an epoch takes the rows left.
    steps, epochs : int
        How long to train: exactly one of them.
    sync : Rule
        :class:`~.sync.AllReduce` (default), :class:`~.sync.Average`, :class:`~.sync.DiLoCo`,
        :class:`~.sync.EASGD`, :class:`~.sync.Downpour` or :class:`~.sync.RateLimited`.
    order : DataOrder, optional
        Which rows each step takes: ``DataOrder(shuffle=True, seed=0)`` (the default),
        a seeded permutation per epoch.
    checks : Checks, optional
        ``Checks(every=None, on_check=None)``: global steps between checks
        (default: one epoch), and ``on_check(history) -> bool``, True stopping the run.
    checkpointing : Checkpointing, optional
        ``Checkpointing(directory, every, resume=False)``: save the parameters
        and the optimizer's state (per device where they differ) to
        ``directory/checkpoint.safetensors`` every ``every`` global steps, with
        the run's data order and rule (:mod:`synkhronos.checkpoint`); with
        ``resume=True``, start from the checkpoint there if there is one (the
        same data, batch size, seed and rule are required, or it is refused
        naming the difference). Under :class:`~.sync.AllReduce`, and
        :class:`~.sync.Average` with ``every`` a multiple of its ``every``, a
        run killed and resumed continues exactly as if it had not stopped (its
        checks too, when ``every`` is a multiple of the checks' ``every``). The
        other rules resume from the saved parameters and continue the step
        count and the data order (an asynchronous rule's devices claim the
        steps after the checkpoint's). The centred rules (:class:`~.sync.EASGD`,
        :class:`~.sync.Downpour`, :class:`~.sync.RateLimited`) keep their center
        in the checkpoint, and every device resumes from it, on any number of
        devices. :class:`~.sync.DiLoCo` keeps its outer parameters, momentum
        and round in the checkpoint and continues exactly. What each device
        keeps for itself (its optimizer's state under local steps) resumes on
        another number of devices by rank: device ``r`` takes saved device
        ``r mod N``'s. A checkpoint keeps no random generator: a step that
        draws (dropout) draws from its generators' seeds again after a resume.
    **shorthands
        The groups' settings as keywords, each instead of its group:
        ``shuffle``, ``seed`` (``order``); ``check_every``, ``on_check``
        (``checks``); ``checkpoint_dir``, ``checkpoint_every``, ``resume``
        (``checkpointing``).

    Returns
    -------
    History

    Examples
    --------
    >>> import os, tempfile
    >>> from synkhronos.extensions import sync, updates
    >>> x, y = pt.matrix("x"), pt.vector("y")
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> loss = ((x.dot(w) - y) ** 2).mean()
    >>> train = make_train_function(loss, [w], x, y, updates.sgd, learning_rate=0.1)
    >>> history = run(train, np.ones((256, 3)), np.ones(256), 32, epochs=10,
    ...               sync=sync.EASGD(0.5, every=4), on_check=lambda h: h[-1].loss < 0.05)
    >>> history[-1].loss < 0.05                         # stopped early by on_check
    True
    >>> history.plot(os.path.join(tempfile.mkdtemp(), "curves.png"))
    """
    state = current()
    sync = AllReduce() if sync is None else sync
    order, checks, checkpointing = options_of(order, checks, checkpointing, dict(shorthands))
    f_grad, f_update = _check_run_arguments(train_fn, sync)
    if getattr(x_data, "sharded", False) and state.topology.several_nodes:
        raise ValueError("train.run splits every epoch of a full copy of the data over every "
                         "device of every node; it does not take Data sharded per node: give each "
                         "node the full data, or call the training step on the shards yourself")
    run_data = _run_data(train_fn, x_data, y_data)
    refs = f_grad.input_refs(*run_data)
    n_rows = refs[0].shape[0]
    uneven = [(str(var), ref.shape[0]) for var, ref in zip(train_fn.inputs, refs) if ref.shape[0] != n_rows]
    if uneven:
        raise ValueError(f"every input and target needs one row per example: {train_fn.inputs[0]} "
                         f"has {n_rows} rows, but {uneven}")
    batch_size = _check_batch_size(batch_size, n_rows, state.n_parallel)
    _check_step_traces(f_grad, train_fn, refs, batch_size, state.n_parallel)
    per_epoch = steps_per_epoch(n_rows, batch_size)
    total = _total_steps(steps, epochs, per_epoch)
    check_every = per_epoch if checks.every is None else int(checks.every)
    saving = RunCheckpoints(checkpointing, train_fn,
                            order_record(order, batch_size, n_rows, run_data, checkpointing), sync)
    spec = state.loops.new(train_fn, refs, batch_size, order.shuffle, order.seed, sync, saving.rule_state)
    run_steps = serialized(state.loops.run, name="train.run")
    if state.nodes is not None:
        # every node's phases must end at the same steps, or one would wait in a collective for
        # a node waiting elsewhere: the nodes compare the run before any of them starts it
        run_text = (f"{batch_size} rows a step, steps {saving.resumed_step()}:{total}, checks every "
                    f"{check_every}, checkpoints every {saving.every}, shuffle {order.shuffle} "
                    f"(seed {order.seed}), {rule_record(sync)}, functions {spec.grad_fid} "
                    f"({f_grad.graph_compared()}) and {spec.update_fid} ({f_update.graph_compared()}), "
                    f"data {[(ref.data_id, tuple(ref.shape)) for ref in refs]}")
        _said_on_every_node(state, ("train.run of", run_text))
    history = History(sync, center_values=lambda: serialized(state.loops.center_values,
                                                             name="train.run")(spec))
    done, elapsed = saving.resumed_step(), 0.0
    if saving.written_on is not None:
        nodes, devices = saving.written_on
        if devices != state.n_parallel or nodes not in (None, state.topology.n_nodes):
            history.resize(Resize(done, nodes, state.topology.n_nodes, devices, state.n_parallel))
    if done >= total:
        warn(f"the checkpoint {saving.path} is at step {done}, at or past this run's "
             f"end ({total} steps): nothing is left to train; ask for more steps or epochs "
             f"to go on")
    stats, seconds = 0.0, 0.0
    try:
        while done < total:
            # checks and checkpoints at whole multiples of their periods, so that a resumed run
            # checks at the steps the uninterrupted one did
            last = int(min(total, next_multiple(done, check_every), saving.next_step(done)))
            start = time.perf_counter()
            stats = stats + run_steps(spec, done, last)
            seconds += time.perf_counter() - start
            done = last
            history.lose_nodes(state.loops.lost_nodes(), done)
            saving.maybe_save(done, lambda: serialized(state.loops.rule_state, name="train.run")(spec))
            if done % check_every and done < total:
                continue
            elapsed += seconds
            history.append(check_from_stats(stats, done, per_epoch, elapsed, seconds))
            stats, seconds = 0.0, 0.0
            if checks.on_check is not None and _stops_on_every_node(state, spec, done, checks.on_check(history)):
                break
    finally:
        if state.is_open:       # the final parameters on every device, also after on_check raised
            serialized(state.loops.finish, name="train.run")(spec)
        history.end_run()
    return history


def _stops_on_every_node(state: Any, spec: Any, done: int, stop: Any) -> bool:
    """Whether ``on_check`` stopped the run: on several nodes, once every node's ``on_check`` said
    the same (a node going on alone would wait in its next step's collective for the others), and
    after any call it made (one made on some nodes only raises NodesDiverged on every node)."""
    stop = bool(stop)
    if state.nodes is not None:
        _said_on_every_node(state, ("train.run: on_check at step", done, "stop" if stop else "go on"),
                            tolerate_loss=spec.rule.asynchronous)
    return stop


def _said_on_every_node(state: Any, what: tuple, tolerate_loss: bool = False) -> None:
    """Every node says ``what`` of its run at this point: nodes that say otherwise raise
    NodesDiverged, naming both."""
    serialized(state.nodes.exchange, name="train.run")(what, None, tolerate_loss=tolerate_loss)


def _run_data(train_fn: TrainStep, x_data: Any, y_data: Any) -> list[Any]:
    """The Data of :func:`run`, flat in the step's input order (x's, then y's)."""
    data = _input_list(x_data, "x") + _input_list(y_data, "y")
    if len(data) != len(train_fn.inputs):
        raise TypeError(f"the step takes {len(train_fn.inputs)} data (x then y: "
                        f"{[str(v) for v in train_fn.inputs]}), got {len(data)}: give x_data and "
                        f"y_data as the step's x and y (a list for several, y_data=None for none)")
    return data


def _check_run_arguments(train_fn: TrainStep, sync: Rule) -> tuple[Function, Function]:
    """The gradient and update functions of ``train_fn``; the step and the rule checked."""
    if not isinstance(train_fn, TrainStep):
        raise TypeError("run() takes the step function make_train_function returns (data in shared "
                        f"memory), got {train_fn!r}")
    if not train_fn.runs_on_devices:
        raise TypeError(f"run() gives every device its rows along axis 0 of the data, but {train_fn!r} "
                        f"takes its rows otherwise (givens=, split_axes=, or device data with batch_s): "
                        f"call it in a loop of your own, or build it with make_train_function(loss, "
                        f"params, x, y, rule) on data whose rows are axis 0")
    if train_fn.scalars:
        raise TypeError(f"run() gives every step its data only, but this step takes the scalar inputs "
                        f"{[str(v) for v in train_fn.scalars]}; make each a shared variable "
                        f"(pytensor.shared) and set_value it between runs")
    check_rule(sync)
    return train_fn.functions


def _check_batch_size(batch_size: int | None, n_rows: int, n_devices: int) -> int:
    if n_rows < n_devices:
        raise ValueError(f"x_data has {n_rows} row(s) for {n_devices} devices: every device needs "
                         f"at least one row of every step; give at least {n_devices} rows")
    if not is_whole(batch_size, at_least=n_devices, below=n_rows + 1):
        raise ValueError(f"batch_size must be a whole number from {n_devices} (one row per device) "
                         f"to {n_rows} (the rows of x_data), got {batch_size!r}")
    assert batch_size is not None
    left = n_rows % batch_size
    if 0 < left < n_devices:
        raise ValueError(f"the last step of every epoch would have {left} rows for {n_devices} "
                         f"devices ({n_rows} rows, batch_size {batch_size}): every device needs a "
                         f"row; choose a batch_size that leaves none or at least {n_devices}")
    return int(batch_size)


def _check_step_traces(f_grad: Function, train_fn: TrainStep, refs: Sequence[InputRef], batch_size: int,
                       n_devices: int) -> None:
    """Trace the master's share of a first step: data that does not fit the graph raises here.

    Inside the loop the same error would leave devices mid-step, and the
    runtime would have to be shut down.
    """
    rows = max(1, batch_size // n_devices)
    shapes = [(rows,) + tuple(ref.shape[1:]) for ref in refs] + [()]
    try:
        f_grad.compiled.check_traces(shapes)
    except Exception as e:
        given = ", ".join(f"{var} {tuple(ref.shape)}" for var, ref in zip(train_fn.inputs, refs))
        raise ValueError(f"the training step cannot run on the data given ({given}): "
                         f"{type(e).__name__}: {e}") from None


def _total_steps(steps: int | None, epochs: int | None, per_epoch: int) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps= (global steps) and epochs= (passes over the rows)")
    value, name = (steps, "steps") if steps is not None else (epochs, "epochs")
    if not is_whole(value, at_least=1):
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    assert value is not None
    return int(value) if steps is not None else int(value) * per_epoch
