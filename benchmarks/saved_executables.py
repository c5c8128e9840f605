r"""The runner's start-up with its programs saved ahead of time (experiments/compile.py --save,
config.compiled_dir: the state's initialisation, the train and eval steps) against compiling
them at start-up, on this host's CPU.

    .venv/bin/python benchmarks/saved_executables.py [--config=configs/lm.py] [--reps=3] [--tiny]

First, untimed: `experiments/compile.py --config=<config> --topology=cpu:1 --save=DIR` (its
wall time is reported), and one launch of the runner (the dataset prepared, files in the page
cache). Then `experiments/run.py --config=<config>` is launched in subprocesses, each with a
fresh workdir, in rounds of both arms in rotated order:
  compile  the runner as shipped, its persistent compilation cache off
           (--compilation_cache_dir=''): the programs are traced, lowered and compiled
  saved    the same with --config.compiled_dir=DIR: they are loaded
Each run is two train steps (num_train_steps=2, then an evaluation of one batch, no samples).
Timed: the launch to the runner's "First step (compilation included)" log line (imports, the
data, set-up with the loading, the state's initialisation, the first step), that line's own
figure (the first step alone: the compile arm compiles the train step there), and the whole run
(with the evaluation, whose step is saved too, and the final checkpoint). Medians over rounds;
the ratios compile / saved.

Prints the table and ratios and writes benchmarks/results/saved_executables.json (or --out).
--tiny: configs/lm.py:tiny, one round, without the untimed launch (a smoke run times nothing).
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness
from harness import ROOT, log

LOADED = "program: loaded from"
# Fields outside the programs (tfjax.runner.executables.NOT_IN_PROGRAM): one eval batch, no
# samples. Two steps with a one-step warm-up shape the schedule: compile.py gets them too.
RUN_ONLY = ("--config.eval_steps=1", "--config.decode.num_samples=0")
PROGRAM = ("--config.num_train_steps=2", "--config.optim.warmup_steps=1")


def child_env() -> dict:
    """The environment of every child: one CPU device (the XLA_FLAGS of this process without
    a simulated device count), no persistent compilation cache from outside."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")):
            del env[k]
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    env["PYTHONPATH"] = ROOT
    env.setdefault("TFJAX_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
    return env


def save(config, directory, env):
    """Runs compile.py --save for one CPU device; returns its wall seconds."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments/compile.py"),
        f"--config={config}",
        *PROGRAM,
        "--topology=cpu:1",
        "--steps=train,eval",
        f"--save={directory}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or "saved to" not in proc.stdout:
        log(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode})")
    return time.perf_counter() - start


def launch(config, env, extra=()):
    """Runs the runner once in a fresh workdir; returns its timings and how many programs it
    loaded."""
    result = harness.launch_runner(
        config, env, ("--compilation_cache_dir=", *PROGRAM, *RUN_ONLY, *extra), marker=LOADED
    )
    result["loaded"] = result.pop("marked")
    return result


def main():
    parser = harness.parser(__doc__, "saved_executables")
    parser.add_argument("--config", default=None, help="default configs/lm.py (tiny: :tiny)")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 3, tiny 1)")
    args = parser.parse_args()
    config = args.config or ("configs/lm.py:tiny" if args.tiny else "configs/lm.py")
    reps = args.reps or (1 if args.tiny else 3)
    env = child_env()
    info = harness.machine("jax", "jaxlib")
    log("saved executables; " + ", ".join(f"{k} {v}" for k, v in info.items()))
    scratch = tempfile.mkdtemp(prefix="tfjax_saved_")
    directory = os.path.join(scratch, "saved")
    try:
        save_s = save(config, directory, env)
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        log(
            f"\nexperiments/compile.py --config={config} --topology=cpu:1 --save=DIR: "
            f"{save_s:.1f} s, {size / 2**20:.1f} MiB written"
        )
        arms = {"compile": (), "saved": (f"--config.compiled_dir={directory}",)}
        if not args.tiny:
            launch(config, env)  # untimed: the dataset prepared, the page cache warm
        runs = {arm: [] for arm in arms}
        log(f"\n[start-up] experiments/run.py --config={config}, fresh workdirs, {reps} round(s)")
        for r in range(reps):
            for arm in harness.rotated(list(arms), r):
                result = launch(config, env, arms[arm])
                runs[arm].append(result)
                log(
                    f"  round {r + 1}: {arm:8} launch to first step "
                    f"{result['to_first_step_s']:5.1f} s, first step {result['first_step_s']:5.1f}"
                    f" s, whole run {result['total_s']:5.1f} s, programs loaded {result['loaded']}"
                )
        if any(x["loaded"] != 3 for x in runs["saved"]) or any(
            x["loaded"] for x in runs["compile"]
        ):
            raise RuntimeError("the saved arm did not load its 3 programs (or the other did)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    keys = ("to_first_step_s", "first_step_s", "total_s")
    med = {arm: {k: statistics.median(x[k] for x in r) for k in keys} for arm, r in runs.items()}
    log(f"\n  {'arm':8} {'launch to first step s':>22} {'first step s':>12} {'whole run s':>11}")
    for arm, m in med.items():
        log(
            f"  {arm:8} {m['to_first_step_s']:>22.2f} {m['first_step_s']:>12.2f} "
            f"{m['total_s']:>11.2f}"
        )
    c, s = med["compile"], med["saved"]
    ratios = {
        "compile/saved launch to first step": c["to_first_step_s"] / s["to_first_step_s"],
        "compile/saved whole run": c["total_s"] / s["total_s"],
    }
    saved_s = {
        "launch to first step": c["to_first_step_s"] - s["to_first_step_s"],
        "whole run": c["total_s"] - s["total_s"],
    }
    for name, value in ratios.items():
        log(f"  {harness.ratio_line(name, value, digits=2)}")
    log("  seconds saved: " + ", ".join(f"{k} {v:.1f} s" for k, v in saved_s.items()))
    info["load_average_end"] = os.getloadavg()
    log()
    harness.write_json(
        args.out,
        dict(
            benchmark="saved_executables",
            tiny=args.tiny,
            machine=info,
            config=config,
            save_s=save_s,
            saved_bytes=size,
            runs=runs,
            median=med,
            ratios=ratios,
            seconds_saved=saved_s,
        ),
    )


if __name__ == "__main__":
    main()
