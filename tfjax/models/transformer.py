"""The encoder-decoder Transformer of Vaswani et al. (2017), "Attention Is All You Need".

Letters: B batch, S source length, T target length, D model width, V vocab.

Post-LN blocks (LN(x + Dropout(F(x)))), ReLU FFN, sinusoidal positions added to embeddings
scaled by sqrt(d_model), one embedding matrix shared by source, target and the pre-softmax
projection (a shared source-target vocabulary, as in the paper), dropout on the embedding sums
and on every sub-layer's output.

    model = transformer.Model(variant="base", vocab_size=37000)
    logits, aux = model.apply(variables, inputs, targets)   # [B, S], [B, T] -> [B, T, V]
    hidden, aux = model.apply(variables, inputs, targets, apply_head=False)  # -> [B, T, D]
    logits = model.apply(variables, hidden, method="logits")                 # -> [B, T, V]

T5 (Raffel et al., 2020; its v1.1 layout, as in Flan-T5) is this model with other fields, see
`T5`: pre-LN stacks with RMSNorm, no biases, unscaled embeddings and no added positions, but a
learned relative position bias per stack (`position="relative"`, T5's buckets) computed once
and added to every layer's self-attention logits, unscaled attention logits
(`attention_scale=1`), a gated-GELU FFN and an output projection of its own.

`targets` are shifted right inside the model (0 is the start token), so logits at t predict
targets[t]. For generation call `encode` once, then `decode` token by token with decode=True,
with Flax's "cache" collection (mutable=["cache"]) or an explicit cache the caller holds, as in
tfjax.models.decoder (T5's relative bias then reads the cache's length from it):

    cache = model.init_cache(batch_size, max_target_length)
    (logits, states), cache = model.apply(variables, encoded, inputs, token, decode=True,
                                          cache=cache, method="decode")

The second form in the first example lets a loss make the logits in slices of T
(`loss.chunks`), never all [B, T, V] at once.
"""

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.models import common
from tfjax.models.common import check_tokens
from tfjax.nn import axes, masks
from tfjax.ops.cache import max_length, query_positions
from tfjax.specs import transformer as transformer_spec

# The presets and choices are the spec's (tfjax.specs.transformer).
VARIANTS, T5, POSITIONS = transformer_spec.VARIANTS, transformer_spec.T5, transformer_spec.POSITIONS


class Transformer(common.FromSpec, nn.Module):
    """Encoder-decoder Transformer; see the module docstring. Its fields, their checks and what
    they build are tfjax.specs.transformer.Transformer's (`spec`)."""

    SPEC = transformer_spec.Transformer
    locals().update(common.spec_fields(SPEC))

    def block_config(self) -> tnn.BlockConfig:
        """The spec's `block_config`: the encoder layers' config (the decoder's made causal,
        with cross-attention)."""
        return self.spec.block_config()

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """The spec's `init_cache`: an empty explicit KV cache of the decoder's self-attention
        for `cache=` to `decode` with decode=True."""
        return self.spec.init_cache(batch_size, length, dtype=dtype, sharding=sharding)

    @property
    def tied(self) -> bool:
        """The spec's `tied`: whether the logits are the target embedding^T."""
        return self.spec.tied

    def setup(self):
        def embed(name):
            return common.embed(
                self, self.vocab_size, name, scale_by_sqrt_width=self.scale_embeddings
            )

        def stack(config, name):
            # Pre-norm stacks always have a final norm; post-norm ones with final_norm.
            final_norm = True if self.final_norm else None
            return common.stack(
                self, config, name, final_norm=final_norm, kernel_init=self.kernel_init
            )

        self.embed = embed("embed")
        if not self.share_embeddings:
            self.target_embed = embed("target_embed")
        if not self.tied:
            self.output_proj = tnn.ffn.dense(
                self.vocab_size,
                (axes.EMBED, axes.VOCAB),
                name="output_proj",
                use_bias=False,
                kernel_init=self.kernel_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )
        if self.logits_bias:
            self.output_bias = self.param(
                "output_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
                (self.vocab_size,),
                self.param_dtype,
            )
        if self.position == "relative":  # one bias per stack, shared by its layers
            bias = functools.partial(
                tnn.position.RelativePositionBias,
                self.num_heads,
                num_buckets=self.relative_buckets,
                max_distance=self.relative_max_distance,
                param_dtype=self.param_dtype,
            )
            self.encoder_position_bias = bias(bidirectional=True)
            self.decoder_position_bias = bias(bidirectional=False)
        config = self.block_config()
        self.encoder = stack(config, "encoder")
        self.decoder = stack(
            dataclasses.replace(config, causal=True, cross_attention=True), "decoder"
        )
        self.dropout = nn.Dropout(self.dropout_rate)
        self.decode_positions = tnn.position.DecodePositions()

    def _relative_bias(self, which, length, decode_positions=None, cache=None):
        """[1, N, T, S] T5 bias of the stack `which` (None for other positions). By arange
        positions also for packed rows: it depends on key - query offsets only, which are the
        same within each packed segment (pairs across segments are masked), and it stays
        [1, ...] instead of [B, ...]. Decoding: `decode_positions` [T] against the whole cache
        (the explicit `cache` gives its length; else the collection keeps it)."""
        if self.position != "relative":
            return None
        bias = getattr(self, f"{which}_position_bias")
        if cache is not None:
            return bias(decode_positions, jnp.arange(max_length(cache)))
        if decode_positions is not None:
            return bias(decode_positions, decode=True)
        return bias(jnp.arange(length))

    def _stack_output(self, x, train):
        return self.dropout(x, deterministic=not train) if self.output_dropout else x

    def _embed(self, embed, tokens, positions, train):
        # [B, T, D]
        x = embed(tokens)
        if self.position == "sinusoidal":
            x = x + tnn.sinusoidal(positions, self.width, dtype=x.dtype)
        return self.dropout(x, deterministic=not train)

    def logits(self, y):
        """The output projection: y [B, T, D] final decoder states -> [B, T, V] logits."""
        # [B, T, V]
        if self.tied:
            embed = self.embed if self.share_embeddings else self.target_embed
            logits = embed.attend(y)
        else:
            logits = self.output_proj(y)
        if self.logits_bias:
            logits = logits + self.output_bias.astype(logits.dtype)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def encode(self, inputs, *, inputs_segment_ids=None, inputs_positions=None, train=False):
        """inputs: [B, S] source ids (0 = padding) -> [B, S, D] encoder output."""
        check_tokens(inputs, "inputs")
        positions = jnp.arange(inputs.shape[1]) if inputs_positions is None else inputs_positions
        x = self._embed(self.embed, inputs, positions, train)
        # without ids, padding (id 0) attends to nothing, is never attended
        inputs_segment_ids = masks.ids_or_padding(inputs_segment_ids, inputs)
        bias = self._relative_bias("encoder", inputs.shape[1])
        x = self.encoder(x, bias=bias, segment_ids=inputs_segment_ids, train=train)
        return self._stack_output(x, train)

    def decode(
        self,
        encoded,
        inputs,
        decoder_inputs,
        *,
        targets=None,
        targets_segment_ids=None,
        inputs_segment_ids=None,
        targets_positions=None,
        train=False,
        decode=False,
        apply_head=True,
        cache=None,
    ):
        """Decoder logits for already-shifted decoder inputs.

        Args:
          encoded: [B, S, D] from `encode`.
          inputs: [B, S] source ids (for the cross-attention padding mask).
          decoder_inputs: [B, T] ids; one token per call when decode=True.
          targets: [B, T] unshifted targets, for the decoder's padding mask in training.
          apply_head: False gives the final decoder states in place of the logits.
          cache: decode=True: the explicit KV cache (`init_cache`) in place of the "cache"
            collection; positions continue from what it holds.
        Returns:
          ([B, T, V] logits, [B, T, D] final decoder states); with `cache`, (that, the
          updated cache).
        """
        check_tokens(decoder_inputs, "decoder_inputs")
        t = decoder_inputs.shape[1]
        counter = self.decode_positions if decode else None
        positions = query_positions(t, targets_positions, cache, counter)
        embed = self.embed if self.share_embeddings else self.target_embed
        y = self._embed(embed, decoder_inputs, positions, train)
        # Segment ids, not [T, S] masks (the attention kernels compare them block by block):
        # packed rows' own, else 1 for tokens and 0 for padding. Decoding (no targets) has a
        # causal cache and masks only the padded source keys.
        inputs_segment_ids = masks.ids_or_padding(inputs_segment_ids, inputs)
        targets_segment_ids = masks.ids_or_padding(targets_segment_ids, targets)
        bias = self._relative_bias("decoder", t, positions if decode else None, cache)
        y = self.decoder(
            y,
            encoded,
            bias=bias,
            segment_ids=targets_segment_ids,
            context_segment_ids=inputs_segment_ids,
            train=train,
            decode=decode,
            cache=cache,
        )
        if cache is not None:
            y, cache = y
        y = self._stack_output(y, train)
        out = (self.logits(y) if apply_head else y), y
        return out if cache is None else (out, cache)

    def __call__(self, inputs, targets, *, train: bool = False, **options):
        """Teacher-forced logits: inputs [B, S] and targets [B, T] (0 = padding; shifted right
        inside) -> ([B, T, V] logits, aux) with aux["encoded"] [B, S, D] and aux["pre_logits"]
        [B, T, D]. `options`: inputs_/targets_segment_ids, inputs_/targets_positions (packed
        rows) and apply_head, as tfjax.specs.transformer.teacher_forced takes them."""
        return transformer_spec.teacher_forced(self, inputs, targets, train=train, **options)


def Model(variant: str | None = None, **overrides) -> Transformer:  # noqa: N802 (a factory)
    """Transformer(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return Transformer.of(transformer_spec.Model(variant, **overrides))
