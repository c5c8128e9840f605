"""Decoding speed with and without the KV cache against output length.

For the decoder (GPT-like) and the encoder-decoder, times greedy generation of N tokens
(EOS never emitted, so every row runs to N) with `use_cache=True` (one token per step through
the cache) and `use_cache=False` (the whole prefix recomputed every step), interleaving the two
after a warm-up compile, and prints tokens per second, their ratio, and the cached path's time
per doubling of N (2.0 = linear). Writes benchmarks/results/decode_speed.json (or --out).

    .venv/bin/python benchmarks/decode_speed.py [--lengths 32,64,128,256,512] [--repeats 3]
"""

import functools

import harness
import jax

from tfjax import decode
from tfjax.models import decoder, transformer


def main():
    parser = harness.parser(__doc__, "decode_speed", tiny=False)
    parser.add_argument("--lengths", default="32,64,128,256,512")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = 1000
    models = {
        "decoder": decoder.Model(
            variant="tiny",
            vocab_size=vocab,
            width=128,
            num_heads=4,
            mlp_dim=512,
            max_len=max(lengths) + 8,
        ),
        "encoder-decoder": transformer.Model(
            variant="tiny", vocab_size=vocab, width=128, num_heads=4, mlp_dim=512
        ),
    }
    inputs = jax.random.randint(jax.random.key(0), (args.batch, 8), 1, vocab)
    rows = []
    print(f"backend {jax.default_backend()}, batch {args.batch}, greedy, median of {args.repeats}")
    print(
        f"{'model':>16} {'N':>5} {'cached tok/s':>13} {'uncached tok/s':>15} {'speed-up':>9} "
        f"{'cached t(2N)/t(N)':>18}"
    )
    for name, model in models.items():
        init_args = (inputs,) if name == "decoder" else (inputs, inputs)
        params = model.init(jax.random.key(1), *init_args)["params"]
        prev = None
        for n in lengths:
            eos = vocab - 1  # checked below never to be generated, so every row runs to N
            fns = {
                cache: functools.partial(
                    decode.generate,
                    model,
                    params,
                    inputs,
                    max_new_tokens=n,
                    eos_id=eos,
                    use_cache=cache,
                )
                for cache in (True, False)
            }
            tokens, _ = fns[True]()
            assert not (tokens == eos).any(), "EOS was generated: pick another id"
            times = harness.medians(harness.time_rounds(fns, args.repeats))
            t_c, t_u = times[True], times[False]
            row = dict(
                model=name,
                length=n,
                cached_s=t_c,
                uncached_s=t_u,
                cached_tokens_per_s=args.batch * n / t_c,
                uncached_tokens_per_s=args.batch * n / t_u,
                speedup=t_u / t_c,
            )
            growth = ""
            if prev:
                row["cached_growth"] = t_c / prev["cached_s"]
                growth = f"{row['cached_growth']:.2f}"
            print(
                f"{name:>16} {n:>5} {row['cached_tokens_per_s']:>13.0f} "
                f"{row['uncached_tokens_per_s']:>15.0f} {row['speedup']:>9.2f} {growth:>18}"
            )
            rows.append(row)
            prev = row
    harness.write_json(
        args.out, {"args": vars(args), "backend": jax.default_backend(), "rows": rows}
    )


if __name__ == "__main__":
    main()
