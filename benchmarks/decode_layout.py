"""Decoding speed with the parameters laid out for the token loop against the training layout.

Greedy generation from a decoder preset whose parameters are stored as training keeps them
(float32; sharded over an FSDP mesh of every device with --fsdp), bf16 compute, random weights.
Times `tfjax.decode.generate` with `layout="as-given"` (every step of the token loop reads the
stored parameters: casts them, and under FSDP gathers them, per token) and `layout="auto"` (laid
out once per call: cast to bf16, replicated), interleaved after a warm-up compile, and prints
tokens per second for each and their ratio. Both give the same tokens (checked).

    .venv/bin/python benchmarks/decode_layout.py --variant=llama-3.2-1b --batch=8 \
        --new_tokens=256 [--fsdp] [--rounds 5]
    .venv/bin/python benchmarks/decode_layout.py --tiny      # smoke test
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np

from tfjax import decode, sharding
from tfjax.models import decoder

LAYOUTS = ("as-given", "auto")


def main():
    parser = harness.parser(__doc__, "decode_layout")
    parser.add_argument("--variant", default="llama-3.2-1b")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsdp", action="store_true", help="params FSDP over every device")
    args = parser.parse_args()
    fields = dict(vocab_size=args.vocab, dtype=jnp.bfloat16, scan_layers=True)
    if args.tiny:
        args.variant, args.rounds, args.new_tokens, args.batch = "tiny", 2, 8, 8
        args.vocab = 512
        fields.update(vocab_size=512, width=128, num_heads=8, num_kv_heads=8, mlp_dim=512)
    model = decoder.Model(variant=args.variant, max_len=args.prompt + args.new_tokens, **fields)
    mesh = sharding.make_mesh({"data": 1, "fsdp": len(jax.devices()) if args.fsdp else 1})
    rules = sharding.DEFAULT_RULES
    prompts = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 1, args.vocab)
    with sharding.logical_context(mesh, rules):
        ids = jnp.zeros((1, 1), jnp.int32)
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))["params"]
        where = sharding.logical_shardings(boxed, mesh, rules)
        init = jax.jit(lambda: model.init(jax.random.key(0), ids)["params"], out_shardings=where)
        params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, init())
    prompts = jax.device_put(prompts, sharding.batch_sharding(mesh, rules, 2))
    count = sum(x.size for x in jax.tree.leaves(params))
    eos = args.vocab - 1  # a random model rarely emits it; rows that do end early (same in both)

    def run(layout):
        with sharding.logical_context(mesh, rules):
            return decode.generate(
                model, params, prompts, max_new_tokens=args.new_tokens, eos_id=eos, layout=layout
            )

    tokens = {layout: np.asarray(run(layout)[0]) for layout in LAYOUTS}
    same = bool((tokens["as-given"] == tokens["auto"]).all())
    generated = int(np.minimum(decode.first_eos(tokens["auto"], eos) + 1, args.new_tokens).sum())
    times = harness.medians(
        harness.time_rounds({n: lambda n=n: run(n) for n in LAYOUTS}, args.rounds)
    )
    harness.log(
        f"{args.variant}: {count / 1e9:.2f} B parameters (float32 stored, bf16 compute) on "
        f"{len(jax.devices())} x {jax.devices()[0].device_kind}, mesh {dict(mesh.shape)}; "
        f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, "
        f"median of {args.rounds}"
    )
    rows = []
    for layout in LAYOUTS:
        rate = generated / times[layout]
        rows.append(dict(layout=layout, seconds=times[layout], tokens_per_s=rate))
        harness.log(f"  layout={layout:>8}: {times[layout]:.3f} s, {rate:,.0f} tokens/s")
    harness.log(f"  same tokens: {same}")
    harness.log(harness.ratio_line("speed auto / as-given", times["as-given"] / times["auto"]))
    if not same:
        raise SystemExit("the layouts generated different tokens")
    harness.write_json(
        args.out,
        dict(
            harness.header("decode_layout", args, "jax", "flax"),
            args=vars(args),
            backend=jax.default_backend(),
            parameters=count,
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
