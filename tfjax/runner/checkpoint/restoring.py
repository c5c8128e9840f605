"""Restoring one step, verified, onto any mesh: a run's full state, or its parameters alone.

Restoring takes an abstract target (jax.ShapeDtypeStruct with the *new* shardings), so a
checkpoint written on one mesh restores onto any other mesh or device count. Before anything
is restored the stored parameter shapes are compared with the model's (compatibility), and a
mismatch is an error naming the first differing parameter; nothing in the checkpoint directory
is ever deleted by a failed restore. There is no silent partial restore: the only one is asked
for by name, `init_from` (`restore_params`: parameters only, no optimizer state), and it too
needs every parameter to match. Everything in a checkpoint is read as JSON, msgpack or
tensorstore arrays: nothing is unpickled, so nothing stored can import or execute code.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from tfjax.runner.checkpoint.compatibility import (
    _check_fit,
    _stored_shapes,
    check_params_fit,
    stored_param_shapes,
)
from tfjax.runner.checkpoint.data_position import DataRestore
from tfjax.runner.checkpoint.errors import UnusableCheckpointError, _permission_errors, _short
from tfjax.runner.checkpoint.handlers import _ReadFailure
from tfjax.runner.checkpoint.integrity import _verify
from tfjax.runner.checkpoint.manager import make_manager
from tfjax.runner.checkpoint.metadata import _check_items, _items_written, check_versions
from tfjax.runner.checkpoint.paths import _step_dir, checkpoints_dir


def _restore_args(abstract_tree):
    """Restore onto the abstract tree's shapes, dtypes and shardings."""
    return ocp.args.PyTreeRestore(
        item=abstract_tree,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
    )


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
        stored = _stored_shapes(manager, step, "params", "state")
        stored_params, stored_state = stored["params"], stored["state"]
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
            items["data"] = DataRestore(step, bound=format_ >= 2)  # see metadata.FORMAT
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
