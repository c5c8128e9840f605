"""tfjax.nnx's Vision Transformer against tfjax.models.vit (Linen): the same parameter tree
(paths, shapes, dtypes, logical names), and from the same parameters the same outputs and
gradients, unrolled and scanned, over configs that cover the family's heads and tokens."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_checks import assert_same_function, assert_same_tree, close

from tfjax.models import vit as linen
from tfjax.nnx import models
from tfjax.nnx.models import vit

TINY = dict(width=32, num_layers=2, num_heads=4, mlp_dim=48, patch_size=4)
CONFIGS = {
    # ViT: class token, learned positions, exact GELU, a random-initialised head
    "vit": dict(TINY, num_classes=5, head_zero_init=False),
    # SigLIP-like tower: attention pooling (MAP head), no class token, gelu_tanh, no head
    "siglip": dict(TINY, num_classes=None, pool="map", activation="gelu_tanh"),
    # DINOv2-like: class token and patch mean side by side, registers, layer scale, the mask
    # token, SwiGLU, the final norm on the pooled features, a bias-free head, remat
    "dinov2": dict(
        TINY,
        num_classes=3,
        pool="cls_gap",
        num_registers=2,
        layer_scale=0.5,
        mask_token=True,
        activation="swiglu",
        final_norm="pooled",
        head_bias=False,
        head_zero_init=False,
        remat_policy="full",
    ),
    # CLIP-like with mean pooling: the norm before the blocks, fixed 2-D sin-cos positions,
    # quick GELU, no patch bias, 18 px images (the last 2 rows and columns dropped)
    "gap": dict(
        TINY,
        num_classes=4,
        pool="gap",
        posemb="sincos2d",
        pre_norm=True,
        activation="quick_gelu",
        patch_bias=False,
        drop_remainder=True,
        head_zero_init=False,
    ),
}
SIZES = {"gap": 18}  # the images' size; 16 for the others


def _images(name):
    size = SIZES.get(name, 16)
    return jax.random.normal(jax.random.key(1), (2, size, size, 3))


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_same_tree_outputs_and_gradients(name, scan_layers):
    fields = dict(CONFIGS[name], scan_layers=scan_layers)
    images = _images(name)
    lm = linen.Model(**fields)
    model = vit.Model(rngs=nnx.Rngs(1), image_size=images.shape[1], **fields)
    params = lm.init(jax.random.key(0), images)["params"]
    assert_same_tree(params, model)
    kwargs = {}
    if lm.mask_token:  # every other patch replaced
        kwargs["mask"] = jnp.asarray(np.arange(16) % 2 == 0)[None].repeat(2, axis=0)
    out, aux = assert_same_function(lm, model, nn.meta.unbox(params), images, **kwargs)
    pooled = 2 * 32 if lm.pool == "cls_gap" else 32
    assert aux["pre_logits"].shape == (2, pooled)
    assert out.shape == (2, lm.num_classes or pooled)


def test_dropout_in_training_only_and_errors():
    model = vit.Model(rngs=nnx.Rngs(1), image_size=16, **dict(CONFIGS["vit"], dropout_rate=0.5))
    images = _images("vit")
    evaluated, _ = model(images)
    first, _ = model(images, train=True, rngs=nnx.Rngs(dropout=3))
    again, _ = model(images, train=True, rngs=nnx.Rngs(dropout=3))
    close(first, again)
    assert not np.allclose(first, evaluated)
    with pytest.raises(ValueError, match="learned position table is for 16"):
        model(jax.random.normal(jax.random.key(1), (1, 20, 20, 3)))
    with pytest.raises(ValueError, match="a mask needs a model with mask_token=True"):
        model(images, mask=jnp.zeros((2, 16), bool))
    with pytest.raises(ValueError, match="image_size=18 is not divisible by patch_size=4"):
        vit.Model(rngs=nnx.Rngs(1), image_size=18, **CONFIGS["vit"])


@pytest.mark.parametrize("variant", ["siglip-so400m/14", "dinov2-B/14"])
def test_published_towers_have_linens_tree(variant):
    """At their trained image size (the NNX model's default for them), abstractly."""
    size = linen.TRAINED_IMAGE_SIZES[variant]
    lm = linen.Model(variant, scan_layers=True)
    model = nnx.eval_shape(lambda: vit.Model(variant, scan_layers=True, rngs=nnx.Rngs(0)))
    images = jnp.zeros((1, size, size, 3))
    params = jax.eval_shape(lambda: lm.init(jax.random.key(0), images))["params"]
    assert_same_tree(params, model)
    options = dict(image_size=size)
    same = nnx.eval_shape(lambda: models.from_linen(lm, rngs=nnx.Rngs(0), **options))
    assert_same_tree(params, same)
