r"""Every paper-scale preset compiled for the TPU slice it names (and two for a GPU host): fit,
memory, FLOPs, collectives (all kinds summed; in parentheses the share XLA:TPU does as collective
matmuls: FSDP's weight gathers and gradient reduce-scatters, see tfjax.runner.aot).

    .venv/bin/python benchmarks/compile_presets.py [--only=lm.py:gpt2-xl,...] [--out=FILE]

Each preset runs `experiments/compile.py` in its own process (libtpu's TPU compiler or XLA's
GPU compiler, on this CPU host; no TPU or GPU is used or needed) and the results go to a
Markdown table on stdout (docs/scaling.md's) and, for a run of them all, to
benchmarks/results/compile_presets.json (or --out). Nothing here is timed on TPU hardware:
"ideal step" is the model's FLOPs at the chips' peak bf16 rate, a lower bound on the step time.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import harness
from harness import ROOT

# (config, the slice its docstring names)
PRESETS = [
    ("configs/translate.py:base", "v5e:2x2"),
    ("configs/translate.py:big", "v5e:2x4"),
    ("configs/mlm.py:bert-base", "v5e:2x2"),
    ("configs/mlm.py:bert-large", "v5e:2x4"),
    ("configs/lm.py:gpt2-small", "v5e:2x2"),
    ("configs/lm.py:gpt2-medium", "v5p:2x2x2"),
    ("configs/lm.py:gpt2-large", "v5p:4x4x2"),
    ("configs/lm.py:gpt2-xl", "v5p:4x4x4"),
    ("configs/lm.py:modern-small", "v5p:2x2x1"),
    ("configs/vit.py:imagenet", "v4:2x2x2"),
    # The same programs for one GPU host (XLA's GPU compiler; fit against JAX's 75% share).
    ("configs/lm.py:gpt2-medium", "h100:8"),
    ("configs/vit.py:imagenet", "h100:8"),
]
GiB = 2**30


def compile_one(config: str, topology: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "experiments", "compile.py"),
                f"--config={config}",
                f"--topology={topology}",
                f"--json={out}",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        wall = time.perf_counter() - start
        print(proc.stdout, flush=True)
        if not os.path.exists(out):  # the compiler failed (exit 3): a row that says so
            error = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            print(error, flush=True)
            return {
                "config": config,
                "topology": topology,
                "error": error[:300],
                "exit_code": proc.returncode,
                "fits": False,
                "wall_s": 0.0,
            }
        with open(out) as f:
            report = json.load(f)
    report["wall_s"] = wall
    report["exit_code"] = proc.returncode
    return report


def row(r: dict) -> str:
    if "error" in r:
        return f"| `{r['config']}` | {r['topology']} | exit {r['exit_code']}: {r['error']} |"
    train = next(s for s in r["steps"] if s["name"] == "train")
    hbm = r["hbm_bytes"]
    peak = f"{train['peak_bytes'] / GiB:.1f} / {hbm / GiB:.1f} ({train['peak_bytes'] / hbm:.0%})"
    coll = sum(train["collectives"].values()) / GiB
    windowed = sum(v for k, v in train["collectives"].items() if "collective matmul" in k) / GiB
    coll = f"{coll:.2f} GiB" + (f" ({windowed:.2f} collective matmul)" if windowed else "")
    compile_s = sum(s["compile_s"] for s in r["steps"])
    steps = ", ".join(s["name"] for s in r["steps"])
    fits = "yes" if r["fits"] else "**no**"
    return (
        f"| `{r['config']}` | {r['topology']} | {r['num_params'] / 1e6:.0f}M | "
        f"{r['mesh']} | {train['compile_s']:.0f} s ({steps}: {compile_s:.0f} s) | {peak} | "
        f"{fits} | {1e3 * r['ideal_step_s']:.1f} ms | {coll} |"
    )


def main():
    parser = harness.parser(__doc__, "compile_presets", tiny=False)
    parser.add_argument("--only", default="", help="comma-separated configs (lm.py:gpt2-xl)")
    args = parser.parse_args()
    wanted = [w for w in args.only.split(",") if w]
    todo = [(c, t) for c, t in PRESETS if not wanted or any(c.endswith(w) for w in wanted)]
    start = time.perf_counter()
    reports = [compile_one(c, t) for c, t in todo]
    print(
        "| config | slice | params | mesh | train compile (all steps) | train peak GiB / HBM | "
        "fits | ideal train step | train collectives |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(row(r))
    print(f"\n{len(reports)} presets in {time.perf_counter() - start:.0f} s")
    if not wanted:  # a partial run leaves the record of a whole one as it is
        harness.write_json(args.out, reports)
    return 0 if all(r["fits"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
