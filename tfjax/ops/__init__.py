"""The maths of tfjax's layers without a module system: JAX and NumPy only, never Flax.

tfjax.nn wraps these in Linen modules (parameters, the "cache" collection, logical sharding
names), tfjax.nnx in Flax NNX modules; another module system (Equinox, plain functions) can
share them unchanged.

  attention    dot_product_attention (the formula; cuDNN, splash and chunked backends, chosen
               per call), attention_weights
  multihead    multi-head attention given its parameters: the projections, RoPE, variants,
               ALiBi, decoding
  chunked, splash   the memory-lean kernels behind dot_product_attention
  delta_rule   the gated delta rule (Qwen3.5's Gated DeltaNet linear attention), chunked or
               recurrent, and the causal depthwise convolution before it
  masks        boolean attention masks
  position     sinusoidal, 2-D sin-cos, RoPE and RopeScaling, ALiBi, T5's buckets and bias
  norms, activations   the norm and FFN activation maths (and the logits' soft cap)
  embed        the token embedding's lookup and the output projection that shares its table
  head         the vocabulary head's matmul, its two gradients released together
  residual     a block's residual sub-layer wired by the norm's position (pre, post, sandwich)
  moe          mixture of experts: routing, dropless grouped-matmul dispatch, expert
               parallelism, the load-balancing and router z losses
  vision       a ViT's patches embedded, its tokens assembled (class token, positions,
               registers, mask token) and pooled
  config       AttentionConfig, MlpConfig, MoeConfig, BlockConfig, LayerAttention: what a
               layer computes
  mla          multi-head latent attention (DeepSeek), its expanded and absorbed forms
  cache        KVCache (LatentCache for latent attention), the decoding cache as a pytree the
               caller holds
"""

from tfjax.ops import (
    activations,
    attention,
    cache,
    chunked,
    config,
    delta_rule,
    embed,
    head,
    masks,
    mla,
    moe,
    multihead,
    norms,
    position,
    residual,
    splash,
    vision,
)
from tfjax.ops.activations import ACTIVATIONS, ALL_ACTIVATIONS, GATED_ACTIVATIONS, gelu
from tfjax.ops.attention import attention_weights, choose_implementation, dot_product_attention
from tfjax.ops.cache import KVCache, LatentCache, init_cache
from tfjax.ops.config import (
    AttentionConfig,
    BlockConfig,
    LatentAttention,
    LayerAttention,
    MlpConfig,
    MoeConfig,
)
from tfjax.ops.delta_rule import causal_conv1d, gated_delta_rule
from tfjax.ops.norms import NORMS, rms_norm_plus_one
from tfjax.ops.position import RopeScaling, alibi_bias, rope, sincos_2d, sinusoidal

__all__ = [
    "ACTIVATIONS",
    "ALL_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "NORMS",
    "AttentionConfig",
    "BlockConfig",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "LayerAttention",
    "MlpConfig",
    "MoeConfig",
    "RopeScaling",
    "activations",
    "alibi_bias",
    "attention",
    "attention_weights",
    "cache",
    "causal_conv1d",
    "choose_implementation",
    "chunked",
    "config",
    "delta_rule",
    "dot_product_attention",
    "embed",
    "gated_delta_rule",
    "gelu",
    "head",
    "init_cache",
    "masks",
    "mla",
    "moe",
    "multihead",
    "norms",
    "position",
    "residual",
    "rms_norm_plus_one",
    "rope",
    "sincos_2d",
    "sinusoidal",
    "splash",
    "vision",
]
