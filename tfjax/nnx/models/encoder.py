"""The BERT-like encoder family (tfjax.models.encoder) as a Flax NNX module.

Letters: B batch, T length, D model width, V vocab, C classes.

The same fields, presets (`encoder.VARIANTS`) and checks as the Linen model: both are built
from the family's spec (tfjax.specs.encoder.Encoder, its `spec`), which holds, checks and
translates the fields into the layers' configs, so a field, preset or check added there holds
in both; this file adds only the NNX modules, which compute the same function with the same
parameter tree:

    from flax import nnx
    from tfjax.nnx.models import encoder
    model = encoder.Model(variant="bert-base", vocab_size=30522, rngs=nnx.Rngs(0))
    logits, aux = model(tokens)                    # [B, T] -> [B, T, V], {"encoded": ...}
    hidden, aux = model(tokens, apply_head=False)  # [B, T, D]; model.logits(hidden): [B, T, V]
    nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the Linen model's params tree

A Linen checkpoint's `params` load with `tfjax.nnx.models.load_params(model, params)`; the
NNX model's go to Linen as `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
"""

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from tfjax.nnx import blocks, models
from tfjax.ops import axes, masks
from tfjax.ops.activations import gelu
from tfjax.specs import encoder as encoder_spec
from tfjax.specs.common import check_tokens

VARIANTS = encoder_spec.VARIANTS


class Encoder(nnx.Module):
    """BERT-like encoder in NNX; see the module docstring. `spec`: the tfjax.specs.encoder
    Encoder whose fields say what to build, or a Linen tfjax.models.encoder Encoder
    (unbound), whose fields and methods are its spec's; `.spec` is the family spec."""

    def __init__(self, spec: encoder_spec.Encoder, *, rngs: nnx.Rngs):
        self.spec = spec = models.family_spec(spec)
        d = spec.width
        dtypes = dict(dtype=spec.dtype, param_dtype=spec.param_dtype)
        init = nn.initializers.normal(spec.init_stddev)
        norm = dict(eps=spec.norm_eps, rngs=rngs, **dtypes)
        self.embed = blocks.Embed(
            spec.vocab_size, d, init_stddev=spec.init_stddev, rngs=rngs, **dtypes
        )
        self.pos_embed = blocks.LearnedPositions(
            spec.max_len, d, init_stddev=spec.init_stddev, rngs=rngs, **dtypes
        )
        if spec.type_vocab_size:
            self.type_embed = blocks.Embed(
                spec.type_vocab_size, d, init_stddev=spec.init_stddev, rngs=rngs, **dtypes
            )
        self.embed_norm = blocks.make_norm("layer", d, **norm)
        self.encoder = blocks.Stack(
            spec.block_config(),
            spec.num_layers,
            d,
            scan_layers=spec.scan_layers,
            remat_policy=spec.remat_policy,
            kernel_init=init,
            rngs=rngs,
            **dtypes,
        )
        dense = dict(use_bias=True, kernel_init=init, rngs=rngs, **dtypes)
        if spec.head == "mlm":
            self.mlm_dense = blocks.dense(d, d, (axes.EMBED, axes.MLP), **dense)
            self.mlm_norm = blocks.make_norm("layer", d, **norm)
            self.mlm_bias = blocks.param(
                rngs, nn.initializers.zeros, (spec.vocab_size,), spec.param_dtype, (axes.VOCAB,)
            )
        else:
            self.pooler = blocks.dense(d, d, (axes.EMBED, axes.MLP), **dense)
            self.classifier = blocks.dense(d, spec.num_classes, (axes.EMBED, None), **dense)
        # Where training's dropout keys come from (the "dropout" stream, else "default").
        self.rngs = rngs.fork()

    def logits(self, h):
        """The masked-LM projection: h [B, T, D] (after the head's LayerNorm) -> [B, T, V]."""
        self.spec.check_logits()
        # [B, T, V]
        logits = self.embed.attend(h) + self.mlm_bias[...].astype(h.dtype)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def __call__(
        self,
        tokens,
        *,
        token_types=None,
        segment_ids=None,
        positions=None,
        train: bool = False,
        apply_head: bool = True,
        rngs: nnx.Rngs | None = None,
    ):
        """The Linen model's call: tokens [B, T] ids (0 = padding) -> (logits, aux): [B, T, V]
        (mlm) or [B, C] (classifier); aux["encoded"] [B, T, D] and, for the classifier,
        aux["pooled"] [B, D].

        train: dropout on, its keys from `rngs` (else the model's own) "dropout" stream.
        """
        spec = self.spec
        check_tokens(tokens, "tokens")
        t = tokens.shape[1]
        spec.check_call(t, apply_head=apply_head)
        key = (rngs or self.rngs).dropout() if train else None
        positions = jnp.arange(t)[None] if positions is None else positions
        # [B, T, D]
        x = self.embed(tokens) + self.pos_embed(positions)
        if spec.type_vocab_size:
            x = x + self.type_embed(jnp.zeros_like(tokens) if token_types is None else token_types)
        x = self.embed_norm(x)
        x = blocks.dropout(x, spec.dropout_rate, blocks.fold_key(key, 0))
        # without ids, padding (id 0) attends to nothing and is never attended
        segment_ids = masks.ids_or_padding(segment_ids, tokens)
        x = self.encoder(x, segment_ids=segment_ids, dropout_rng=blocks.fold_key(key, 1))
        aux = {"encoded": x}
        if spec.head == "mlm":
            # [B, T, D]
            h = self.mlm_norm(gelu(self.mlm_dense(x)))
            return (self.logits(h) if apply_head else h), aux
        # [B, D]
        pooled = jnp.tanh(self.pooler(x[:, 0]))
        aux["pooled"] = pooled
        pooled = blocks.dropout(pooled, spec.dropout_rate, blocks.fold_key(key, 2))
        # [B, C]
        return self.classifier(pooled), aux


def Model(variant: str | None = None, *, rngs: nnx.Rngs, **overrides) -> Encoder:  # noqa: N802
    """Encoder(spec=tfjax.specs.encoder.Model(variant, **overrides)): the family's
    presets, fields and checks; `vocab_size` is required."""
    return Encoder(encoder_spec.Model(variant, **overrides), rngs=rngs)
