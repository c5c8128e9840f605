r"""Attention matmuls on token-major vs head-major operands, against PyTorch's SDPA, on CPU.

    .venv/bin/python benchmarks/attention_layouts.py [--rounds N] [--tiny] [--out FILE]

q, k, v arrive as [B, T, N, H] (what the projections give). Contenders, float32, no mask
("vit": ViT-S/16 at 224 px, batch 8) and a causal mask ("decoder": the d=512 GPT-like decoder
of contenders.py, batch 4):
  token_major  einsums straight on [B, T, N, H] ("btnh,bsnh->bnts"), XLA picks the layouts
               (tfjax before this benchmark)
  tfjax        tfjax.nn.dot_product_attention(implementation="xla"): q, k, v swapped to
               head-major [B, N, T, H] before the einsums
  torch_sdpa   torch.nn.functional.scaled_dot_product_attention on [B, N, T, H] tensors
Each is timed forward and forward+backward (grad of sum(out * cotangent) w.r.t. q, k, v),
compiled and warmed up first, then in rounds of rotated order; the table shows medians and the
ratios to token_major and to torch_sdpa. The forward outputs are checked to
agree (1e-4) before timing. Writes benchmarks/results/attention_layouts.json.
"""

import harness

SHAPES = {
    "vit": dict(B=8, T=197, N=6, H=64, causal=False),
    "decoder": dict(B=4, T=256, N=8, H=64, causal=True),
}
TINY = {
    "vit": dict(B=2, T=17, N=2, H=8, causal=False),
    "decoder": dict(B=2, T=16, N=2, H=8, causal=True),
}


def token_major(q, k, v, causal):
    import jax
    import jax.numpy as jnp

    t, h = q.shape[1], q.shape[3]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * h**-0.5
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def jax_contenders(shape, qkv):
    import jax
    import jax.numpy as jnp

    from tfjax.nn import dot_product_attention

    def tfjax_attention(q, k, v, causal):
        return dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    causal = shape["causal"]
    cot = jnp.ones_like(qkv[0])
    out = {}
    for name, fn in (("token_major", token_major), ("tfjax", tfjax_attention)):
        fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, causal))
        grad = jax.jit(
            jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v, causal) * cot), argnums=(0, 1, 2))
        )
        out[f"{name} fwd"] = lambda f=fwd: f(*qkv)
        out[f"{name} fwd+bwd"] = lambda g=grad: g(*qkv)
    return out


def torch_contenders(shape, qkv_np):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a.copy()).permute(0, 2, 1, 3).contiguous() for a in qkv_np)
    causal = shape["causal"]

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).permute(0, 2, 1, 3)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        F.scaled_dot_product_attention(*leaves, is_causal=causal).sum().backward()

    return {"torch_sdpa fwd": fwd, "torch_sdpa fwd+bwd": fwd_bwd}


def main():
    parser = harness.parser(__doc__, "attention_layouts")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cores = harness.use_cores()
    import jax
    import numpy as np
    import torch

    torch.set_num_threads(cores)
    print(
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
        f"{cores} cores, float32; medians of {args.rounds} rounds (ms)"
    )
    results = {}
    for model, shape in (TINY if args.tiny else SHAPES).items():
        rng = np.random.default_rng(0)
        qkv_np = [
            rng.standard_normal((shape["B"], shape["T"], shape["N"], shape["H"]), dtype=np.float32)
            for _ in range(3)
        ]
        cases = {
            **jax_contenders(shape, [jax.numpy.asarray(a) for a in qkv_np]),
            **torch_contenders(shape, qkv_np),
        }
        # The contenders compute the same attention ([B, T, N, H] outputs).
        want = np.asarray(cases["token_major fwd"]())
        for n in ("tfjax fwd", "torch_sdpa fwd"):
            got = np.asarray(cases[n]())
            if not np.allclose(got, want, atol=1e-4):
                raise SystemExit(f"{n} differs from token_major: {np.abs(got - want).max()}")
        names = list(cases)
        times = harness.time_rounds(cases, args.rounds, warmup=2)
        median = harness.medians(times)
        print(f"\n[{model}] {shape}")
        print(f"  {'contender':22} {'median ms':>10} {'min ms':>8}")
        for n in names:
            print(f"  {n:22} {1e3 * median[n]:>10.2f} {1e3 * min(times[n]):>8.2f}")
        ratios = {}
        for pass_ in ("fwd", "fwd+bwd"):
            for base in ("token_major", "torch_sdpa"):
                key = f"tfjax/{base} {pass_}"
                ratios[key] = median[f"tfjax {pass_}"] / median[f"{base} {pass_}"]
                print(f"  {harness.ratio_line(key, ratios[key])}")
        results[model] = dict(shape=shape, median_s=median, step_s=times, ratios=ratios)
    harness.write_json(
        args.out,
        dict(
            **harness.header("attention_layouts", args, "jax", "torch"),
            results=results,
        ),
    )


if __name__ == "__main__":
    main()
