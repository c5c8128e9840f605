"""GPT-like causal language models: GPT-2 (Radford et al., 2019) and a modern variant.

Letters: B batch, T length, D model width, V vocab.

What GPT-2, the modern variant (as in Llama), Gemma 2 / 3 and GPT-OSS change is told once, in
the family's spec (tfjax.specs.decoder). Local (sliding-window) and global layers of Gemma's
`attention_pattern` differ only so and keep one parameter shape: a scanned stack passes each
layer's kind as a scanned index (tfjax.nn.Stack's `variants`). GPT-OSS's attention sinks
(`attention_sinks`) are a learned logit per query head in each softmax's denominator.

Mixtures of experts (num_experts > 0; Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek): each layer's FFN
is a tfjax.nn.MoeMlp, a router choosing experts_per_token of num_experts expert MLPs of width
expert_mlp_dim per token, after first_dense_layers layers with a dense FFN of width mlp_dim
(DeepSeek's first_k_dense_replace; those form a stack of their own, "dense_decoder", before
"decoder"). Training adds the layers' load-balancing and router z losses with their weights.

    model = decoder.Model(variant="gpt2-small", vocab_size=50257)
    logits, aux = model.apply(variables, tokens)            # [B, T] -> [B, T, V]
    hidden, aux = model.apply(variables, tokens, apply_head=False)      # -> [B, T, D]
    logits = model.apply(variables, hidden, method="logits")            # -> [B, T, V]

The second form lets a loss apply the output projection to slices of T (`loss.chunks`), so
that the [B, T, V] logits of a large vocabulary are never all in memory.

logits[:, t] predict tokens[:, t + 1]. For generation (tfjax.decode.generate does all this)
the KV cache is either explicit, a pytree the caller makes, passes and gets back, laid out and
sharded as it chooses:

    cache = model.init_cache(batch_size, max_length)         # a tfjax.ops.KVCache per layer
    (logits, aux), cache = model.apply(variables, prompt, decode=True, cache=cache)
    (logits, aux), cache = model.apply(variables, next_token, decode=True, cache=cache)

or Flax's "cache" collection: initialise it with `model.init(rng, tokens_of_max_length,
decode=True)` and call with one token, decode=True and mutable=["cache"]. Both compute the
same numbers.
"""

import flax.linen as nn

from tfjax import nn as tnn
from tfjax.models import common
from tfjax.models.common import check_tokens
from tfjax.nn import axes
from tfjax.ops import head
from tfjax.ops.activations import softcap
from tfjax.ops.cache import query_positions
from tfjax.specs import decoder as decoder_spec

# The presets and choices are the spec's (tfjax.specs.decoder).
VARIANTS = decoder_spec.VARIANTS
POSITIONS, NORM_POSITIONS, LAYER_KINDS = (
    decoder_spec.POSITIONS,
    decoder_spec.NORM_POSITIONS,
    decoder_spec.LAYER_KINDS,
)
MOE_ONLY = decoder_spec.MOE_ONLY


class Decoder(common.FromSpec, nn.Module):
    """GPT-like decoder; see the module docstring. Its fields, their checks and what they build
    are tfjax.specs.decoder.Decoder's (`spec`)."""

    SPEC = decoder_spec.Decoder
    locals().update(common.spec_fields(SPEC))

    def layer_variants(self):
        """The spec's `layer_variants`: (the stack's attention variants, each layer's index)."""
        return self.spec.layer_variants()

    def block_config(self, *, experts: bool = True) -> tnn.BlockConfig:
        """The spec's `block_config`: the layers' config."""
        return self.spec.block_config(experts=experts)

    def stacks(self):
        """The spec's `stacks`: (name, config, first layer, number of layers) of each stack."""
        return self.spec.stacks()

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """The spec's `init_cache`: an empty explicit KV cache for `cache=` with decode=True."""
        return self.spec.init_cache(batch_size, length, dtype=dtype, sharding=sharding)

    def setup(self):
        # The modules the output head shares with __call__, here so that `logits` can be
        # applied on its own; everything else is declared inline in __call__.
        self.embed = common.embed(self, self.vocab_size, None, **self.spec.embed_options())
        if not self.tie_embeddings:
            self.output_proj = tnn.ffn.dense(
                self.vocab_size,
                (axes.EMBED, axes.VOCAB),
                name=None,  # named by the attribute
                use_bias=False,
                kernel_init=nn.initializers.normal(self.init_stddev),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                dot_general=head.dot_general,  # its two gradients made together
            )

    def logits(self, x):
        """The output head: x [B, T, D] final hidden states -> [B, T, V] logits."""
        # [B, T, V]
        logits = self.embed.attend(x) if self.tie_embeddings else self.output_proj(x)
        if self.final_logit_softcap is not None:
            logits = softcap(logits, self.final_logit_softcap)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    @nn.compact
    def __call__(
        self,
        tokens,
        *,
        segment_ids=None,
        positions=None,
        train=False,
        decode=False,
        apply_head=True,
        cache=None,
    ):
        """Args:
          tokens: [B, T] ids.
          segment_ids, positions: [B, T] for packed rows (attention stays within a segment).
          decode: use the KV cache (one or more new tokens per call).
          apply_head: False returns the final hidden states [B, T, D] in place of the logits
            (`logits(hidden)` gives the logits).
          cache: decode=True: the explicit KV cache (`init_cache`) in place of the "cache"
            collection; positions continue from what it holds.
        Returns:
          ([B, T, V] logits, aux) with aux["pre_logits"] [B, T, D]; with `cache`, (that, the
          updated cache).
        """
        check_tokens(tokens, "tokens")
        t = tokens.shape[1]
        self.spec.check_length(t)
        init = nn.initializers.normal(self.init_stddev)
        embed = self.embed
        counter = tnn.position.DecodePositions() if decode else None
        positions = query_positions(t, positions, cache, counter)
        # [B, T, D]
        x = embed(tokens)
        if self.position == "learned":
            x = x + common.learned_positions(self)(positions)
        elif self.position == "sinusoidal":
            x = x + tnn.sinusoidal(positions, self.width, dtype=x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        pos = positions if positions.ndim == 2 else positions[None]
        variants = self.layer_variants()[1]
        stacks, caches = self.stacks(), []
        stack_caches = self.spec.stack_caches(cache)
        for i, (name, config, first, n) in enumerate(stacks):
            layers = common.stack(
                self,
                config,
                name,
                num_layers=n,
                variants=None if variants is None else variants[first : first + n],
                kernel_init=init,
                final_norm=None if i == len(stacks) - 1 else False,
            )
            x = layers(
                x,
                segment_ids=segment_ids,
                positions=pos,
                train=train,
                decode=decode,
                cache=stack_caches[i],
            )
            if cache is not None:
                x, stack_cache = x
                caches.append(stack_cache)
        if cache is not None:
            cache = self.spec.join_caches(caches)
        out = (self.logits(x) if apply_head else x), {"pre_logits": x}
        return out if cache is None else (out, cache)


def Model(variant: str | None = None, **overrides) -> Decoder:  # noqa: N802 (a factory)
    """Decoder(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return Decoder.of(decoder_spec.Model(variant, **overrides))
