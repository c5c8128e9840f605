r"""Train-step time of tfjax against PyTorch (eager, torch.compile) and stock flax.linen, on CPU.

    .venv/bin/python benchmarks/train_step_vs_torch.py [--models=decoder,vit,gpt2] [--rounds=N]
        [--contenders=tfjax,stock_flax,torch_eager,torch_compile] [--threads=N]
        [--malloc=keep|glibc] [--tiny]

The models (decoder: a d=512 GPT-like decoder, T=256; vit: ViT-S/16 at 224 px; gpt2: GPT-2
small, T=128) and the contenders' training steps (forward, backward, AdamW, float32) are those
of contenders.py, which describes them.

Every contender runs in its own process (in one process, torch slowed the JAX contenders by
uneven amounts), started, compiled and warmed up one after another; then the timed steps run
in rounds, each round one step of every contender in a rotated order (so that the machine's
load drifts hit all alike) while the others wait idle, and the tables show medians.
Threads: torch.set_num_threads(threads) and XLA's own thread pool, which takes every core of
the process's CPU affinity; --threads below the core count pins each process to that many
cores first, so both libraries see the same. Host memory: every contender's process alike
keeps freed memory for reuse (tfjax.runner.host_memory, as experiments/run.py does; --malloc=glibc
leaves glibc's defaults, which page-fault each step's temporaries in anew).

MFU = model FLOPs per step / step time / roofline. Model FLOPs follow tfjax.runner.chips
(Kaplan et al. / PaLM): 6 * N * T for the weight matmuls (N = non-embedding parameters plus
the output projection; embedding lookups count nothing) plus 12 * L * T * S * D for attention
scores and values (causal masking not discounted). The roofline is the fastest float32
[n, n] x [n, n] matmul (n = 512, 1024, 2048; best of 5) measured in this run by JAX and by
torch, before and after the timed rounds. Beside it, the MFU of a step that did nothing but
its matmuls (step_matmuls: every forward, input-gradient and weight-gradient product), each as
fast as it runs alone, with JAX's and with torch's kernels: the ceiling those kernels set.

Prints versions, the machine, step times, ratios and MFU; writes benchmarks/results/
train_step_vs_torch.json (or --out). --tiny runs toy sizes for the smoke test.
"""

import os
import statistics

import contenders
import harness
from harness import log

# Targets of issue 9: contender -> the largest allowed tfjax / contender step-time ratio.
TARGETS = {
    "decoder": {"torch_eager": 1.0},
    "vit": {"torch_eager": 1.0},
    "gpt2": {"torch_eager": 0.85, "stock_flax": 0.95},
}
MFU_TARGET = {"gpt2": 0.75}


# ------------------------------------------------------------------------------ the roofline
def best_matmul_s(shape, repeats=5):
    """{"jax": s, "torch": s}: best of `repeats` float32 products [g, m, k] x [g, k, n] (2-D when
    g == 1) on random operands, JAX's and torch's interleaved like the contenders."""
    import jax
    import jax.numpy as jnp
    import torch

    g, m, k, n = shape
    batch = (g,) if g > 1 else ()
    a = jax.random.normal(jax.random.key(0), (*batch, m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (*batch, k, n), jnp.float32)
    ta, tb = torch.randn(*batch, m, k), torch.randn(*batch, k, n)
    mm = jax.jit(jnp.matmul)
    times = harness.time_rounds({"jax": lambda: mm(a, b), "torch": lambda: ta @ tb}, repeats)
    return {lib: min(t) for lib, t in times.items()}


def roofline(sizes=(512, 1024, 2048), repeats=5):
    """{"jax n": FLOP/s, "torch n": FLOP/s}: best of `repeats` float32 square matmuls."""
    out = {}
    for n in sizes:
        for lib, seconds in best_matmul_s((1, n, n, n), repeats).items():
            out[f"{lib} {n}"] = 2.0 * n**3 / seconds
    return out


def step_matmuls(spec):
    """{(batch, m, k, n): count} of the matmul products of one train step: every forward
    product [m, k] x [k, n] (weights, attention scores and values, the output layer) and its
    two backward products (input gradient [m, n] x [n, k], weight gradient [k, m] x [m, n])."""
    b, d, f, layers = spec["batch"], spec["width"], spec["mlp"], spec["layers"]
    h = d // spec["heads"]
    if spec["kind"] == "lm":
        t, out = spec["length"], [(1, b * spec["length"], d, spec["vocab"])]
    else:
        n = (spec["image"] // spec["patch"]) ** 2
        t = n + 1
        out = [(1, b * n, 3 * spec["patch"] ** 2, d), (1, b, d, spec["classes"])]
    per_layer = [(1, b * t, d, d)] * 4 + [(1, b * t, d, f), (1, b * t, f, d)]
    per_layer += [(b * spec["heads"], t, h, t), (b * spec["heads"], t, t, h)]
    counts = {}
    for g, m, k, n in per_layer * layers + out:
        for shape in ((g, m, k, n), (g, m, n, k), (g, k, m, n)):
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def matmul_time(counts, repeats=5):
    """{"jax": s, "torch": s}: the step's matmuls (step_matmuls) each timed alone
    (best_matmul_s), summed with their counts: the step time if it did nothing but its matmuls,
    each as fast as alone."""
    total = {"jax": 0.0, "torch": 0.0}
    for shape, count in counts.items():
        for lib, seconds in best_matmul_s(shape, repeats).items():
            total[lib] += count * seconds
    return total


# ------------------------------------------------------------------------------------- main
def main():
    parser = harness.parser(__doc__, "train_step_vs_torch")
    parser.add_argument("--models", default="decoder,vit,gpt2")
    parser.add_argument("--contenders", default=",".join(contenders.CONTENDERS))
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 10, gpt2 6)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    parser.add_argument(
        "--malloc",
        default="keep",
        choices=("keep", "glibc"),
        help="keep: every contender's process keeps freed memory for reuse "
        "(tfjax.runner.host_memory, as experiments/run.py does); glibc: its defaults",
    )
    args = parser.parse_args()
    threads = harness.use_cores(args.threads)
    import jax
    import torch

    torch.set_num_threads(threads)  # the roofline's torch matmuls
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(contenders.CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; allowed: {contenders.CONTENDERS}")
    sizes = contenders.TINY if args.tiny else contenders.MODELS
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in sizes:
            parser.error(f"unknown model {m!r}; allowed: {list(sizes)}")

    info = harness.machine("jax", "jaxlib", "flax", "optax", "torch", "transformers")
    info.update(
        cores_used=threads,
        torch_threads=torch.get_num_threads(),
        torch_interop_threads=torch.get_num_interop_threads(),
        jax_backend=jax.default_backend(),
        jax_devices=len(jax.devices()),
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", ""),
        malloc=args.malloc,
    )
    log("train step (forward + backward + AdamW), float32, CPU")
    log("  " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "load_average"))
    log(f"  load average at start: {info['load_average']}")
    peak_before = roofline(sizes=(128, 256) if args.tiny else (512, 1024, 2048))
    results = {}
    for m in models:
        spec = sizes[m]
        rounds = args.rounds or (3 if args.tiny else (6 if m == "gpt2" else 10))
        log(f"\n[{m}] {spec}; {rounds} rounds after {args.warmup} warm-up steps")
        commands = {
            c: contenders.command(
                c, m, warmup=args.warmup, threads=args.threads, malloc=args.malloc, tiny=args.tiny
            )
            for c in names
        }
        results[m] = dict(spec=spec, **harness.time_processes(commands, rounds))
    peak_after = roofline(sizes=(128, 256) if args.tiny else (512, 1024, 2048))
    peak_all = {k: max(peak_before[k], peak_after[k]) for k in peak_before}
    peak = max(peak_all.values())
    peak_src = max(peak_all, key=peak_all.get)

    log(
        "\nmatmul roofline (float32 n x n, best of 5, before/after): "
        + ", ".join(
            f"{k}: {peak_before[k] / 1e9:.0f}/{peak_after[k] / 1e9:.0f}" for k in peak_before
        )
        + f" GFLOP/s; roofline = {peak / 1e9:.1f} GFLOP/s ({peak_src})"
    )
    summary = {}
    for m, r in results.items():
        flops = r.get("flops")
        log(
            f"\n[{m}] params: tfjax {r.get('params_tfjax', 0):,}, stock_flax "
            f"{r.get('params_stock_flax', 0):,}, torch {r.get('params_torch', 0):,}; "
            f"model FLOPs/step {flops / 1e9 if flops else float('nan'):.1f} G"
        )
        log(
            f"  {'contender':14} {'compile+1st s':>13} {'median ms':>10} {'min ms':>9} "
            f"{'max ms':>9} {'GFLOP/s':>8} {'MFU':>6} {'page faults':>11}"
        )
        mfu = {}
        for c in r["contenders"]:
            t = r["step_s"][c]
            med = r["median_s"][c]
            rate = flops / med if flops else float("nan")
            mfu[c] = rate / peak
            faults = statistics.median(r["page_faults"][c])
            log(
                f"  {c:14} {r['first_step_s'][c]:>13.1f} {1e3 * med:>10.1f} "
                f"{1e3 * min(t):>9.1f} {1e3 * max(t):>9.1f} {rate / 1e9:>8.1f} "
                f"{100 * mfu[c]:>5.1f}% {faults:>11,.0f}"
            )
        counts = step_matmuls(r["spec"])
        matmul_flops = sum(2.0 * g * m * k * n * c for (g, m, k, n), c in counts.items())
        matmul_s = matmul_time(counts, repeats=2 if args.tiny else 5)
        ceiling = {lib: flops / t / peak if flops else float("nan") for lib, t in matmul_s.items()}
        log(
            f"  the step's matmuls alone ({matmul_flops / 1e9:.1f} GFLOP, {len(counts)} shapes, "
            f"best of {2 if args.tiny else 5} each): JAX {1e3 * matmul_s['jax']:.0f} ms, torch "
            f"{1e3 * matmul_s['torch']:.0f} ms; MFU of a step doing only these: JAX "
            f"{ceiling['jax']:.3f}, torch {ceiling['torch']:.3f}"
        )
        ratios, checks = {}, []
        if "tfjax" in r["median_s"]:
            for c in r["contenders"]:
                if c == "tfjax":
                    continue
                ratio = ratios[f"tfjax/{c}"] = r["median_s"]["tfjax"] / r["median_s"][c]
                target = TARGETS[m].get(c)
                if target is not None:
                    checks.append(
                        dict(
                            what=f"tfjax/{c}",
                            value=ratio,
                            target=f"<= {target}",
                            met=ratio <= target,
                        )
                    )
                log(f"  {harness.ratio_line(f'tfjax/{c}', ratio, at_most=target)}")
            if m in MFU_TARGET:
                met = mfu["tfjax"] >= MFU_TARGET[m]
                checks.append(
                    dict(
                        what="tfjax MFU", value=mfu["tfjax"], target=f">= {MFU_TARGET[m]}", met=met
                    )
                )
                note = harness.target_note(mfu["tfjax"], at_least=MFU_TARGET[m])
                log(f"  tfjax MFU = {mfu['tfjax']:.3f}{note}")
        for k in [k for k in r if k.endswith("_error")]:
            log(f"  {k[: -len('_error')]} did not run: {r[k][:300]}")
        if args.tiny:
            log("  (tiny sizes: a smoke run, targets do not apply)")
        summary[m] = dict(
            ratios=ratios,
            mfu=mfu,
            checks=checks,
            matmul_flops=matmul_flops,
            matmuls_alone_s=matmul_s,
            mfu_of_matmuls_alone=ceiling,
        )
    info["load_average_end"] = os.getloadavg()
    log(f"\nload average at end: {info['load_average_end']}")
    harness.write_json(
        args.out,
        dict(
            benchmark="train_step_vs_torch",
            tiny=args.tiny,
            machine=info,
            roofline_flops=peak,
            roofline_source=peak_src,
            roofline_before=peak_before,
            roofline_after=peak_after,
            flops_convention="6*N*T + 12*L*T*S*D (tfjax.runner.chips), causal not discounted",
            results=results,
            summary=summary,
        ),
    )


if __name__ == "__main__":
    main()
