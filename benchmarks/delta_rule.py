r"""The gated delta rule's chunked and recurrent forms against full causal attention, on CPU.

    .venv/bin/python benchmarks/delta_rule.py [--rounds N] [--tiny] [--out FILE]

At T = 512 ... 8192 tokens (batch 1, 4 heads of 64, float32), forward passes, jitted:
  chunked    tfjax.ops.delta_rule.gated_delta_rule_chunked (chunks of 64: matmuls and a
             triangular solve within a chunk, a scan across chunks); linear in T
  recurrent  gated_delta_rule_recurrent, a scan over the T tokens; linear in T, sequential
  attention  tfjax.ops.attention.dot_product_attention(is_causal=True), the implementation tfjax
             picks for the length (shown); quadratic in T
Each is compiled and run once untimed, then timed once a round in rotated order; the table
shows medians (ms and ms per token) and the ratio chunked/attention of each length, and the
chunked form's outputs are checked against the recurrent form's (1e-4) before timing. Writes
benchmarks/results/delta_rule.json.
"""

import harness

from tfjax.runner import startup

startup.choose_platform()  # before JAX starts: no plugin errors on a CPU host

SHAPE = dict(B=1, N=4, H=64, lengths=(512, 1024, 2048, 4096, 8192), chunk=64)
TINY = dict(B=1, N=2, H=16, lengths=(64, 96), chunk=32)


def contenders(shape, t):
    """{name: fn} of the three forms on fixed random inputs of length t, and tfjax's attention
    implementation for it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tfjax.ops import attention, delta_rule

    b, n, h = shape["B"], shape["N"], shape["H"]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h), np.float32)) for _ in range(3))
    g = jnp.asarray(-np.abs(rng.standard_normal((b, t, n), np.float32)) * 0.1)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, n)).astype(np.float32))
    chunked = jax.jit(lambda *a: delta_rule.gated_delta_rule_chunked(*a, chunk_size=shape["chunk"]))
    recurrent = jax.jit(delta_rule.gated_delta_rule_recurrent)
    attend = jax.jit(lambda q, k, v: attention.dot_product_attention(q, k, v, is_causal=True))
    calls = {
        "chunked": lambda: chunked(q, k, v, g, beta),
        "recurrent": lambda: recurrent(q, k, v, g, beta),
        "attention": lambda: attend(q, k, v),
    }
    return calls, attention.choose_implementation(q, k)


def main():
    parser = harness.parser(__doc__, "delta_rule")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cores = harness.use_cores()
    import jax
    import numpy as np

    shape = TINY if args.tiny else SHAPE
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), {cores} cores, float32, "
        f"B={shape['B']} N={shape['N']} H={shape['H']}, chunks of {shape['chunk']}; "
        f"medians of {args.rounds} rounds"
    )
    print(
        f"  {'T':>6} {'chunked ms':>11} {'recurrent ms':>13} {'attention ms':>13} "
        f"{'chunked ms/tok':>15} {'attention ms/tok':>17} {'chunked/attn':>13}  attention impl"
    )
    rows = []
    for t in shape["lengths"]:
        calls, impl = contenders(shape, t)
        got, want = (np.asarray(calls[n]()[0]) for n in ("chunked", "recurrent"))
        difference = float(np.abs(got - want).max())
        if difference > 1e-4:
            raise SystemExit(f"T={t}: chunked differs from recurrent by {difference}")
        times = harness.time_rounds(calls, args.rounds)
        ms = {n: 1e3 * s for n, s in harness.medians(times).items()}
        ratio = ms["chunked"] / ms["attention"]
        print(
            f"  {t:>6} {ms['chunked']:>11.2f} {ms['recurrent']:>13.2f} {ms['attention']:>13.2f} "
            f"{ms['chunked'] / t:>15.5f} {ms['attention'] / t:>17.5f} {ratio:>13.3f}  {impl}"
        )
        rows.append(
            dict(
                length=t,
                attention_implementation=impl,
                max_abs_difference=difference,
                median_ms=ms,
                ms_per_token={n: m / t for n, m in ms.items()},
                chunked_over_attention=ratio,
                recurrent_over_chunked=ms["recurrent"] / ms["chunked"],
                seconds=times,
            )
        )
    last = rows[-1]
    print(
        harness.ratio_line(
            f"chunked/attention time at T={last['length']}", last["chunked_over_attention"]
        )
    )
    print(
        harness.ratio_line(
            f"recurrent/chunked time at T={last['length']}", last["recurrent_over_chunked"]
        )
    )
    result = dict(
        **harness.header("delta_rule", args, "jax", "jaxlib"),
        shape={k: v for k, v in shape.items() if k != "lengths"},
        rounds=args.rounds,
        rows=rows,
    )
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
