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
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.allowed import one_of
from tfjax.models import common
from tfjax.models.common import check_tokens, from_variant
from tfjax.nn import axes, masks

# Sizes of BERT (Devlin et al.) and its miniatures (Turc et al., 2019); "tiny" for tests.
VARIANTS = {
    "tiny": dict(width=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=128),
    # configs/mlm.py's CPU experiment (pydoc): trains in minutes on two cores
    "demo": dict(width=128, num_layers=4, num_heads=4, mlp_dim=512, max_len=128),
    "bert-mini": dict(width=256, num_layers=4, num_heads=4, mlp_dim=1024),
    "bert-small": dict(width=512, num_layers=4, num_heads=8, mlp_dim=2048),
    "bert-medium": dict(width=512, num_layers=8, num_heads=8, mlp_dim=2048),
    "bert-base": dict(width=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "bert-large": dict(width=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}
HEADS = ("mlm", "classifier")


class Encoder(nn.Module):
    """BERT-like encoder; see the module docstring."""

    vocab_size: int  # V
    width: int = 768  # D
    num_layers: int = 12  # L
    num_heads: int = 12  # A
    mlp_dim: int = 3072  # 4 D in BERT
    max_len: int = 512  # learned position table size
    type_vocab_size: int = 2  # sentence A / B embeddings; 0 for none
    head: str = "mlm"  # "mlm" (masked-LM logits) or "classifier" (pooled sequence logits)
    num_classes: int = 2  # C, with head="classifier"
    dropout_rate: float = 0.1  # embeddings, residual sub-layers and the classifier input
    attention_dropout_rate: float = 0.1  # on attention weights (BERT: 0.1)
    activation: str = "gelu"  # exact GELU as in BERT
    norm_position: str = "post"  # BERT is post-LN
    norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    init_stddev: float = 0.02  # truncated-normal-like init scale of BERT
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.nn.blocks.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        common.check_fields(self, head=one_of(*HEADS))
        self.block_config()  # the layers' configs check the fields they take
        super().__post_init__()

    def block_config(self) -> tnn.BlockConfig:
        """Every layer's config: the flat fields translated (common.block_config)."""
        return common.block_config(self)

    def setup(self):
        # What the masked-LM projection shares with __call__, here so that `logits` can be
        # applied on its own; everything else is declared inline in __call__.
        self.embed = tnn.Embed(
            self.vocab_size,
            self.width,
            init_stddev=self.init_stddev,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        if self.head == "mlm":
            self.mlm_bias = self.param(
                "mlm_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
                (self.vocab_size,),
                self.param_dtype,
            )

    def logits(self, h):
        """The masked-LM projection: h [B, T, D] (after the head's LayerNorm) -> [B, T, V]."""
        if self.head != "mlm":
            raise ValueError(f"logits is the projection of head='mlm'; this head={self.head!r}")
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
        if t > self.max_len:
            raise ValueError(f"tokens are {t} long; max_len={self.max_len}")
        if not apply_head and self.head != "mlm":
            raise ValueError(f"apply_head=False is for head='mlm'; this head={self.head!r}")
        embed = self.embed
        positions = jnp.arange(t)[None] if positions is None else positions
        # [B, T, D]
        x = embed(tokens) + tnn.LearnedPositions(
            self.max_len,
            self.width,
            self.init_stddev,
            self.param_dtype,
            self.dtype,
            name="pos_embed",
        )(positions)
        if self.type_vocab_size:
            types = jnp.zeros_like(tokens) if token_types is None else token_types
            x = x + tnn.Embed(
                self.type_vocab_size,
                self.width,
                init_stddev=self.init_stddev,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="type_embed",
            )(types)
        x = self._norm("embed_norm")(x)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        if segment_ids is None:  # padding (id 0) attends to nothing and is never attended
            segment_ids = masks.padding_ids(tokens)
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
    return from_variant(Encoder, VARIANTS, variant, overrides)
