r"""Decoding caches at the published sizes: bytes per generated token and the part that does not
grow with the context, for each cache kind tfjax's decoder builds.

    .venv/bin/python benchmarks/cache_memory.py [--presets=deepseek-v3,llama-3.1-8b]
        [--lengths=4096,32768] [--tiny]

Each preset's explicit cache (`spec.init_cache(1, S, dtype=bfloat16)`, the layout
`tfjax.decode.generate` fills) is built abstractly (jax.eval_shape: nothing is allocated) at
the two context lengths S; bytes per token is the growth between them over the tokens added,
and the constant part what is left at S = 0. The kinds: "kv" (tfjax.ops.KVCache: keys and
values per kv head), "latent" (tfjax.ops.LatentCache of multi-head latent attention: the
compressed latent and the shared rotated key per token), "recurrent" (a linear-attention
layer's state, which does not grow). For latent attention the table also gives the per-head
keys and values the same attention would store without the latent (N heads of Hn + Hr keys and
Hv values a token and layer: transformers' DeepseekV3 cache) and the ratio. Results:
benchmarks/results/cache_memory.json (or --out) and a Markdown table on stdout.
"""

import collections

import harness

from tfjax.runner import startup

startup.choose_platform()  # before JAX starts: no plugin errors on a CPU host
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tfjax.specs import decoder  # noqa: E402

PRESETS = ("deepseek-v3", "qwen3.5-35b-a3b", "qwen3-30b-a3b", "llama-3.1-8b")
TINY = ("deepseek-tiny", "qwen3.5-tiny", "modern-tiny")


def cache_bytes(spec, length: int) -> dict[str, int]:
    """{cache kind: bytes} of spec's cache for one row of `length` tokens, in bfloat16."""
    cache = jax.eval_shape(lambda: spec.init_cache(1, length, dtype=jnp.bfloat16))
    sizes = collections.Counter()
    for layer in jax.tree_util.tree_leaves(cache, is_leaf=lambda x: hasattr(x, "_fields")):
        kind = {"KVCache": "kv", "LatentCache": "latent"}.get(type(layer).__name__, "recurrent")
        sizes[kind] += sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(layer))
    return dict(sizes)


def per_head_bytes_per_token(spec) -> int | None:
    """Latent attention's keys and values expanded per head, bytes a token (bfloat16)."""
    if spec.kv_lora_rank is None:
        return None
    key = spec.head_dim + spec.qk_rope_head_dim
    value = spec.v_head_dim or spec.head_dim
    return spec.num_layers * spec.num_heads * (key + value) * 2


def measure(preset: str, short: int, long: int) -> dict:
    spec = decoder.Model(preset, vocab_size=decoder.VARIANTS[preset].get("vocab_size", 32000))
    at_short, at_long = cache_bytes(spec, short), cache_bytes(spec, long)
    row = {"preset": preset, "kinds": {}}
    for kind in at_long:
        per_token = (at_long[kind] - at_short[kind]) / (long - short)
        row["kinds"][kind] = {
            "bytes_per_token": per_token,
            "constant_bytes": at_short[kind] - per_token * short,
            f"bytes_at_{long}": at_long[kind],
        }
    expanded = per_head_bytes_per_token(spec)
    if expanded:
        row["per_head_bytes_per_token"] = expanded
        row["latent_over_per_head"] = row["kinds"]["latent"]["bytes_per_token"] / expanded
    return row


def main():
    p = harness.parser(__doc__, "cache_memory")
    p.add_argument("--presets", default=None, help="comma-separated decoder presets")
    p.add_argument("--lengths", default="4096,32768", help="two context lengths")
    args = p.parse_args()
    presets = args.presets.split(",") if args.presets else (TINY if args.tiny else PRESETS)
    short, long = (int(x) for x in args.lengths.split(","))
    rows = [measure(preset, short, long) for preset in presets]
    harness.log(f"| preset | cache kind | bytes per token | constant bytes | at {long} tokens |")
    harness.log("|---|---|---|---|---|")
    for row in rows:
        for kind, m in row["kinds"].items():
            harness.log(
                f"| {row['preset']} | {kind} | {m['bytes_per_token']:,.0f} | "
                f"{m['constant_bytes']:,.0f} | {m[f'bytes_at_{long}'] / 2**30:.2f} GiB |"
            )
        if "per_head_bytes_per_token" in row:
            harness.log(
                f"| {row['preset']} | per-head keys and values (no latent) | "
                f"{row['per_head_bytes_per_token']:,} | 0 | "
                f"{row['per_head_bytes_per_token'] * long / 2**30:.2f} GiB |"
            )
            harness.log(
                harness.ratio_line(
                    f"{row['preset']} latent/per_head", row["latent_over_per_head"], digits=4
                )
            )
    result = harness.header("cache_memory", args, "jax")
    harness.write_json(args.out, {**result, "lengths": [short, long], "rows": rows})


if __name__ == "__main__":
    main()
