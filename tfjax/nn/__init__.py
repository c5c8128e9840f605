"""Building blocks: pure functions and thin Linen modules. No mesh, no config objects."""

from tfjax.nn import axes, masks, position
from tfjax.nn.attention import (
    LayerAttention,
    MultiHeadAttention,
    attention_weights,
    dot_product_attention,
)
from tfjax.nn.blocks import Block, Stack, scanned_to_unrolled, unrolled_to_scanned
from tfjax.nn.embed import Embed
from tfjax.nn.ffn import GatedMlp, Mlp, gelu, make_mlp
from tfjax.nn.masks import causal_mask, combine_masks, padding_mask, segment_mask
from tfjax.nn.norms import RMSNormPlusOne, make_norm, rms_norm_plus_one
from tfjax.nn.position import (
    LearnedPositions,
    RopeScaling,
    alibi_bias,
    rope,
    sincos_2d,
    sinusoidal,
)

__all__ = [
    "Block",
    "Embed",
    "GatedMlp",
    "LayerAttention",
    "LearnedPositions",
    "Mlp",
    "MultiHeadAttention",
    "RMSNormPlusOne",
    "RopeScaling",
    "Stack",
    "alibi_bias",
    "attention_weights",
    "axes",
    "causal_mask",
    "combine_masks",
    "dot_product_attention",
    "gelu",
    "make_mlp",
    "make_norm",
    "masks",
    "padding_mask",
    "position",
    "rms_norm_plus_one",
    "rope",
    "scanned_to_unrolled",
    "segment_mask",
    "sincos_2d",
    "sinusoidal",
    "unrolled_to_scanned",
]
