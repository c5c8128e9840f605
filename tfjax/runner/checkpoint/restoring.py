"""Checkpoints with Orbax: what a run saves, how it resumes, and the checks before restoring.

A checkpoint step directory `WORKDIR/checkpoints/<step>/` holds four items:

  params     the model parameters (sharded arrays; every process writes its shards)
  state      {"step", "opt_state", "rng" (the run's dropout key data), "ema_params" (if on)}
  data       the data loader's position, one JSON file per process (`process_<i>-of-<n>.json`),
             which names its step
  checksums  each array's checksum (see below)

Every step directory also records, in Orbax's `_CHECKPOINT_METADATA` (JSON), the items it was
written with, tfjax's checkpoint FORMAT, and the versions of jax, flax, optax, orbax and tfjax
that wrote it; restoring under other versions logs a warning with both lists.

Crash safety (what a SIGKILL at any moment leaves behind):
  * Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only
    when every file (and every process's data position) is written, so a listed step is always
    complete; temporary directories of interrupted saves are removed when a manager is made.
  * Old steps are not deleted in place (an interrupted `rmtree` would leave a listed but
    partial step): they are first renamed, atomically, into `<checkpoints>/TRASH/` and removed
    from there (after each save and when a manager is made).
  * A failed asynchronous write raises at the next save or when the run ends
    (`wait_until_finished`), and its step never becomes a complete directory.
  * A save that raises after it started the writes waits for them to end (they need nothing
    more from it) and raises its own error, within seconds.
Everything in a checkpoint is read as JSON, msgpack or tensorstore arrays: nothing is
unpickled, so nothing stored can import or execute code.

Verified restores (what a flipped bit or a truncated file does):
  * Every save records a checksum of each array's values (`<step>/checksums/checksums.json`;
    two 32-bit position-weighted sums of the bit patterns, computed on the devices where the
    arrays live and fetched by the background commit, so any single changed value always
    changes them and the loop does not wait); every restore recomputes them on the restored
    arrays and refuses a step whose values differ, naming the array, or whose checksums file
    lacks one of them. The data position's JSON carries its step and their SHA-256: a damaged
    position, or one copied from another step, is refused.
  * A step that lacks an item it was written with (its metadata lists them) is damaged, not
    old: it is refused like one that fails verification. So is an entry named as a step that
    Orbax does not list (a dangling symbolic link, a file), on which the next save of that
    step would fail.
  * `restore_newest` tries the newest step first; a step that fails verification or reading
    is named with the file and the reason in a few lines, and the run resumes from the newest
    step that verifies (config.checkpoint.restore_step picks one explicitly). The unusable
    steps (and, with restore_step, newer ones) are then moved, files unchanged, into
    `<workdir>/checkpoints_set_aside/`, so that the resumed run's new steps neither collide
    with them nor get deleted in their favour. A step this process may not read is no damage:
    the run stops naming it (CheckpointPermissionError), moving nothing.
  * A write that fails (a full disk) stops the run with one error naming the directory, the
    step and the free space; older steps are untouched.
  * TRASH is emptied when the manager closes: a finished run keeps `keep` steps, no more.

Restoring takes an abstract target (jax.ShapeDtypeStruct with the *new* shardings), so a
checkpoint written on one mesh restores onto any other mesh or device count. Before anything
is restored the stored parameter shapes are compared with the model's, and a mismatch is an
error naming the first differing parameter; nothing in the checkpoint directory is ever
deleted by a failed restore. There is no silent partial restore: the only one is asked for by
name, `init_from` (`restore_params`: parameters only, no optimizer state), and it too needs
every parameter to match.

Fields of `config.checkpoint`:
  every         save every this many steps (and always after the last step); 0: only at the end
  keep          keep the newest this many checkpoints
  best_metric   also keep the checkpoint with the best value of this eval metric, e.g.
                "accuracy" ("" for none); checkpoints are then also saved at every evaluation.
                A name the run's evaluation never gives is refused before the run starts
                (check_best_metric); a step whose value is not finite is never the best
  best_mode     "max" or "min" for best_metric
  async_save    write in a background thread: training continues while the files are written
  replica_parallel   replicas of a replicated array each write a slice of it (faster saves
                on many devices; the first save compiles small slicing programs, seconds on CPU)
  restore_step  resume from this step instead of the newest one that verifies (None: newest),
                setting the newer ones aside; it takes effect once, in the run that sets or
                changes it: running the same command again resumes from the newest step
                (restore_step_to_apply)
  timeout_s     the most seconds a save's background commit waits for the other processes to
                finish writing (Orbax's barrier) before it fails with an error; a process that
                died is caught sooner by JAX's heartbeat (experiments/run.py --heartbeat_timeout)
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import importlib.metadata
import json
import logging as std_logging
import math
import os
import re
import shutil
import stat
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import future as ocp_future

from tfjax.runner import workdirs

TRASH = "TRASH"  # old steps are renamed into this subdirectory, then removed from there
VERSIONED = ("jax", "flax", "optax", "orbax-checkpoint", "tfjax")
TIMEOUT_S = 1200  # checkpoint.timeout_s when a config has none (Orbax's own default)
CHECKSUMS_FILE = "checksums.json"  # in the step's "checksums" item
UNUSABLE = "checkpoints_set_aside"  # beside checkpoints/: steps a resumed run moved away
# The format of the steps this tfjax writes, recorded in their metadata ("tfjax_format"). 2:
# data positions name their step. Steps without it were written before: their positions are
# not bound to a step, and they may lack the checksums item.
FORMAT = 2


class CheckpointError(Exception):
    """An error of a run's checkpoints whose message names the step or file and what to do:
    experiments/run.py prints it alone (status 1)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is readable but does not fit this run (another model, optimizer or data
    loader): a config error, so no older step is tried instead."""


class DamagedWeightsError(CheckpointError, ValueError):
    """The weights a run starts from (config.init_from) hold NaN or Inf values."""


class UnusableCheckpointError(CheckpointError, RuntimeError):
    """A checkpoint step cannot be read, lacks an item it was written with, or fails its
    checksums: the run passes it over."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """This process may not read a checkpoint: not damage, so nothing is passed over or
    moved; the user gives the permission back."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save could not be written (disk full, permissions)."""


@functools.cache  # read once per process: every save records them
def versions() -> dict[str, str]:
    """{"jax": "0.x", ...}: the versions of the packages a checkpoint's contents depend on."""
    out = {}
    for package in VERSIONED:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # e.g. tfjax run from a checkout
            out[package] = "unknown"
    if out["tfjax"] == "unknown":
        import tfjax

        out["tfjax"] = tfjax.__version__
    return out


def _step_dir(manager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _custom_metadata(manager, step: int) -> dict:
    """The custom metadata of a step, read from its JSON file alone (Orbax's `metadata(step)`
    also opens every array, which fails on a damaged step before it says anything useful)."""
    path = _step_dir(manager, step) / "_CHECKPOINT_METADATA"
    return json.loads(path.read_text()).get("custom_metadata") or {}


def check_versions(manager, step: int) -> None:
    """Warns (naming both lists) when the checkpoint was written under other package versions."""
    try:
        stored = _custom_metadata(manager, step).get("versions")
    except Exception as e:  # noqa: BLE001 - metadata is advisory, never a reason to fail
        logging.warning(
            "Checkpoint %s/%d: cannot read its metadata (%s)", manager.directory, step, e
        )
        return
    current = versions()
    if stored is None:
        logging.warning(
            "Checkpoint %s/%d records no package versions (written before tfjax recorded "
            "them); restoring under %s",
            manager.directory,
            step,
            current,
        )
    elif stored != current:
        logging.warning(
            "Checkpoint %s/%d was written under other package versions: checkpoint %s, now %s. "
            "Restoring anyway; if values or shapes look wrong, use the versions it was written "
            "with.",
            manager.directory,
            step,
            stored,
            current,
        )


def empty_trash(directory, *, background: bool = False) -> None:
    """Removes the old steps renamed into `<directory>/TRASH/` (primary process only).

    Only entries present now are removed, and never TRASH itself, so a deletion that Orbax's
    background thread is renaming in at this moment is left for the next call. background:
    remove them in a daemon thread, so that the training loop does not wait for the file
    system; what a process exit interrupts is removed when the next manager is made.
    """
    if jax.process_index() != 0:
        return
    trash = os.path.join(os.fspath(directory), TRASH)
    if not os.path.isdir(trash):
        return
    paths = [os.path.join(trash, name) for name in os.listdir(trash)]

    def remove():
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    if background and paths:
        threading.Thread(target=remove, name="tfjax-empty-trash", daemon=True).start()
    else:
        remove()


# ------------------------------------------------------------------ the data loader's position
def _data_file(directory: epath.Path) -> epath.Path:
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _digest(content) -> str:
    """The SHA-256 of canonical JSON."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _data_text(state: dict, step: int) -> str:
    """The position as JSON, bound to its step, with the SHA-256 of both (checked on restore)."""
    return json.dumps({"step": step, "sha256": _digest([step, state]), "state": state})


def _read_data(path: epath.Path, step: int, *, bound: bool) -> dict:
    """The loader state in `path`, checked against its SHA-256 and, for a step whose positions
    are `bound` (FORMAT 2), that it is the position of `step`, not a copy of another step's."""
    stored = _read_json(path)
    fields = {"step", "sha256", "state"} if bound else {"sha256", "state"}
    if not bound and not (isinstance(stored, dict) and stored.keys() & fields):
        return stored  # written before the checksum: the loader state itself
    if not isinstance(stored, dict) or stored.keys() != fields:
        found = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
        raise UnusableCheckpointError(f"{path}: its fields are damaged ({found})")
    content = [stored["step"], stored["state"]] if bound else stored["state"]
    if _digest(content) != stored["sha256"]:
        raise UnusableCheckpointError(f"{path}: its content does not match its SHA-256")
    if bound and stored["step"] != step:
        raise UnusableCheckpointError(
            f"{path}: it is the data position of step {stored['step']}, not of step {step} "
            "(copied from another step)"
        )
    return stored["state"]


@dataclasses.dataclass
class _ReadFailure:
    """What an item's restore returns instead of raising. Orbax's restore ends with a barrier
    of every process; an item that raised on one process only would skip it and leave the
    others waiting there. So every process reaches the barrier, and `restore` then agrees on
    the outcome (`_agree`) and raises on all of them."""

    error: BaseException


class _PyTreeHandler(ocp.PyTreeCheckpointHandler):
    """Orbax's PyTree handler whose read errors come back as a _ReadFailure."""

    def restore(self, directory: epath.Path, args=None):
        try:
            return super().restore(directory, args=args)
        except Exception as e:  # noqa: BLE001 - tensorstore and Orbax raise many kinds
            return _ReadFailure(e)


class _FileItemHandler(ocp.AsyncCheckpointHandler):
    """An item of tfjax's own files: no metadata, nothing to finalize or close."""

    def metadata(self, directory: epath.Path):
        return None

    def finalize(self, directory: epath.Path):
        pass

    def close(self):
        pass


class DataStateHandler(_FileItemHandler):
    """Saves each process's loader state (a JSON-serialisable dict) in its own file.

    Orbax's JSON handler writes from the primary process only; every process reads its own
    shard of the data, so each one saves its own position.
    """

    async def async_save(self, directory: epath.Path, args: DataSave):
        text = _data_text(args.state, args.step)  # now: the loader moves on during the write

        async def write():
            _data_file(directory).write_text(text)

        # Waits for Orbax's (possibly asynchronous) creation of `directory` before writing.
        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="data_save")]

    def save(self, directory: epath.Path, args: DataSave):
        _data_file(directory).write_text(_data_text(args.state, args.step))

    def restore(self, directory: epath.Path, args: DataRestore):
        path = _data_file(directory)
        try:
            if not path.exists():
                ours = f"-of-{jax.process_count()}.json"
                others = [n for n in os.listdir(directory) if _DATA_FILE.fullmatch(n)]
                if others and not any(n.endswith(ours) for n in others):
                    return None  # saved by a different number of processes
                raise UnusableCheckpointError(f"{path}: missing (this process's data position)")
            return _read_data(path, args.step, bound=args.bound)
        except UnusableCheckpointError as e:
            return _ReadFailure(e)  # raised after Orbax's barrier (see _ReadFailure)


_DATA_FILE = re.compile(r"process_\d+-of-\d+\.json")


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    state: dict
    step: int


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    step: int
    bound: bool  # the step's positions name their step (FORMAT 2)


# ------------------------------------------------------------------------------------ manager
def _registry(replica_parallel: bool):
    th = ocp.type_handlers
    # Orbax's defaults, except for replica-parallel writing of jax.Arrays, which is a choice.
    arrays = th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=replica_parallel)),
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("params", "state"):
        handler = _PyTreeHandler(type_handler_registry=arrays)
        registry.add(item, ocp.args.PyTreeSave, handler)
        registry.add(item, ocp.args.PyTreeRestore, handler)
    registry.add("data", DataSave)
    registry.add("data", DataRestore)
    registry.add("checksums", ChecksumsSave)
    return registry


def _restore_args(abstract_tree):
    """Restore onto the abstract tree's shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        item=abstract_tree,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
    )


def check_options(c) -> None:
    """Raises ValueError naming the first invalid field of config.checkpoint."""
    timeout_s = c.get("timeout_s", TIMEOUT_S)
    if not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(
            f"checkpoint.timeout_s must be a whole number of seconds >= 1, got {timeout_s!r}"
        )
    if c.get("every", 0) < 0:
        raise ValueError(f"checkpoint.every must be >= 0, got {c.every}")
    if c.get("keep", 1) < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {c.keep}")
    if c.get("best_mode", "max") not in ("max", "min"):
        raise ValueError(f"checkpoint.best_mode must be 'max' or 'min', got {c.best_mode!r}")
    if c.get("restore_step") is not None and c.restore_step < 0:
        raise ValueError(
            f"checkpoint.restore_step must be a step >= 0 (or None: the newest), "
            f"got {c.restore_step}"
        )


def _best_metric_fn(name: str, mode: str):
    """The value BestN ranks a step's metrics by. Orbax calls it inside `manager.save`, for
    every kept step, so it never raises: a step whose metrics lack `name` (saved under another
    best_metric) or whose value is not finite ranks worst, never best."""
    worst = -math.inf if mode == "max" else math.inf

    def value(metrics: dict) -> float:
        v = metrics.get(name)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else worst

    return value


def check_best_metric(config) -> None:
    """Raises ValueError when config.checkpoint.best_metric names a metric that the run's
    evaluation never produces (its task's metrics, and its decode-eval hook's when it decodes):
    a checkpoint would never be kept as the best. A pre-start check."""
    from tfjax.runner import evaluation

    name = config.checkpoint.get("best_metric", "")
    if not name:
        return
    produced = evaluation.metric_names(config)
    if name not in produced:
        raise ValueError(
            f"checkpoint.best_metric={name!r} is not an eval metric of task={config.task!r}"
            f"; allowed: {', '.join(produced)}, or '' to keep only the newest checkpoints"
        )


def make_manager(directory, checkpoint_config=None, *, read_only=False) -> ocp.CheckpointManager:
    """The CheckpointManager of a run's `checkpoints/` directory (created when missing)."""
    policies = []
    timeout_s = TIMEOUT_S
    if checkpoint_config is not None:
        c = checkpoint_config
        check_options(c)
        timeout_s = c.get("timeout_s", TIMEOUT_S)
        policies.append(ocp.checkpoint_managers.LatestN(n=c.keep))
        if c.best_metric:
            policies.append(
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=_best_metric_fn(c.best_metric, c.best_mode),
                    reverse=c.best_mode == "min",  # BestN keeps the end of an ascending sort
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
    options = ocp.CheckpointManagerOptions(
        read_only=read_only,
        create=not read_only,
        # Leftovers of a save that was killed are never listed as steps; remove them.
        cleanup_tmp_directories=not read_only,
        # Delete old steps by an atomic rename first (see the module docstring).
        todelete_subdir=TRASH,
        enable_async_checkpointing=bool(checkpoint_config is None or checkpoint_config.async_save),
        # The background commit's wait for every process is bounded (see checkpoint.timeout_s).
        async_options=ocp.options.AsyncOptions(timeout_secs=timeout_s),
        # We decide when to save; Orbax saves whenever asked.
        save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(1),
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies)
        if policies
        else None,
    )
    _shorten_disk_full_logs()
    _drop_closed_loop_noise()  # before the first read or write that could fail
    replica_parallel = checkpoint_config is None or checkpoint_config.replica_parallel
    directory = epath.Path(directory).absolute()
    with _permission_errors(directory):  # Orbax lists the steps here
        manager = ocp.CheckpointManager(
            directory, options=options, handler_registry=_registry(replica_parallel)
        )
    if not read_only:
        empty_trash(manager.directory)
    return manager


def save(manager, step: int, *, params, state: dict, data_state: dict | None, metrics=None):
    """Starts saving (returns once arrays are copied off the devices when async).

    Waits for the previous asynchronous save first, and raises its error if it failed
    (CheckpointWriteError for a full disk).
    """
    items = dict(params=ocp.args.PyTreeSave(params), state=ocp.args.PyTreeSave(state))
    if data_state is not None:
        items["data"] = DataSave(data_state, step)
    # Written by the background commit, which waits for them (see ChecksumsHandler); an async
    # save starts them after its copy off the devices, so that the two never compete.
    sums = _PendingChecksums(manager._options.async_options.timeout_secs)  # noqa: SLF001
    items["checksums"] = ChecksumsSave(sums)
    tree = {"params": params, "state": state}
    if not manager._options.enable_async_checkpointing:  # noqa: SLF001 - no public getter
        sums.start(tree)
    with _write_errors(manager, step):
        try:
            manager.save(
                step,
                args=ocp.args.Composite(**items),
                metrics=metrics,
                force=True,
                custom_metadata={"versions": versions(), "tfjax_format": FORMAT},
            )
        except BaseException:
            # manager.save may raise after starting the writes; _write_errors then waits for
            # them, and the checksums item among them waits for this start.
            with contextlib.suppress(Exception):  # its own error is the writer's to raise
                sums.start(tree)
            raise
        sums.start(tree)
    manager.tfjax_writing = step  # named if its background write fails
    # The previous save (and its deletions) finished inside manager.save.
    empty_trash(manager.directory, background=True)


def wait_until_finished(manager) -> None:
    """manager.wait_until_finished(), raising a failed save's error only once the writes of
    that save's other items have ended."""
    with _write_errors(manager, None):
        manager.wait_until_finished()


def close(manager) -> None:
    """Waits for the last save (raising its error), closes the manager and empties TRASH, so
    that a finished run keeps `keep` steps on disk and no deleted one."""
    try:
        wait_until_finished(manager)
    finally:
        manager.close()
        if not manager._options.read_only:  # noqa: SLF001 - Orbax has no public getter
            empty_trash(manager.directory)


@contextlib.contextmanager
def _write_errors(manager, step):
    """Lets a failed save's other writes end first; a full disk becomes one short error."""
    try:
        with _unfinished_writes_end_before_errors(manager):
            yield
    except Exception as e:
        if not _disk_full(e):
            raise
        directory = os.fspath(manager.directory)
        failed = getattr(manager, "tfjax_writing", step)
        usage = shutil.disk_usage(directory)
        latest = manager.latest_step()
        error = CheckpointWriteError(
            f"checkpoint step {failed} could not be written to {directory}: no space left on "
            f"the device ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB). "
            + (
                f"The newest complete checkpoint, step {latest}, is intact"
                if latest is not None
                else "No complete checkpoint was written"
            )
            + "; the partial step is removed at the next start. Free space (or move the "
            "workdir), then run the same command again to resume."
        )
        error.errno = errno.ENOSPC
        raise error from None


@contextlib.contextmanager
def _unfinished_writes_end_before_errors(manager):
    """On an error, waits for every write of the last asynchronous save to end, then raises.

    Orbax reports a failed save at its first failed item while the other items may still be
    writing into the step's temporary directory. Raised then, the error would let the same
    process (a notebook, a retry) save that step again, or remove the directory, while those
    writes go on: "Directory not empty" from the removal, or stale files in the new save. Orbax
    has no public call for this, so it reads the commit futures it keeps; if that attribute
    moves in another Orbax version this waits for nothing, as before. Each wait is bounded by
    the save's own timeout (checkpoint.timeout_s).
    """
    try:
        yield
    except BaseException:
        async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
        timeout = getattr(async_manager, "_timeout_secs", None)
        for commit in getattr(async_manager, "_commit_futures", None) or ():
            try:
                commit.result(timeout=timeout)
            except Exception:  # the save's error is already being raised
                pass
        raise


class _ShortDiskFullLogs(std_logging.Filter):
    """Orbax logs a failed background write from each of its threads with a full traceback (a
    full disk: ~500 lines). Those caused by a full disk keep one line each; the run's own error
    (CheckpointWriteError) says what to do."""

    def filter(self, record):
        e = record.exc_info[1] if record.exc_info else None
        if e is not None and f"{os.sep}orbax{os.sep}" in record.pathname and _disk_full(e):
            record.msg, record.args = "Orbax: %s failed: %s", (record.funcName, _short(e, 200))
            record.exc_info, record.exc_text = None, None
        return True


@functools.cache  # once per process
def _shorten_disk_full_logs() -> None:
    std_logging.getLogger("absl").addFilter(_ShortDiskFullLogs())


def _chain(e: BaseException | None):
    """e, then the exception it was raised from (or during), and so on."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _disk_full(e: BaseException | None) -> bool:
    # tensorstore's errors carry only the text
    return any(
        (isinstance(x, OSError) and x.errno == errno.ENOSPC) or "No space left on device" in str(x)
        for x in _chain(e)
    )


# ------------------------------------------------------------------------------ compatibility
def _path_str(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(path): tuple(leaf.shape) for path, leaf in leaves if leaf is not None}


# ---------------------------------------------------------------------------------- checksums
def _bits(x):
    """Each element's bit pattern as uint32 (8-byte types: one uint32 per 32-bit word)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size < 4:
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(
            jnp.uint32
        )
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _checksum(x):
    """[2] uint32: two sums (mod 2**32) of each element's bits times an odd weight of its
    position. The weight is a product of one odd number per axis, so it is odd and invertible
    mod 2**32: changing any one element always changes both sums; the two weightings differ, so
    other changes collide with a chance of about 2**-64. Reducing one axis at a time with its
    weights costs a multiply-add per element and sums a sharded array where it lies."""
    u = _bits(x)
    sums = []
    for salt in (0x9E3779B1, 0x85EBCA77):
        h = u
        for axis in reversed(range(u.ndim)):
            position = jnp.arange(u.shape[axis], dtype=jnp.uint32)
            weight = position * jnp.uint32(salt) + jnp.uint32(2 * axis + 1) | 1
            h = jnp.sum(h * weight, axis=-1, dtype=jnp.uint32)
        sums.append(h)
    return jnp.stack(sums)


@functools.cache
def _checksums_fn(out_sharding):
    return jax.jit(lambda leaves: [_checksum(x) for x in leaves], out_shardings=out_sharding)


def _start_checksums(tree) -> dict:
    """{"params/encoder/.../kernel": [2] uint32 device array} of each leaf, dispatched (not
    waited for): one program per device set, on the devices that hold the arrays."""
    groups = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf is None:
            continue
        x = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
        groups.setdefault(frozenset(x.sharding.device_set), []).append((_path_str(path), x))
    out = {}
    for members in groups.values():
        first = members[0][1].sharding
        replicated = (
            jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
            if isinstance(first, jax.sharding.NamedSharding)
            else None
        )
        sums = _checksums_fn(replicated)([x for _, x in members])
        out.update({name: s for (name, _), s in zip(members, sums, strict=True)})
    return out


def _hex(sums: dict) -> dict[str, str]:
    return {name: f"{int(a):08x}{int(b):08x}" for name, (a, b) in jax.device_get(sums).items()}


def checksums(tree) -> dict[str, str]:
    """{"params/encoder/.../kernel": "89abcdef01234567"}: each array's checksum (16 hex digits),
    as `save` records them in `<step>/checksums/checksums.json`."""
    return _hex(_start_checksums(tree))


class _PendingChecksums:
    """Checksums that a save starts (dispatches to the devices) once, and its writer waits for
    at most `timeout_s` (the save's checkpoint.timeout_s)."""

    def __init__(self, timeout_s: float):
        self._timeout_s, self._sums, self._error = timeout_s, None, None
        self._started = threading.Event()

    def start(self, tree) -> None:
        if self._started.is_set():
            return
        try:
            self._sums = _start_checksums(tree)
        except BaseException as e:  # the writer fails with it instead of waiting
            self._error = e
            raise
        finally:
            self._started.set()

    def text(self) -> str:
        if not self._started.wait(self._timeout_s):
            raise TimeoutError(f"the checksums were not started within {self._timeout_s} s")
        if self._error is not None:
            raise RuntimeError("computing the checksums failed") from self._error
        return json.dumps(_hex(self._sums))


class ChecksumsHandler(_FileItemHandler):
    """Writes the arrays' checksums as JSON (process 0). They are computed on the devices; the
    save only starts that computation, and the background commit waits for the 16 bytes per
    array, so the training loop never waits for it."""

    async def async_save(self, directory: epath.Path, args: ChecksumsSave):
        async def write():
            self.save(directory, args)

        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="checksums")]

    def save(self, directory: epath.Path, args: ChecksumsSave):
        if jax.process_index() == 0:  # the sums are replicated: the others fetch nothing
            (directory / CHECKSUMS_FILE).write_text(args.sums.text())

    def restore(self, directory: epath.Path, args=None):  # restores verify with the file itself
        return json.loads((directory / CHECKSUMS_FILE).read_text())


@ocp.args.register_with_handler(ChecksumsHandler, for_save=True)
@dataclasses.dataclass
class ChecksumsSave(ocp.args.CheckpointArgs):
    sums: _PendingChecksums


def _verify(manager, step: int, restored: dict, *, written: bool) -> None:
    """Raises UnusableCheckpointError naming the arrays whose values differ from the checksums
    recorded at save time, or the checksums file when it does not hold one of each restored
    array. `written`: the step was written with its checksums item (a step saved before tfjax
    recorded them: a warning)."""
    path = _step_dir(manager, step) / "checksums" / CHECKSUMS_FILE
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        if written:
            raise UnusableCheckpointError(f"{path}: missing") from None
        logging.warning(
            "Checkpoint %s/%d records no checksums (written before tfjax recorded "
            "them): its values are not verified.",
            manager.directory,
            step,
        )
        return
    except (ValueError, UnicodeDecodeError) as e:
        raise UnusableCheckpointError(f"{path}: not valid JSON ({e})") from None
    now = checksums(restored)
    missing = sorted(now.keys() - stored.keys()) if isinstance(stored, dict) else sorted(now)
    if missing:
        raise UnusableCheckpointError(
            f"{path}: damaged: it holds no checksum of {missing[0]}"
            + (f" (nor of {len(missing) - 1} more arrays)" if len(missing) > 1 else "")
        )
    bad = sorted(k for k in now if stored[k] != now[k])
    if bad:
        raise UnusableCheckpointError(
            f"{manager.directory}/{step}: the values of {bad[0]}"
            + (f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else "")
            + " differ from the checksums recorded when it was saved (the files were changed "
            "or damaged on disk)"
        )


def stored_param_shapes(manager, step: int) -> dict[str, tuple]:
    """{"encoder/layers_0/mlp/wi/kernel": shape} of the parameters saved at `step`."""
    return _stored_shapes(manager, step, "params")


def _stored_shapes(manager, step: int, item: str) -> dict[str, tuple]:
    try:
        metadata = manager.item_metadata(step)[item]
    except Exception as e:  # noqa: BLE001 - any failure to read metadata makes the step unusable
        raise UnusableCheckpointError(
            f"{manager.directory}/{step}: the metadata of its {item} cannot be read ({_short(e)})"
        ) from e
    return _shapes(getattr(metadata, "tree", metadata))


def check_params_fit(stored: dict[str, tuple], abstract_params, where: str) -> None:
    """Raises CheckpointMismatchError naming the first parameter whose path or shape differs."""
    _check_fit(
        stored, abstract_params, where, "parameter", "the config the checkpoint was written with"
    )


def _check_fit(stored: dict[str, tuple], abstract, where: str, what: str, hint: str) -> None:
    wanted = _shapes(abstract)
    problems = []
    for name in sorted(wanted.keys() | stored.keys()):
        if name not in stored:
            problems.append(f"{what} {name!r} {wanted[name]} of the model is not in it")
        elif name not in wanted:
            problems.append(f"its {what} {name!r} {stored[name]} is not in the model")
        elif stored[name] != wanted[name]:
            problems.append(
                f"{what} {name!r} has shape {stored[name]} there but {wanted[name]} in the model"
            )
    if problems:
        raise CheckpointMismatchError(
            f"the checkpoint {where} does not fit this run: {problems[0]}"
            + (f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else "")
            + f". Nothing was restored or deleted; use another workdir or {hint}."
        )


@functools.cache  # installed once, with the first manager
def _drop_closed_loop_noise() -> None:
    """After Orbax gives up on a failed read or write it closes its event loop while
    tensorstore still completes the others. Each completion then raises "Event loop is closed"
    as an unraisable exception, and each abandoned one (a coroutine or task) reports its own
    tensorstore error as unraisable or as asyncio's "exception was never retrieved": hundreds
    of traceback lines that say nothing the first error did not. Drop only those."""
    previous = sys.unraisablehook

    def noise(e) -> bool:
        text = str(e)
        return (
            text == "Event loop is closed"
            or "TensorStore" in text
            or "OCDBT" in text
            or "'_read_array_index_and_device_put' was never awaited" in text
        )

    def hook(unraisable):
        if not noise(unraisable.exc_value):
            previous(unraisable)

    def keep(record) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not ("never retrieved" in record.getMessage() and noise(e))

    sys.unraisablehook = hook
    std_logging.getLogger("asyncio").addFilter(keep)


def _short(e: BaseException, limit: int = 400) -> str:
    """One line of an exception, from the innermost cause (tensorstore's names the file;
    Orbax's wrappers around it run to many lines and name none)."""
    *_, e = _chain(e)
    text = " ".join(str(e).split()).split(" [tensorstore_spec=")[0]  # the spec is a page long
    return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def _is_dir(path) -> bool:
    """Whether `path` is a directory; unlike Path.is_dir, a directory this process may not
    search raises PermissionError instead of looking absent."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnusableCheckpointError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UnusableCheckpointError(f"{path}: not valid JSON ({e})") from None


def _items_written(metadata: dict, root) -> set[str]:
    """The items a step was written with, as Orbax records them in its _CHECKPOINT_METADATA
    (versions of Orbax that did not record them: the item directories it has)."""
    handlers = metadata.get("item_handlers")
    if isinstance(handlers, dict):
        return set(handlers)
    return {"params", "state"} | {item for item in ("data", "checksums") if _is_dir(root / item)}


def _check_items(manager, step: int, items) -> dict:
    """The step's _CHECKPOINT_METADATA, after naming what a read would miss: a metadata file
    missing or unparsable, or an item (of `items`, or any other the step was written with: a
    step that lacks one is damaged, not old) missing."""
    root = _step_dir(manager, step)
    metadata = _read_json(root / "_CHECKPOINT_METADATA")
    if not isinstance(metadata, dict):
        raise UnusableCheckpointError(f"{root / '_CHECKPOINT_METADATA'}: damaged (not an object)")
    for item in sorted(set(items) | _items_written(metadata, root)):
        if not _is_dir(root / item):
            raise UnusableCheckpointError(f"{root / item}: missing (the step lacks its {item})")
        if item in ("params", "state"):
            _read_json(root / item / "_METADATA")
    return metadata


def _denied(e: BaseException) -> bool:
    # tensorstore's errors carry only the text
    return any(isinstance(x, PermissionError) or "PERMISSION_DENIED" in str(x) for x in _chain(e))


@contextlib.contextmanager
def _permission_errors(path):
    """A read of `path` (a step, the checkpoints directory) that this process may not make
    becomes one CheckpointPermissionError: not damage, so no older step is tried instead."""
    try:
        yield
    except (OSError, UnusableCheckpointError) as e:
        if isinstance(e, CheckpointPermissionError) or not _denied(e):
            raise
        raise CheckpointPermissionError(
            f"{path}: permission denied ({_short(e, 200)}). Give this user read and write "
            f"access to it (e.g. chmod -R u+rwX {path}) or run as the user who wrote it, then "
            "run the same command again; nothing was moved or deleted."
        ) from None


def restore(
    manager,
    step: int,
    *,
    abstract_params,
    abstract_state: dict,
    optional_state=(),
    data: bool = True,
):
    """{"params", "state", "data"} of `step`, verified, on the shardings of the abstract targets.

    Keys of abstract_state named in `optional_state` are restored only where the step has them
    (older checkpoints lack some). "data" is None when the checkpoint has no position for this
    process (written by a different number of processes or without one) or data=False.
    Raises CheckpointMismatchError when the step was written for another model or optimizer,
    UnusableCheckpointError when it cannot be read, lacks an item or fails its checksums,
    CheckpointPermissionError when this process may not read it.
    """
    where = f"{manager.directory}/{step}"
    with _permission_errors(_step_dir(manager, step)):
        metadata = _check_items(manager, step, ("params", "state"))
        written = _items_written(metadata, _step_dir(manager, step))
        stored_params = stored_param_shapes(manager, step)
        stored_state = _stored_shapes(manager, step, "state")
        check_params_fit(stored_params, abstract_params, where)
        stored_keys = {name.split("/")[0] for name in stored_state}
        abstract_state = {
            k: v for k, v in abstract_state.items() if k in stored_keys or k not in optional_state
        }
        _check_fit(
            stored_state,
            abstract_state,
            where,
            "state array",
            "the optimizer and EMA settings it was written with",
        )
        check_versions(manager, step)
        items = dict(params=_restore_args(abstract_params), state=_restore_args(abstract_state))
        if data and "data" in written:
            custom = metadata.get("custom_metadata")
            format_ = custom.get("tfjax_format", 1) if isinstance(custom, dict) else 1
            items["data"] = DataRestore(step, bound=format_ >= 2)  # see FORMAT
        restored = _read_verified(manager, step, items, checksums="checksums" in written)
    return {"params": restored["params"], "state": restored["state"], "data": restored.get("data")}


def _read_verified(manager, step: int, items: dict, *, checksums: bool) -> dict:
    """manager.restore of `items` at `step`, checked against the step's checksums (`checksums`:
    the step was written with them); a failure on any process raises UnusableCheckpointError
    on every process."""
    where = f"{manager.directory}/{step}"
    try:
        restored = dict(manager.restore(step, args=ocp.args.Composite(**items)))
    except Exception as e:  # noqa: BLE001 - tensorstore and Orbax raise many kinds
        restored = {"all items": _ReadFailure(e)}
    error = next((v.error for v in restored.values() if isinstance(v, _ReadFailure)), None)
    if error is not None and not isinstance(error, UnusableCheckpointError):
        error = UnusableCheckpointError(f"{where}: reading it failed ({_short(error)})")
    error = _agree(error, where)  # before _verify, whose checksums are computed by all
    if error is not None:
        raise error
    arrays = {k: restored[k] for k in ("params", "state") if k in restored}
    _verify(manager, step, arrays, written=checksums)
    return restored


def _step_entries(manager) -> dict[int, str]:
    """{step: path} of every entry of the checkpoints directory named as a step, whether Orbax
    lists it or not."""
    directory = os.fspath(manager.directory)
    with _permission_errors(directory):
        names = os.listdir(directory)
    return {int(n): os.path.join(directory, n) for n in names if n.isascii() and n.isdigit()}


def _unlisted(manager) -> dict[int, str]:
    """{step: what is wrong} of the entries named as a step that Orbax does not list (a
    dangling symbolic link, a file): never restorable, and the next save of that step would
    fail on them."""
    listed, out = set(manager.all_steps()), {}
    for step, path in _step_entries(manager).items():
        if step in listed:
            continue
        if os.path.islink(path) and not os.path.exists(path):
            why = f"a symbolic link to {os.readlink(path)}, which does not exist"
        elif not os.path.isdir(path):
            why = "a file, not a step directory"
        else:
            why = "a directory Orbax does not list as a step"
        out[step] = f"{path}: {why}"
    return out


def _no_such_step(step: int, directory, steps) -> str:
    return (
        f"checkpoint.restore_step={step}: {directory} has no such step (it has "
        f"{sorted(steps) or 'none'}); set one of them, or leave it unset to resume from the "
        "newest step"
    )


def restore_step_to_apply(config, workdir: str) -> int | None:
    """config.checkpoint.restore_step, or None where an earlier run of `workdir` applied it.

    restore_step takes effect in the run that sets it (or changes it): that run resumes from
    it and sets the newer steps aside. The workdir's config.json records the config each run
    started with, so running the same command again (as run.py says after a stop) resumes
    from the newest step instead of rolling the run back again.
    """
    step = config.checkpoint.get("restore_step")
    previous = workdirs.previous_config(workdir) or {}
    applied = (previous.get("checkpoint") or {}).get("restore_step")
    return None if step == applied else step


def check_restore_step(config, workdir: str) -> None:
    """Raises ValueError when config.checkpoint.restore_step, still to apply, names no step in
    `workdir`: a pre-start check."""
    step = restore_step_to_apply(config, workdir)
    if step is None:
        return
    directory = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [int(n) for n in names if n.isascii() and n.isdigit()]
    if step not in steps:
        raise ValueError(_no_such_step(step, directory, steps))


def restore_newest(manager, *, restore_step: int | None = None, **restore_kwargs):
    """(step, restored) of the newest step that reads and verifies, or (None, None) when the
    directory has no step. A step that fails (entries named as a step that Orbax does not list
    among them) is logged (file and reason) and left on disk, and the next older one is tried;
    `restore_step` restores that step or raises. With no usable step, raises
    UnusableCheckpointError listing them all. `restore_kwargs` go to `restore`.

    Every process takes the same decision: a step that fails on one process fails on all.
    """
    unlisted = _unlisted(manager)
    steps = sorted({*manager.all_steps(), *unlisted}, reverse=True)
    if restore_step is not None:
        if restore_step not in steps:
            raise CheckpointError(_no_such_step(restore_step, manager.directory, steps))
        steps = [restore_step]
    failures = []
    for step in steps:
        restored, error = None, None
        try:
            if step in unlisted:
                raise UnusableCheckpointError(unlisted[step])
            restored = restore(manager, step, **restore_kwargs)
        except UnusableCheckpointError as e:  # others (a mismatch, a permission) stop the run
            error = e  # the same on every process (see restore)
        if error is None:
            if failures:
                logging.warning(
                    "Resuming from checkpoint %s/%d, the newest that verifies.",
                    manager.directory,
                    step,
                )
            return step, restored
        failures.append(str(error))
        if restore_step is not None:
            raise error
        logging.error(
            "Checkpoint unusable: %s. Its files are left as they are; trying an older step.", error
        )
    if failures:
        raise UnusableCheckpointError(
            f"no checkpoint in {manager.directory} can be restored, and nothing was deleted:\n  "
            + "\n  ".join(failures)
            + "\nMove them away to start over in this workdir, or use another workdir."
        )
    return None, None


def _agree(error, where: str):
    """The error of a step on every process when it failed on any (a collective)."""
    if jax.process_count() == 1:
        return error
    ok = multihost_utils.process_allgather(np.int32(error is None))
    if error is None and not ok.all():
        failed = [i for i, flag in enumerate(ok) if not flag]
        error = UnusableCheckpointError(
            f"{where}: process(es) {failed} could not restore it (their logs name the file)"
        )
    return error


def set_aside_after(manager, step: int) -> None:
    """Moves every entry named as a step after `step` (unusable or passed over by restore_step:
    listed steps, dangling links, files), unchanged, into `<workdir>/checkpoints_set_aside/`,
    out of the manager's listing: a run resumed from `step` then neither collides with their
    step numbers nor has its own new steps deleted in their favour (keep counts the newest)."""
    directory = os.fspath(manager.directory)
    aside = os.path.join(os.path.dirname(directory), UNUSABLE)
    if jax.process_index() == 0:
        for newer, path in sorted(_step_entries(manager).items()):
            if newer <= step:
                continue
            os.makedirs(aside, exist_ok=True)
            target, n = os.path.join(aside, str(newer)), 1
            while os.path.lexists(target):
                target, n = os.path.join(aside, f"{newer}.{n}"), n + 1
            with _permission_errors(directory):
                os.rename(path, target)
            logging.warning("Checkpoint step %d moved, files unchanged, to %s", newer, target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tfjax: checkpoints set aside")
    manager.reload()


def checkpoints_dir(path: str) -> str:
    """A run's workdir or its checkpoints directory -> the checkpoints directory."""
    path = os.path.abspath(os.path.expanduser(path))
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def has_checkpoint(path: str) -> bool:
    """A run's workdir, or its checkpoints directory, holds a step directory (Orbax's names)."""
    directory = checkpoints_dir(path)
    return os.path.isdir(directory) and any(
        name.isdigit() and os.path.isdir(os.path.join(directory, name))
        for name in os.listdir(directory)
    )


def restore_params(
    path: str,
    abstract_params,
    *,
    average_last: int = 1,
    what: str = "init_from",
    step: int | None = None,
):
    """The newest parameters of a run (its workdir or checkpoints directory), checked against
    the model and placed on the abstract target's shardings. `init_from` and decoding use it.

    average_last=N > 1 returns the mean of the newest N checkpoints' parameters (the paper
    averages the last 5 for evaluation); fewer kept than N is an error naming both. `step`
    takes that step instead of the newest (an error lists the kept ones when it is not kept).
    `what` names the option in error messages.
    """
    directory = checkpoints_dir(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{what}={path!r}: no such directory")
    if average_last < 1:
        raise ValueError(f"average_last must be at least 1, got {average_last}")
    manager = make_manager(directory, read_only=True)
    try:
        kept = sorted(manager.all_steps())
        if step is not None and step not in kept:
            raise FileNotFoundError(f"step {step} is not kept in {directory}; kept: {kept}")
        steps = (kept[: kept.index(step) + 1] if step is not None else kept)[-average_last:]
        if not steps:
            raise FileNotFoundError(f"{what}={path!r}: no checkpoint in {directory}")
        if len(steps) < average_last:
            raise ValueError(
                f"average_last={average_last} but {directory} keeps only {len(steps)} "
                f"checkpoints (steps {steps}); keep more (checkpoint.keep) or average fewer"
            )
        total = None
        for kept_step in steps:
            with _permission_errors(_step_dir(manager, kept_step)):
                metadata = _check_items(manager, kept_step, ("params",))
                check_params_fit(
                    stored_param_shapes(manager, kept_step),
                    abstract_params,
                    f"{directory}/{kept_step} ({what})",
                )
                check_versions(manager, kept_step)
                items = {"params": _restore_args(abstract_params)}
                written = _items_written(metadata, _step_dir(manager, kept_step))
                params = _read_verified(
                    manager, kept_step, items, checksums="checksums" in written
                )["params"]
            # Summed in float32 one checkpoint at a time: memory stays at two copies.
            total = params if total is None else jax.tree.map(jnp.add, total, params)
    finally:
        manager.close()
    if len(steps) > 1:
        total = jax.tree.map(lambda x: (x / len(steps)).astype(x.dtype), total)
        logging.info("Averaged the parameters of %s/%s", directory, steps)
    else:
        logging.info("Restored the parameters of %s/%d", directory, steps[0])
    return total


def abstract_like(tree, shardings):
    """jax.ShapeDtypeStructs of `tree`'s leaves carrying the given shardings."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )


# --------------------------------------------------------------------- a TrainState's items
# The train state <-> checkpoint items mapping: `params` holds state.params; `state` the rest,
# with the run's dropout key as its raw key data. Checkpoints written before the skip counters
# existed have none: they restore as 0.
OPTIONAL_STATE = ("skipped", "skipped_in_a_row")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What `restore_train_state` found: the step, the state, the dropout key and the data
    loader's position (None when the checkpoint has none for this process count)."""

    step: int
    state: Any  # tfjax.runner.steps.TrainState
    rng: jax.Array
    data_state: dict | None


@functools.cache
def _key_data_fn(sharding):
    # In a multi-process run every array the loop touches must be a global array: keys are
    # converted inside jit, replicated over the mesh.
    return jax.jit(jax.random.key_data, out_shardings=sharding)


@functools.cache
def _wrap_key_data_fn(sharding):
    return jax.jit(jax.random.wrap_key_data, out_shardings=sharding)


def _state_item(state, rng_data) -> dict:
    item = dict(
        step=state.step,
        opt_state=state.opt_state,
        rng=rng_data,
        skipped=state.skipped,
        skipped_in_a_row=state.skipped_in_a_row,
    )
    if state.ema_params is not None:
        item["ema_params"] = state.ema_params
    return item


def save_train_state(manager, step: int, state, rng, *, data_state, metrics=None) -> None:
    """`save` of a TrainState, the run's dropout key `rng` and the data position."""
    rng_data = _key_data_fn(rng.sharding)(rng)
    save(
        manager,
        step,
        params=state.params,
        state=_state_item(state, rng_data),
        data_state=data_state,
        metrics=metrics,
    )


def restore_train_state(manager, abstract_state, abstract_rng, *, restore_step=None):
    """The newest usable checkpoint of `manager` as a `Resumed` (see `restore_newest`), onto the
    shardings of `abstract_state` (a TrainState of ShapeDtypeStructs) and `abstract_rng`; None
    when the directory has no step."""
    from tfjax.runner.steps import TrainState

    key = jax.eval_shape(jax.random.key_data, abstract_rng)
    rng_data = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=abstract_rng.sharding)
    step, restored = restore_newest(
        manager,
        restore_step=restore_step,
        abstract_params=abstract_state.params,
        abstract_state=_state_item(abstract_state, rng_data),
        optional_state=OPTIONAL_STATE,
    )
    if step is None:
        return None
    s = restored["state"]
    zero = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=abstract_rng.sharding)
    state = TrainState(
        step=s["step"],
        params=restored["params"],
        opt_state=s["opt_state"],
        ema_params=s.get("ema_params"),
        **{name: s[name] if name in s else zero() for name in OPTIONAL_STATE},
    )
    rng = _wrap_key_data_fn(abstract_rng.sharding)(s["rng"])
    return Resumed(step, state, rng, restored["data"])
