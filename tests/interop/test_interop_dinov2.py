"""DINOv2 and DINOv2 with registers (tfjax.interop.families.dinov2) against transformers:
outputs (also of SwiGLU's giant layout and with the mask token), interpolated positions, round
trips, refusals, and the presets' parameter counts.

Small random towers are built from configs (no download); tfjax in float32 must give a float64
copy of the reference's last_hidden_state and pooler_output within 1e-5.
"""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import ATOL, SMALL, images, torch, tower, tower_reference, transformers

from tfjax import interop
from tfjax.interop.families import dinov2 as dinov2_family
from tfjax.models import vit

dinov2 = references.dinov2


@references.reference
def dinov2_swiglu():
    """DINOv2 giant's FFN (SwiGLU, weights_in fused) on a small tower."""
    config = transformers.Dinov2Config(
        **{**SMALL, "hidden_size": 48}, patch_size=7, use_swiglu_ffn=True
    )
    return tower(transformers.Dinov2Model, config, 1)


@references.reference
def dinov2_registers():
    config = transformers.Dinov2WithRegistersConfig(**SMALL, patch_size=7, num_register_tokens=3)
    return tower(transformers.Dinov2WithRegistersModel, config, 2)


TOWERS = ["dinov2", "dinov2_swiglu", "dinov2_registers"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_outputs_match_reference(family, scan_layers, request):
    references.check_tower_outputs(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("size", [(42, 35), (21, 21)])
@pytest.mark.parametrize("family", ["dinov2", "dinov2_registers"])
def test_at_another_image_size_matches_interpolated_reference(family, size, request):
    """DINOv2 always interpolates its position embeddings to the image's size."""
    references.check_tower_at_image_size(*request.getfixturevalue(family), size)


def test_mask_token_replaces_masked_patches(dinov2):
    ref, path = dinov2
    model, params = interop.load(path)
    pixels = images(28, 28)
    mask = np.random.RandomState(2).rand(2, 16) < 0.5
    pooled, aux = model.apply(
        {"params": params}, jnp.asarray(pixels.transpose(0, 2, 3, 1)), mask=mask
    )
    want_tokens, want_pooled = tower_reference(ref, pixels, bool_masked_pos=torch.tensor(mask))
    np.testing.assert_allclose(np.asarray(aux["encoded"]), want_tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), want_pooled, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_round_trip_is_bitwise_and_loads_in_transformers(family, scan_layers, request, tmp_path):
    references.check_tower_round_trip(*request.getfixturevalue(family), scan_layers, tmp_path)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_act": "silu"}, r"hidden_act='silu' is not supported; allowed: \("),
        ({"qkv_bias": False}, r"qkv_bias=False is not supported \(needs True\)"),
        ({"drop_path_rate": 0.1}, r"drop_path_rate=0.1 is not supported \(needs 0.0\)"),
        ({"use_swiglu_ffn": "yes"}, r"use_swiglu_ffn='yes' is not supported"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(dinov2, changes, message):
    references.check_loader_refuses(dinov2[1], lambda config: {**config, **changes}, message)


def test_export_refuses_what_the_architecture_cannot_hold(dinov2):
    _, path = dinov2
    model, params = interop.load(path)
    with pytest.raises(ValueError, match="no mlp_ratio for the model's mlp_dim=100"):
        dinov2_family.to_dinov2(model.clone(mlp_dim=100), params)
    with pytest.raises(ValueError, match="CLIPVisionModel needs a model with"):
        interop.to_clip_vision(model, params)
    plain = vit.Model("tiny/4", num_classes=None)
    with pytest.raises(ValueError, match="exports as a vision tower"):
        interop.export(plain, {})


# ----------------------------------------------------------------------------------------------
# Presets.

# Published parameter counts in millions and how many the figure rounds to, from DINOv2's
# README (github.com/facebookresearch/dinov2, "Pretrained models": ViT-S/14 21 M, ViT-B/14
# 86 M, ViT-L/14 300 M, ViT-g/14 1,100 M; with registers the same). Those round coarsely (at
# 518 px S holds 22.06 M, B 86.58 M, L 304.37 M, g 1,136.48 M), so within 6 %; the exact counts
# are checked against transformers' own model below.
DINOV2_README = {"dinov2-S/14": 21, "dinov2-B/14": 86, "dinov2-L/14": 300, "dinov2-g/14": 1100}
PUBLISHED = [v for v in vit.VARIANTS if v.startswith("dinov2-")]


@pytest.mark.parametrize("variant", sorted(DINOV2_README))
def test_presets_have_the_readme_parameter_counts(variant):
    n = references.parameter_count(vit.Model(variant), vit.TRAINED_IMAGE_SIZES[variant])
    assert abs(n / 1e6 / DINOV2_README[variant] - 1) < 0.06, n


@pytest.mark.parametrize("variant, registers", [(v, r) for r in (0, 4) for v in PUBLISHED])
def test_presets_match_transformers_count_built_from_their_export(variant, registers):
    references.check_preset_is_transformers_count(variant, registers)
