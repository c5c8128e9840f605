r"""Mixture-of-experts dispatch: tfjax's dropless grouped matmuls against a dense one-hot einsum.

    .venv/bin/python benchmarks/moe_dispatch.py [--sizes=2048x256x512x8x2,...] [--rounds=5]
        [--dtype=float32] [--platform=cpu] [--also=xla,megablox,tokamax] [--topology=v5e:1x1]
        [--threads=0] [--tiny]

For each size N x D x F x E x k (tokens, width, expert width, experts, experts per token) the
experts' SwiGLU FFN of N routed tokens, on --platform (this CPU, or `cuda` where a GPU is
attached) in one process, in rotated rounds:
  ragged  tfjax.ops.moe.experts_ffn: the N k (token, expert) pairs sorted by expert, each
          expert's rows through the grouped matmul ops.moe.grouped_matmul chooses for the
          platform, put back by a gather (what MoeMlp runs)
  dense   every expert on every token (einsums over [E, N, F]) and a [N, E] matrix of the
          router's weights, zero where an expert was not chosen: the reference of the tests
  --also  `ragged` with a grouped matmul forced (xla: jax.lax.ragged_dot; megablox; tokamax)
It times the forward pass and forward + backward (the gradients of the kernels and the input),
medians of --rounds, and prints ratios to dense (< 1: faster). It also reports XLA's
cost_analysis of each compiled program (FLOPs, bytes accessed) and, with --topology, of the
programs compiled for one chip of that TPU by libtpu's compiler on this host (nothing runs
there; a Pallas kernel's FLOPs are its custom call's estimate). Results:
benchmarks/results/moe_dispatch.json (or --out).
"""

import functools
import itertools
import os
import sys

import harness


def parse_sizes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in size.split("x")) for size in text.split(",")]


def build(n, d, f, e, k, dtype="float32"):
    """Tokens, their routes (a random router), the kernels and a cotangent, in `dtype` (the
    router's weights too, as MoeMlp casts them to the activations' dtype)."""
    import jax

    from tfjax.ops import moe

    keys = jax.random.split(jax.random.key(0), 6)
    weights, experts, _ = moe.route(jax.random.normal(keys[1], (n, e)), k)
    scale = d**-0.5

    def normal(key, shape, std=1.0):
        return (std * jax.random.normal(key, shape)).astype(dtype)

    kernels = {
        "wi_0": normal(keys[2], (e, d, f), scale),
        "wi_1": normal(keys[3], (e, d, f), scale),
        "wo": normal(keys[4], (e, f, d), f**-0.5),
    }
    x, cotangent = normal(keys[0], (n, d)), normal(keys[5], (n, d))
    return x, weights.astype(dtype), experts, kernels, cotangent


def ragged(x, weights, experts, kernels):
    from tfjax.ops import moe

    return moe.experts_ffn(
        x, weights, experts, kernels, activation="swiglu", num_experts=kernels["wo"].shape[0]
    )


def dense(x, weights, experts, kernels):
    import jax
    import jax.numpy as jnp

    e = kernels["wo"].shape[0]
    # [N, E]: the router's weight of each chosen expert, 0 for the others
    combine = jnp.sum(jax.nn.one_hot(experts, e, dtype=x.dtype) * weights[..., None], axis=1)
    # [E, N, F]
    gate = jnp.einsum("nd,edf->enf", x, kernels["wi_0"])
    up = jnp.einsum("nd,edf->enf", x, kernels["wi_1"])
    # [E, N, D]
    out = jnp.einsum("enf,efd->end", jax.nn.silu(gate) * up, kernels["wo"])
    return jnp.einsum("end,ne->nd", out, combine)


def forced(implementation):
    """`ragged` with ops.moe.grouped_matmul's `implementation` forced (xla, megablox, tokamax)."""

    def way(x, weights, experts, kernels):
        from tfjax.ops import moe

        chosen = moe.grouped_matmul
        moe.grouped_matmul = functools.partial(chosen, implementation=implementation)
        try:  # traced here, under jit
            return ragged(x, weights, experts, kernels)
        finally:
            moe.grouped_matmul = chosen

    return way


WAYS = {"ragged": ragged, "dense": dense}


def programs(way, weights, experts, cotangent):
    """{"fwd": f(x, kernels), "fwd+bwd": the gradients of <f, cotangent>}."""
    import jax
    import jax.numpy as jnp

    def forward(x, kernels):
        return WAYS[way](x, weights, experts, kernels)

    def objective(x, kernels):
        return jnp.sum((forward(x, kernels) * cotangent).astype(jnp.float32))

    return {"fwd": forward, "fwd+bwd": jax.grad(objective, argnums=(0, 1))}


def cost(compiled) -> dict:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return {"flops": analysis.get("flops", 0.0), "bytes": analysis.get("bytes accessed", 0.0)}


def tpu_costs(topology, size, ways, dtype) -> dict:
    """{way: {pass: cost}} of the programs compiled for one chip of `topology`, or an error."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tfjax.runner import aot

    try:
        device = aot.topology_devices(topology)[0]
    except (ValueError, RuntimeError) as e:
        return {"error": str(e)}
    whole = NamedSharding(Mesh([device], ("chip",)), PartitionSpec())
    x, weights, experts, kernels, cotangent = build(*size, dtype)

    def abstract(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)

    out = {}
    for way in ways:
        # The routes are constants of the programs (as in the CPU runs).
        fns = programs(way, weights, experts, cotangent)
        args = jax.tree.map(abstract, (x, kernels))
        with jax.set_mesh(whole.mesh):  # the target ops.moe chooses its grouped matmul for
            out[way] = {p: cost(jax.jit(fn).lower(*args).compile()) for p, fn in fns.items()}
    return out


def measure(size, rounds: int, dtype: str, ways) -> dict:
    import jax
    import numpy as np

    x, weights, experts, kernels, cotangent = build(*size, dtype)
    compiled, errors = {}, {}
    for way in ways:
        try:
            for p, fn in programs(way, weights, experts, cotangent).items():
                compiled[way, p] = jax.jit(fn).lower(x, kernels).compile()
        except Exception as e:  # noqa: BLE001 - a contender that does not compile is reported
            errors[way] = f"{type(e).__name__}: {str(e)[:300]}"
            harness.log(f"  {way}: not compiled: {errors[way]}")
            compiled = {key: c for key, c in compiled.items() if key[0] != way}
    dense_out = np.asarray(compiled["dense", "fwd"](x, kernels), np.float32)
    differences = {
        way: float(np.max(np.abs(np.asarray(c(x, kernels), np.float32) - dense_out)))
        for (way, p), c in compiled.items()
        if p == "fwd" and way != "dense"
    }
    error = differences["ragged"]
    calls = {f"{way} {p}": functools.partial(c, x, kernels) for (way, p), c in compiled.items()}
    times = harness.medians(harness.time_rounds(calls, rounds))
    return {
        "size": dict(zip("NDFEk", size, strict=True)),
        "max_abs_difference": error,
        "max_abs_difference_from_dense": differences,
        "errors": errors,
        "seconds": times,
        "compiled_cost": {f"{way} {p}": cost(c) for (way, p), c in compiled.items()},
    }


def main():
    parser = harness.parser(__doc__, "moe_dispatch")
    parser.add_argument("--sizes", default="2048x256x512x8x2,2048x256x128x32x4")
    parser.add_argument("--rounds", type=int, default=5, help="0: no timings, compile only")
    parser.add_argument("--topology", default="v5e:1x1", help="'' skips the TPU compile")
    parser.add_argument("--threads", type=int, default=0, help="CPU cores to use (0: all)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--platform", default="cpu", help="where the timings run: cpu or cuda")
    parser.add_argument("--also", default="", help="grouped matmuls forced, e.g. xla,megablox")
    args = parser.parse_args()
    # libtpu, when installed, only compiles (--topology): nothing runs on a TPU here.
    os.environ["JAX_PLATFORMS"] = args.platform
    if args.tiny:
        args.sizes, args.rounds = "64x16x32x4x2", 1
    harness.use_cores(args.threads)
    harness.log(" ".join([sys.executable, *sys.argv]))
    result = harness.header("moe_dispatch", args, "jax", "jaxlib", "libtpu")
    result["rounds"], result["topology"], result["results"] = args.rounds, args.topology, []
    result["dtype"], result["platform"] = args.dtype, args.platform
    import jax

    where = jax.devices()[0].device_kind
    harness.log(f"timings on {args.platform}: {where}, {args.dtype}")
    result["device_kind"] = where
    extra = [way for way in args.also.split(",") if way]
    WAYS.update({way: forced(way) for way in extra})
    for size in parse_sizes(args.sizes):
        if not args.rounds:  # the TPU compile alone (--topology)
            row = {"size": dict(zip("NDFEk", size, strict=True))}
        else:
            row = measure(size, args.rounds, args.dtype, list(WAYS))
            name = "[N={N} D={D} F={F} E={E} k={k}]".format(**row["size"])
            harness.log(f"{name} max |ragged - dense| = {row['max_abs_difference']:.2e}")
            s, c = row["seconds"], row["compiled_cost"]
            for p in ("fwd", "fwd+bwd"):
                ragged_s, dense_s = s[f"ragged {p}"], s[f"dense {p}"]
                harness.log(
                    f"  {p}: ragged {1e3 * ragged_s:.2f} ms, dense {1e3 * dense_s:.2f} ms "
                    f"({where}); "
                    + harness.ratio_line(f"ragged/dense {p} time ({where})", ragged_s / dense_s)
                )
                flops = c[f"ragged {p}"]["flops"] / c[f"dense {p}"]["flops"]
                moved = c[f"ragged {p}"]["bytes"] / c[f"dense {p}"]["bytes"]
                harness.log(
                    f"  {p}: {where} compiled FLOPs ragged/dense {flops:.3f}, bytes {moved:.3f}"
                )
                for way in extra:
                    if f"{way} {p}" in s:
                        harness.log(
                            f"  {p}: {way} {1e3 * s[f'{way} {p}']:.2f} ms; "
                            + harness.ratio_line(
                                f"{way}/dense {p} time ({where})", s[f"{way} {p}"] / dense_s
                            )
                        )
        if args.topology:
            tpu_ways = [w for w in WAYS if w != "tokamax"]  # Tokamax's kernel here is the GPU's
            row["tpu_cost"] = tpu_costs(args.topology, size, tpu_ways, args.dtype)
            if "error" in row["tpu_cost"]:
                harness.log(f"  {args.topology}: not compiled: {row['tpu_cost']['error']}")
            else:
                for p, way in itertools.product(("fwd", "fwd+bwd"), tpu_ways):
                    if way == "dense":
                        continue
                    r, d = row["tpu_cost"][way][p], row["tpu_cost"]["dense"][p]
                    harness.log(
                        f"  {p}: {args.topology} compiled FLOPs {way} {r['flops']:.3g}, dense "
                        f"{d['flops']:.3g} (ratio {r['flops'] / d['flops']:.3f}); bytes ratio "
                        f"{r['bytes'] / d['bytes']:.3f}"
                    )
        result["results"].append(row)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
