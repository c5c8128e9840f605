r"""Compile time of the train step against depth (unrolled vs scanned layers), and the runner's
cold vs warm start with JAX's persistent compilation cache.

    .venv/bin/python benchmarks/compile_time.py [--depths=2,4,8,16,32] [--reps=2]
        [--parts=depth,cache] [--runner_config=configs/vit.py:tiny] [--tiny]

depth: the GPT-like decoder of contenders.py (d=512, 8 heads, F=2048,
V=8192, T=256, batch 4, float32, its config and AdamW) at each depth, `scan_layers` False and
True; the whole train step (`train_step` of tfjax.runner.setup.set_up, with its shardings and
donation) is traced and lowered (`.lower` on the abstract state and batch), then compiled by
XLA (`.compile()`), nothing executed. In-process and persistent caches are off; each
measurement builds a new model and a new jitted function (a new, untimed `set_up`). The
configurations run in rounds, each round every configuration once in a rotated order; medians
over rounds.

cache: `experiments/run.py --config=<runner_config>` launched in subprocesses, each with a
fresh workdir, twice in a row (cold, then warm) for each mode:
  runner     as shipped: no cache settings from outside; HOME and XDG_CACHE_HOME point at a
             fresh directory per pair, so the runner's default cache (~/.cache/tfjax/jax,
             its --compilation_cache_dir) starts empty
  env_cache  JAX_COMPILATION_CACHE_DIR=<fresh dir> and
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 in the environment: JAX's own
             settings, which the runner's flag sets too
Timed: the runner's own "First step (compilation included)" log line (the train step's
compilation plus one tiny step), the wall time from launch to that line, and the whole run.

Prints the tables and ratios (scanned L=32 / L=2; warm / cold) and writes
benchmarks/results/compile_time.json (or --out). --tiny: depths 1,2 of a toy model, one round.
"""

import os
import shutil
import statistics
import tempfile
import time

import contenders
import harness
from harness import log

SPEC = dict(width=512, heads=8, mlp=2048, vocab=8192, length=256, batch=4)
TINY_SPEC = dict(width=32, heads=4, mlp=64, vocab=128, length=16, batch=2)
SCAN_TARGET = 1.25  # scanned deepest / scanned shallowest compile time, at most
CACHE_TARGET = 3.0  # cold / warm first-step (compile) time, at least


def compile_once(spec, depth, scan):
    """(trace + lower seconds, XLA compile seconds) of one fresh train step."""
    decoder = dict(spec, kind="lm", layers=depth, max_len=spec["length"])
    exp = contenders.set_up_tfjax(decoder, scan_layers=scan)
    start = time.perf_counter()
    lowered = exp.train_step.lower(exp.abstract_state, exp.train_batch, exp.abstract_rng)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    return lower_s, time.perf_counter() - start


def depth_part(spec, depths, reps, log):
    configs = [(d, s) for d in depths for s in (False, True)]
    times = {c: [] for c in configs}
    for r in range(reps):
        for depth, scan in harness.rotated(configs, r):
            times[(depth, scan)].append(compile_once(spec, depth, scan))
            lo, co = times[(depth, scan)][-1]
            log(
                f"  round {r + 1}: L={depth:<3} {'scan' if scan else 'unrolled':8} "
                f"lower {lo:6.2f} s, compile {co:6.2f} s"
            )
    rows = {}
    for (depth, scan), t in times.items():
        rows[f"{depth}/{'scan' if scan else 'unrolled'}"] = dict(
            depth=depth,
            scan=scan,
            lower_s=statistics.median(x[0] for x in t),
            compile_s=statistics.median(x[1] for x in t),
            total_s=statistics.median(x[0] + x[1] for x in t),
            runs=t,
        )
    return rows


def launch(config, env, log):
    """Runs the runner once in a fresh workdir; returns its timings."""
    result = harness.launch_runner(config, env, log=log)
    del result["marked"]
    return result


def cache_part(config, modes, reps, log):
    base = dict(os.environ)
    for k in list(base):
        if k.startswith("JAX_COMPILATION_CACHE") or k.startswith("JAX_PERSISTENT_CACHE"):
            del base[k]
    # The real data and matplotlib caches, whatever HOME the child gets.
    base.setdefault("TFJAX_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
    base.setdefault("MPLCONFIGDIR", os.path.expanduser("~/.config/matplotlib"))
    runs = {m: {"cold": [], "warm": []} for m in modes}
    for r in range(reps):
        for mode in harness.rotated(modes, r):
            scratch = tempfile.mkdtemp(prefix="tfjax_cache_bench_")
            env = dict(base)
            if mode == "runner":
                env.update(HOME=scratch, XDG_CACHE_HOME=os.path.join(scratch, ".cache"))
            else:
                env.update(
                    JAX_COMPILATION_CACHE_DIR=os.path.join(scratch, "jax_cache"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                )
            for phase in ("cold", "warm"):
                result = launch(config, env, log)
                runs[mode][phase].append(result)
                log(
                    f"  round {r + 1}: {mode:9} {phase}: first step {result['first_step_s']:5.1f}"
                    f" s, launch to first step {result['to_first_step_s']:5.1f} s, "
                    f"whole run {result['total_s']:5.1f} s"
                )
            entries = 0
            for _, _, files in os.walk(scratch):
                entries += len(files)
            runs[mode].setdefault("cache_files", []).append(entries)
            shutil.rmtree(scratch, ignore_errors=True)
    out = {}
    for mode, r in runs.items():
        med = {
            phase: {k: statistics.median(x[k] for x in r[phase]) for k in r[phase][0]}
            for phase in ("cold", "warm")
        }
        out[mode] = dict(runs=r, median=med)
    return out


def main():
    parser = harness.parser(__doc__, "compile_time")
    parser.add_argument("--depths", default=None, help="default 2,4,8,16,32 (tiny: 1,2)")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 2, tiny 1)")
    parser.add_argument("--parts", default="depth,cache")
    parser.add_argument("--cache_modes", default="runner,env_cache")
    parser.add_argument("--runner_config", default="configs/vit.py:tiny")
    args = parser.parse_args()
    parts = args.parts.split(",")
    depths = [int(x) for x in (args.depths or ("1,2" if args.tiny else "2,4,8,16,32")).split(",")]
    reps = args.reps or (1 if args.tiny else 2)
    spec = TINY_SPEC if args.tiny else SPEC

    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # every compile is a real one

    info = dict(harness.machine("jax", "jaxlib"), backend=jax.default_backend())
    log("compile time; " + ", ".join(f"{k} {v}" for k, v in info.items()))
    result = dict(benchmark="compile_time", tiny=args.tiny, machine=info)
    if "depth" in parts:
        log(f"\n[depth] train step of a decoder {spec}, {reps} round(s)")
        rows = depth_part(spec, depths, reps, log)
        head = f"{'scanned lower':>13} {'compile':>8} {'total':>7}   {'unrolled/scan':>13}"
        log(f"\n  {'layers':>6} {'unrolled lower':>14} {'compile':>8} {'total':>7}   {head}")
        for d in depths:
            u, s = rows[f"{d}/unrolled"], rows[f"{d}/scan"]
            log(
                f"  {d:>6} {u['lower_s']:>14.2f} {u['compile_s']:>8.2f} {u['total_s']:>7.2f}   "
                f"{s['lower_s']:>13.2f} {s['compile_s']:>8.2f} {s['total_s']:>7.2f}   "
                f"{u['total_s'] / s['total_s']:>13.2f}"
            )
        lo, hi = min(depths), max(depths)
        ratios = {
            f"scan L={hi}/L={lo}": rows[f"{hi}/scan"]["total_s"] / rows[f"{lo}/scan"]["total_s"],
            f"unrolled L={hi}/L={lo}": rows[f"{hi}/unrolled"]["total_s"]
            / rows[f"{lo}/unrolled"]["total_s"],
        }
        for k, v in ratios.items():
            target = SCAN_TARGET if k.startswith("scan") and not args.tiny else None
            log(f"  {harness.ratio_line(f'{k} (lower + compile)', v, digits=2, at_most=target)}")
        result["depth"] = dict(spec=spec, rows=rows, ratios=ratios)
    if "cache" in parts:
        modes = args.cache_modes.split(",")
        log(
            f"\n[cache] experiments/run.py --config={args.runner_config}, fresh workdirs, "
            f"{reps} round(s) of cold + warm per mode"
        )
        if not args.tiny:
            launch(args.runner_config, dict(os.environ), log)  # untimed: data, page cache
        runs = cache_part(args.runner_config, modes, reps, log)
        log(
            f"\n  {'mode':10} {'first step cold s':>17} {'warm s':>7} {'cold/warm':>9}   "
            f"{'to first step cold s':>20} {'warm s':>7} {'cold/warm':>9}"
        )
        ratios = {}
        for mode, r in runs.items():
            c, w = r["median"]["cold"], r["median"]["warm"]
            ratio = c["first_step_s"] / max(w["first_step_s"], 0.05)
            ratio_wall = c["to_first_step_s"] / w["to_first_step_s"]
            ratios[mode] = dict(first_step=ratio, to_first_step=ratio_wall)
            log(
                f"  {mode:10} {c['first_step_s']:>17.1f} {w['first_step_s']:>7.1f} "
                f"{ratio:>9.2f}   {c['to_first_step_s']:>20.1f} {w['to_first_step_s']:>7.1f} "
                f"{ratio_wall:>9.2f}"
            )
        for mode, r in ratios.items():
            target = CACHE_TARGET if mode == "runner" and not args.tiny else None
            name = f"{mode} cold/warm first step (compile)"
            log(f"  {harness.ratio_line(name, r['first_step'], digits=2, at_least=target)}")
        result["cache"] = dict(config=args.runner_config, modes=runs, ratios=ratios)
    info["load_average_end"] = os.getloadavg()
    log()
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
