"""The encoder-decoder Transformer family's spec (Vaswani et al., 2017; T5 v1.1, Flan-T5,
Marian): its flat fields, their checks and presets, and what they build (the layers' config,
the decoder's KV cache layout), without a framework; tfjax.models.transformer (Linen) and
tfjax.nnx.models.transformer (NNX) build their modules from it.

    spec = transformer.Model("base", vocab_size=32000)   # a checked, frozen Transformer
    spec.block_config(), spec.init_cache(batch_size, max_target_length)

`teacher_forced` is both models' call: their `encode` and `decode` put together.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from tfjax.allowed import one_of
from tfjax.ops.config import BlockConfig, default_kernel_init
from tfjax.specs import common

# "base" and "big" are Table 3 of the paper; "tiny" is for tests, "demo" for configs/translate.py's
# CPU experiment (trains in minutes on two cores), "small" a step between it and "base".
VARIANTS = {
    "tiny": dict(width=32, num_layers=2, num_heads=4, mlp_dim=64, dropout_rate=0.0),
    "demo": dict(width=128, num_layers=2, num_heads=4, mlp_dim=512, dropout_rate=0.1),
    "small": dict(width=256, num_layers=3, num_heads=4, mlp_dim=1024, dropout_rate=0.1),
    "base": dict(width=512, num_layers=6, num_heads=8, mlp_dim=2048, dropout_rate=0.1),
    "big": dict(width=1024, num_layers=6, num_heads=16, mlp_dim=4096, dropout_rate=0.3),
}
# T5 v1.1 (Raffel et al., 2020, its v1.1 release): what every size shares. Dropout as in the
# checkpoints' config.json, everywhere transformers' T5 applies it (attention weights, the FFN's
# hidden activations and each stack's output too).
T5 = dict(
    norm="rms",
    norm_position="pre",
    use_bias=False,
    position="relative",
    scale_embeddings=False,
    attention_scale=1.0,
    activation="geglu_tanh",
    head_dim=64,
    share_embeddings=True,
    tie_embeddings=False,
    norm_eps=1e-6,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    mlp_dropout_rate=0.1,
    output_dropout=True,
    vocab_size=32128,
)
# The published sizes of T5 v1.1 and Flan-T5 (Chung et al., 2022), which share them.
VARIANTS |= {
    "flan-t5-small": dict(T5, width=512, num_layers=8, num_heads=6, mlp_dim=1024),
    "flan-t5-base": dict(T5, width=768, num_layers=12, num_heads=12, mlp_dim=2048),
    "flan-t5-large": dict(T5, width=1024, num_layers=24, num_heads=16, mlp_dim=2816),
    "flan-t5-xl": dict(T5, width=2048, num_layers=24, num_heads=32, mlp_dim=5120),
    "flan-t5-xxl": dict(T5, width=4096, num_layers=24, num_heads=64, mlp_dim=10240),
}
POSITIONS = ("sinusoidal", "relative")


@dataclasses.dataclass(**common.SPEC_OPTIONS)
class Transformer(common.FamilySpec):
    """The encoder-decoder Transformer's fields (letters as in tfjax.models.transformer)."""

    CHOICES = dict(position=one_of(*POSITIONS))

    vocab_size: int  # V, shared by source and target
    width: int = 512  # D = d_model
    num_layers: int = 6  # N, in the encoder and in the decoder
    num_heads: int = 8  # h
    mlp_dim: int = 2048  # d_ff
    head_dim: int | None = None  # d_k = d_v; width // num_heads when None (T5: 64)
    dropout_rate: float = 0.1  # P_drop: embeddings and every residual sub-layer
    attention_dropout_rate: float = 0.0  # on attention weights (not in the paper; T5's rate)
    mlp_dropout_rate: float = 0.0  # on the FFN's hidden activations (not in the paper; T5's)
    output_dropout: bool = False  # dropout_rate also on each stack's output, after its final
    # norm (T5)
    activation: str = "relu"  # FFN activation (T5 v1.1: "geglu_tanh")
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm, T5)
    norm_position: str = "post"  # "post" as in the paper, "pre" for stabler deep stacks
    norm_eps: float = 1e-6  # norm epsilon
    use_bias: bool = True  # biases in the attention and FFN projections (T5: none)
    position: str = "sinusoidal"  # added sinusoids (the paper) or "relative" (T5's bias)
    relative_buckets: int = 32  # position="relative": buckets of T5's relative distances
    relative_max_distance: int = 128  # ... and the distance where the last bucket starts
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) (the paper; T5: no)
    attention_scale: float | None = None  # logit scale; head_dim**-0.5 when None (T5: 1)
    share_embeddings: bool = True  # one token embedding for source and target
    tie_embeddings: bool | None = None  # the output projection is the target embedding^T;
    # share_embeddings when None (the paper: one matrix for all three; T5 v1.1: no)
    logits_bias: bool = False  # a learned [V] bias added to the logits (Marian)
    final_norm: bool = False  # a LayerNorm after each post-norm stack (torch.nn.Transformer)
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.ops.remat.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    kernel_init: Callable = default_kernel_init  # every projection kernel
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def block_config(self) -> BlockConfig:
        """The encoder layers' config: the flat fields translated (common.block_config); the
        decoder's is the same made causal and with cross-attention."""
        return common.block_config(self)

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """An empty explicit KV cache of the decoder's self-attention for `batch_size` rows of
        up to `length` target tokens, to pass as `cache=` to `decode` with decode=True (as
        decoder.Decoder.init_cache)."""
        config = self.block_config().attention
        return common.init_cache(self, config, batch_size, length, dtype=dtype, sharding=sharding)

    @property
    def tied(self) -> bool:
        """Whether the logits are the target embedding^T (no output_proj)."""
        return self.share_embeddings if self.tie_embeddings is None else self.tie_embeddings


def teacher_forced(
    model,
    inputs,
    targets,
    *,
    inputs_segment_ids=None,
    targets_segment_ids=None,
    inputs_positions=None,
    targets_positions=None,
    apply_head: bool = True,
    **options,
):
    """Teacher-forced logits of an encoder-decoder `model` (Linen or NNX: its `encode` and
    `decode`), the call of both.

    Args:
      inputs: [B, S] source ids, 0 = padding.
      targets: [B, T] target ids, 0 = padding; shifted right here (0 starts), so the logits at
        t predict targets[t].
      *_segment_ids, *_positions: [B, S] / [B, T] for packed rows.
      apply_head: False gives the final decoder states [B, T, D] in place of the logits
        (`model.logits(hidden)` gives the logits).
      options: what else both `encode` and `decode` take (train; NNX: rngs).
    Returns:
      ([B, T, V] logits, aux) with aux["encoded"] [B, S, D], aux["pre_logits"] [B, T, D].
    """
    common.check_tokens(targets, "targets")
    encoded = model.encode(
        inputs, inputs_segment_ids=inputs_segment_ids, inputs_positions=inputs_positions, **options
    )
    logits, y = model.decode(
        encoded,
        inputs,
        common.shift_right(targets, targets_segment_ids),
        targets=targets,
        targets_segment_ids=targets_segment_ids,
        inputs_segment_ids=inputs_segment_ids,
        targets_positions=targets_positions,
        apply_head=apply_head,
        **options,
    )
    return logits, {"encoded": encoded, "pre_logits": y}


def Model(variant: str | None = None, **overrides) -> Transformer:  # noqa: N802 (a factory)
    """Transformer(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return common.from_variant(Transformer, VARIANTS, variant, overrides)
