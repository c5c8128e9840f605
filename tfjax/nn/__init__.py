"""Building blocks: thin Linen modules over tfjax.ops' maths, configured by tfjax.ops' config
objects (AttentionConfig, MlpConfig, BlockConfig). No mesh: logical axis names only."""

from tfjax.nn import attention, axes, blocks, embed, ffn, moe, norms, position
from tfjax.nn.attention import MultiHeadAttention, attention_weights, dot_product_attention
from tfjax.nn.blocks import (
    Block,
    Stack,
    scanned_path,
    scanned_to_unrolled,
    unrolled_to_scanned,
)
from tfjax.nn.embed import Embed
from tfjax.nn.ffn import GatedMlp, Mlp, gelu, make_mlp
from tfjax.nn.moe import MoeMlp
from tfjax.nn.norms import RMSNormPlusOne, make_norm, rms_norm_plus_one
from tfjax.nn.position import (
    LearnedPositions,
    RopeScaling,
    alibi_bias,
    rope,
    sincos_2d,
    sinusoidal,
)
from tfjax.ops import chunked, masks, splash
from tfjax.ops.cache import KVCache, init_cache
from tfjax.ops.config import AttentionConfig, BlockConfig, LayerAttention, MlpConfig, MoeConfig
from tfjax.ops.masks import causal_mask, combine_masks, padding_mask, segment_mask

__all__ = [
    "AttentionConfig",
    "Block",
    "BlockConfig",
    "Embed",
    "GatedMlp",
    "KVCache",
    "LayerAttention",
    "LearnedPositions",
    "Mlp",
    "MlpConfig",
    "MoeConfig",
    "MoeMlp",
    "MultiHeadAttention",
    "RMSNormPlusOne",
    "RopeScaling",
    "Stack",
    "alibi_bias",
    "attention",
    "attention_weights",
    "axes",
    "blocks",
    "causal_mask",
    "chunked",
    "combine_masks",
    "dot_product_attention",
    "embed",
    "ffn",
    "gelu",
    "init_cache",
    "make_mlp",
    "make_norm",
    "masks",
    "moe",
    "norms",
    "padding_mask",
    "position",
    "rms_norm_plus_one",
    "rope",
    "scanned_path",
    "scanned_to_unrolled",
    "segment_mask",
    "sincos_2d",
    "sinusoidal",
    "splash",
    "unrolled_to_scanned",
]
