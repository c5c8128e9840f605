"""Vision Transformer (Dosovitskiy et al., 2021).

Letters: B batch, H, W image height and width, C image channels, D model width, N heads,
L layers, P patches (tokens); in the patch embedding (p the patch size) X, Y the patch grid's
rows and columns (H/p, W/p) and I, J a pixel's row and column within its patch (p each). The
head gives num_classes logits.

Patches embedded by a strided convolution (computed as a matmul), a class token (pool="cls")
or mean pooling (pool="gap"), learned or 2-D sin-cos position embeddings, pre-LN blocks with
exact GELU, a final LayerNorm and a linear head (zero-initialised, as in big_vision).

    model = vit.Model(variant="B/16", num_classes=1000)
    logits, aux = model.apply(variables, images)        # [B, H, W, 3] float -> [B, num_classes]

Variants are "<size>/<patch>" with size Ti, S, B, L, H and patch 2, 4, 8, 14, 16 or 32,
plus "tiny/<patch>" for tests and "demo/<patch>" for configs/vit.py's CPU experiment.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.models.common import from_variant
from tfjax.nn import axes

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
POOLS = ("cls", "gap")
POSEMBS = ("learned", "sincos2d")


class PatchEmbed(nn.Module):
    """[B, H, W, C] -> [B, X, Y, D] (X = H/p, Y = W/p): the p x p convolution with stride p,
    done as a matmul.

    The parameters are nn.Conv's (kernel [I, J, C, D] = [p, p, C, D], lecun-normal; bias [D]),
    so checkpoints and converters see a convolution. Patches do not overlap, so the output at
    each grid position is its p x p x C patch, flattened, times the kernel flattened to
    [p * p * C, D]: the same linear map as the stride-p convolution, written as a reshape and
    one einsum.
    """

    features: int  # D
    patch_size: int  # p
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images):
        p = self.patch_size
        b, h, w, c = images.shape
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), (None, None, None, axes.EMBED)
            ),
            (p, p, c, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
            (self.features,),
            self.param_dtype,
        )
        images, kernel, bias = nn.dtypes.promote_dtype(images, kernel, bias, dtype=self.dtype)
        # [B, X, I, Y, J, C]: patch (x, y) of the grid, its pixel row i and column j
        patches = images.reshape(b, h // p, p, w // p, p, c)
        # [B, X, Y, D]
        return jnp.einsum("bxiyjc,ijcd->bxyd", patches, kernel) + bias


class VisionTransformer(nn.Module):
    """ViT; see the module docstring."""

    num_classes: int | None = 1000  # no head (aux["pre_logits"] only) when None
    patch_size: int = 16  # square patches
    width: int = 768  # D
    num_layers: int = 12  # L
    mlp_dim: int = 3072  # 4 D
    num_heads: int = 12  # N
    pool: str = "cls"  # "cls" (class token) or "gap" (mean of patch tokens)
    posemb: str = "learned"  # "learned" or "sincos2d"
    dropout_rate: float = 0.0  # embeddings and residual sub-layers
    attention_dropout_rate: float = 0.0  # on attention weights
    norm_eps: float = 1e-6  # LayerNorm epsilon
    head_zero_init: bool = True  # zero head kernel (big_vision); False for a random head
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.nn.blocks.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        for field, value, allowed in (("pool", self.pool, POOLS), ("posemb", self.posemb, POSEMBS)):
            if value not in allowed:
                raise ValueError(f"{field}={value!r} is unknown; allowed: {allowed}")
        super().__post_init__()

    @nn.compact
    def __call__(self, images, *, train=False):
        """Args:
          images: [B, H, W, C] floats; H and W divisible by patch_size.
        Returns:
          ([B, num_classes] logits, or the [B, D] pre-logits without a head, aux) with
          aux["pre_logits"] [B, D] and aux["encoded"] [B, P(+1), D].
        """
        if images.ndim != 4 or not jnp.issubdtype(images.dtype, jnp.floating):
            raise ValueError(
                f"images must be [B, H, W, C] floats, got shape {images.shape} {images.dtype}"
            )
        _, height, width, _ = images.shape
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} is not divisible by patch_size={p}")
        # [B, X, Y, D]
        x = PatchEmbed(
            self.width, p, dtype=self.dtype, param_dtype=self.param_dtype, name="patch_embed"
        )(images)
        b, gh, gw, d = x.shape
        # [B, P, D]
        x = x.reshape(b, gh * gw, d)
        if self.pool == "cls":
            cls = self.param(
                "cls",
                nn.with_logical_partitioning(nn.initializers.zeros, (None, None, axes.EMBED)),
                (1, 1, d),
                self.param_dtype,
            )
            # [B, 1 + P, D]
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)
        n_cls = x.shape[1] - gh * gw
        if self.posemb == "learned":  # one per token, the class token's included (as in the paper)
            pe = self.param(
                "pos_embed",
                nn.with_logical_partitioning(
                    nn.initializers.normal(0.02), (None, None, axes.EMBED)
                ),
                (1, x.shape[1], d),
                self.param_dtype,
            )
        else:  # fixed; the class token gets none (as in MoCo v3)
            pe = jnp.pad(tnn.sincos_2d(gh, gw, d), ((n_cls, 0), (0, 0)))[None]
        x = x + pe.astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        block = tnn.Block(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            activation="gelu",
            norm_eps=self.norm_eps,
            norm_position="pre",
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            implementation=self.implementation,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        x = tnn.Stack(
            self.num_layers,
            block,
            scan_layers=self.scan_layers,
            remat_policy=self.remat_policy,
            name="encoder",
        )(x, train=train)
        # [B, D]
        pre_logits = x[:, 0] if self.pool == "cls" else x.mean(axis=1)
        aux = {"encoded": x, "pre_logits": pre_logits}
        if self.num_classes is None:
            return pre_logits, aux
        head_init = nn.initializers.zeros if self.head_zero_init else nn.initializers.lecun_normal()
        logits = tnn.ffn.dense(
            self.num_classes,
            (axes.EMBED, None),
            name="head",
            use_bias=True,
            kernel_init=head_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(pre_logits)
        return logits, aux


def Model(variant: str | None = None, **overrides) -> VisionTransformer:  # noqa: N802 (a factory)
    """VisionTransformer(**VARIANTS[variant], **overrides), variant like "B/16"."""
    return from_variant(VisionTransformer, VARIANTS, variant, overrides)
