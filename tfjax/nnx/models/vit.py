"""The Vision Transformer family (tfjax.models.vit: ViT, DINOv2, CLIP and SigLIP towers) as a
Flax NNX module.

Letters: B batch, H, W image height and width, C channels, D model width, P patches.

The same fields, presets (`vit.VARIANTS`) and checks as the Linen model: both are built from
the family's spec (tfjax.specs.vit.VisionTransformer, its `spec`), which holds, checks and
translates the fields into the layers' configs, so a field, preset or check added there holds
in both; this file adds only the NNX modules, which compute the same function with the same
parameter tree:

    from flax import nnx
    from tfjax.nnx.models import vit
    model = vit.Model(variant="B/16", num_classes=1000, rngs=nnx.Rngs(0))
    logits, aux = model(images)                    # [B, 224, 224, 3] -> [B, 1000]
    nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the Linen model's params tree

Linen sizes the patch kernel [p, p, C, D] and the learned position table [1, n, D] from the
images it is initialised with; an NNX model is made before any image, so it takes them as
`image_size` and `channels`: its arguments, else the spec's fields, else the published towers'
TRAINED_IMAGE_SIZES (the factory `Model`) or 224, and 3.
"""

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from tfjax.nnx import blocks, models
from tfjax.ops import axes, vision
from tfjax.specs import vit as vit_spec

VARIANTS = vit_spec.VARIANTS


class PatchEmbed(nnx.Module):
    """tfjax.models.vit.PatchEmbed in NNX: the p x p convolution of stride p (nn.Conv's
    parameters: kernel [p, p, C, D], bias [D]) as a matmul (tfjax.ops.vision.patch_embed)."""

    def __init__(
        self, channels, features, patch_size, *, use_bias=True, dtype=None, param_dtype, rngs
    ):
        self.dtype = dtype
        p = patch_size
        shape, names = (p, p, channels, features), (None, None, None, axes.EMBED)
        self.kernel = blocks.param(rngs, nn.initializers.lecun_normal(), shape, param_dtype, names)
        if use_bias:
            self.bias = blocks.param(
                rngs, nn.initializers.zeros, (features,), param_dtype, (axes.EMBED,)
            )

    def __call__(self, images):
        """[B, H, W, C] -> [B, H/p, W/p, D]."""
        bias = self.bias[...] if hasattr(self, "bias") else None
        images, kernel, bias = nnx.nn.dtypes.promote_dtype(
            (images, self.kernel[...], bias), dtype=self.dtype
        )
        return vision.patch_embed(images, kernel, bias)


class MapHead(nnx.Module):
    """tfjax.models.vit.MapHead in NNX (big_vision's MAPHead): a learned probe attends to the
    tokens, then a residual pre-LN MLP; [B, P, D] -> [B, D]."""

    def __init__(self, config, width, *, dtype=None, param_dtype=jnp.float32, rngs):
        dtypes = dict(dtype=dtype, param_dtype=param_dtype)
        self.probe = blocks.param(
            rngs, nn.initializers.normal(0.02), (1, 1, width), param_dtype, (None, None, axes.EMBED)
        )
        self.attention = blocks.Attention(config.attention, width, rngs=rngs, **dtypes)
        self.norm = blocks.make_norm(config.norm, width, eps=config.norm_eps, rngs=rngs, **dtypes)
        self.mlp = blocks.Mlp(config.mlp, width, rngs=rngs, **dtypes)

    def __call__(self, x):
        """x: [B, P, D] -> [B, D]."""
        b, _, d = x.shape
        # [B, 1, D]: the probe's query attends to every token
        y = self.attention(jnp.broadcast_to(self.probe[...].astype(x.dtype), (b, 1, d)), x)
        y = y + self.mlp(self.norm(y))
        # [B, D]
        return y[:, 0]


class VisionTransformer(nnx.Module):
    """ViT in NNX; see the module docstring. `spec`: the tfjax.specs.vit VisionTransformer whose
    fields say what to build, or a Linen tfjax.models.vit VisionTransformer (unbound), whose
    fields and methods are its spec's; `.spec` is the family spec. `image_size` (an int, or
    (H, W)) and `channels`: the images' it takes (the spec's when None, else 224 and 3), which
    size the patch kernel and a learned position table."""

    def __init__(
        self,
        spec: vit_spec.VisionTransformer,
        *,
        image_size: int | tuple[int, int] | None = None,
        channels: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.spec = spec = models.family_spec(spec)
        d, p = spec.width, spec.patch_size
        dtypes = dict(dtype=spec.dtype, param_dtype=spec.param_dtype)
        image_size = image_size or spec.image_size or 224
        channels = channels or spec.channels or 3
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        rows, columns = spec.patch_grid(size)
        self.num_patches = rows * columns
        self.image_size, self.channels = size, channels  # (H, W) and C: see `options`
        self.patch_embed = PatchEmbed(channels, d, p, use_bias=spec.patch_bias, rngs=rngs, **dtypes)

        def embedding(shape, init=nn.initializers.zeros):
            names = (None,) * (len(shape) - 1) + (axes.EMBED,)
            return blocks.param(rngs, init, shape, spec.param_dtype, names)

        if spec.mask_token:
            self.mask_token = embedding((d,))
        cls = spec.pool in ("cls", "cls_gap")
        if cls:
            self.cls = embedding((1, 1, d))
        if spec.posemb == "learned":
            n = self.num_patches + cls
            self.pos_embed = embedding((1, n, d), nn.initializers.normal(0.02))
        if spec.num_registers:
            self.registers = embedding((1, spec.num_registers, d))
        norm = dict(eps=spec.norm_eps, rngs=rngs, **dtypes)
        if spec.pre_norm:
            self.pre_norm = blocks.make_norm("layer", d, **norm)
        config = spec.block_config()
        self.encoder = blocks.Stack(
            config,
            spec.num_layers,
            d,
            scan_layers=spec.scan_layers,
            remat_policy=spec.remat_policy,
            final_norm=spec.final_norm == "tokens",
            rngs=rngs,
            **dtypes,
        )
        if spec.pool == "map":
            self.map_head = MapHead(config, d, rngs=rngs, **dtypes)
        pooled = 2 * d if spec.pool == "cls_gap" else d
        if spec.final_norm == "pooled":
            self.pooled_norm = blocks.make_norm("layer", pooled, **norm)
        if spec.num_classes is not None:
            self.head = blocks.dense(
                pooled,
                spec.num_classes,
                (axes.EMBED, None),
                use_bias=spec.head_bias,
                kernel_init=nn.initializers.zeros
                if spec.head_zero_init
                else nn.initializers.lecun_normal(),
                rngs=rngs,
                **dtypes,
            )
        # Where training's dropout keys come from (the "dropout" stream, else "default").
        self.rngs = rngs.fork()

    @property
    def options(self) -> dict:
        """What sized this model besides its spec (tfjax.nnx.functional remakes it by them)."""
        return dict(image_size=self.image_size, channels=self.channels)

    def _param(self, name):
        value = getattr(self, name, None)
        return None if value is None else value[...]

    def __call__(self, images, *, mask=None, train: bool = False, rngs: nnx.Rngs | None = None):
        """The Linen model's call: images [B, H, W, C] (and the optional [B, P] `mask` of
        patches the mask token replaces) -> ([B, num_classes] logits, or the pooled features
        without a head, aux) with aux["pre_logits"] and aux["encoded"] as Linen's.

        train: dropout on, its keys from `rngs` (else the model's own) "dropout" stream.
        """
        spec = self.spec
        key = (rngs or self.rngs).dropout() if train else None
        images = vision.crop_to_patches(images, spec.patch_size, drop_remainder=spec.drop_remainder)
        # [B, X, Y, D]
        x = self.patch_embed(images)
        b, gh, gw, d = x.shape
        if spec.posemb == "learned" and gh * gw != self.num_patches:
            raise ValueError(
                f"images of {images.shape[1]}x{images.shape[2]} give {gh * gw} patches; this "
                f"model's learned position table is for {self.num_patches} (its image_size)"
            )
        # [B, 1 + R + P, D]
        x = vision.tokens(
            x.reshape(b, gh * gw, d),
            (gh, gw),
            mask=mask,
            mask_token=self._param("mask_token"),
            cls=self._param("cls"),
            pos_embed=self._param("pos_embed"),
            registers=self._param("registers"),
        )
        x = blocks.dropout(x, spec.dropout_rate, blocks.fold_key(key, 0))
        if spec.pre_norm:
            x = self.pre_norm(x)
        x = self.encoder(x, dropout_rng=blocks.fold_key(key, 1))
        # [B, D]
        if spec.pool == "map":
            pre_logits = self.map_head(x)
        else:
            pre_logits = vision.pool(x, spec.pool, spec.num_registers)
        if spec.final_norm == "pooled":
            pre_logits = self.pooled_norm(pre_logits)
        aux = {"encoded": x, "pre_logits": pre_logits}
        if spec.num_classes is None:
            return pre_logits, aux
        return self.head(pre_logits), aux


def input_sizes(images, *args, **kwargs) -> dict:
    """The `image_size` and `channels` of a model that takes `images` [B, H, W, C] (an array or
    its shape and dtype), as Linen's `init` sizes the model by the images it is given."""
    _, height, width, channels = images.shape
    return dict(image_size=(height, width), channels=channels)


def Model(  # noqa: N802 (a factory)
    variant: str | None = None,
    *,
    rngs: nnx.Rngs,
    image_size: int | tuple[int, int] | None = None,
    channels: int | None = None,
    **overrides,
) -> VisionTransformer:
    """VisionTransformer(spec=tfjax.specs.vit.Model(variant, **overrides)): the family's
    presets, fields and checks; image_size: the spec's when None, else the published tower's
    trained size (TRAINED_IMAGE_SIZES), else 224."""
    spec = vit_spec.Model(variant, **overrides)
    if image_size is None and spec.image_size is None:
        image_size = vit_spec.TRAINED_IMAGE_SIZES.get(variant, 224)
    return VisionTransformer(spec, image_size=image_size, channels=channels, rngs=rngs)
