r"""Peak memory of the train step with the full [B, T, V] logits against the chunked loss
(config.loss.chunks), compiled for a TPU slice from this CPU host.

    .venv/bin/python benchmarks/chunked_loss_memory.py [--chunks=1,4,8,16] \
        [--config=configs/lm.py:modern-small] [--topology=v5p:2x2x1] [--vocab_size=128256] \
        [--seq_len=4096] [--batch_size=64] [--steps=train,eval] [--tiny] [--out=FILE]

By default: the modern-small decoder (Llama-like, untied head) with Llama 3's vocabulary of
128,256 tokens at T=4096, 64 rows (16 per chip: the 65,536 tokens per chip of the preset) on a
v5p:2x2x1 slice with FSDP, bf16. Every --chunks value (the first is the baseline, normally 1:
the full logits) is compiled in this one process by libtpu's compiler through
`tfjax.runner.aot.compile_experiment`, the path of experiments/compile.py; nothing runs on a TPU.
Memory is XLA's memory analysis of each compiled program per device (peak as tfjax.runner.aot
defines it: what must fit). The table gives each peak and its ratio to the baseline's, and the FLOPs
the chunked loss adds: the backward pass makes each slice's logits again, one more
[B, T, D] x [D, V] matmul (2 B T D V FLOPs), shown as a share of the step's model FLOPs
(tfjax.runner.chips' count). No time is measured.

Results go to benchmarks/results/chunked_loss_memory.json (or --out). --tiny compiles the
tiny LM preset with the same vocabulary at T=128 on v5e:2x2, for a smoke run.
"""

import json
import os
import sys
import time

# Compile-only: the host computes nothing, and must not try to start a TPU backend of its own.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness  # noqa: E402
from harness import ROOT, log  # noqa: E402

from tfjax.runner import aot, setup  # noqa: E402

GiB = 2**30


def make_config(args, chunks):
    config = setup.load_config(os.path.join(ROOT, args.config))
    # The model's context length (the preset's unless the config sets one), widened to T.
    max_len = setup.build_model(config, vocab_size=args.vocab_size).max_len
    with config.unlocked():
        config.model.vocab_size = args.vocab_size
        config.model.max_len = max(args.seq_len, max_len or 0)
        config.dataset.seq_len = args.seq_len
        config.batch_size = config.eval_batch_size = args.batch_size
        config.loss.chunks = chunks
        if args.mesh:
            config.mesh.update(json.loads(args.mesh))
        if args.tiny:
            config.dtype = "bfloat16"
            config.model.scan_layers = True
    return config


def measure(args, chunks, log):
    config = make_config(args, chunks)
    devices = aot.topology_devices(args.topology)
    start = time.perf_counter()
    report = aot.compile_experiment(
        config, devices, topology=args.topology, steps=tuple(args.steps)
    )
    seconds = time.perf_counter() - start
    model = setup.build_model(config, vocab_size=args.vocab_size)
    head_flops = 2 * args.batch_size * args.seq_len * model.width * model.vocab_size
    row = {
        "chunks": chunks,
        "fits": report.fits,
        "mesh": report.mesh,
        "per_device_batch": report.per_device_batch,
        "compile_s": seconds,
        "flops_per_step": report.flops_per_step,
        # the backward pass makes every slice's logits again
        "recomputed_flops": head_flops if chunks > 1 else 0,
        "steps": {
            s.name: {
                "peak_bytes": s.peak_bytes,
                "temp_bytes": s.temp_bytes,
                "argument_bytes": s.argument_bytes,
                "error": s.error,
            }
            for s in report.steps
        },
    }
    log(
        f"loss.chunks={chunks}: "
        + ", ".join(
            f"{name} peak {s['peak_bytes'] / GiB:.2f} GiB" for name, s in row["steps"].items()
        )
        + f" ({seconds:.0f} s to compile)"
    )
    return row, report


def main():
    parser = harness.parser(__doc__, "chunked_loss_memory")
    parser.add_argument("--chunks", default="1,4,8,16", help="first = baseline")
    parser.add_argument("--config", default="configs/lm.py:modern-small")
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--mesh", default="", help='JSON mesh override, e.g. {"fsdp": -1}')
    parser.add_argument("--vocab_size", type=int, default=128256)  # Llama 3
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", default="train,eval")
    args = parser.parse_args()
    if args.tiny:
        args.config, args.topology, args.seq_len = "configs/lm.py:tiny", "v5e:2x2", 128
        args.mesh = args.mesh or json.dumps({"data": 1, "fsdp": 2, "tensor": 2})
    args.steps = [s for s in args.steps.split(",") if s]
    chunks = [int(c) for c in args.chunks.split(",")]

    log(
        f"{args.config}, vocab {args.vocab_size:,}, T={args.seq_len}, batch {args.batch_size}, "
        f"on {args.topology}; loss.chunks {chunks} (baseline {chunks[0]})"
    )
    rows, reports = [], []
    for c in chunks:
        row, report = measure(args, c, log)
        rows.append(row)
        reports.append(report)
    base = rows[0]
    for row in rows:
        row["ratio_to_baseline"] = {
            name: s["peak_bytes"] / base["steps"][name]["peak_bytes"]
            for name, s in row["steps"].items()
        }
    hbm = reports[0].hbm_bytes
    log(
        f"\nper device, of {hbm / GiB:.0f} GiB HBM ({reports[0].devices}); mesh {base['mesh']}, "
        f"{base['per_device_batch']:g} rows per device\n"
    )
    header = (
        "| loss.chunks | "
        + " | ".join(f"{n} peak GiB | {n} peak / chunks={base['chunks']}" for n in args.steps)
        + " | train step: recomputed head FLOPs | fits |"
    )
    log(header)
    log("|" + "---|" * (header.count("|") - 1))
    for row in rows:
        cells = []
        for n in args.steps:
            s = row["steps"][n]
            cells += [f"{s['peak_bytes'] / GiB:.2f}", f"{row['ratio_to_baseline'][n]:.2f}"]
        extra = row["recomputed_flops"] / row["flops_per_step"]
        log(
            f"| {row['chunks']} | " + " | ".join(cells) + f" | +{extra:.1%} | "
            f"{'yes' if row['fits'] else 'no'} |"
        )
    for row in rows[1:]:
        for n in args.steps:
            log(
                f"ratio {n} peak chunks={row['chunks']}/chunks={base['chunks']} = "
                f"{row['ratio_to_baseline'][n]:.3f}"
            )
    result = {
        "config": args.config,
        "topology": args.topology,
        "vocab_size": args.vocab_size,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "hbm_bytes": hbm,
        "devices": reports[0].devices,
        "rows": rows,
        "command": " ".join([os.path.relpath(sys.executable, ROOT)] + sys.argv),
        "machine": harness.machine("jax", "libtpu"),
    }
    log()
    harness.write_json(args.out, result)
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
