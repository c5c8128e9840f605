"""CLIP's and SigLIP's vision towers (tfjax.interop.families.clip) against transformers:
CLIPVisionModel and SiglipVisionModel outputs, CLIPVisionModelWithProjection and the image
features of whole CLIPModel and SiglipModel files, interpolated positions, round trips to the
vision-only architectures, export and refusals, and the presets' parameter counts.

Small random towers are built from configs (no download); tfjax in float32 must give a float64
copy of the reference's last_hidden_state, pooler_output and image features within 1e-5.
"""

import copy

import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields
from interop_references import ATOL, SMALL, images, torch, tower, transformers

from tfjax import interop
from tfjax.interop.core import files
from tfjax.models import vit

dinov2 = references.dinov2


@references.reference
def clip():
    config = transformers.CLIPVisionConfig(**SMALL, patch_size=7, intermediate_size=40)
    return tower(transformers.CLIPVisionModel, config, 3)


@references.reference
def siglip():
    config = transformers.SiglipVisionConfig(**SMALL, patch_size=7, intermediate_size=40)
    return tower(transformers.SiglipVisionModel, config, 4)


TOWERS = ["clip", "siglip"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_tower_outputs_match_reference(family, scan_layers, request):
    references.check_tower_outputs(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("size", [(42, 35), (21, 21)])
@pytest.mark.parametrize("family", TOWERS)
def test_tower_at_another_image_size_matches_interpolated_reference(family, size, request):
    """CLIP and SigLIP interpolate their position embeddings when asked."""
    ref, path = request.getfixturevalue(family)
    references.check_tower_at_image_size(ref, path, size, interpolate_pos_encoding=True)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_tower_round_trip_is_bitwise_and_loads_in_transformers(
    family, scan_layers, request, tmp_path
):
    references.check_tower_round_trip(*request.getfixturevalue(family), scan_layers, tmp_path)


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("clip", {"hidden_act": "silu"}, r"CLIPVisionModel: hidden_act='silu' is not supported"),
        ("siglip", {"vision_use_head": False}, r"vision_use_head=False is not supported"),
    ],
)
def test_tower_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    path = request.getfixturevalue(family)[1]
    references.check_loader_refuses(path, lambda config: {**config, **changes}, message)


def test_tower_weights_of_another_tower_name_missing_keys(dinov2, clip):
    _, dino_path = dinov2
    _, clip_path = clip
    with pytest.raises(ValueError, match=r"CLIPVisionModel: \d+ key\(s\) missing"):
        interop.from_clip_vision(interop.read_state_dict(dino_path), interop.read_config(clip_path))


PUBLISHED = [v for v in vit.VARIANTS if v.startswith(("clip-", "siglip-"))]


@pytest.mark.parametrize("variant", PUBLISHED)
def test_tower_presets_match_transformers_count_built_from_their_export(variant):
    references.check_preset_is_transformers_count(variant, 0)


# ----------------------------------------------------------------------------------------------
# CLIPVisionModelWithProjection, and the vision towers of whole CLIPModel and SiglipModel files.

VISION = dict(SMALL, patch_size=7, intermediate_size=40)
TEXT = dict(
    hidden_size=24, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40, vocab_size=99
)


@references.reference
def clip_model():
    config = transformers.CLIPConfig(vision_config=VISION, text_config=TEXT, projection_dim=24)
    return tower(transformers.CLIPModel, config, 5)


@references.reference
def siglip_model():
    config = transformers.SiglipConfig(vision_config=VISION, text_config=TEXT)
    return tower(transformers.SiglipModel, config, 6)


@references.reference
def clip_projection():
    config = transformers.CLIPVisionConfig(**VISION, projection_dim=24)
    return tower(transformers.CLIPVisionModelWithProjection, config, 7)


WHOLE = ["clip_model", "siglip_model", "clip_projection"]
# The vision-only architecture each exports as.
EXPORTED = {
    "clip_model": "CLIPVisionModelWithProjection",
    "siglip_model": "SiglipVisionModel",
    "clip_projection": "CLIPVisionModelWithProjection",
}


def _vision_keys(state):
    return {k for k in state if k.startswith("vision_model.") or k == "visual_projection.weight"}


def _embeddings(ref, pixels, **kwargs):
    """The image features of a transformers model: get_image_features (a ModelOutput whose
    pooler_output holds them since transformers 5, a tensor before), image_embeds of a
    CLIPVisionModelWithProjection, pooler_output of a SiglipVisionModel."""
    with torch.no_grad():
        if isinstance(ref, transformers.CLIPVisionModelWithProjection):
            return ref(pixels, **kwargs).image_embeds
        if isinstance(ref, transformers.SiglipVisionModel):
            return ref(pixels, **kwargs).pooler_output
        out = ref.get_image_features(pixels, **kwargs)
        return getattr(out, "pooler_output", out)


def _features(ref, pixels, **kwargs):
    """(last_hidden_state, the tower's pooler_output, the image features) of a float64 copy."""
    ref64 = copy.deepcopy(ref).double()
    x = torch.tensor(pixels, dtype=torch.float64)
    with torch.no_grad():
        out = ref64.vision_model(x, **kwargs)
    features = _embeddings(ref64, x, **kwargs)
    return out.last_hidden_state.numpy(), out.pooler_output.numpy(), features.numpy()


def _check_features(model, params, ref, pixels, **kwargs):
    features, aux = jax.jit(lambda p, x: model.apply({"params": p}, x))(
        params, jnp.asarray(pixels.transpose(0, 2, 3, 1))
    )
    tokens, pooled, want = _features(ref, pixels, **kwargs)
    np.testing.assert_allclose(np.asarray(aux["encoded"]), tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(aux["pre_logits"]), pooled, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(features), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", WHOLE)
def test_whole_model_gives_the_image_features(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers
    # CLIP: visual_projection as a bias-free head of projection_dim; SigLIP: the pooled output.
    assert model.num_classes == (None if family == "siglip_model" else 24)
    assert model.head_bias == (family == "siglip_model")
    _check_features(model, params, ref, images(28, 28))


@pytest.mark.parametrize("size", [(42, 35), (21, 21)])
@pytest.mark.parametrize("family", WHOLE)
def test_whole_model_at_another_image_size_matches_interpolated_reference(family, size, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, image_size=size, scan_layers=True)
    _check_features(model, params, ref, images(*size, seed=1), interpolate_pos_encoding=True)


@pytest.mark.parametrize("family", ["clip_model", "clip_projection"])
def test_clip_without_projection_gives_the_towers_pooler_output(family, request, tmp_path):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, projection=False)
    assert model.num_classes is None and "head" not in params
    pixels = images(28, 28, seed=2)
    pooled, aux = model.apply({"params": params}, jnp.asarray(pixels.transpose(0, 2, 3, 1)))
    tokens, want, _ = _features(ref, pixels)
    np.testing.assert_allclose(np.asarray(aux["encoded"]), tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), want, atol=ATOL, rtol=0)
    interop.save(model, params, tmp_path)  # the bare tower
    assert interop.read_config(tmp_path)["architectures"] == ["CLIPVisionModel"]
    model2, params2 = interop.load(tmp_path)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    with pytest.raises(ValueError, match=r"CLIPModel: projection='no'; allowed: True, False"):
        interop.from_clip(path, projection="no")


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", WHOLE)
def test_whole_model_exports_its_vision_tower_bitwise_and_transformers_reads_it(
    family, scan_layers, request, tmp_path
):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    interop.save(model, params, tmp_path)
    config = interop.read_config(tmp_path)
    assert config["architectures"] == [EXPORTED[family]]
    model2, params2 = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    # The export holds the vision tower's tensors of the original file, bitwise, and no others.
    original, exported = interop.read_state_dict(path), interop.read_state_dict(tmp_path)
    assert exported.keys() == _vision_keys(original)
    for k in exported:
        assert np.array_equal(exported[k], original[k]), k
    if scan_layers:
        return
    references.quiet()
    again = getattr(transformers, EXPORTED[family]).from_pretrained(tmp_path).eval()
    pixels = torch.tensor(images(28, 28, seed=3))
    want, got = _embeddings(ref, pixels), _embeddings(again, pixels)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def _vision(config, changes):
    """config with `changes` in its vision_config."""
    return {**config, "vision_config": {**config["vision_config"], **changes}}


@pytest.mark.parametrize(
    "family, edit, changes, message",
    [
        (
            "clip_model",
            _vision,
            {"hidden_act": "silu"},
            r"^CLIPModel: vision_config\.hidden_act='silu' is not supported; allowed: \(",
        ),
        (
            "siglip_model",
            _vision,
            {"vision_use_head": False},
            r"^SiglipModel: vision_config\.vision_use_head=False is not supported \(needs True\)",
        ),
        (
            "siglip_model",
            _vision,
            {"hidden_act": "gelu_fast"},
            r"^SiglipModel: vision_config\.hidden_act='gelu_fast' is not supported; allowed: \(",
        ),
        (
            "clip_projection",
            dict.__or__,
            {"hidden_act": "silu"},
            r"^CLIPVisionModelWithProjection: hidden_act='silu' is not supported; allowed: \(",
        ),
        # A config that disagrees with the tensors: the key (or the size) and the tensor named.
        (
            "clip_model",
            _vision,
            {"image_size": 56},
            r"^CLIPModel: vision_config\.image_size=56 means 8x8 patches of 7 px \(65 position "
            r"embeddings\), but 'vision_model\.embeddings\.position_embedding\.weight' in .*"
            r"model\.safetensors holds 17",
        ),
        (
            "clip_projection",
            dict.__or__,
            {"image_size": 21},
            r"^CLIPVisionModelWithProjection: image_size=21 means 3x3 patches .* holds 17",
        ),
        (
            "siglip_model",
            _vision,
            {"intermediate_size": 48},
            r"^SiglipModel: 'vision_model\.encoder\.layers\.0\.mlp\.fc1\.weight' in .* has shape "
            r"\(40, 32\), but the model built from the config expects \(48, 32\)",
        ),
        (
            "clip_model",
            dict.__or__,
            {"projection_dim": 16},
            r"^CLIPModel: 'visual_projection\.weight' in .* has shape \(24, 32\), but the model "
            r"built from the config expects \(16, 32\)",
        ),
        (
            "clip_model",
            _vision,
            {"num_hidden_layers": 3},
            r"^CLIPModel: 16 key\(s\) missing .*'vision_model\.encoder\.layers\.2\.",
        ),
    ],
)
def test_whole_model_refuses_configs_it_cannot_read_naming_the_key(
    family, edit, changes, message, request
):
    _, path = request.getfixturevalue(family)
    references.check_loader_refuses(path, lambda config: edit(config, changes), message)


@pytest.mark.parametrize("family", ["clip_model", "siglip_model"])
def test_whole_model_skips_only_the_text_tower_and_the_named_keys(family, request):
    """The text tower's keys and logit_scale (SigLIP: and logit_bias) are skipped by name (the
    loads above hold them); a stray key beside the vision tower's is refused, and a missing
    vision key is named."""
    _, path = request.getfixturevalue(family)
    state, config = interop.read_state_dict(path), interop.read_config(path)
    what = config["architectures"][0]
    loader = interop.ARCHITECTURES[what]
    stray = files.StateDict(state, origin="stray.safetensors")
    stray["vision_model.encoder.layers.0.extra.weight"] = np.zeros(3, np.float32)
    message = rf"^{what}: 1 unexpected key\(s\) in stray\.safetensors: 'vision_model\.encoder"
    with pytest.raises(ValueError, match=message):
        loader(stray, config)
    for key in ("vision_model.post_layernorm.weight", "visual_projection.weight"):
        if key in state:
            lacking = files.StateDict({k: v for k, v in state.items() if k != key})
            with pytest.raises(ValueError, match=rf"^{what}: 1 key\(s\) missing .*'{key}'"):
                loader(lacking, config)


def test_whole_model_export_refusals(clip_model):
    _, path = clip_model
    model, params = interop.load(path)
    message = r"CLIPVisionModelWithProjection needs a model with .*head_bias=False"
    with pytest.raises(ValueError, match=message):
        interop.to_clip_vision_projection(model.clone(head_bias=True), params)
    # A bias-free head on a tower that is not CLIP's has no architecture.
    with pytest.raises(ValueError, match="bias-free head"):
        interop.export(vit.Model("tiny/4", num_classes=3, head_bias=False), {})
    # config.json's image_size is one number: a non-square grid cannot be written.
    model, params = interop.load(path, image_size=(42, 35))
    with pytest.raises(ValueError, match=r"30 patches, no square grid"):
        interop.export(model, params)
