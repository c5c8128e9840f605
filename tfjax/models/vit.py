"""Vision Transformer (Dosovitskiy et al., 2021).

Letters: B batch, H, W image height and width, C image channels, D model width, N heads,
L layers, P patches (tokens), R register tokens; in the patch embedding (p the patch size) X, Y
the patch grid's rows and columns (H/p, W/p) and I, J a pixel's row and column within its patch
(p each). The head gives num_classes logits.

Patches embedded by a strided convolution (computed as a matmul), a class token (pool="cls"),
mean pooling (pool="gap"), both side by side (pool="cls_gap": the class token and the mean of
the patch tokens concatenated, [B, 2 D], what Hugging Face's Dinov2ForImageClassification
feeds its classifier) or a multihead-attention pooling head with a learned probe
(pool="map", big_vision's MAPHead, SigLIP), learned or 2-D sin-cos position embeddings,
optional register tokens (DINOv2 with registers), an optional LayerNorm before the blocks
(CLIP), pre-LN blocks with exact GELU by default (or quick_gelu, gelu_tanh, swiglu) and an
optional layer scale (DINOv2), a final LayerNorm on every token (final_norm="tokens") or on the
pooled features only (final_norm="pooled", CLIP), and a linear head (zero-initialised, as in
big_vision; head_bias=False: a bias-free projection, as CLIP's visual projection), or none
(num_classes=None: the pooled features, as a vision tower gives them).

    model = vit.Model(variant="B/16", num_classes=1000)
    logits, aux = model.apply(variables, images)        # [B, H, W, 3] float -> [B, num_classes]
    tower = vit.Model(variant="dinov2-B/14")             # num_classes=None: an encoder
    pooled, aux = tower.apply(variables, images)        # [B, D]; aux["encoded"] every token

Variants are "<size>/<patch>" with size Ti, S, B, L, H and patch 2, 4, 8, 14, 16 or 32,
plus "tiny/<patch>" for tests and "demo/<patch>" for configs/vit.py's CPU experiment, and the
published vision towers (sizes from their config.json): "dinov2-S/14", "dinov2-B/14",
"dinov2-L/14", "dinov2-g/14" (with registers: num_registers=4), "clip-B/32", "clip-B/16",
"clip-L/14" and "siglip-so400m/14". Their learned position embeddings are made for the image
size in TRAINED_IMAGE_SIZES (init with images of that size to get the checkpoint's shapes).

The model takes images of any size and channels, sized by those it is initialised with, unless
its `image_size` and `channels` fields are set: then it refuses others by name (an NNX model,
made before any image, is sized by them).
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.models import common
from tfjax.nn import axes
from tfjax.ops import vision
from tfjax.specs import vit as vit_spec

# The presets and choices are the spec's (tfjax.specs.vit).
SIZES, PATCHES, VARIANTS = vit_spec.SIZES, vit_spec.PATCHES, vit_spec.VARIANTS
TRAINED_IMAGE_SIZES = vit_spec.TRAINED_IMAGE_SIZES
POOLS, POSEMBS, FINAL_NORMS = vit_spec.POOLS, vit_spec.POSEMBS, vit_spec.FINAL_NORMS


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
    use_bias: bool = True  # a bias [D] (CLIP's patch embedding has none)
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
        bias = jnp.zeros((self.features,), self.param_dtype)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
                (self.features,),
                self.param_dtype,
            )
        images, kernel, bias = nn.dtypes.promote_dtype(images, kernel, bias, dtype=self.dtype)
        # [B, X, Y, D]
        return vision.patch_embed(images, kernel, bias if self.use_bias else None)


class MapHead(nn.Module):
    """Multihead attention pooling (big_vision's MAPHead; SigLIP's vision head): a learned
    probe attends to the tokens, then a residual pre-LN MLP; [B, P, D] -> [B, D]."""

    config: tnn.BlockConfig  # its attention, norm and MLP (the tower's blocks')
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    @nn.compact
    def __call__(self, x):
        """x: [B, P, D] -> [B, D]."""
        b, _, d = x.shape
        probe = self.param(
            "probe",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, None, axes.EMBED)),
            (1, 1, d),
            self.param_dtype,
        )
        dtypes = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        # [B, 1, D]: the probe's query attends to every token
        y = tnn.MultiHeadAttention(self.config.attention, **dtypes, name="attention")(
            jnp.broadcast_to(probe.astype(x.dtype), (b, 1, d)), x
        )
        z = tnn.make_norm(self.config.norm, eps=self.config.norm_eps, **dtypes, name="norm")(y)
        y = y + tnn.make_mlp(self.config.mlp, **dtypes, name="mlp")(z)
        # [B, D]
        return y[:, 0]


class VisionTransformer(common.FromSpec, nn.Module):
    """ViT; see the module docstring. Its fields, their checks and what they build are
    tfjax.specs.vit.VisionTransformer's (`spec`)."""

    SPEC = vit_spec.VisionTransformer
    locals().update(common.spec_fields(SPEC))

    def block_config(self) -> tnn.BlockConfig:
        """The spec's `block_config`: every layer's config (and the MAP head's)."""
        return self.spec.block_config()

    def patch_grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """The spec's `patch_grid`: the (rows, columns) of patches of images of `image_size`."""
        return self.spec.patch_grid(image_size)

    def _norm(self, name):
        return tnn.make_norm(
            "layer", eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )

    def _embedding(self, name, shape, init=nn.initializers.zeros):
        """A learned parameter whose last axis is the model width (a token, tokens, a table)."""
        names = (None,) * (len(shape) - 1) + (axes.EMBED,)
        return self.param(name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)

    @nn.compact
    def __call__(self, images, *, mask=None, train=False):
        """Args:
          images: [B, H, W, C] floats; H and W divisible by patch_size (or drop_remainder).
          mask: optional [B, P] booleans (P = H/p * W/p, row-major), True where a patch is
            replaced by the mask token (needs mask_token=True).
        Returns:
          ([B, num_classes] logits, or the [B, D] pooled features without a head, aux) with
          aux["pre_logits"] [B, D] (the pooled features; [B, 2 D] with pool "cls_gap") and
          aux["encoded"] [B, 1 + R + P, D] (every token after the blocks and, with
          final_norm="tokens", the final norm; no class token with pool "gap" or "map").
        """
        # [B, 1 + R + P, D]
        x = self._tokens(images, mask)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        if self.pre_norm:
            x = self._norm("pre_norm")(x)
        final_norm = self.final_norm == "tokens"
        x = common.stack(self, self.block_config(), "encoder", final_norm=final_norm)(
            x, train=train
        )
        # [B, D]
        if self.pool == "map":
            pre_logits = MapHead(
                self.block_config(), self.dtype, self.param_dtype, name="map_head"
            )(x)
        else:
            pre_logits = vision.pool(x, self.pool, self.num_registers)
        if self.final_norm == "pooled":
            pre_logits = self._norm("pooled_norm")(pre_logits)
        aux = {"encoded": x, "pre_logits": pre_logits}
        if self.num_classes is None:
            return pre_logits, aux
        head_init = nn.initializers.zeros if self.head_zero_init else nn.initializers.lecun_normal()
        logits = tnn.ffn.dense(
            self.num_classes,
            (axes.EMBED, None),
            name="head",
            use_bias=self.head_bias,
            kernel_init=head_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(pre_logits)
        return logits, aux

    def _tokens(self, images, mask):
        """images [B, H, W, C] -> the blocks' input [B, 1 + R + P, D]: the patches (masked ones
        replaced), the class token, position embeddings and the registers."""
        self.spec.check_images(images.shape)
        p = self.patch_size
        images = vision.crop_to_patches(images, p, drop_remainder=self.drop_remainder)
        # [B, X, Y, D]
        x = PatchEmbed(
            self.width,
            p,
            use_bias=self.patch_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="patch_embed",
        )(images)
        b, gh, gw, d = x.shape
        n = gh * gw + (self.pool in ("cls", "cls_gap"))  # tokens with a position embedding
        return vision.tokens(
            # [B, P, D]
            x.reshape(b, gh * gw, d),
            (gh, gw),
            mask=mask,
            mask_token=self._embedding("mask_token", (d,)) if self.mask_token else None,
            cls=self._embedding("cls", (1, 1, d)) if self.pool in ("cls", "cls_gap") else None,
            pos_embed=self._embedding("pos_embed", (1, n, d), nn.initializers.normal(0.02))
            if self.posemb == "learned"
            else None,
            registers=self._embedding("registers", (1, self.num_registers, d))
            if self.num_registers
            else None,
        )


def Model(variant: str | None = None, **overrides) -> VisionTransformer:  # noqa: N802 (a factory)
    """VisionTransformer(**VARIANTS[variant], **overrides), variant like "B/16"."""
    return VisionTransformer.of(vit_spec.Model(variant, **overrides))
