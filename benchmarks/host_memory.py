r"""tfjax's train step with glibc's malloc defaults vs tfjax.host_memory.keep_freed_memory().

    .venv/bin/python benchmarks/host_memory.py [--models=gpt2,decoder,vit] [--rounds=N] [--tiny]

The models, batches and step are those of train_step_vs_torch.py's tfjax contender. Two
processes per model run the same step, one with glibc's defaults, one keeping freed memory
(as experiments/run.py does), driven one step at a time in rotated rounds; the tables show
median step times, page faults per step and the peak resident memory of each process.
Writes benchmarks/results/host_memory.json (or --out).
"""

import argparse
import copy
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_step_vs_torch as bench  # noqa: E402 (the worker processes and the models)

SETTINGS = ("glibc", "keep")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,decoder,vit")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    parser.add_argument(
        "--out", default=os.path.join(bench.ROOT, "benchmarks/results", "host_memory.json")
    )
    args = parser.parse_args()
    sizes = bench.TINY if args.tiny else bench.MODELS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in sizes:
            parser.error(f"unknown model {m!r}; allowed: {list(sizes)}")
    print(f"tfjax train step, malloc {' vs '.join(SETTINGS)}; load average {os.getloadavg()}")
    results = {}
    for m in models:
        workers = {}
        try:
            for setting in SETTINGS:
                worker_args = copy.copy(args)
                worker_args.malloc = setting
                workers[setting] = bench.Worker("tfjax", m, worker_args)
                reply = workers[setting].ask()
                if "error" in reply:
                    raise RuntimeError(f"{m} ({setting}) did not start: {reply['error']}")
            steps = {s: [] for s in SETTINGS}
            for r in range(args.rounds):
                for setting in SETTINGS[r % 2 :] + SETTINGS[: r % 2]:
                    reply = workers[setting].ask("step")
                    if "error" in reply:
                        raise RuntimeError(f"{m} ({setting}) failed: {reply['error']}")
                    steps[setting].append(reply)
        finally:
            for w in workers.values():
                w.close()
        row = {
            s: dict(
                median_s=statistics.median(x["s"] for x in steps[s]),
                page_faults=statistics.median(x["page_faults"] for x in steps[s]),
                max_rss_gib=max(x["max_rss_kib"] for x in steps[s]) / 2**20,
                step_s=[x["s"] for x in steps[s]],
            )
            for s in SETTINGS
        }
        row["ratio keep/glibc"] = row["keep"]["median_s"] / row["glibc"]["median_s"]
        results[m] = row
        print(f"\n[{m}] {args.rounds} rounds after {args.warmup} warm-up steps")
        print(f"  {'malloc':8} {'median ms':>10} {'page faults/step':>17} {'peak RSS GiB':>13}")
        for s in SETTINGS:
            print(f"  {s:8} {1e3 * row[s]['median_s']:>10.1f} {row[s]['page_faults']:>17,.0f} "
                  f"{row[s]['max_rss_gib']:>13.2f}")  # fmt: skip
        print(f"  step time keep/glibc = {row['ratio keep/glibc']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="host_memory", tiny=args.tiny, results=results), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
