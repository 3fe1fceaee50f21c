"""Checkpoints of a runtime's shared variables: :func:`save` and :func:`restore`, and those
:func:`synkhronos.extensions.train.run` keeps (:class:`Checkpointing`, :class:`RunCheckpoints`).

A checkpoint is one `safetensors <https://huggingface.co/docs/safetensors>`_ file:
every variable's value, once if every device holds the same value, else one per
device, and in its metadata the step, the caller's ``extra`` (JSON) and the
layout. The file is written beside its final name, flushed to disk and then
renamed over it, so a process killed during :func:`save` leaves the previous
checkpoint whole.

Examples
--------
>>> import os, tempfile
>>> w = pytensor.shared(np.arange(3.0), name="w")
>>> total = synk.function([], (w.sum(), "sum"))
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
>>> synk.checkpoint.save(path, [w], step=1000, extra={"epoch": 3})
>>> w.set_value(np.zeros(3))
>>> synk.checkpoint.restore(path, [w])
{'step': 1000, 'extra': {'epoch': 3}}
>>> w.get_value(), synk.get_value(1, w)
(array([0., 1., 2.]), array([0., 1., 2.]))
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping, Protocol, Sequence

import numpy as np
import numpy.typing as npt
from pytensor.compile.sharedvalue import SharedVariable

from ..compile import randomness
from ..errors import is_whole
from ..platform.interrupt_hold import held
from ..runtime.nodes import joined_over_nodes
from ..runtime.session import active, current, serialized
from ..seams.rule import Rule, flag, rule_difference, rule_record, settle
from . import collectives

if TYPE_CHECKING:
    from ..runtime.nodes import NodeLink
    from ..runtime.state import State

__all__ = ["save", "restore", "read", "exists", "default_variables", "ARRAY_PREFIX", "Checkpointing",
           "RunCheckpoints"]

#: the name beside a checkpoint that a save writes before it takes the checkpoint's place
PARTIAL = ".partial"

#: the layout version written into every checkpoint's metadata
FORMAT_VERSION = 1
_META_KEY = "synkhronos"
#: the key prefix of the arrays save() keeps beside the variables
ARRAY_PREFIX = "array/"

#: what the ranks compare of a value: its shape, dtype and checksum (:func:`_digest`)
Digest = tuple[tuple[int, ...], str, str]


def default_variables() -> list[SharedVariable]:
    """What :func:`save` saves by default: every shared variable of every synkhronos function.

    Left out: flat gradients (``extensions.updates`` marks them), shared
    variables holding scattered data (``sliceable_shareds``), random generators.
    """
    state = current()
    scattered = {id(v) for v in state.registry.scattered_shared()}
    return [v for v in state.registry.known_shared()
            if id(v) not in scattered and not getattr(v.tag, "synk_gradient", False)
            and not randomness.is_generator(v)]


def _check_variables(variables: Iterable[SharedVariable]) -> list[SharedVariable]:
    variables = list(variables)
    for var in variables:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"checkpoints hold shared variables, got {var!r}")
        if randomness.is_generator(var):
            raise TypeError(f"{var} is a random generator; checkpoints hold tensors only (its draws "
                            f"restart from its seed)")
        if np.dtype(var.type.dtype).kind == "c":
            raise TypeError(f"{var} holds {var.type.dtype}, which a checkpoint (safetensors) cannot hold; "
                            f"give variables= without it, and keep its real and imaginary parts as "
                            f"float variables of their own")
    collectives.resolve_shareds(variables)       # each known to the devices: as collectives refuse
    return variables


def _check_any_count(any_count: Collection[SharedVariable] | SharedVariable | None,
                     variables: Sequence[SharedVariable]) -> list[SharedVariable]:
    """``restore``'s ``any_count`` as a list of shared variables among ``variables``, or an error
    naming the fix."""
    if any_count is None:
        return []
    if isinstance(any_count, SharedVariable):
        any_count = [any_count]
    what = ("any_count takes shared variables (those of variables= whose per-device values may "
            "come from another number of devices)")
    try:
        items = list(any_count)
    except TypeError:
        raise TypeError(f"{what}, got {any_count!r}") from None
    wrong = [item for item in items if not isinstance(item, SharedVariable)]
    if wrong:
        raise TypeError(f"{what}, got {wrong[0]!r}")
    foreign = [item for item in items if not any(item is var for var in variables)]
    if foreign:
        raise ValueError(f"any_count names {foreign[0]}, which is not among the variables restored; "
                         f"{what}: give it in variables= too, or leave it out of any_count")
    return items


def _check_step(step: int | None) -> int | None:
    if step is None:
        return None
    if not is_whole(step):
        raise TypeError(f"step must be a whole number (or None), got {step!r}")
    return int(step)


def _key(i: int, var: SharedVariable) -> str:
    return f"{i}/{var.name or 'unnamed'}"


@serialized(name="synk.checkpoint.save")
def save(path: str | os.PathLike, variables: Sequence[SharedVariable] | None = None,
         step: int | None = None, extra: Any = None, arrays: Mapping[str, Any] | None = None) -> None:
    """Write the values of ``variables`` on every device to ``path``, atomically.

    Parameters
    ----------
    path : str or path-like
        The checkpoint file (its directory must exist). A symbolic link is
        followed: the file it names is replaced and the link stays. Anything
        else already there that is no regular file (a directory, a device, a
        pipe) is refused.
    variables : list of SharedVariable, optional
        Default: :func:`default_variables`. A value that differs between
        devices is saved once per device.
    step : int, optional
    extra : optional
        Anything JSON can hold (data order, epoch, ...), returned by :func:`restore`.
    arrays : dict of str to array, optional
        Arrays of this process that are no shared variable but the same on
        every device (a sync rule's state, say), kept by name: :func:`read`
        returns them among its tensors as ``"array/<name>"``.

    Notes
    -----
    On several nodes every node calls ``save`` alike; node 0's master writes
    the file (the masters compare digests of their ranks' values and send node
    0 only the values that differ between ranks), and every node returns once
    it is written. To restore on every node, ``path`` must be on a file system
    every node reads (or copied there).
    """
    state = current()
    path = _file_to_write(os.fspath(path))
    variables = default_variables() if variables is None else _check_variables(variables)
    step = _check_step(step)
    try:
        extra_text = json.dumps(extra)
    except TypeError as e:
        raise TypeError(f"extra must be JSON-serializable ({e}); give plain numbers, strings, "
                        f"lists and dicts") from None
    # views of the values where they come without a copy: nothing changes them before the file
    # is written (the runtime's lock is held)
    local = [state.collectives.local_values(rank, variables, copy=False) for rank in range(state.n_local)]
    values_of, replicated, digests = _values_on_every_rank(state, local, variables)
    tensors, checksums, layout = {}, {}, []
    for i, var in enumerate(variables):
        key = _key(i, var)
        if replicated[i]:
            tensors[key] = _contiguous(local[state.local_master][i])
            checksums[key] = digests[state.local_master][i][2]
        else:
            for rank, value in enumerate(values_of(i)):
                tensors[f"{key}@{rank}"] = _contiguous(value)
        layout.append(dict(key=key, name=var.name, per_rank=not replicated[i]))
    for name, value in (arrays or {}).items():
        tensors[f"{ARRAY_PREFIX}{name}"] = np.array(value)
    #: a digest of every tensor's bytes: a file whose data changed is refused when read
    checksums = {key: checksums.get(key) or _checksum(value) for key, value in tensors.items()}
    meta = dict(version=FORMAT_VERSION, n_devices=state.n_parallel, step=step, variables=layout,
                checksum=CHECKSUM, checksums=checksums)
    meta["header_checksum"] = _header_checksum(meta, extra_text)
    if state.topology.node_rank == 0:             # one writer: node 0's master
        try:
            _write_atomically(path, tensors, {_META_KEY: json.dumps(meta), "extra": extra_text})
        except Exception as e:
            _tell_nodes(state, f"failed: {type(e).__name__}: {e}")
            raise
    _tell_nodes(state, "written")


def _values_on_every_rank(state: State, local: list[list[np.ndarray]], variables: Sequence[SharedVariable]
                          ) -> tuple[Callable[[int], list[np.ndarray]], list[bool], list[list[Digest]]]:
    """``(values_of, replicated, digests)``: variable ``i``'s value on every global rank, whether
    every rank holds the same, and this node's ranks' digests of their values (:func:`_digest`).
    The ranks compare digests, and on several nodes the masters send each other only the values
    that differ between ranks (the nodes saving other variables raise NodesDiverged)."""
    n_vars = len(variables)
    digests = [[_digest(v) for v in values] for values in local]
    by_rank: list[list[np.ndarray]] | list[dict[int, np.ndarray]]
    if state.nodes is None:
        by_rank, every = local, digests
    else:
        names = ", ".join(str(var) for var in variables)
        every = joined_over_nodes(state.nodes, ("checkpoint: digests of", names), digests)
    differ = [i for i in range(n_vars) if len({d[i] for d in every}) > 1]
    if state.nodes is not None:
        by_rank = joined_over_nodes(state.nodes, "checkpoint: values",
                                    [{i: values[i] for i in differ} for values in local])

    def values_of(i: int) -> list[np.ndarray]:
        return [values[i] for values in by_rank]
    return values_of, [i not in differ for i in range(n_vars)], digests


def _digest(value: npt.ArrayLike) -> Digest:
    """``(shape, dtype, checksum)`` of an array: equal for equal values (a 128-bit hash of the
    bytes), what the ranks compare and what the file keeps."""
    value = np.asarray(value)
    return value.shape, str(value.dtype), _checksum(value)


def _tell_nodes(state: State, outcome: str) -> None:
    """On several nodes: every node learns whether node 0 wrote the checkpoint."""
    if state.nodes is None:
        return
    outcomes = state.nodes.exchange("checkpoint: written", outcome)
    if outcomes[0] != "written" and state.topology.node_rank != 0:
        raise RuntimeError(f"node 0 could not write the checkpoint ({outcomes[0]})")


def _checksum(value: npt.ArrayLike, algorithm: str | None = None) -> str:
    """The hex digest of an array's bytes: xxHash's XXH3-128, which hashes at memory speed (a
    checksum against damage, not a cryptographic seal); ``"blake2b"`` for files written before."""
    data = _contiguous(value).reshape(-1).view(np.uint8)
    if algorithm == "blake2b":
        import hashlib
        return hashlib.blake2b(data, digest_size=16).hexdigest()
    import xxhash
    return xxhash.xxh3_128_hexdigest(data)


def _contiguous(value: npt.ArrayLike) -> np.ndarray:
    """``value`` as a C-contiguous array, copied only if it is not one (a 0-d array stays 0-d)."""
    value = np.asarray(value)
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


#: the checksum a checkpoint's metadata names (files without the name were written with blake2b)
CHECKSUM = "xxh3_128"


def digest(values: list) -> str:
    """One hex digest of the bytes, shapes and dtypes of ``values`` (arrays, or Data): what a run's
    checkpoint records of its data, to refuse resuming on other data.

    Examples
    --------
    >>> a = np.arange(6.0)
    >>> digest([a]) == digest([a.copy()]), digest([a]) == digest([a.reshape(2, 3)])
    (True, False)
    """
    parts = []
    for value in values:
        array = np.asarray(value.data if hasattr(value, "belongs_to") else value)
        parts.append(f"{array.dtype.str}{array.shape}{_checksum(array)}")
    return _checksum(np.frombuffer(";".join(parts).encode(), np.uint8))


def _header_checksum(meta: Mapping[str, Any], extra_text: str, algorithm: str = CHECKSUM) -> str:
    """A digest of the metadata (the step, the layout, the data's digests, the device count) and of
    ``extra``: a file whose metadata changed is refused when read, as one whose data changed."""
    described = {k: v for k, v in meta.items() if k != "header_checksum"}
    text = json.dumps([described, extra_text], sort_keys=True).encode()
    return _checksum(np.frombuffer(text, np.uint8), algorithm)


def _file_to_write(path: str) -> str:
    """The regular file a save of ``path`` replaces: ``path`` itself, or the file a symbolic link
    there names (the link stays, as ``open(path, "wb")`` keeps it). Anything else already there (a
    directory, a device, a pipe) is refused: the save would put a file in its place."""
    if path.endswith((os.sep, "/")):
        raise ValueError(f"the checkpoint's path {path} ends with a separator, as a directory's; give "
                         f"the path of a checkpoint file")
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the checkpoint's directory {directory} does not exist; make it "
                                f"first (os.makedirs)")
    if os.path.lexists(target) and not os.path.isfile(target):
        kind = ("a directory" if os.path.isdir(target) else
                "a symbolic link that does not resolve (a loop?)" if os.path.islink(target) else
                "not a regular file (a device or a pipe?)")
        raise ValueError(f"the checkpoint's path {path} is {kind}: a save would replace it; give the "
                         f"path of a checkpoint file")
    return target


def _write_atomically(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write beside ``path`` (``<path>.partial``, taking the place of one a killed save left),
    flush it to disk, then rename it over ``path``. A write that fails or is interrupted leaves
    nothing beside ``path``; what else lies there is the user's, and left alone."""
    from safetensors.numpy import save_file
    partial = path + PARTIAL
    try:
        save_file(tensors, partial, metadata=metadata)
        with open(partial, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(partial, path)         # atomic: readers see the old file or the new one
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read(path: str | os.PathLike) -> tuple[dict, Any, dict]:
    """``(metadata, extra, tensors)`` of the checkpoint at ``path`` (no runtime needed).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError``, naming
    the file (and the variable), for one that is damaged: truncated, with a
    broken header, or with data whose checksum does not match.
    """
    from safetensors import safe_open
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with safe_open(path, "np") as fh:
            header = fh.metadata() or {}
            if _META_KEY not in header:
                raise ValueError(f"{path} is a safetensors file but not a synkhronos checkpoint")
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta, extra = json.loads(header[_META_KEY]), json.loads(header.get("extra", "null"))
        layout, checksums = meta["variables"], meta.get("checksums")
        for entry in layout:
            missing = {"key", "name", "per_rank"} - set(entry)
            if missing:
                raise KeyError(f"an entry of the layout lacks {sorted(missing)}")
    except ValueError as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path} is not a readable checkpoint (damaged or truncated: {e})") from None
    except Exception as e:
        raise ValueError(f"{path} is not a readable checkpoint (damaged or truncated: "
                         f"{type(e).__name__}: {e})") from None
    algorithm = meta.get("checksum", "blake2b")
    if "header_checksum" in meta and \
            _header_checksum(meta, header.get("extra", "null"), algorithm) != meta["header_checksum"]:
        raise ValueError(f"{path}: its metadata (step, extra, layout) do not match their checksum; "
                         f"the file was changed or damaged after it was written")
    for key, expected in (checksums or {}).items():
        if key not in tensors or _checksum(tensors[key], algorithm) != expected:
            name = next((entry["name"] for entry in layout if key.split("@")[0] == entry["key"]), key)
            raise ValueError(f"{path}: the data of {name!r} ({key}) do not match their checksum; "
                             f"the file was changed or damaged after it was written")
    return meta, extra, tensors


def exists(path: str | os.PathLike) -> bool:
    """Whether a checkpoint file is at ``path``, on every node alike.

    A regular file counts (a directory does not); :func:`restore` checks
    what it holds. On several nodes every node looks; if some find it and some do not,
    every node raises ``FileNotFoundError`` naming those that do not (the
    checkpoint's directory must be on a file system every node reads).

    Examples
    --------
    >>> exists("/nonexistent/checkpoint.safetensors")
    False
    """
    path = os.fspath(path)
    found = os.path.isfile(path)
    nodes = _nodes_if_running()
    if nodes is None:
        return found
    every = nodes.exchange("checkpoint: exists", (found, path))
    if len({here for here, _ in every}) > 1:
        lacking = ", ".join(f"node {node} at {where}" for node, (here, where) in enumerate(every) if not here)
        raise FileNotFoundError(f"no checkpoint is found by {lacking}; the other nodes find theirs: "
                                f"put it on a file system every node reads, or copy it to every node")
    return found


def read_on_every_node(path: str | os.PathLike) -> tuple[dict, Any, dict]:
    """:func:`read` on every node of the runtime alike: every node gets the same checkpoint, or every
    node raises, naming the node that could not read it or saying that they read different files."""
    path = os.fspath(path)
    nodes = _nodes_if_running()
    try:
        found = read(path)
        outcome = ("ok", found[0].get("header_checksum"))
    except (OSError, ValueError) as e:
        if nodes is None:
            raise
        found, outcome = None, ("failed", f"{type(e).__name__}: {e}")
    if nodes is not None:
        every = nodes.exchange("checkpoint: read", outcome)
        failed = [(node, why) for node, (status, why) in enumerate(every) if status == "failed"]
        if failed:
            node, why = failed[0]
            raise ValueError(f"node {node} cannot read the checkpoint at {path} ({why}); every node "
                             f"needs the same file: put it on a file system every node reads")
        if len({checksum for _, checksum in every}) > 1:
            raise ValueError(f"the nodes read different checkpoints at {path}; every node needs the "
                             f"same file: put it on a file system every node reads")
    assert found is not None
    return found


def _nodes_if_running() -> NodeLink | None:
    state = active()
    return None if state is None else state.nodes


@serialized(name="synk.checkpoint.restore")
def restore(path: str | os.PathLike, variables: Sequence[SharedVariable] | None = None,
            any_count: Collection[SharedVariable] = ()) -> dict:
    """Set ``variables`` on every device to the values saved at ``path``.

    ``variables`` are matched to the saved ones by position (default:
    :func:`default_variables`, in the order the functions were built, as when
    saving); names, shapes and dtypes are checked. A value saved once goes
    to every device, whatever the number of devices now; values saved per
    device need the same number of devices, but for those in ``any_count``.
    On several nodes every node restores the same variables (nodes naming other
    ones raise NodesDiverged before any is set).

    Parameters
    ----------
    path : str or path-like
    variables : list of SharedVariable, optional
    any_count : collection of SharedVariable, optional
        Variables whose values saved per device may come from another number
        of devices ``N``: device ``r`` takes saved device ``r mod N``'s (state
        each device keeps for itself, as an optimizer's under local steps).

    Returns
    -------
    dict
        ``{"step": ..., "extra": ...}`` as given to :func:`save`.
    """
    path = os.fspath(path)
    return restore_read(path, read_on_every_node(path), variables, any_count)


@serialized(name="synk.checkpoint.restore")
def restore_read(path: str, contents: tuple[dict, Any, dict], variables: Sequence[SharedVariable] | None = None,
                 any_count: Collection[SharedVariable] = ()) -> dict:
    """:func:`restore` from ``contents``, what :func:`read_on_every_node` read at ``path`` (named in
    the messages): a caller that looked into the checkpoint first sets the variables from the same
    read, not from a second one of a file that may have changed since."""
    state = current()
    meta, extra, tensors = contents
    try:
        variables = default_variables() if variables is None else _check_variables(variables)
        any_count = _check_any_count(any_count, variables)
        replicated, per_rank = _restored_values(path, meta, tensors, variables, any_count, state.n_parallel)
    except Exception as e:
        state.tell_nodes_refused("checkpoint: restore", e)
        raise
    if state.nodes is not None:       # (nodes restoring other variables would pair other collectives)
        state.nodes.exchange(("checkpoint: restore of", ", ".join(str(var) for var in variables),
                              "any_count", ", ".join(str(var) for var in any_count)), None)
    per_rank_vars = [var for var, _ in per_rank]
    own = state.master_rank
    with held():    # the script's own values: all the checkpoint's or none, wherever a Ctrl-C lands
        for var, (value,) in replicated:
            var.set_value(value)
        if per_rank:
            state.collectives.set_values(own, per_rank_vars, [values[own] for _, values in per_rank])
    if replicated:
        collectives.broadcast([var for var, _ in replicated])
    for rank in state.topology.ranks_of(state.topology.node_rank):    # every node sets its own
        if per_rank and rank != own:
            state.collectives.set_values(rank, per_rank_vars, [values[rank] for _, values in per_rank])
    return {"step": meta["step"], "extra": extra}


def _restored_values(path: str, meta: dict, tensors: dict, variables: Sequence[SharedVariable],
                     any_count: Sequence[SharedVariable], n_parallel: int) -> tuple[list, list]:
    """``(replicated, per_rank)``: each variable with its saved values (one, or one per device), the
    checkpoint's layout checked against ``variables`` (an error naming the fix)."""
    layout = meta["variables"]
    if len(layout) != len(variables):
        raise ValueError(f"{path} holds {len(layout)} variables but {len(variables)} were given to "
                         f"restore; pass variables= as they were passed to save")
    replicated: list = []
    per_rank: list = []
    for entry, var in zip(layout, variables):
        if entry["name"] != var.name:
            raise ValueError(f"{path} holds {entry['name']!r} where {var.name!r} was given; pass "
                             f"variables= in the order they were saved")
        if entry["per_rank"]:
            saved_on = meta["n_devices"]
            if saved_on != n_parallel and not any(var is v for v in any_count):
                raise ValueError(f"{var} was saved per device from {saved_on} devices; it "
                                 f"needs as many to restore (running: {n_parallel}), unless "
                                 f"given in any_count= (device r then takes saved device r mod "
                                 f"{saved_on}'s)")
            values = [tensors[f"{entry['key']}@{r % saved_on}"] for r in range(n_parallel)]
        else:
            values = [tensors[entry["key"]]]
        for value in values:
            _check_fits(var, value, path)
        (per_rank if entry["per_rank"] else replicated).append((var, values))
    return replicated, per_rank


def _check_fits(var: SharedVariable, value: np.ndarray, path: str) -> None:
    own = np.asarray(var.get_value(borrow=True))
    if value.shape != own.shape or value.dtype != own.dtype:
        raise ValueError(f"{path} holds {var} as {value.dtype}{list(value.shape)} but it is "
                         f"{own.dtype}{list(own.shape)} now")


# --- train.run's checkpoints ---------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpointing:
    """Where and how often a run saves, and whether it resumes from what it finds there.

    Parameters
    ----------
    directory : str or os.PathLike
        The run's checkpoint is ``directory/checkpoint.safetensors``.
    every : int
        Global steps between saves.
    resume : bool
        Start from the checkpoint in ``directory`` if there is one.
    """

    directory: str | os.PathLike
    every: int
    resume: bool = False

    def __post_init__(self) -> None:
        directory = self.directory
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(f"checkpoint_dir must be a directory's path (a str or os.PathLike), got "
                            f"{directory!r}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint_dir {os.fspath(directory)!r} is a file; give a directory (the "
                             f"run keeps its checkpoint.safetensors there)")
        if not is_whole(self.every, at_least=1):
            raise ValueError(f"checkpoint_every must be a positive number of steps with "
                             f"checkpoint_dir=, got {self.every!r}")
        settle(self, "every", int(self.every))
        settle(self, "resume", flag(self.resume, "resume", "Checkpointing"))


class RunVariables(Protocol):
    """What :class:`RunCheckpoints` takes of a training step (``train.TrainStep`` has it)."""

    state_variables: list
    params: list
    statistics: list
    optimizer_state: list


class RunOrder(Protocol):
    """What :func:`order_record` takes of a run's data order (``train.DataOrder`` has it)."""

    @property
    def seed(self) -> int: ...

    @property
    def shuffle(self) -> bool: ...


def order_record(order: RunOrder, batch_size: int, n_rows: int, run_data: list,
                 checkpointing: Checkpointing | None) -> dict[str, Any]:
    """What a checkpoint records of the run's data order, which a resumed run must share: the order's
    settings and a digest of the data (taken only with checkpoints)."""
    recorded: dict[str, Any] = dict(seed=order.seed, shuffle=order.shuffle, batch_size=batch_size, n_rows=n_rows)
    if checkpointing is not None:
        recorded["data_digest"] = digest(run_data)
    return recorded


def next_multiple(step: int, period: int) -> int:
    return (step // period + 1) * period


class RunCheckpoints:
    """Where and when :func:`run` saves, and the step it resumes from.

    The checkpoint is ``<checkpoint_dir>/checkpoint.safetensors``, replaced
    atomically every ``every`` global steps; its ``extra`` records the run's
    data order (seed, shuffle, batch size, rows) and the rule (its type and
    settings, :func:`~synkhronos.seams.rule.rule_record`), which a resumed run
    must share.
    """

    FILE = "checkpoint.safetensors"

    def __init__(self, checkpointing: Checkpointing | None, step: RunVariables, order: dict,
                 rule: Rule) -> None:
        self.path: str = ""          # set with a Checkpointing (empty: no checkpoints)
        self.every: int | None = None
        self.variables, self.order, self.rule = step.state_variables, order, rule
        self.n_params = len(step.params)
        #: the parameters a rule's center holds (statistics included)
        self.synced = step.params + step.statistics
        #: what each device keeps for itself: restored by rank on another number of devices
        self.own_state = step.optimizer_state
        self._resumed = 0
        #: the sync rule's state the checkpoint holds (see Rule.saved_state), or None
        self.rule_state: list | None = None
        #: (nodes, devices) the resumed checkpoint was written on, or None
        self.written_on: tuple | None = None
        if checkpointing is None:
            return
        directory = os.fspath(checkpointing.directory)
        os.makedirs(directory, exist_ok=True)
        self.path, self.every = os.path.join(directory, self.FILE), checkpointing.every
        for path in (self.path, self.path + PARTIAL):
            if os.path.lexists(path) and not os.path.isfile(path):
                what = "a link to nothing" if os.path.islink(path) and not os.path.exists(path) else \
                    "a directory" if os.path.isdir(path) else "not a regular file"
                raise ValueError(f"{path!r} is {what}, where the run keeps its checkpoint; remove it "
                                 f"or give another checkpoint_dir")
        if checkpointing.resume and exists(self.path):
            self._resumed = self._restore()

    def _restore(self) -> int:
        contents = read_on_every_node(self.path)
        meta, saved, tensors = contents
        saved = saved if isinstance(saved, dict) else {}
        differences = _order_difference(saved.get("order"), self.order)
        if differences is None:
            differences = rule_difference(saved.get("rule") or {}, self.rule)
        if differences is not None:
            raise ValueError(f"the checkpoint {self.path} was written by another run: {differences}; "
                             f"resume with the same data, batch size, seed and rule, or use another "
                             f"checkpoint_dir")
        held = saved.get("rule_state", 0)
        keys = [f"{ARRAY_PREFIX}rule/{i}" for i in range(held)] if is_whole(held, at_least=0) else []
        if not is_whole(held, at_least=0) or any(k not in tensors for k in keys):
            raise ValueError(f"the checkpoint {self.path} records {held!r} arrays of the rule's state "
                             f"but holds {sum(k in tensors for k in keys)}; it is damaged: use another "
                             f"checkpoint_dir")
        self.rule_state = [tensors[k] for k in keys]
        if len(meta["variables"]) != len(self.variables):
            raise ValueError(f"the checkpoint {self.path} holds {len(meta['variables'])} variables where "
                             f"this training has {len(self.variables)}: it was written for another "
                             f"model; use another checkpoint_dir")
        n_devices = current().n_parallel
        self.rule.check_saved(self.rule_state, n_devices, self.n_params)
        from_center = self.rule.saves_center and bool(self.rule_state)
        self._check_devices(meta, n_devices, from_center)
        layout = saved.get("layout") or {}
        self.written_on = (layout.get("nodes"), meta["n_devices"])
        # the center is the run's parameters: every device starts from it, on any number of devices
        any_count = self.own_state + (self.synced if from_center else [])
        step = restore_read(self.path, contents, self.variables, any_count=any_count)["step"]
        if not is_whole(step, at_least=0):          # a str or a float is not whole either
            raise ValueError(f"the checkpoint {self.path} records the step {step!r}, not a whole "
                             f"number of steps; it is damaged: use another checkpoint_dir")
        if from_center:
            self._start_from_center(self.rule_state)
            self.rule_state = []
        return int(step)

    def _check_devices(self, meta: Mapping[str, Any], n_devices: int, from_center: bool) -> None:
        """Refuse parameters that differed between the devices of a checkpoint written on another count."""
        if meta["n_devices"] == n_devices or from_center:
            return
        differed = [entry["name"] for entry, var in zip(meta["variables"], self.variables)
                    if entry["per_rank"] and any(var is v for v in self.synced)]
        if differed:
            raise ValueError(f"the checkpoint {self.path} was written on {meta['n_devices']} devices "
                             f"whose parameters differed ({differed[0]}, ...: {self.rule!r} had not "
                             f"synchronised them); resume it on {meta['n_devices']} devices, or on "
                             f"{n_devices} from a checkpoint where they agree (checkpoint_every a "
                             f"multiple of the rule's every)")

    def _start_from_center(self, center: Sequence[npt.ArrayLike]) -> None:
        """Every device's parameters (and statistics) from the center the checkpoint holds."""
        fits = len(center) == len(self.synced) and all(
            np.shape(c) == np.shape(v.get_value(borrow=True)) for c, v in zip(center, self.synced))
        if not fits:
            raise ValueError(f"the checkpoint {self.path} holds a center of {len(center)} arrays "
                             f"that does not fit this model's {len(self.synced)} parameters; it was "
                             f"written for another model: use another checkpoint_dir")
        for var, value in zip(self.synced, center):
            var.set_value(np.asarray(value, var.dtype))
        collectives.broadcast(self.synced)

    def resumed_step(self) -> int:
        """The global step the run starts from (0 unless resumed)."""
        return self._resumed

    def next_step(self, done: int) -> float:
        return next_multiple(done, self.every) if self.every is not None else float("inf")

    def maybe_save(self, done: int, rule_state: Callable[[], Sequence[npt.ArrayLike]] = lambda: []) -> None:
        """Save at a multiple of the period; ``rule_state()`` gives the sync rule's state (arrays)."""
        if self.every is not None and done % self.every == 0:
            held = rule_state()
            state = current()
            save(self.path, self.variables, step=done,
                            extra=dict(order=self.order, rule=rule_record(self.rule),
                                       rule_state=len(held),
                                       layout=dict(nodes=state.topology.n_nodes, devices=state.n_parallel)),
                            arrays={f"rule/{i}": a for i, a in enumerate(held)})


def _order_difference(saved: object, order: Mapping[str, Any]) -> str | None:
    """How the data order ``order`` differs from the checkpoint's ``saved``, in words; None if not."""
    if not isinstance(saved, dict):
        return f"it records no data order ({saved!r})"
    differ = [f"{k} is {saved.get(k)!r} in the checkpoint, {order.get(k)!r} here"
              for k in sorted(set(saved) | set(order)) if saved.get(k) != order.get(k)]
    return "; ".join(differ) or None
