"""Checkpoints with Orbax: what a run saves, how it resumes, and the checks before restoring.

A checkpoint step directory `WORKDIR/checkpoints/<step>/` holds three items:

  params  the model parameters (sharded arrays; every process writes its shards)
  state   {"step", "opt_state", "rng" (the run's dropout key data), "ema_params" (if on)}
  data    the data loader's position, one JSON file per process (`process_<i>-of-<n>.json`)

Every step directory also records, in Orbax's `_CHECKPOINT_METADATA` (JSON), the versions of
jax, flax, optax, orbax and tfjax that wrote it; restoring under other versions logs a warning
with both lists.

Crash safety (what a SIGKILL at any moment leaves behind):
  * Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only
    when every file (and every process's data position) is written, so a listed step is always
    complete; temporary directories of interrupted saves are removed when a manager is made.
  * Old steps are not deleted in place (an interrupted `rmtree` would leave a listed but
    partial step): they are first renamed, atomically, into `<checkpoints>/TRASH/` and removed
    from there (after each save and when a manager is made).
  * A failed asynchronous write raises at the next save or when the run ends
    (`wait_until_finished`), and its step never becomes a complete directory.
Everything in a checkpoint is read as JSON, msgpack or tensorstore arrays: nothing is
unpickled, so nothing stored can import or execute code.

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
                "accuracy" ("" for none); checkpoints are then also saved at every evaluation
  best_mode     "max" or "min" for best_metric
  async_save    write in a background thread: training continues while the files are written
  replica_parallel   replicas of a replicated array each write a slice of it (faster saves
                on many devices; the first save compiles small slicing programs, seconds on CPU)
  timeout_s     the most seconds a save's background commit waits for the other processes to
                finish writing (Orbax's barrier) before it fails with an error; a process that
                died is caught sooner by JAX's heartbeat (experiments/run.py --heartbeat_timeout)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint import future as ocp_future

ITEMS = ("params", "state", "data")
TRASH = "TRASH"  # old steps are renamed into this subdirectory, then removed from there
VERSIONED = ("jax", "flax", "optax", "orbax-checkpoint", "tfjax")
TIMEOUT_S = 1200  # checkpoint.timeout_s when a config has none (Orbax's own default)


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


def check_versions(manager, step: int) -> None:
    """Warns (naming both lists) when the checkpoint was written under other package versions."""
    try:
        stored = (manager.metadata(step).custom_metadata or {}).get("versions")
    except Exception as e:  # noqa: BLE001 - metadata is advisory, never a reason to fail
        logging.warning("Checkpoint %s/%d: cannot read its metadata (%s)", manager.directory,
                        step, e)  # fmt: skip
        return
    current = versions()
    if stored is None:
        logging.warning(
            "Checkpoint %s/%d records no package versions (written before tfjax recorded "
            "them); restoring under %s", manager.directory, step, current,
        )  # fmt: skip
    elif stored != current:
        logging.warning(
            "Checkpoint %s/%d was written under other package versions: checkpoint %s, now %s. "
            "Restoring anyway; if values or shapes look wrong, use the versions it was written "
            "with.", manager.directory, step, stored, current,
        )  # fmt: skip


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


class DataStateHandler(ocp.AsyncCheckpointHandler):
    """Saves each process's loader state (a JSON-serialisable dict) in its own file.

    Orbax's JSON handler writes from the primary process only; every process reads its own
    shard of the data, so each one saves its own position.
    """

    async def async_save(self, directory: epath.Path, args: DataSave):
        text = json.dumps(args.state)  # serialised now: the loader moves on during the write

        async def write():
            _data_file(directory).write_text(text)

        # Waits for Orbax's (possibly asynchronous) creation of `directory` before writing.
        return [ocp_future.CommitFutureAwaitingContractedSignals(write(), name="data_save")]

    def save(self, directory: epath.Path, args: DataSave):
        _data_file(directory).write_text(json.dumps(args.state))

    def restore(self, directory: epath.Path, args: DataRestore | None = None):
        path = _data_file(directory)
        if not path.exists():
            return None  # saved by a different number of processes
        return json.loads(path.read_text())

    def metadata(self, directory: epath.Path):
        return None

    def finalize(self, directory: epath.Path):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    pass


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
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=arrays)
        registry.add(item, ocp.args.PyTreeSave, handler)
        registry.add(item, ocp.args.PyTreeRestore, handler)
    registry.add("data", DataSave)
    registry.add("data", DataRestore)
    return registry


def _restore_args(abstract_tree):
    """Restore onto the abstract tree's shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        item=abstract_tree,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
    )


def make_manager(directory, checkpoint_config=None, *, read_only=False) -> ocp.CheckpointManager:
    """The CheckpointManager of a run's `checkpoints/` directory (created when missing)."""
    policies = []
    timeout_s = TIMEOUT_S
    if checkpoint_config is not None:
        c = checkpoint_config
        timeout_s = c.get("timeout_s", TIMEOUT_S)
        if not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"checkpoint.timeout_s must be a whole number of seconds >= 1, "
                             f"got {timeout_s!r}")  # fmt: skip
        if c.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {c.keep}")
        if c.best_mode not in ("max", "min"):
            raise ValueError(f"checkpoint.best_mode must be 'max' or 'min', got {c.best_mode!r}")
        policies.append(ocp.checkpoint_managers.LatestN(n=c.keep))
        if c.best_metric:
            metric = c.best_metric
            policies.append(
                ocp.checkpoint_managers.BestN(
                    get_metric_fn=lambda metrics: metrics[metric],
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
    replica_parallel = checkpoint_config is None or checkpoint_config.replica_parallel
    manager = ocp.CheckpointManager(
        epath.Path(directory).absolute(), options=options,
        handler_registry=_registry(replica_parallel),
    )  # fmt: skip
    if not read_only:
        empty_trash(manager.directory)
    return manager


def save(manager, step: int, *, params, state: dict, data_state: dict | None, metrics=None):
    """Starts saving (returns once arrays are copied off the devices when async).

    Waits for the previous asynchronous save first, and raises its error if it failed.
    """
    items = dict(params=ocp.args.PyTreeSave(params), state=ocp.args.PyTreeSave(state))
    if data_state is not None:
        items["data"] = DataSave(data_state)
    with _unfinished_writes_end_before_errors(manager):
        manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True,
                     custom_metadata={"versions": versions()})  # fmt: skip
    # The previous save (and its deletions) finished inside manager.save.
    empty_trash(manager.directory, background=True)


def wait_until_finished(manager) -> None:
    """manager.wait_until_finished(), raising a failed save's error only once the writes of
    that save's other items have ended."""
    with _unfinished_writes_end_before_errors(manager):
        manager.wait_until_finished()


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


# ------------------------------------------------------------------------------ compatibility
def _path_str(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(path): tuple(leaf.shape) for path, leaf in leaves if leaf is not None}


def stored_state_keys(manager, step: int) -> set[str]:
    """The top-level keys of the "state" item saved at `step` (older checkpoints have fewer)."""
    metadata = manager.item_metadata(step)["state"]
    return set(getattr(metadata, "tree", metadata) or {})


def stored_param_shapes(manager, step: int) -> dict[str, tuple]:
    """{"encoder/layers_0/mlp/wi/kernel": shape} of the parameters saved at `step`."""
    metadata = manager.item_metadata(step)["params"]
    return _shapes(getattr(metadata, "tree", metadata))


def check_params_fit(stored: dict[str, tuple], abstract_params, where: str) -> None:
    """Raises ValueError naming the first parameter whose path or shape differs."""
    wanted = _shapes(abstract_params)
    problems = []
    for name in sorted(wanted.keys() | stored.keys()):
        if name not in stored:
            problems.append(f"parameter {name!r} {wanted[name]} of the model is not in it")
        elif name not in wanted:
            problems.append(f"its parameter {name!r} {stored[name]} is not in the model")
        elif stored[name] != wanted[name]:
            problems.append(
                f"parameter {name!r} has shape {stored[name]} there but {wanted[name]} in the model"
            )
    if problems:
        raise ValueError(
            f"the checkpoint {where} does not fit this model: {problems[0]}"
            + (f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else "")
            + ". Nothing was restored or deleted; use another workdir or the config the "
            "checkpoint was written with."
        )


def restore(manager, step: int, *, abstract_params, abstract_state: dict, data: bool = True):
    """{"params", "state", "data"} restored onto the shardings of the abstract targets.

    "data" is None when the checkpoint has no position for this process (written by a different
    number of processes) or data=False.
    """
    check_params_fit(
        stored_param_shapes(manager, step), abstract_params, f"{manager.directory}/{step}"
    )
    check_versions(manager, step)
    items = dict(params=_restore_args(abstract_params), state=_restore_args(abstract_state))
    if data and "data" in (manager.item_metadata(step) or {}):
        items["data"] = DataRestore()
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**items))
    except ValueError as e:
        raise ValueError(
            f"the training state in checkpoint {manager.directory}/{step} does not fit this run "
            f"(a different optimizer or EMA setting?): {e}. Nothing was restored or deleted."
        ) from e
    return {"params": restored["params"], "state": restored["state"], "data": restored.get("data")}


def _checkpoints_dir(path: str) -> str:
    """A run's workdir or its checkpoints directory -> the checkpoints directory."""
    path = os.path.abspath(os.path.expanduser(path))
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def restore_params(path: str, abstract_params, *, average_last: int = 1, what: str = "init_from"):
    """The newest parameters of a run (its workdir or checkpoints directory), checked against
    the model and placed on the abstract target's shardings. `init_from` and decoding use it.

    average_last=N > 1 returns the mean of the newest N checkpoints' parameters (the paper
    averages the last 5 for evaluation); fewer kept than N is an error naming both. `what`
    names the option in error messages.
    """
    directory = _checkpoints_dir(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{what}={path!r}: no such directory")
    if average_last < 1:
        raise ValueError(f"average_last must be at least 1, got {average_last}")
    manager = make_manager(directory, read_only=True)
    try:
        steps = sorted(manager.all_steps())[-average_last:]
        if not steps:
            raise FileNotFoundError(f"{what}={path!r}: no checkpoint in {directory}")
        if len(steps) < average_last:
            raise ValueError(
                f"average_last={average_last} but {directory} keeps only {len(steps)} "
                f"checkpoints (steps {steps}); keep more (checkpoint.keep) or average fewer"
            )
        total = None
        for step in steps:
            check_params_fit(
                stored_param_shapes(manager, step), abstract_params, f"{directory}/{step} ({what})"
            )
            check_versions(manager, step)
            params = manager.restore(
                step, args=ocp.args.Composite(params=_restore_args(abstract_params))
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
