r"""tfjax's train step with glibc's malloc defaults vs tfjax.runner.host_memory.keep_freed_memory().

    .venv/bin/python benchmarks/host_memory.py [--models=gpt2,decoder,vit] [--rounds=N] [--tiny]

The models, batches and step are those of contenders.py's tfjax contender. Two processes per
model run the same step, one with glibc's defaults, one keeping freed memory (as
experiments/run.py does), driven one step at a time in rotated rounds by
harness.time_processes; the tables show median step times, page faults per step and the peak
resident memory of each process. Writes benchmarks/results/host_memory.json (or --out).
"""

import os
import statistics

import contenders
import harness

SETTINGS = ("glibc", "keep")


def main():
    parser = harness.parser(__doc__, "host_memory")
    parser.add_argument("--models", default="gpt2,decoder,vit")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    args = parser.parse_args()
    sizes = contenders.TINY if args.tiny else contenders.MODELS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in sizes:
            parser.error(f"unknown model {m!r}; allowed: {list(sizes)}")
    print(f"tfjax train step, malloc {' vs '.join(SETTINGS)}; load average {os.getloadavg()}")
    results = {}
    for m in models:
        print(f"\n[{m}] {args.rounds} rounds after {args.warmup} warm-up steps")
        # The same tfjax contender, its malloc setting per process.
        commands = {
            s: contenders.command(
                "tfjax", m, warmup=args.warmup, threads=args.threads, malloc=s, tiny=args.tiny
            )
            for s in SETTINGS
        }
        r = harness.time_processes(commands, args.rounds)
        failed = [k for k in r if k.endswith("_error")]
        if failed:
            raise RuntimeError(f"{m}: {failed[0][: -len('_error')]} did not start: {r[failed[0]]}")
        row = {
            s: dict(
                median_s=r["median_s"][s],
                page_faults=statistics.median(r["page_faults"][s]),
                max_rss_gib=r["max_rss_gib"][s],
                step_s=r["step_s"][s],
            )
            for s in SETTINGS
        }
        row["ratio keep/glibc"] = row["keep"]["median_s"] / row["glibc"]["median_s"]
        results[m] = row
        print(f"  {'malloc':8} {'median ms':>10} {'page faults/step':>17} {'peak RSS GiB':>13}")
        for s in SETTINGS:
            print(
                f"  {s:8} {1e3 * row[s]['median_s']:>10.1f} {row[s]['page_faults']:>17,.0f} "
                f"{row[s]['max_rss_gib']:>13.2f}"
            )
        print(f"  step time keep/glibc = {row['ratio keep/glibc']:.3f}")
    harness.write_json(
        args.out, dict(**harness.header("host_memory", args, "jax"), results=results)
    )


if __name__ == "__main__":
    main()
