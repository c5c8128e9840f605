"""Checkpoints with Orbax: what a run saves, how it resumes, and the checks before restoring.

A checkpoint step directory `WORKDIR/checkpoints/<step>/` holds four items:

  params     the model parameters (sharded arrays; every process writes its shards)
  state      {"step", "opt_state", "rng" (the run's dropout key data), "ema_params" (if on)}
  data       the data loader's position, one JSON file per process (`process_<i>-of-<n>.json`),
             which names its step
  checksums  each array's checksum

and, in Orbax's `_CHECKPOINT_METADATA`, the items it was written with, tfjax's FORMAT and the
package versions that wrote it. Each module's docstring says what it guarantees:

  errors         CheckpointError and its kinds; Orbax's failures as one line, its noise dropped
  paths          the checkpoints directory: step entries, TRASH, checkpoints_dir, has_checkpoint
  metadata       FORMAT, the package versions (versions, check_versions), the items a step has
  data_position  the `data` item (DataSave, DataRestore): positions bound to their step
  integrity      the `checksums` item (checksums, ChecksumsSave) and its verification
  compatibility  stored shapes against the model's (check_params_fit, stored_param_shapes)
  manager        make_manager from config.checkpoint (check_options, check_best_metric)
  saving         save, wait_until_finished, close: crash safety and failed writes
  restoring      restore (one step, verified), restore_params (init_from, decoding)
  resume         restore_newest, restore_step (check_restore_step, restore_step_to_apply),
                 set_aside_after
  train_state    a TrainState's items: save_train_state, restore_train_state (Resumed)

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

import orbax.checkpoint as ocp  # noqa: F401 - tests/runner/test_decode_runner.py reads checkpoint.ocp

from tfjax.runner.checkpoint.compatibility import check_params_fit, stored_param_shapes
from tfjax.runner.checkpoint.data_position import DataRestore, DataSave, DataStateHandler
from tfjax.runner.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointPermissionError,
    CheckpointWriteError,
    DamagedWeightsError,
    UnusableCheckpointError,
)
from tfjax.runner.checkpoint.integrity import (
    CHECKSUMS_FILE,
    ChecksumsHandler,
    ChecksumsSave,
    checksums,
)
from tfjax.runner.checkpoint.manager import (
    TIMEOUT_S,
    check_best_metric,
    check_options,
    make_manager,
)
from tfjax.runner.checkpoint.metadata import FORMAT, VERSIONED, check_versions, versions
from tfjax.runner.checkpoint.paths import (
    TRASH,
    UNUSABLE,
    checkpoints_dir,
    empty_trash,
    has_checkpoint,
)
from tfjax.runner.checkpoint.restoring import abstract_like, restore, restore_params
from tfjax.runner.checkpoint.resume import (
    check_restore_step,
    restore_newest,
    restore_step_to_apply,
    set_aside_after,
)
from tfjax.runner.checkpoint.saving import close, save, wait_until_finished
from tfjax.runner.checkpoint.train_state import (
    OPTIONAL_STATE,
    Resumed,
    restore_train_state,
    save_train_state,
)

__all__ = [
    "CHECKSUMS_FILE",
    "FORMAT",
    "OPTIONAL_STATE",
    "TIMEOUT_S",
    "TRASH",
    "UNUSABLE",
    "VERSIONED",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointPermissionError",
    "CheckpointWriteError",
    "ChecksumsHandler",
    "ChecksumsSave",
    "DamagedWeightsError",
    "DataRestore",
    "DataSave",
    "DataStateHandler",
    "Resumed",
    "UnusableCheckpointError",
    "abstract_like",
    "check_best_metric",
    "check_options",
    "check_params_fit",
    "check_restore_step",
    "check_versions",
    "checkpoints_dir",
    "checksums",
    "close",
    "empty_trash",
    "has_checkpoint",
    "make_manager",
    "restore",
    "restore_newest",
    "restore_params",
    "restore_step_to_apply",
    "restore_train_state",
    "save",
    "save_train_state",
    "set_aside_after",
    "stored_param_shapes",
    "versions",
    "wait_until_finished",
]
