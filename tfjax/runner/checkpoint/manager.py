"""The Orbax CheckpointManager of a run's `checkpoints/` directory, set up from config.checkpoint:
what it keeps (keep, best_metric), how it writes (async_save, replica_parallel, timeout_s) and
the handlers of a step's four items."""

from __future__ import annotations

import math

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tfjax.runner.checkpoint.data_position import DataRestore, DataSave
from tfjax.runner.checkpoint.errors import (
    _drop_closed_loop_noise,
    _permission_errors,
    _shorten_disk_full_logs,
)
from tfjax.runner.checkpoint.handlers import _PyTreeHandler
from tfjax.runner.checkpoint.integrity import ChecksumsSave
from tfjax.runner.checkpoint.paths import TRASH, empty_trash

TIMEOUT_S = 1200  # checkpoint.timeout_s when a config has none (Orbax's own default)


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
        # Delete old steps by an atomic rename first (see the paths module).
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
