"""Loader throughput of each shipped (embedded) experiment against its training step.

For each embedded dataset config it prepares the data (into --data_dir, reused, or a temporary
directory), builds the training loader (shuffle, augmentation, packing as configured), skips
the start-up and warm-up batches, then times --batches batches. It prints rows (examples or
packed rows) per second, real tokens per second for text, and the start-up time.

The step side: pass the measured training step time of each experiment at the same batch
size with --step_ms digits=26.1,pydoc_lm=442 (from benchmarks/train_step.py or the runner's
log), or call `step_ms(step_fn, batch)` from code, and the ratio loader rate / step rate is
printed; the input pipeline must deliver at least 5x what the step consumes.

Writes benchmarks/results/data_throughput.json (or --out).

    .venv/bin/python benchmarks/data_throughput.py [--batches 200] [--batch_size 0]
        [--step_ms digits=26.1,...] [--num_workers 0] [--data_dir DIR] [--out FILE]
"""

import os
import tempfile
import time

import harness
import jax
import numpy as np

import tfjax.data as td

# name -> (dataset config, batch size) of the shipped experiments (configs/vit.py:digits,
# lm.py:pydoc, mlm.py:pydoc, translate.py:demo use these datasets' defaults).
EXPERIMENTS = {
    "digits": ({"name": "digits"}, 64),
    "pydoc_lm": ({"name": "pydoc"}, 32),
    "pydoc_mlm": ({"name": "pydoc", "task": "mlm"}, 32),
    "numbers_translate": ({"name": "numbers_translate"}, 64),
}
REQUIRED_RATIO = 5.0


def loader_rate(config, *, batch_size, data_dir, num_batches, warmup=10):
    """Times `num_batches` batches of the training loader after `warmup` batches."""
    start = time.perf_counter()
    with td.make_loader(
        config,
        split=td.resolve_config(config).train_split,
        batch_size=batch_size,
        seed=0,
        shuffle=True,
        num_epochs=None,
        data_dir=data_dir,
    ) as loader:
        for _ in range(warmup):
            next(loader)
        startup = time.perf_counter() - start
        tokens = 0
        start = time.perf_counter()
        for _ in range(num_batches):
            batch = next(loader)
            key = "inputs" if "inputs" in batch else "tokens"
            tokens += int(np.count_nonzero(batch[key])) if key in batch else 0
        seconds = time.perf_counter() - start
    return {
        "rows_per_s": num_batches * batch_size / seconds,
        "batches_per_s": num_batches / seconds,
        "tokens_per_s": tokens / seconds,
        "startup_s": startup,
    }


def step_ms(step_fn, batch, repeats=20):
    """Milliseconds per call of a (jitted) training step `step_fn(batch)`, after compiling."""
    jax.block_until_ready(step_fn(batch))
    start = time.perf_counter()
    for _ in range(repeats):
        out = step_fn(batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1000


def main():
    parser = harness.parser(__doc__, "data_throughput", tiny=False)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=0, help="0: each experiment's own")
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--step_ms", default="", help="name=ms,... training step times")
    parser.add_argument("--only", default=",".join(EXPERIMENTS))
    parser.add_argument("--data_dir", default=None)
    args = parser.parse_args()
    steps = {k: float(v) for k, v in (kv.split("=") for kv in args.step_ms.split(",") if kv)}
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="tfjax_data_")

    print(
        f"{os.cpu_count()} CPUs, workers {args.num_workers}, "
        f"{args.batches} batches after warm-up; data in {data_dir}"
    )
    print(
        f"{'experiment':<18} {'batch':>5} {'rows/s':>9} {'batch ms':>9} {'tokens/s':>10} "
        f"{'start s':>8} {'step ms':>8} {'ratio':>6}"
    )
    results = {}
    for name in args.only.split(","):
        config, batch_size = EXPERIMENTS[name]
        config = {**config, "num_workers": args.num_workers}
        batch_size = args.batch_size or batch_size
        td.prepare(config["name"], data_dir)
        r = loader_rate(config, batch_size=batch_size, data_dir=data_dir, num_batches=args.batches)
        step = steps.get(name)
        r["step_ms"] = step
        r["ratio"] = r["batches_per_s"] * step / 1000 if step else None
        results[name] = r
        ratio = f"{r['ratio']:6.1f}" if step else f"{'-':>6}"
        print(
            f"{name:<18} {batch_size:>5} {r['rows_per_s']:9.0f} {1000 / r['batches_per_s']:9.2f} "
            f"{r['tokens_per_s']:10.0f} {r['startup_s']:8.2f} "
            f"{step if step else '-':>8} {ratio}"
        )
    short = [
        n for n, r in results.items() if r["ratio"] is not None and r["ratio"] < REQUIRED_RATIO
    ]
    if short:
        print(f"below the required {REQUIRED_RATIO}x: {', '.join(short)}")
    harness.write_json(args.out, results)


if __name__ == "__main__":
    main()
