r"""The largest train batch that fits a TPU slice, and the memory each extra row costs, compiled
from this CPU host (libtpu's compiler; no TPU is used).

    .venv/bin/python benchmarks/batch_fit.py --config=configs/lm.py:modern-small \
        --topology=v5p:2x2x2 --set=model.variant=llama-3.1-8b --set=model.vocab_size=128256 \
        [--rows=4] [--max_rows=256] [--set=loss.chunks=8 ...] [--tiny] [--out=FILE]

Rows are per data-parallel chip (the config's batch_size is rows x the data-parallel devices).
The config's train step (only it) is compiled by `tfjax.runner.aot.compile_experiment`, the
path of experiments/compile.py, at --rows and 2 x --rows: the difference of the two peaks
over the rows added is the memory per extra row. Then the largest batch that fits is found by
bisection over the rows, starting where the slope says HBM runs out: a batch fits when the
compiler accepts it (libtpu refuses a program over HBM; tfjax.runner.aot), which is the
verdict reported, with XLA's peak and the sum of every buffer (arguments + outputs - donated
+ temporaries) beside it where they differ. Each compile is one line; the last lines say the
slope and the largest batch (or that --max_rows fits).

Results go to benchmarks/results/batch_fit.json (or --out). --tiny compiles the tiny LM with a
2M-token vocabulary at T=256 on v5e:2x2 (14 rows fit), for a smoke run: from 7 and 14 rows the
slope's first guess, 15, is the first that does not fit, so three compiles find it.
"""

import os
import sys
import time

# Compile-only: the host computes nothing, and must not try to start a TPU backend of its own.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness  # noqa: E402
from harness import ROOT, log  # noqa: E402

from tfjax import sharding  # noqa: E402
from tfjax.runner import aot, chips, setup  # noqa: E402

GiB = 2**30
TINY = dict(  # a few rows of a 2M-token vocabulary's logits fill a v5e chip (~1 GiB a row)
    config="configs/lm.py:tiny",
    topology="v5e:2x2",
    sets=[
        "model.vocab_size=2097152",
        "dataset.seq_len=256",
        "dtype=bfloat16",
        "model.scan_layers=True",
    ],
    rows=7,  # past the peak's flat start (1 and 2 rows peak alike), where the slope is true
    max_rows=16,
)


def load(spec: str, sets: list[str]):
    """The config of `spec` with --set key=value fields, each parsed as the field's type (as
    --config.key=value does); an unknown key or a bad value is an error naming it."""
    config = setup.load_config(os.path.join(ROOT, spec))
    with config.unlocked():
        for item in sets:
            key, sep, text = item.partition("=")
            if not sep:
                raise SystemExit(f"--set={item}: expected key=value")
            *parents, leaf = key.split(".")
            node = config
            try:
                for p in parents:
                    node = node[p]
                kind = node.get_type(leaf)
            except (KeyError, AttributeError):
                raise SystemExit(f"--set={item}: the config has no field {key!r}") from None
            try:
                node[leaf] = text.lower() == "true" if kind is bool else kind(text)
            except (TypeError, ValueError) as e:
                raise SystemExit(f"--set={item}: {e}") from None
    return config


def data_parallel_devices(config, devices) -> int:
    mesh = sharding.make_mesh(config.mesh, devices)
    return sharding.data_parallel_size(mesh, sharding.check_rules(config.logical_axis_rules))


def measure(config, rows: int, dp: int, devices, topology: str, label: str = "") -> dict:
    """Compiles the config's train step at `rows` per data-parallel chip: record()'s row."""
    with config.unlocked():
        config.batch_size = config.eval_batch_size = rows * dp
    start = time.perf_counter()
    (train,) = aot.compile_experiment(config, devices, topology=topology, steps=("train",)).steps
    return record(rows, train, time.perf_counter() - start, label)


def record(rows: int, train: aot.StepReport, seconds: float, label: str = "") -> dict:
    """One compile's row of the results (fit, XLA's peak, every buffer's sum), and its log line
    (after `label`)."""
    row = {
        "rows": rows,
        "fits": train.fits,
        "peak_bytes": train.peak_bytes,
        "total_bytes": train.total_bytes,
        "host_bytes": train.host_bytes,
        "error": train.error,
        "seconds": seconds,
    }
    took = f"({seconds:.0f} s)"
    if train.fits:
        total = train.total_bytes
        also = f" (all buffers {total / GiB:.2f} GiB)"
        also = also if f"{total / GiB:.2f}" != f"{train.peak_bytes / GiB:.2f}" else ""
        log(f"{label}rows {rows}: fits, peak {train.peak_bytes / GiB:.2f} GiB{also} {took}")
    else:
        log(f"{label}rows {rows}: DOES NOT FIT: {train.error or 'peak over the memory'} {took}")
    return row


def search(measure, rows: int, max_rows: int, hbm: int, dp: int, label: str = "") -> dict:
    """The slope and the largest fitting batch: `measure(r)` (a record() row) at `rows` and
    2 x `rows`, then bisection up to `max_rows` from where the slope meets `hbm` (`dp`: the
    data-parallel chips, for the log). Returns
    slope_bytes_per_row (None where 2 x rows does not fit), mean_bytes_per_row (from `rows` to
    the largest), largest_rows, capped_by_max_rows and every row tried."""
    tried = {r: measure(r) for r in (rows, 2 * rows)}
    small, double = tried[rows], tried[2 * rows]
    if not small["fits"]:
        raise SystemExit(f"{label}--rows={rows} does not fit: try fewer")
    slope = None
    if double["fits"]:
        slope = (double["peak_bytes"] - small["peak_bytes"]) / rows
        log(f"{label}per extra row: {slope / GiB:.3f} GiB ({rows} -> {2 * rows} rows)")
    # Bisection over rows: `fit` fits, `over` does not (None: not yet found).
    fit = max(r for r, t in tried.items() if t["fits"])
    over = min((r for r, t in tried.items() if not t["fits"]), default=None)
    # First guess: where HBM's slope meets HBM (the peak less buffers offloaded to the host,
    # which a program with offloaded buffers counts in its peak: see tfjax.runner.aot).
    hbm_slope = slope and (slope - (double["host_bytes"] - small["host_bytes"]) / rows)
    if over is None and hbm_slope and hbm_slope > 0:
        in_hbm = tried[fit]["peak_bytes"] - tried[fit]["host_bytes"]
        guess = fit + int((hbm - in_hbm) / hbm_slope)
        guess = min(max(guess, fit + 1), max_rows)
    else:
        guess = min(2 * fit, max_rows) if over is None else (fit + over) // 2
    while fit < max_rows and (over is None or over - fit > 1):
        tried[guess] = measure(guess)
        if tried[guess]["fits"]:
            fit = guess
            step = max(1, fit // 8)  # past a guess that fits, a short step out
            guess = min(fit + step, max_rows) if over is None else (fit + over) // 2
        else:
            over = guess
            guess = (fit + over) // 2
    best = tried[fit]
    mean = (best["peak_bytes"] - small["peak_bytes"]) / (fit - rows) if fit > rows else 0
    at_least = "at least " if fit == max_rows else ""
    host = f" (with {best['host_bytes'] / GiB:.2f} GiB on the host)" if best["host_bytes"] else ""
    log(
        f"{label}largest fitting batch: {at_least}{fit} rows per chip ({fit * dp} in all), peak "
        f"{best['peak_bytes'] / GiB:.2f} of {hbm / GiB:.2f} GiB{host}; {mean / GiB:.3f} GiB per "
        f"row from {rows} rows"
    )
    return {
        "slope_bytes_per_row": slope,
        "mean_bytes_per_row": mean,
        "largest_rows": fit,
        "capped_by_max_rows": fit == max_rows,
        "tried": [tried[r] for r in sorted(tried)],
    }


def main():
    parser = harness.parser(__doc__, "batch_fit")
    parser.add_argument("--config", default="configs/lm.py:modern-small")
    parser.add_argument("--topology", default="v5p:2x2x2", help=aot.TOPOLOGY_HELP)
    parser.add_argument("--set", action="append", default=[], dest="sets", help="key=value")
    parser.add_argument("--rows", type=int, default=4, help="rows per chip for the slope")
    parser.add_argument("--max_rows", type=int, default=256, help="the bisection's upper bound")
    args = parser.parse_args()
    if args.tiny:
        args.config, args.topology = TINY["config"], TINY["topology"]
        args.rows, args.max_rows = TINY["rows"], TINY["max_rows"]
        args.sets = TINY["sets"] + args.sets
    if not 0 < args.rows < args.max_rows:
        parser.error(f"--rows={args.rows} must be > 0 and below --max_rows={args.max_rows}")
    config = load(args.config, args.sets)
    devices = aot.topology_devices(args.topology)
    hbm = aot.usable_memory(chips.of(devices[0], devices))[0]
    dp = data_parallel_devices(config, devices)
    log(f"{args.config} {' '.join(args.sets)} on {args.topology}: {dp} data-parallel chips")

    found = search(
        lambda rows: measure(config, rows, dp, devices, args.topology),
        args.rows,
        args.max_rows,
        hbm,
        dp,
    )
    harness.write_json(
        args.out,
        {
            "config": args.config,
            "sets": args.sets,
            "topology": args.topology,
            "hbm_bytes": hbm,
            "data_parallel_devices": dp,
            **found,
            "command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
            "machine": harness.machine("jax", "libtpu"),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
