r"""Runs an experiment: a config file, a workdir, optional overrides.

    python experiments/run.py --config=configs/vit.py:digits --workdir=/tmp/vit_digits \
        [--config.batch_size=256 --config.mesh.fsdp=2 ...]

The config is locked: a misspelt override or a value of the wrong type is an error naming the
key. Running the same command again resumes from the workdir's newest checkpoint.

SIGTERM or SIGINT (preemption, Ctrl-C) finish the current step, save a checkpoint and exit
with status 143 or 130 (128 + the signal) and a line saying where to resume; a non-finite loss
exits with a FloatingPointError naming the step (see tfjax.train).

Many hosts: with --coordinator_address, --num_processes and --process_id (or JAX's own
environment: JAX_COORDINATOR_ADDRESS, or a detected SLURM / Cloud TPU cluster), every process
calls jax.distributed.initialize() first and then loads only its part of each batch.
"""

import logging as std_logging
import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# The checkout's root, so that `python experiments/run.py` finds tfjax without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/<family>.py[:preset,...]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run (created if missing).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for a multi-process run."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0-based.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "yes", "no"],
    "Call jax.distributed.initialize(): 'auto' when a coordinator is given (flag or "
    "JAX_COORDINATOR_ADDRESS) or a SLURM job has several tasks; 'yes' always (Cloud TPU pod "
    "slices detect everything themselves); 'no' never.",
)  # fmt: skip
_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", os.path.join("~", ".cache", "tfjax", "jax"),
    "JAX's persistent compilation cache: a rerun or resume skips XLA compilation. "
    "$JAX_COMPILATION_CACHE_DIR wins; '' turns it off.",
)  # fmt: skip
flags.mark_flags_as_required(["config", "workdir"])


def _want_distributed() -> bool:
    if _DISTRIBUTED.value != "auto":
        return _DISTRIBUTED.value == "yes"
    if _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


class _OwnInfoOnly(std_logging.Filter):
    """Below WARNING, only tfjax's and this file's lines (Orbax logs every file it writes)."""

    def filter(self, record):
        return (
            record.levelno >= std_logging.WARNING
            or f"{os.sep}tfjax{os.sep}" in record.pathname
            or record.pathname == os.path.abspath(__file__)
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if logging.get_verbosity() <= logging.INFO:  # --verbosity=1 shows everything
        logging.get_absl_handler().addFilter(_OwnInfoOnly())
    import jax

    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR.value)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
        # Every program, even fast-compiling ones: small CPU runs start in seconds this way.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if _want_distributed():
        # CPU processes exchange data through gloo (accelerators use their own collectives).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
    logging.info(
        "Process %d of %d; %d local devices of %d (%s)", jax.process_index(),
        jax.process_count(), jax.local_device_count(), jax.device_count(), jax.default_backend(),
    )  # fmt: skip
    from tfjax import train

    result = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    if result["stopped_by"]:
        # Every process says so (each may be watched on its own); the status is the shell's
        # for a process ended by that signal, so a wrapper script sees the run did not finish.
        print(
            f"Stopped by {result['stopped_by']} at step {result['step']} of "
            f"{_CONFIG.value.num_train_steps}: checkpoint {result['step']} saved in "
            f"{result['checkpoints']}. Run the same command again to resume.",
            flush=True,
        )
        signum = {"SIGINT": signal.SIGINT}.get(result["stopped_by"], signal.SIGTERM)
        sys.exit(128 + signum)
    if jax.process_index() == 0:
        print(_summary(result), flush=True)


def _summary(result: dict) -> str:
    """The end-of-run report: final eval metrics and where everything was written."""
    evals = ", ".join(f"{k} {v:.4g}" for k, v in sorted(result["eval"].items()))
    workdir = result["workdir"]
    lines = [
        f"Done: step {result['step']}; eval {evals or '(none)'}",
        f"  workdir      {workdir}",
        f"  checkpoints  {result['checkpoints']}",
        f"  tensorboard  tensorboard --logdir {os.path.join(workdir, 'tensorboard')}",
        f"  curves       {result['curves']}",
        f"  metrics      {os.path.join(workdir, 'metrics.jsonl')}",
    ]
    if os.path.exists(os.path.join(workdir, "samples.jsonl")):
        lines.append(f"  samples      {os.path.join(workdir, 'samples.jsonl')}")
    return "\n".join(lines)


if __name__ == "__main__":
    app.run(main)
