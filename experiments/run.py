r"""Runs an experiment: a config file, a workdir, optional overrides.

    python experiments/run.py --config=configs/vit.py:digits --workdir=/tmp/vit_digits \
        [--config.batch_size=256 --config.mesh.fsdp=2 ...]

The config is locked: a misspelt override or a value of the wrong type is an error naming the
key. Every field's value, the paths, the dataset config and the model (built abstractly on the
batches the run will have) are checked before any data or model work and before JAX starts a
backend (tfjax.runner.setup.check_run); then the mesh's sizes and the batch sizes against the
devices. These errors are a line or two and exit with status 2. Running the same command again
resumes from the workdir's newest checkpoint.

SIGTERM or SIGINT (preemption, Ctrl-C) finish the current step, save a checkpoint and exit
with status 143 or 130 (128 + the signal) and a line saying where to resume. A non-finite loss,
a workdir another run owns, a checkpoint that does not fit, cannot be restored or may not be
read, a save that cannot be written (a full disk) and a record whose label has no logit exit
with status 1 and their message alone (see tfjax.runner.train, tfjax.runner.workdirs,
tfjax.runner.checkpoint, tfjax.data.loader).

Many hosts: with --coordinator_address, --num_processes and --process_id (or JAX's own
environment: JAX_COORDINATOR_ADDRESS, or a detected SLURM / Cloud TPU cluster), every process
calls jax.distributed.initialize() first and then loads only its part of each batch.

No multi-process wait is unbounded. At start-up every process waits at most --distributed_timeout
seconds for all of them to connect, then exits (non-zero) naming the processes that did not (and
waits as long at exit for the others to finish). Once running, a process that dies (SIGKILL, a
lost host) stops sending heartbeats: after --heartbeat_timeout seconds JAX's coordination service
names it and ends every other process with an error, wherever it waits (a collective, a
checkpoint barrier). A killed process can end the others sooner, when its death cuts a
collective's transfer short: the collective library (gloo on CPU) then aborts them with its own
error, which names no process. Orbax's background commit waits at most
config.checkpoint.timeout_s for the other processes.
"""

import difflib
import os
import signal
import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

# The checkout's root, so that `python experiments/run.py` finds tfjax without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfjax.runner import startup  # noqa: E402 - imports no JAX

startup.choose_platform()  # before anything imports JAX (the config files' loading may)

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
    "distributed",
    "auto",
    ["auto", "yes", "no"],
    "Call jax.distributed.initialize(): 'auto' when a coordinator is given (flag or "
    "JAX_COORDINATOR_ADDRESS) or a SLURM job has several tasks; 'yes' always (Cloud TPU pod "
    "slices detect everything themselves); 'no' never.",
)
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout",
    300,
    "Seconds each process waits at start-up for all --num_processes processes to connect "
    "(then it exits naming the processes that did not), and at exit for the others to finish.",
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout",
    100,
    "Seconds without a heartbeat after which a process counts as dead: JAX's coordination "
    "service then ends every other process with an error naming it.",
)
_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    os.path.join("~", ".cache", "tfjax", "jax"),
    "JAX's persistent compilation cache: a rerun or resume skips XLA compilation. "
    "$JAX_COMPILATION_CACHE_DIR wins; '' turns it off.",
)
_KEEP_FREED_MEMORY = flags.DEFINE_bool(
    "keep_freed_memory",
    True,
    "CPU runs: glibc's malloc keeps freed memory for reuse, so XLA's per-step temporaries are "
    "not page-faulted in anew every step (see tfjax.runner.host_memory; GPT-2 small: a 0.90x "
    "step).",
)
flags.mark_flags_as_required(["config", "workdir"])


def _want_distributed() -> bool:
    if _DISTRIBUTED.value != "auto":
        return _DISTRIBUTED.value == "yes"
    if _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def _usage_error(message: str):
    """A mistake on the command line: its message alone, status 2 (as absl's usage errors)."""
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: {message}\n")
    sys.exit(2)


def _parse_flags(argv):
    """absl's flag parsing, with a bad --config or --config.<key> a short error (status 2).

    ml_collections raises a KeyError or AttributeError (with a long traceback) for an override
    of a key the config lacks, and returns a config that raises on first use for a missing file.
    """
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        lines = str(e).rstrip().splitlines() or [""]
        message, last = lines[0], lines[-1]
        if message.endswith("Error whilst parsing config file:") and last.startswith("ValueError"):
            # get_config refused its argument (an unknown preset) with a message that says what
            # is allowed; the traceback around it adds nothing.
            message = message.replace("Error whilst parsing config file:", last.split(": ", 1)[1])
        _usage_error(message)
    except (AttributeError, KeyError, IndexError, OSError):
        message = _bad_override(argv)
        if message is None:
            raise
        _usage_error(message)
    path = config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]
    if not os.path.isfile(path):
        _usage_error(f"--config={path}: no such file")
    return rest


def _bad_override(argv) -> str | None:
    """What is wrong with the first --config.<key>=... of `argv` that the config lacks."""
    spec, keys = None, []
    for i, arg in enumerate(argv):
        name = arg.lstrip("-").partition("=")[0] if arg.startswith("-") else ""
        if name == "config":
            spec = arg.partition("=")[2] if "=" in arg else argv[i + 1]
        elif name.startswith("config."):
            keys.append(name.removeprefix("config."))
    if spec is None:
        return None
    if not os.path.isfile(spec.partition(":")[0]):
        return f"--config={spec}: no such file"
    from tfjax.runner import setup

    config = setup.load_config(spec)
    fields = _field_paths(config)
    for key in keys:
        node, path = config, []
        for part in key.split("."):
            if not isinstance(node, ml_collections.ConfigDict):
                return (
                    f"--config.{key}: {'.'.join(path)} is a value ({type(node).__name__}), "
                    "not a group of fields"
                )
            if part not in node:
                near = difflib.get_close_matches(key, fields, n=2, cutoff=0.8)
                group = f"config.{'.'.join(path)}" if path else "the config"
                hint = (
                    f"did you mean {' or '.join(near)}?"
                    if near
                    else f"the fields of {group}: {', '.join(node)}"
                )
                return f"--config.{key}: {spec} has no field {key}; {hint}"
            node, path = node[part], [*path, part]
    return None


def _field_paths(config, prefix="") -> list[str]:
    """Every field of `config` as a dotted path (groups and their fields)."""
    paths = []
    for key, value in config.items():
        paths.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict):
            paths += _field_paths(value, f"{prefix}{key}.")
    return paths


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")

    from tfjax.runner import checks, setup  # start no JAX backend

    try:  # before any work: here a bad field is a line, not a traceback after data work
        checked = setup.check_run(_CONFIG.value, _WORKDIR.value)
    except (ValueError, OSError) as e:
        _usage_error(str(e))
    startup.show_own_info_only()
    from tfjax.runner import host_memory

    if _KEEP_FREED_MEMORY.value:  # before JAX starts its backend threads
        logging.info("Keep freed host memory: %s", host_memory.keep_freed_memory())
    import jax

    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR.value)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
        # Every program, even fast-compiling ones: small CPU runs start in seconds this way.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if _want_distributed():
        from tfjax.runner import distributed

        for flag in (_DISTRIBUTED_TIMEOUT, _HEARTBEAT_TIMEOUT):
            if flag.value < 1:
                _usage_error(f"--{flag.name} must be at least 1 (seconds), got {flag.value}")
        distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
            timeout_s=_DISTRIBUTED_TIMEOUT.value,
            heartbeat_timeout_s=_HEARTBEAT_TIMEOUT.value,
        )
    logging.info(
        "Process %d of %d; %d local devices of %d (%s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.default_backend(),
    )
    from tfjax.data import files, loader
    from tfjax.runner import checkpoint, train, workdirs

    try:
        result = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value, checked=checked)
    except (checks.ConfigError, files.BadRowsError) as e:  # found before any training
        _usage_error(str(e))
    except (
        workdirs.WorkdirBusyError,
        checkpoint.CheckpointError,  # mismatch, unusable, permission, write, restore_step
        loader.LabelError,
        FloatingPointError,
    ) as e:
        # Errors whose message says what happened and what to do: no traceback around them.
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: {type(e).__name__}: {e}\n")
        sys.exit(1)
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
    app.run(main, flags_parser=_parse_flags)
