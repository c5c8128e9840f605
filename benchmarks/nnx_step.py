"""Train-step time of the decoder as a Linen model and as a tfjax.nnx model, same parameters.

One jitted step each (forward, backward, AdamW from Optax): Linen's `apply`, and the NNX model
through `tfjax.nnx.functional.Functional`, as the runner runs it with model.api=nnx: its graph
made once, merged with the parameters inside the jitted step (no `nnx.jit` graph walk in the
hot path). Both start from the same parameters and take the same batches; their
losses are checked to agree. Prints the median step time of each over rotated rounds and the
ratio NNX / Linen.

    .venv/bin/python benchmarks/nnx_step.py --variant=gpt2-medium --batch=8 --seq_len=1024
    .venv/bin/python benchmarks/nnx_step.py --tiny      # smoke test
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfjax.models import decoder as linen_decoder
from tfjax.nnx import functional
from tfjax.nnx.models import decoder as nnx_decoder


def main():
    parser = harness.parser(__doc__, "nnx_step")
    parser.add_argument("--variant", default="gpt2-medium")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    fields = dict(vocab_size=args.vocab, dtype=jnp.dtype(args.dtype), scan_layers=True)
    if args.tiny:
        args.variant, args.vocab, args.batch, args.seq_len, args.rounds = "tiny", 512, 4, 64, 3
        args.dtype = "float32"
        fields.update(vocab_size=512, dtype=jnp.float32)
    fields["max_len"] = args.seq_len
    linen = linen_decoder.Model(args.variant, **fields)
    model = nnx_decoder.Model(args.variant, rngs=nnx.Rngs(0), **fields)
    nnx_fn, linen_params = functional.split(model)  # the params as Linen's tree
    nnx_params = linen_params  # the same starting point
    tx = optax.adamw(1e-4)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, args.vocab, (args.batch, args.seq_len + 1)), jnp.int32)

    def loss_of(logits, tokens):
        labels = tokens[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels
        ).mean()

    def linen_loss(params, tokens):
        return loss_of(linen.apply({"params": params}, tokens[:, :-1])[0], tokens)

    def nnx_loss(params, tokens):
        return loss_of(nnx_fn.apply({"params": params}, tokens[:, :-1])[0], tokens)

    def make_step(loss):
        @jax.jit
        def step(params, opt_state, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step

    steps = {"linen": make_step(linen_loss), "nnx": make_step(nnx_loss)}
    state = {
        "linen": [linen_params, tx.init(linen_params)],
        "nnx": [nnx_params, tx.init(nnx_params)],
    }
    first = {}

    def run(name):
        params, opt_state, value = steps[name](*state[name], tokens)
        state[name][:] = [params, opt_state]
        first.setdefault(name, float(value))
        return value

    times = harness.medians(
        harness.time_rounds({n: lambda n=n: run(n) for n in steps}, args.rounds)
    )
    count = sum(x.size for x in jax.tree.leaves(linen_params))
    harness.log(
        f"{args.variant}: {count / 1e6:.1f} M parameters, {args.dtype} compute, batch "
        f"{args.batch} x {args.seq_len} tokens, AdamW, on {jax.devices()[0].device_kind}; "
        f"median of {args.rounds}"
    )
    for name in steps:
        harness.log(f"  {name:>5}: {times[name] * 1e3:.1f} ms a step, first loss {first[name]:.6f}")
    rel = abs(first["nnx"] - first["linen"]) / abs(first["linen"])
    harness.log(f"  first losses relative difference: {rel:.2e}")
    harness.log(harness.ratio_line("step time nnx/linen", times["nnx"] / times["linen"]))
    if rel > 1e-3:
        raise SystemExit("the two APIs' first losses differ")
    harness.write_json(
        args.out,
        dict(
            harness.header("nnx_step", args, "jax", "flax"),
            args=vars(args),
            backend=jax.default_backend(),
            parameters=count,
            seconds=times,
            first_loss=first,
        ),
    )


if __name__ == "__main__":
    main()
