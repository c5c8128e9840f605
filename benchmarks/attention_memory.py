"""Peak temporary memory of attention forward + backward against sequence length.

For each implementation, compiles grad(sum(attention(q, k, v) * cotangent)) at T = S and reads
XLA's memory analysis of the compiled program (temporary buffers, not inputs or outputs); no
step is executed, so long lengths cost compile time only. Prints the chunked/xla ratio at each
length and the growth per doubling of T, and writes a JSON file.

    .venv/bin/python benchmarks/attention_memory.py [--lengths 1024,2048,...] [--out FILE]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp

from tfjax.nn import dot_product_attention


def temp_bytes(impl, length, batch, heads, head_dim, causal):
    shape = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)

    def loss(q, k, v, cot):
        out = dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
        return jnp.sum(out * cot)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    compiled = grad.lower(shape, shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/attention_memory.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    print(
        f"backend {jax.default_backend()}, B={args.batch} N={args.heads} H={args.head_dim} "
        f"causal={args.causal}; temporary bytes of forward+backward"
    )
    print(
        f"{'T':>6} {'xla MiB':>10} {'chunked MiB':>12} {'chunked/xla':>12} "
        f"{'xla x/2T':>9} {'chunked x/2T':>13}"
    )
    rows, prev = [], None
    for t in lengths:
        start = time.perf_counter()
        mem = {
            impl: temp_bytes(impl, t, args.batch, args.heads, args.head_dim, args.causal)
            for impl in ("xla", "chunked")
        }
        row = {"length": t, **{f"{k}_bytes": v for k, v in mem.items()}}
        row["chunked_over_xla"] = mem["chunked"] / mem["xla"]
        growth = ("", "")
        if prev:
            row["xla_growth"] = mem["xla"] / prev["xla_bytes"]
            row["chunked_growth"] = mem["chunked"] / prev["chunked_bytes"]
            growth = (f"{row['xla_growth']:.2f}", f"{row['chunked_growth']:.2f}")
        print(
            f"{t:>6} {mem['xla'] / 2**20:>10.1f} {mem['chunked'] / 2**20:>12.1f} "
            f"{row['chunked_over_xla']:>12.4f} {growth[0]:>9} {growth[1]:>13}"
            f"   ({time.perf_counter() - start:.1f}s to compile)"
        )
        rows.append(row)
        prev = row
    import os

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "backend": jax.default_backend(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
