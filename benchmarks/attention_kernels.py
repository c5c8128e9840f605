r"""Attention implementations compiled for a TPU slice: peak memory per chip and compile time.

    .venv/bin/python benchmarks/attention_kernels.py [--topology=v5p:2x2x1]
        [--lengths=2048,4096,8192,16384,32768] [--implementations=xla,chunked,splash]
        [--loss_chunks=16]

The train step of configs/lm.py:modern-small (12 layers, width 768, 12 query / 4 kv heads of
64, RoPE, packed rows, FSDP, remat "full", bf16) at each sequence length T, with the tokens per
step of the preset (128 x 2048) kept, compiled by libtpu's compiler on this CPU host for each
attention implementation. The loss runs in `--loss_chunks` slices (config.loss.chunks): the
[B, T, V] logits would otherwise put a floor of about 16 GiB under every row (1 keeps them).
"peak" is what tfjax.runner.aot reports (what must fit in HBM per chip); a program over the
chip's HBM is refused by the compiler, and the row gives what it asked for. Nothing runs on a
TPU: speed is not measured here. Results: benchmarks/results/attention_kernels.json (or --out) and a
Markdown table on stdout (docs/performance.md's), with each implementation's peak as a ratio of
"chunked"'s at the same T, compiled in the same run.
"""

import json
import time

import harness

from tfjax.runner import aot, setup

TOKENS_PER_STEP = 128 * 2048  # the modern-small preset's batch
GiB = 2**30


def config_for(length: int, implementation: str, num_devices: int, loss_chunks: int):
    config = setup.load_config(f"{harness.ROOT}/configs/lm.py:modern-small")
    batch = max(TOKENS_PER_STEP // length, num_devices)
    config.dataset.seq_len = length
    config.model.max_len = length
    config.model.implementation = implementation
    config.loss.chunks = loss_chunks
    config.batch_size = config.eval_batch_size = batch
    return config


def measure(topology: str, length: int, implementation: str, loss_chunks: int) -> dict:
    devices = aot.topology_devices(topology)
    config = config_for(length, implementation, len(devices), loss_chunks)
    start = time.perf_counter()
    try:
        report = aot.compile_experiment(config, devices, topology=topology, steps=("train",))
    except Exception as e:  # noqa: BLE001 - a row that says why it did not compile
        return {"length": length, "implementation": implementation, "error": str(e)[:300]}
    (train,) = report.steps
    return {
        "length": length,
        "implementation": implementation,
        "batch": config.batch_size,
        "loss_chunks": loss_chunks,
        "fits": train.fits,
        "peak_bytes": train.peak_bytes,
        "temp_bytes": train.temp_bytes,
        "hbm_bytes": report.hbm_bytes,
        "compile_s": train.compile_s,
        "wall_s": time.perf_counter() - start,
        "refused": train.error,
    }


def table(rows: list[dict], topology: str) -> str:
    by = {(r["length"], r["implementation"]): r for r in rows}
    lines = [
        f"| T | batch | implementation | peak per chip ({topology}) | vs chunked | compile |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['length']} | | {r['implementation']} | error: {r['error']} | | |")
            continue
        base = by.get((r["length"], "chunked"), {})
        peak = f"{r['peak_bytes'] / GiB:.1f} GiB" if r["peak_bytes"] else "?"
        if not r["fits"]:
            peak = f"**does not fit** ({peak} asked, {r['hbm_bytes'] / GiB:.0f} GiB HBM)"
        ratio = (
            f"{r['peak_bytes'] / base['peak_bytes']:.2f}x"
            if base.get("peak_bytes") and r["peak_bytes"]
            else ""
        )
        lines.append(
            f"| {r['length']} | {r['batch']} | {r['implementation']} | {peak} | "
            f"{ratio} | {r['compile_s']:.0f} s |"
        )
    return "\n".join(lines)


def main():
    parser = harness.parser(__doc__, "attention_kernels", tiny=False)
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--implementations", default="xla,chunked,splash")
    parser.add_argument("--loss_chunks", type=int, default=16)
    args = parser.parse_args()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for implementation in args.implementations.split(","):
            rows.append(measure(args.topology, length, implementation, args.loss_chunks))
            harness.log(json.dumps(rows[-1]))
    harness.log(table(rows, args.topology))
    harness.write_json(
        args.out, dict(topology=args.topology, loss_chunks=args.loss_chunks, rows=rows)
    )


if __name__ == "__main__":
    main()
