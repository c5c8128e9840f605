"""BERT-like encoders (Devlin et al., 2019) with a masked-LM or a classification head.

Letters: B batch, T length, D model width, V vocab, C classes.

Word + learned position + token-type embeddings, LayerNorm, dropout; post-LN blocks with exact
GELU; then either the masked-LM head (dense, GELU, LayerNorm, projection tied to the word
embeddings plus an output bias) or the pooler (tanh dense on the first token) and a classifier.

    model = encoder.Model(variant="bert-base", vocab_size=30522)
    logits, aux = model.apply(variables, tokens)          # [B, T] -> [B, T, V] (head="mlm")
    hidden, aux = model.apply(variables, tokens, apply_head=False)   # [B, T, D] (head="mlm")
    logits = model.apply(variables, hidden, method="logits")         # [B, T, V]
    model = encoder.Model(variant="bert-base", vocab_size=30522, head="classifier", num_classes=2)
    logits, aux = model.apply(variables, tokens)          # [B, T] -> [B, C]

With head="mlm", `apply_head=False` stops before the projection onto the vocabulary (after the
head's dense, GELU and LayerNorm) and `logits` applies it: a loss can then make the logits in
slices of T (`loss.chunks`), never all [B, T, V] at once.
"""

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.models import common
from tfjax.models.common import check_tokens
from tfjax.nn import axes, masks
from tfjax.specs import encoder as encoder_spec

# The presets and choices are the spec's (tfjax.specs.encoder).
VARIANTS, HEADS = encoder_spec.VARIANTS, encoder_spec.HEADS


class Encoder(common.FromSpec, nn.Module):
    """BERT-like encoder; see the module docstring. Its fields, their checks and what they
    build are tfjax.specs.encoder.Encoder's (`spec`)."""

    SPEC = encoder_spec.Encoder
    locals().update(common.spec_fields(SPEC))

    def block_config(self) -> tnn.BlockConfig:
        """The spec's `block_config`: every layer's config."""
        return self.spec.block_config()

    def setup(self):
        # What the masked-LM projection shares with __call__, here so that `logits` can be
        # applied on its own; everything else is declared inline in __call__.
        self.embed = common.embed(self, self.vocab_size, None, init_stddev=self.init_stddev)
        if self.head == "mlm":
            self.mlm_bias = self.param(
                "mlm_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
                (self.vocab_size,),
                self.param_dtype,
            )

    def logits(self, h):
        """The masked-LM projection: h [B, T, D] (after the head's LayerNorm) -> [B, T, V]."""
        self.spec.check_logits()
        # [B, T, V]
        logits = self.embed.attend(h) + self.mlm_bias.astype(h.dtype)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    @property
    def _kernel_init(self) -> Callable:
        return nn.initializers.normal(self.init_stddev)

    def _norm(self, name):
        return tnn.make_norm(
            "layer", eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )

    def _dense(self, features, names, name):
        return tnn.ffn.dense(
            features,
            names,
            name=name,
            use_bias=True,
            kernel_init=self._kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )

    @nn.compact
    def __call__(
        self,
        tokens,
        *,
        token_types=None,
        segment_ids=None,
        positions=None,
        train=False,
        apply_head=True,
    ):
        """Args:
          tokens: [B, T] ids, 0 = padding.
          token_types: [B, T] sentence ids (0 or 1); zeros when None.
          segment_ids, positions: [B, T] for packed rows.
          apply_head: False (head="mlm" only) returns the masked-LM head's hidden states
            [B, T, D] in place of the logits (`logits(hidden)` gives the logits).
        Returns:
          (logits, aux): [B, T, V] (mlm) or [B, C] (classifier); aux["encoded"] [B, T, D]
          and, for the classifier, aux["pooled"] [B, D].
        """
        check_tokens(tokens, "tokens")
        t = tokens.shape[1]
        self.spec.check_call(t, apply_head=apply_head)
        embed = self.embed
        positions = jnp.arange(t)[None] if positions is None else positions
        # [B, T, D]
        x = embed(tokens) + common.learned_positions(self)(positions)
        if self.type_vocab_size:
            types = jnp.zeros_like(tokens) if token_types is None else token_types
            type_embed = common.embed(
                self, self.type_vocab_size, "type_embed", init_stddev=self.init_stddev
            )
            x = x + type_embed(types)
        x = self._norm("embed_norm")(x)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        # without ids, padding (id 0) attends to nothing and is never attended
        segment_ids = masks.ids_or_padding(segment_ids, tokens)
        layers = common.stack(self, self.block_config(), "encoder", kernel_init=self._kernel_init)
        x = layers(x, segment_ids=segment_ids, train=train)
        aux = {"encoded": x}
        if self.head == "mlm":
            # [B, T, D]
            h = tnn.gelu(self._dense(self.width, (axes.EMBED, axes.MLP), "mlm_dense")(x))
            h = self._norm("mlm_norm")(h)
            return (self.logits(h) if apply_head else h), aux
        # [B, D]
        pooled = jnp.tanh(self._dense(self.width, (axes.EMBED, axes.MLP), "pooler")(x[:, 0]))
        aux["pooled"] = pooled
        pooled = nn.Dropout(self.dropout_rate)(pooled, deterministic=not train)
        # [B, C]
        return self._dense(self.num_classes, (axes.EMBED, None), "classifier")(pooled), aux


def Model(variant: str | None = None, **overrides) -> Encoder:  # noqa: N802 (a factory)
    """Encoder(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return Encoder.of(encoder_spec.Model(variant, **overrides))
