"""The encoder-decoder Transformer family (tfjax.models.transformer: Vaswani et al.'s, and T5
v1.1 / Flan-T5 with its relative position bias) as a Flax NNX module.

Letters: B batch, S source length, T target length, D model width, V vocab.

The same fields, presets (`transformer.VARIANTS`) and checks as the Linen model: both are
built from the family's spec (tfjax.specs.transformer.Transformer, its `spec`), which holds,
checks and translates the fields into the layers' configs, so a field, preset or check added
there holds in both; this file adds only the NNX modules, which compute the same function with
the same parameter tree:

    from flax import nnx
    from tfjax.nnx.models import transformer
    model = transformer.Model(variant="flan-t5-small", rngs=nnx.Rngs(0))
    logits, aux = model(inputs, targets)           # [B, S], [B, T] -> [B, T, V]
    encoded = model.encode(inputs)                 # [B, S, D]
    cache = model.init_cache(batch_size, max_target_length)
    (logits, states), cache = model.decode(encoded, inputs, token, cache=cache)
    nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the Linen model's params tree

Decoding passes the explicit KV cache (`init_cache`, `cache=`), as the Linen model's explicit
form does; there is no "cache" collection (T5's relative bias reads the cache's length from it).
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from tfjax.nnx import blocks, models
from tfjax.ops import axes, masks
from tfjax.ops.cache import max_length, query_positions
from tfjax.ops.position import sinusoidal
from tfjax.specs import transformer as transformer_spec
from tfjax.specs.common import check_tokens

VARIANTS = transformer_spec.VARIANTS


class Transformer(nnx.Module):
    """Encoder-decoder Transformer in NNX; see the module docstring. `spec`: the
    tfjax.specs.transformer Transformer whose fields say what to build, or a Linen
    tfjax.models.transformer Transformer (unbound), whose fields and methods are its spec's;
    held as its family spec, `spec` (`models.family_spec`)."""

    def __init__(self, spec: transformer_spec.Transformer, *, rngs: nnx.Rngs):
        self.spec = spec = models.family_spec(spec)
        d, v = spec.width, spec.vocab_size
        dtypes = dict(dtype=spec.dtype, param_dtype=spec.param_dtype)

        def embed():
            return blocks.Embed(
                v, d, scale_by_sqrt_width=spec.scale_embeddings, rngs=rngs, **dtypes
            )

        self.embed = embed()
        if not spec.share_embeddings:
            self.target_embed = embed()
        if not spec.tied:
            self.output_proj = blocks.dense(
                d,
                v,
                (axes.EMBED, axes.VOCAB),
                use_bias=False,
                kernel_init=spec.kernel_init,
                rngs=rngs,
                **dtypes,
            )
        if spec.logits_bias:
            self.output_bias = blocks.param(
                rngs, nn.initializers.zeros, (v,), spec.param_dtype, (axes.VOCAB,)
            )
        if spec.position == "relative":  # one bias per stack, shared by its layers
            for which, bidirectional in (("encoder", True), ("decoder", False)):
                bias = blocks.RelativePositionBias(
                    spec.num_heads,
                    bidirectional=bidirectional,
                    num_buckets=spec.relative_buckets,
                    max_distance=spec.relative_max_distance,
                    param_dtype=spec.param_dtype,
                    rngs=rngs,
                )
                setattr(self, f"{which}_position_bias", bias)
        config = spec.block_config()

        def stack(config):
            # Pre-norm stacks always have a final norm; post-norm ones with final_norm.
            return blocks.Stack(
                config,
                spec.num_layers,
                d,
                scan_layers=spec.scan_layers,
                remat_policy=spec.remat_policy,
                final_norm=True if spec.final_norm else None,
                kernel_init=spec.kernel_init,
                rngs=rngs,
                **dtypes,
            )

        self.encoder = stack(config)
        self.decoder = stack(dataclasses.replace(config, causal=True, cross_attention=True))
        # Where training's dropout keys come from (the "dropout" stream, else "default").
        self.rngs = rngs.fork()

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """The Linen model's `init_cache`: an empty explicit KV cache for `decode`'s `cache=`."""
        return self.spec.init_cache(batch_size, length, dtype=dtype, sharding=sharding)

    def _key(self, train, rngs):
        return (rngs or self.rngs).dropout() if train else None

    def _relative_bias(self, which, length, decode_positions=None, cache=None):
        """[1, N, T, S] T5 bias of the stack `which` (None for other positions), by arange
        positions (as the Linen model's, which says why); decoding: `decode_positions` [T]
        against the whole cache."""
        if self.spec.position != "relative":
            return None
        bias = getattr(self, f"{which}_position_bias")
        if cache is not None:
            return bias(decode_positions, jnp.arange(max_length(cache)))
        return bias(jnp.arange(length))

    def _stack_output(self, x, key):
        return blocks.dropout(x, self.spec.dropout_rate, key) if self.spec.output_dropout else x

    def _embed(self, embed, tokens, positions, key):
        # [B, T, D]
        x = embed(tokens)
        if self.spec.position == "sinusoidal":
            x = x + sinusoidal(positions, self.spec.width, dtype=x.dtype)
        return blocks.dropout(x, self.spec.dropout_rate, key)

    def logits(self, y):
        """The output projection: y [B, T, D] final decoder states -> [B, T, V] logits."""
        spec = self.spec
        # [B, T, V]
        if spec.tied:
            embed = self.embed if spec.share_embeddings else self.target_embed
            logits = embed.attend(y)
        else:
            logits = self.output_proj(y)
        if spec.logits_bias:
            logits = logits + self.output_bias[...].astype(logits.dtype)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def encode(
        self,
        inputs,
        *,
        inputs_segment_ids=None,
        inputs_positions=None,
        train: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        """The Linen model's `encode`: inputs [B, S] source ids (0 = padding) -> [B, S, D]."""
        check_tokens(inputs, "inputs")
        key = self._key(train, rngs)
        positions = jnp.arange(inputs.shape[1]) if inputs_positions is None else inputs_positions
        x = self._embed(self.embed, inputs, positions, blocks.fold_key(key, 0))
        # without ids, padding (id 0) attends to nothing, is never attended
        inputs_segment_ids = masks.ids_or_padding(inputs_segment_ids, inputs)
        bias = self._relative_bias("encoder", inputs.shape[1])
        x = self.encoder(
            x, bias=bias, segment_ids=inputs_segment_ids, dropout_rng=blocks.fold_key(key, 1)
        )
        return self._stack_output(x, blocks.fold_key(key, 2))

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
        train: bool = False,
        decode: bool = False,
        apply_head: bool = True,
        cache=None,
        rngs: nnx.Rngs | None = None,
    ):
        """The Linen model's `decode`: decoder logits for already-shifted decoder inputs
        [B, T] against `encoded` [B, S, D] of `inputs` [B, S] -> ([B, T, V] logits, [B, T, D]
        final decoder states); with `cache` (decoding), (that, the updated cache).

        decode=True needs the explicit `cache` (there is no "cache" collection).
        """
        spec = self.spec
        check_tokens(decoder_inputs, "decoder_inputs")
        if decode and cache is None:
            raise ValueError(
                "decode=True: tfjax.nnx decodes with the explicit cache (cache=model.init_cache"
                "(...)); it has no 'cache' collection"
            )
        key = self._key(train, rngs)
        t = decoder_inputs.shape[1]
        positions = query_positions(t, targets_positions, cache)
        embed = self.embed if spec.share_embeddings else self.target_embed
        y = self._embed(embed, decoder_inputs, positions, blocks.fold_key(key, 0))
        inputs_segment_ids = masks.ids_or_padding(inputs_segment_ids, inputs)
        targets_segment_ids = masks.ids_or_padding(targets_segment_ids, targets)
        bias = self._relative_bias("decoder", t, positions, cache)
        y = self.decoder(
            y,
            encoded,
            bias=bias,
            segment_ids=targets_segment_ids,
            context_segment_ids=inputs_segment_ids,
            dropout_rng=blocks.fold_key(key, 1),
            cache=cache,
        )
        if cache is not None:
            y, cache = y
        y = self._stack_output(y, blocks.fold_key(key, 2))
        out = (self.logits(y) if apply_head else y), y
        return out if cache is None else (out, cache)

    def __call__(
        self, inputs, targets, *, train: bool = False, rngs: nnx.Rngs | None = None, **options
    ):
        """The Linen model's call (tfjax.specs.transformer.teacher_forced, which takes the
        `options`): teacher-forced logits, inputs [B, S] and targets [B, T] (0 = padding;
        shifted right inside) -> ([B, T, V] logits, aux) with aux["encoded"] [B, S, D] and
        aux["pre_logits"] [B, T, D].

        train: dropout on, its keys from `rngs` (else the model's own) "dropout" stream.
        """
        return transformer_spec.teacher_forced(
            self, inputs, targets, train=train, rngs=rngs, **options
        )


def Model(variant: str | None = None, *, rngs: nnx.Rngs, **overrides) -> Transformer:  # noqa: N802
    """Transformer(spec=tfjax.models.transformer.Model(variant, **overrides)): the Linen
    family's presets, fields and checks; `vocab_size` is required (the T5 presets set it)."""
    return Transformer(transformer_spec.Model(variant, **overrides), rngs=rngs)
