"""timm's VisionTransformer (tfjax.interop.from_timm_vit) against timm itself: tiny random
models built here (no download), logits within ATOL for each option the converter supports
(class token, registers, average pooling, no_embed_class, pre-norm, fc_norm, layer scale,
non-square grids, other image sizes as dynamic_img_size resamples), and each option it does
not refused by name."""

import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import ATOL, torch

from tfjax import interop

# pyproject.toml's timm extra, which `make install-dev` installs only beside PyPI's torch (PyPI's
# torchvision, which timm imports, does not import beside torch's CPU build).
_NO_TIMM = "timm is not installed (the timm extra: installed beside PyPI's torch only)"
timm_vit = pytest.importorskip("timm.models.vision_transformer", reason=_NO_TIMM)
timm_layers = pytest.importorskip("timm.layers", reason=_NO_TIMM)

P, D, HEADS = 8, 32, 2


def _timm(**options):
    """A tiny timm ViT in eval mode, every parameter random (biases, gammas, tokens and
    position embeddings included, so that a misplaced one shows in the logits)."""
    torch.manual_seed(0)
    options = dict(img_size=32, patch_size=P, embed_dim=D, depth=2, num_heads=HEADS) | options
    model = timm_vit.VisionTransformer(num_classes=options.pop("num_classes", 5), **options)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


# name: (timm's options, from_timm_vit's options, the image size fed; None: img_size)
CASES = {
    "class_token": ({}, {}, None),
    "registers": (dict(reg_tokens=3), {}, None),
    "no_embed_class": (dict(no_embed_class=True, reg_tokens=2), dict(no_embed_class=True), None),
    "avg_registers_fc_norm": (  # timm's *_reg4_gap layout; fc_norm is avg's default
        dict(class_token=False, global_pool="avg", reg_tokens=2, no_embed_class=True),
        dict(global_pool="avg", no_embed_class=True),
        None,
    ),
    "avg_no_head": (
        dict(class_token=False, global_pool="avg", fc_norm=False, num_classes=0),
        dict(global_pool="avg"),
        None,
    ),
    "token_fc_norm": (dict(fc_norm=True), {}, None),
    "pre_norm": (dict(pre_norm=True), {}, None),
    "layer_scale": (dict(init_values=0.1), {}, None),
    "non_square": (dict(img_size=(32, 48)), dict(trained_image_size=(32, 48)), None),
    "dynamic_larger": (dict(dynamic_img_size=True), {}, (40, 56)),
    "dynamic_non_square_registers": (
        dict(img_size=(32, 48), dynamic_img_size=True, reg_tokens=2),
        dict(trained_image_size=(32, 48)),
        (40, 24),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_timm(case):
    options, convert, size = CASES[case]
    ref = _timm(**options)
    size = size or timm_layers.to_2tuple(options.get("img_size", 32))
    images = np.random.RandomState(1).randn(2, 3, *size).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.tensor(images)).numpy()
    model, params = interop.from_timm_vit(
        ref.state_dict(), image_size=size, num_heads=HEADS, **convert
    )
    got, _ = model.apply({"params": params}, jnp.asarray(images.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("options", "convert", "message"),
    [
        (dict(qk_norm=True), {}, r"qk_norm=True \('blocks.0.attn.q_norm.weight'"),
        (dict(global_pool="map", class_token=False), {}, r"global_pool='map'"),
        (dict(global_pool="avg"), dict(global_pool="avg"), "'avg' with class_token=True"),
        (dict(global_pool="max"), dict(global_pool="max"), "global_pool='max'"),
        (dict(qkv_bias=False), {}, "qkv_bias=False"),
        (dict(proj_bias=False), {}, "proj_bias=False"),
        (dict(final_norm=False), {}, "final_norm=False"),
        (dict(pos_embed="none"), {}, "pos_embed='none'"),
        (dict(scale_attn_norm=True), {}, "scale_attn_norm=True"),
        (dict(scale_mlp_norm=True), {}, "scale_mlp_norm=True"),
        (dict(embed_norm_layer="layernorm"), {}, "embed_norm_layer"),
        (dict(mlp_layer=timm_layers.SwiGLU), {}, "mlp_layer=SwiGLU"),
        (dict(mlp_layer=timm_layers.GluMlp), {}, "mlp_layer=GluMlp"),
        (dict(patch_size=(8, 4)), {}, r"patch_size=\(8, 4\)"),
    ],
)
def test_timm_options_tfjax_lacks_are_refused_by_name(options, convert, message):
    """One line naming timm's option and what is supported, before any conversion."""
    state = _timm(**options).state_dict()
    with pytest.raises(ValueError, match=f"timm VisionTransformer: .*{message}.* supported: "):
        interop.from_timm_vit(state, image_size=32, num_heads=HEADS, **convert)


@pytest.mark.parametrize(
    ("options", "convert", "message"),
    [
        # 4 x 6 patches and a class token are 25 rows: no longer read as a 5 x 5 grid
        (dict(img_size=(32, 48)), {}, r"24 patch rows .* not a square grid; pass trained_image"),
        (dict(img_size=(32, 48)), dict(trained_image_size=32), r"not trained_image_size=32"),
        (dict(no_embed_class=True), {}, "15 patch rows after the 1 class .* no_embed_class"),
        (dict(class_token=False, global_pool="avg"), {}, "global_pool='token' needs a class"),
        ({}, dict(pool="gap"), "pool are read from the state dict"),
    ],
)
def test_what_the_weights_do_not_show_is_asked_for(options, convert, message):
    """The trained grid, no_embed_class and global_pool are not in the state dict: a wrong
    guess is refused (naming the argument to pass), not converted."""
    state = _timm(**options).state_dict()
    with pytest.raises(ValueError, match=message):
        interop.from_timm_vit(state, image_size=32, num_heads=HEADS, **convert)
