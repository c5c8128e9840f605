"""Attention forward + backward against sequence length: peak temporary memory and time.

    .venv/bin/python benchmarks/attention_memory.py [--lengths 1024,2048,...]
        [--time-lengths 512,1024,...] [--rounds N] [--causal] [--dtype float32] [--tiny]
        [--out FILE]

What runs, for every implementation of `tfjax.nn.dot_product_attention` that this backend
has ("xla", "chunked", and "cudnn" on a GPU with --dtype bfloat16; otherwise a printed note
says why it is skipped): grad(sum(attention(q, k, v) * cotangent)) with respect to q, k and v,
at T = S, B=1, N=8, H=64 by default.

Memory: XLA's memory analysis of the compiled program (temporary buffers, not inputs or
outputs), at every --lengths; nothing is executed, so long lengths cost compile time only.
Prints the chunked/xla ratio and the growth per doubling of T.

Time: at every --time-lengths (shorter: these run), each implementation is compiled and run
once (untimed, and its gradients checked against "xla"), then --rounds rounds time one call of
every implementation in a rotated order, so that load drifts of a shared machine hit all
alike; the table shows medians (and minimums), the chunked/xla ratio and the attention FLOP/s
(4 matmuls of 2*T*S*H*N FLOPs forward and backward counted as 2 + 4 = 6 such products in
all; causal masking not discounted). --tiny runs toy sizes for the smoke test.
"""

import functools
import os

import harness
import jax
import jax.numpy as jnp
from harness import log

from tfjax.nn import attention, dot_product_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def implementations(dtype, log):
    """The implementations that run here; a note for each one that does not."""
    names = ["xla", "chunked"]
    probe = jnp.zeros((1, 8, 1, 64), dtype)
    reason = attention.cudnn_unsupported_reason(probe, probe, 0.0, jax.default_backend())
    if reason is None:
        names.append("cudnn")
    else:
        log(f"note: cudnn skipped: {reason}")
    return names


def grad_fn(impl, causal):
    def loss(q, k, v, cot):
        out = dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def temp_bytes(impl, length, batch, heads, head_dim, causal, dtype):
    shape = jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype)
    cot = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    compiled = grad_fn(impl, causal).lower(shape, shape, shape, cot).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def attention_flops(batch, length, heads, head_dim):
    """QK^T and PV forward (2 products), their 4 gradient products backward, 2*T*S*H*N each."""
    return 6 * 2 * batch * heads * length * length * head_dim


def time_lengths(impls, lengths, args, dtype, log):
    rows = []
    log(
        f"\ntime of forward+backward (median of {args.rounds} rounds, rotated order; min in "
        "parentheses)"
    )
    log(
        f"{'T':>6} "
        + " ".join(f"{i + ' ms':>20}" for i in impls)
        + f" {'chunked/xla':>12} "
        + " ".join(f"{i + ' GFLOP/s':>16}" for i in impls)
    )
    for t in lengths:
        keys = jax.random.split(jax.random.key(t), 4)
        shape = (args.batch, t, args.heads, args.head_dim)
        q, k, v = (jax.random.normal(key, shape, dtype) for key in keys[:3])
        cot = jax.random.normal(keys[3], shape, jnp.float32)
        fns, first_s, max_err = {}, {}, {}
        ref = None
        for impl in impls:
            fns[impl] = grad_fn(impl, args.causal)
            grads, first_s[impl] = harness.timed_call(functools.partial(fns[impl], q, k, v, cot))
            if ref is None:
                ref = grads
            max_err[impl] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(grads, ref, strict=True)
            )
        calls = {impl: functools.partial(fn, q, k, v, cot) for impl, fn in fns.items()}
        times = harness.time_rounds(calls, args.rounds, warmup=0)
        median = harness.medians(times)
        flops = attention_flops(args.batch, t, args.heads, args.head_dim)
        row = {
            "length": t,
            "median_s": median,
            "min_s": {i: min(ts) for i, ts in times.items()},
            "times_s": times,
            "first_call_s": first_s,
            "max_abs_grad_diff_vs_xla": max_err,
            "flops": flops,
            "chunked_over_xla": median["chunked"] / median["xla"],
        }
        rows.append(row)
        log(
            f"{t:>6} "
            + " ".join(f"{1e3 * median[i]:>11.1f} ({1e3 * min(times[i]):>6.1f})" for i in impls)
            + f" {row['chunked_over_xla']:>12.3f} "
            + " ".join(f"{flops / median[i] / 1e9:>16.1f}" for i in impls)
            + "   max |grad diff| vs xla: "
            + ", ".join(f"{i} {max_err[i]:.1e}" for i in impls if i != "xla")
        )
    return rows


def memory_lengths(impls, lengths, args, dtype, log):
    log("\ntemporary bytes of forward+backward (compiled, not run)")
    log(
        f"{'T':>6} "
        + " ".join(f"{i + ' MiB':>12}" for i in impls)
        + f" {'chunked/xla':>12} {'xla x/2T':>9} {'chunked x/2T':>13}"
    )
    rows, prev = [], None
    for t in lengths:
        mem, compile_s = harness.timed_call(
            lambda t=t: {
                impl: temp_bytes(impl, t, args.batch, args.heads, args.head_dim, args.causal, dtype)
                for impl in impls
            }
        )
        row = {"length": t, **{f"{k}_bytes": v for k, v in mem.items()}}
        row["chunked_over_xla"] = mem["chunked"] / mem["xla"]
        growth = ("", "")
        if prev:
            row["xla_growth"] = mem["xla"] / prev["xla_bytes"]
            row["chunked_growth"] = mem["chunked"] / prev["chunked_bytes"]
            growth = (f"{row['xla_growth']:.2f}", f"{row['chunked_growth']:.2f}")
        log(
            f"{t:>6} "
            + " ".join(f"{mem[i] / 2**20:>12.1f}" for i in impls)
            + f" {row['chunked_over_xla']:>12.4f} {growth[0]:>9} {growth[1]:>13}"
            + f"   ({compile_s:.1f}s to compile)"
        )
        rows.append(row)
        prev = row
    return rows


def main():
    parser = harness.parser(__doc__, "attention_memory")
    parser.add_argument("--lengths", default=None, help="memory (default 1024,...,16384)")
    parser.add_argument("--time-lengths", default=None, help="timed (default 256,...,4096)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="N (default 8)")
    parser.add_argument("--head-dim", type=int, default=None, help="H (default 64)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    args = parser.parse_args()
    tiny = dict(lengths="64,128", time_lengths="64,128", rounds=2, heads=2, head_dim=16)
    full = dict(
        lengths="1024,2048,4096,8192,16384",
        time_lengths="256,512,1024,2048,4096",
        rounds=5,
        heads=8,
        head_dim=64,
    )
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dtype = DTYPES[args.dtype]

    log(
        f"attention forward+backward; backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), jax {jax.__version__}, B={args.batch} "
        f"N={args.heads} H={args.head_dim} causal={args.causal} dtype={args.dtype}; "
        f"load average {os.getloadavg()}"
    )
    impls = implementations(dtype, log)
    memory = memory_lengths(impls, [int(x) for x in args.lengths.split(",")], args, dtype, log)
    timed = time_lengths(impls, [int(x) for x in args.time_lengths.split(",")], args, dtype, log)
    load_end = os.getloadavg()
    log(f"load average at end: {load_end}")
    harness.write_json(
        args.out,
        {
            "benchmark": "attention_memory",
            "args": vars(args),
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "implementations": impls,
            "rows": memory,
            "time_rows": timed,
            "load_average_end": load_end,
        },
    )


if __name__ == "__main__":
    main()
