"""The Vision Transformer family's spec (ViT, DINOv2, CLIP and SigLIP towers): its flat
fields, their checks and presets, and the layers' config they make, without a framework;
tfjax.models.vit (Linen) and tfjax.nnx.models.vit (NNX) build their modules from it.

    spec = vit.Model("B/16", num_classes=1000)   # a checked, frozen VisionTransformer
    spec.block_config(), spec.patch_grid((224, 224))
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from tfjax.allowed import one_of
from tfjax.ops.config import BlockConfig
from tfjax.specs import common

SIZES = {
    "tiny": dict(width=32, num_layers=2, mlp_dim=64, num_heads=4),
    "demo": dict(width=64, num_layers=4, mlp_dim=128, num_heads=4),
    "Ti": dict(width=192, num_layers=12, mlp_dim=768, num_heads=3),
    "S": dict(width=384, num_layers=12, mlp_dim=1536, num_heads=6),
    "B": dict(width=768, num_layers=12, mlp_dim=3072, num_heads=12),
    "L": dict(width=1024, num_layers=24, mlp_dim=4096, num_heads=16),
    "H": dict(width=1280, num_layers=32, mlp_dim=5120, num_heads=16),
}
PATCHES = (2, 4, 8, 14, 16, 32)
VARIANTS = {f"{s}/{p}": dict(SIZES[s], patch_size=p) for s in SIZES for p in PATCHES}
# Published vision towers, sizes and options from their config.json (no classification head;
# image sizes no multiple of the patch drop their last pixels, as those towers' convolutions do:
# SigLIP so400m/14 at 384 px is 27 patches of 14 and 6 px).
_DINOV2 = dict(  # facebook/dinov2-*: layerscale_value 1.0 in config.json (the weights hold
    # the trained gammas); the mask token is kept for the masked-patch input
    patch_size=14,
    num_classes=None,
    layer_scale=1.0,
    mask_token=True,
    norm_eps=1e-6,
    drop_remainder=True,
)
_CLIP = dict(  # openai/clip-vit-*: quick_gelu, no patch bias, LayerNorm before the blocks and
    # on the pooled class token only (post_layernorm)
    num_classes=None,
    activation="quick_gelu",
    patch_bias=False,
    pre_norm=True,
    final_norm="pooled",
    norm_eps=1e-5,
    drop_remainder=True,
)
_SIGLIP = dict(  # google/siglip-*: no class token, attention pooling head, gelu_tanh
    num_classes=None, pool="map", activation="gelu_tanh", norm_eps=1e-6, drop_remainder=True
)
VARIANTS |= {
    "dinov2-S/14": dict(_DINOV2, width=384, num_layers=12, mlp_dim=1536, num_heads=6),
    "dinov2-B/14": dict(_DINOV2, width=768, num_layers=12, mlp_dim=3072, num_heads=12),
    "dinov2-L/14": dict(_DINOV2, width=1024, num_layers=24, mlp_dim=4096, num_heads=16),
    # SwiGLU with mlp_ratio 4: 2/3 of 4 D rounded up to a multiple of 8 (DINOv2's SwiGLUFFN)
    "dinov2-g/14": dict(
        _DINOV2, width=1536, num_layers=40, mlp_dim=4096, num_heads=24, activation="swiglu"
    ),
    "clip-B/32": dict(_CLIP, width=768, num_layers=12, mlp_dim=3072, num_heads=12, patch_size=32),
    "clip-B/16": dict(_CLIP, width=768, num_layers=12, mlp_dim=3072, num_heads=12, patch_size=16),
    "clip-L/14": dict(_CLIP, width=1024, num_layers=24, mlp_dim=4096, num_heads=16, patch_size=14),
    "siglip-so400m/14": dict(
        _SIGLIP,
        width=1152,
        num_layers=27,
        mlp_dim=4304,
        num_heads=16,
        patch_size=14,
    ),
}
# The square image size each published tower's position embeddings were made for (config.json's
# image_size; siglip-so400m-patch14-384).
TRAINED_IMAGE_SIZES = {
    "dinov2-S/14": 518,
    "dinov2-B/14": 518,
    "dinov2-L/14": 518,
    "dinov2-g/14": 518,
    "clip-B/32": 224,
    "clip-B/16": 224,
    "clip-L/14": 224,
    "siglip-so400m/14": 384,
}
POOLS = ("cls", "gap", "cls_gap", "map")
POSEMBS = ("learned", "sincos2d")
FINAL_NORMS = ("tokens", "pooled")


@dataclasses.dataclass(**common.SPEC_OPTIONS)
class VisionTransformer(common.FamilySpec):
    """The ViT's fields (letters as in tfjax.models.vit)."""

    CHOICES = dict(pool=one_of(*POOLS), posemb=one_of(*POSEMBS), final_norm=one_of(*FINAL_NORMS))

    num_classes: int | None = 1000  # no head (aux["pre_logits"] only) when None
    patch_size: int = 16  # square patches
    width: int = 768  # D
    num_layers: int = 12  # L
    mlp_dim: int = 3072  # 4 D
    num_heads: int = 12  # N
    pool: str = "cls"  # "cls" (class token), "gap" (mean of patch tokens), "cls_gap" (both,
    # concatenated: [B, 2 D]) or "map" (MapHead)
    posemb: str = "learned"  # "learned" or "sincos2d"
    activation: str = "gelu"  # FFN: see tfjax.nn.blocks.Block ("quick_gelu" CLIP, "gelu_tanh"
    # SigLIP, "swiglu" DINOv2 giant)
    num_registers: int = 0  # R learned tokens after the class token, without position
    # embeddings (Darcet et al., 2024; DINOv2 with registers)
    layer_scale: float | None = None  # init of a learned [D] gamma on each sub-layer's output
    # (DINOv2); none when None
    pre_norm: bool = False  # a LayerNorm on the embeddings before the blocks (CLIP)
    final_norm: str = "tokens"  # "tokens": a LayerNorm after the last block on every token;
    # "pooled": on the pooled features only (CLIP's post_layernorm)
    patch_bias: bool = True  # a bias in the patch embedding (CLIP has none)
    image_size: int | None = None  # H = W of the images the model takes; None: any (the Linen
    # model's learned positions sized by its init images; an NNX model's by its image_size
    # argument, else 224 or the published tower's TRAINED_IMAGE_SIZES)
    channels: int | None = None  # C of the images; None: any (NNX: 3 unless its argument says)
    drop_remainder: bool = False  # an image size no multiple of patch_size loses its last rows
    # and columns, as a stride-p convolution does (SigLIP so400m/14 at 384 px: 27 patches, 6 px
    # dropped); refused when False
    mask_token: bool = False  # a learned [D] embedding that __call__'s `mask` puts in place of
    # masked patches (DINOv2, BEiT pre-training)
    dropout_rate: float = 0.0  # embeddings and residual sub-layers
    attention_dropout_rate: float = 0.0  # on attention weights
    norm_eps: float = 1e-6  # LayerNorm epsilon
    head_zero_init: bool = True  # zero head kernel (big_vision); False for a random head
    head_bias: bool = True  # a bias in the head (CLIP's visual projection has none)
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.ops.remat.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def check_family(self) -> None:
        """The sin-cos table's width, and image_size against patch_size."""
        if self.posemb == "sincos2d" and self.width % 4:  # sin and cos of rows and columns
            raise ValueError(
                f"VisionTransformer.width={self.width} must be a multiple of 4 with "
                "posemb='sincos2d'"
            )
        if self.image_size is not None:
            self.patch_grid((self.image_size, self.image_size))

    def block_config(self) -> BlockConfig:
        """Every layer's config (and the MAP head's): the flat fields translated
        (common.block_config), pre-norm."""
        return common.block_config(self, norm_position="pre")

    def patch_grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """The (rows, columns) of patches of images of `image_size` (H, W); refused unless
        patch_size divides both or drop_remainder."""
        p = self.patch_size
        height, width = image_size
        if (height % p or width % p) and not self.drop_remainder:
            size = height if height == width else image_size
            raise ValueError(
                f"image_size={size} is not divisible by patch_size={p} (set "
                "drop_remainder=True to drop the last rows and columns)"
            )
        return height // p, width // p

    def check_images(self, shape) -> None:
        """Images of `shape` [B, H, W, C] against image_size and channels (when set); another
        rank is left to tfjax.ops.vision's check."""
        if len(shape) != 4:
            return
        _, height, width, channels = shape
        size = self.image_size
        if size is not None and (height, width) != (size, size):
            raise ValueError(
                f"images are {height}x{width}; VisionTransformer.image_size={size} (set it to "
                "the images' size, or None to take any)"
            )
        if self.channels is not None and channels != self.channels:
            raise ValueError(
                f"images have {channels} channels; VisionTransformer.channels={self.channels}"
            )


def Model(variant: str | None = None, **overrides) -> VisionTransformer:  # noqa: N802 (a factory)
    """VisionTransformer(**VARIANTS[variant], **overrides), variant like "B/16"."""
    return common.from_variant(VisionTransformer, VARIANTS, variant, overrides)
