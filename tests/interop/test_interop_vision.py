"""Vision towers (DINOv2, DINOv2 with registers, CLIP, SigLIP; CLIP with its projection and the
vision towers of whole CLIPModel and SiglipModel files) against transformers: outputs,
interpolated positions, round trips, export and refusals; presets' parameter counts.

Small random towers are built from configs (no download); tfjax in float32 must give a float64
copy of the reference's last_hidden_state and pooler_output within 1e-5.
"""

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tfjax import interop  # noqa: E402
from tfjax.interop import core  # noqa: E402
from tfjax.interop.families import clip as clip_family  # noqa: E402
from tfjax.interop.families import dinov2 as dinov2_family  # noqa: E402
from tfjax.models import vit  # noqa: E402

ATOL = 1e-5
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=28)


def _randomise(ref, std=0.3):
    """Norms, biases, layer scales, tokens, the probe and the position embeddings random (the
    projections keep transformers' small init, so activations stay near 1), so a swapped or
    missing one shows in the outputs."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim >= 2 and "position" not in name and "token" not in name:
                continue
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
            p.copy_(base + std * torch.randn_like(p))
    return ref


def _tower(cls, config, seed, tmp_path_factory, name):
    torch.manual_seed(seed)
    ref = _randomise(cls(config).eval())
    return ref, save_pretrained(ref, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def dinov2(tmp_path_factory):
    config = transformers.Dinov2Config(**SMALL, patch_size=7, layerscale_value=0.5)
    return _tower(transformers.Dinov2Model, config, 0, tmp_path_factory, "dinov2")


@pytest.fixture(scope="module")
def dinov2_swiglu(tmp_path_factory):
    """DINOv2 giant's FFN (SwiGLU, weights_in fused) on a small tower."""
    config = transformers.Dinov2Config(
        **{**SMALL, "hidden_size": 48}, patch_size=7, use_swiglu_ffn=True
    )
    return _tower(transformers.Dinov2Model, config, 1, tmp_path_factory, "dinov2_swiglu")


@pytest.fixture(scope="module")
def dinov2_registers(tmp_path_factory):
    config = transformers.Dinov2WithRegistersConfig(**SMALL, patch_size=7, num_register_tokens=3)
    return _tower(
        transformers.Dinov2WithRegistersModel, config, 2, tmp_path_factory, "dinov2_registers"
    )


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    config = transformers.CLIPVisionConfig(**SMALL, patch_size=7, intermediate_size=40)
    return _tower(transformers.CLIPVisionModel, config, 3, tmp_path_factory, "clip")


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    config = transformers.SiglipVisionConfig(**SMALL, patch_size=7, intermediate_size=40)
    return _tower(transformers.SiglipVisionModel, config, 4, tmp_path_factory, "siglip")


TOWERS = ["dinov2", "dinov2_swiglu", "dinov2_registers", "clip", "siglip"]
# Interpolation at another image size: the DINOv2s always; CLIP and SigLIP when asked.
RESIZED = {
    "dinov2": {},
    "dinov2_registers": {},
    "clip": {"interpolate_pos_encoding": True},
    "siglip": {"interpolate_pos_encoding": True},
}


def _images(h, w, seed=0):
    return np.random.RandomState(seed).randn(2, 3, h, w).astype(np.float32)  # NCHW


def _reference(ref, images, **kwargs):
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        out = ref64(torch.tensor(images, dtype=torch.float64), **kwargs)
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _ours(model, params, images):
    fn = jax.jit(lambda p, x: model.apply({"params": p}, x))
    pooled, aux = fn(params, jnp.asarray(images.transpose(0, 2, 3, 1)))
    return np.asarray(aux["encoded"]), np.asarray(pooled)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_tower_outputs_match_reference(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers and model.num_classes is None
    images = _images(28, 28)
    tokens, pooled = _ours(model, params, images)
    want_tokens, want_pooled = _reference(ref, images)
    np.testing.assert_allclose(tokens, want_tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)


@pytest.mark.parametrize("size", [(42, 35), (21, 21)])
@pytest.mark.parametrize("family", sorted(RESIZED))
def test_tower_at_another_image_size_matches_interpolated_reference(family, size, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, image_size=size, scan_layers=True)
    images = _images(*size, seed=1)
    tokens, pooled = _ours(model, params, images)
    want_tokens, want_pooled = _reference(ref, images, **RESIZED[family])
    np.testing.assert_allclose(tokens, want_tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)


def test_dinov2_mask_token_replaces_masked_patches(dinov2):
    ref, path = dinov2
    model, params = interop.load(path)
    images = _images(28, 28)
    mask = np.random.RandomState(2).rand(2, 16) < 0.5
    pooled, aux = model.apply(
        {"params": params}, jnp.asarray(images.transpose(0, 2, 3, 1)), mask=mask
    )
    want_tokens, want_pooled = _reference(ref, images, bool_masked_pos=torch.tensor(mask))
    np.testing.assert_allclose(np.asarray(aux["encoded"]), want_tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), want_pooled, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", TOWERS)
def test_tower_round_trip_is_bitwise_and_loads_in_transformers(
    family, scan_layers, request, tmp_path
):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    interop.save(model, params, tmp_path)
    model2, params2 = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    # The export holds the reference file's tensors bitwise; CLIP and SigLIP under the
    # "vision_model." prefix that hub files carry (transformers reads both).
    original = interop.read_state_dict(path)
    exported = {
        k.removeprefix("vision_model."): v for k, v in interop.read_state_dict(tmp_path).items()
    }
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k
    if scan_layers:
        return
    transformers.logging.set_verbosity_error()
    again = type(ref).from_pretrained(tmp_path).eval()
    images = _images(28, 28, seed=3)
    with torch.no_grad():
        a, b = ref(torch.tensor(images)), again(torch.tensor(images))
    np.testing.assert_array_equal(a.pooler_output.numpy(), b.pooler_output.numpy())
    np.testing.assert_array_equal(a.last_hidden_state.numpy(), b.last_hidden_state.numpy())


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("dinov2", {"hidden_act": "silu"}, r"hidden_act='silu' is not supported; allowed: \("),
        ("dinov2", {"qkv_bias": False}, r"qkv_bias=False is not supported \(needs True\)"),
        ("dinov2", {"drop_path_rate": 0.1}, r"drop_path_rate=0.1 is not supported \(needs 0.0\)"),
        ("dinov2", {"use_swiglu_ffn": "yes"}, r"use_swiglu_ffn='yes' is not supported"),
        ("clip", {"hidden_act": "silu"}, r"CLIPVisionModel: hidden_act='silu' is not supported"),
        ("siglip", {"vision_use_head": False}, r"vision_use_head=False is not supported"),
    ],
)
def test_tower_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    _, path = request.getfixturevalue(family)
    state, config = core.read_state_dict(path), core.read_config(path)
    loader = interop.ARCHITECTURES[config["architectures"][0]]
    with pytest.raises(ValueError, match=message):
        loader(state, {**config, **changes})


def test_tower_export_refuses_what_the_architecture_cannot_hold(dinov2):
    _, path = dinov2
    model, params = interop.load(path)
    with pytest.raises(ValueError, match="no mlp_ratio for the model's mlp_dim=100"):
        dinov2_family.to_dinov2(model.clone(mlp_dim=100), params)
    with pytest.raises(ValueError, match="CLIPVisionModel needs a model with"):
        clip_family.to_clip_vision(model, params)
    plain = vit.Model("tiny/4", num_classes=None)
    with pytest.raises(ValueError, match="exports as a vision tower"):
        interop.export(plain, {})


def test_tower_weights_of_another_tower_name_missing_keys(dinov2, clip):
    _, dino_path = dinov2
    _, clip_path = clip
    with pytest.raises(ValueError, match=r"CLIPVisionModel: \d+ key\(s\) missing"):
        interop.from_clip_vision(core.read_state_dict(dino_path), core.read_config(clip_path))


# ----------------------------------------------------------------------------------------------
# Presets.

# Published parameter counts in millions and how many the figure rounds to, from DINOv2's
# README (github.com/facebookresearch/dinov2, "Pretrained models": ViT-S/14 21 M, ViT-B/14
# 86 M, ViT-L/14 300 M, ViT-g/14 1,100 M; with registers the same). Those round coarsely (at
# 518 px S holds 22.06 M, B 86.58 M, L 304.37 M, g 1,136.48 M), so within 6 %; the exact counts
# are checked against transformers' own model below.
DINOV2_README = {"dinov2-S/14": 21, "dinov2-B/14": 86, "dinov2-L/14": 300, "dinov2-g/14": 1100}
PUBLISHED = [v for v in vit.VARIANTS if v.startswith(("dinov2-", "clip-", "siglip-"))]


def _count(model, size) -> int:
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3), jnp.float32))
    )
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("variant", sorted(DINOV2_README))
def test_dinov2_presets_have_the_readme_parameter_counts(variant):
    n = _count(vit.Model(variant), vit.TRAINED_IMAGE_SIZES[variant])
    assert abs(n / 1e6 / DINOV2_README[variant] - 1) < 0.06, n


@pytest.mark.parametrize(
    "variant, registers",
    [(v, 0) for v in PUBLISHED] + [(v, 4) for v in PUBLISHED if v.startswith("dinov2-")],
)  # registers are DINOv2's
def test_tower_presets_match_transformers_count_built_from_their_export(variant, registers):
    """The preset's exported config.json, built by transformers on the meta device, has exactly
    the preset's parameter count and loads back as the same model."""
    model = vit.Model(variant, num_registers=registers)
    family = interop.REGISTRY.exporter(model).family(model)
    size = vit.TRAINED_IMAGE_SIZES[variant]
    config = core.hf_config(family, model) | {"image_size": size, "num_channels": 3}
    assert vit.Model(**core.model_fields(family, config)) == model
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        reference = getattr(transformers, config["architectures"][0])(hf_config)
    want = sum(p.numel() for p in reference.parameters())
    assert _count(model, size) == want


# ----------------------------------------------------------------------------------------------
# CLIPVisionModelWithProjection, and the vision towers of whole CLIPModel and SiglipModel files.

VISION = dict(SMALL, patch_size=7, intermediate_size=40)
TEXT = dict(
    hidden_size=24, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40, vocab_size=99
)


@pytest.fixture(scope="module")
def clip_model(tmp_path_factory):
    config = transformers.CLIPConfig(vision_config=VISION, text_config=TEXT, projection_dim=24)
    return _tower(transformers.CLIPModel, config, 5, tmp_path_factory, "clip_model")


@pytest.fixture(scope="module")
def siglip_model(tmp_path_factory):
    config = transformers.SiglipConfig(vision_config=VISION, text_config=TEXT)
    return _tower(transformers.SiglipModel, config, 6, tmp_path_factory, "siglip_model")


@pytest.fixture(scope="module")
def clip_projection(tmp_path_factory):
    config = transformers.CLIPVisionConfig(**VISION, projection_dim=24)
    return _tower(
        transformers.CLIPVisionModelWithProjection, config, 7, tmp_path_factory, "clip_projection"
    )


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


def _features(ref, images, **kwargs):
    """(last_hidden_state, the tower's pooler_output, the image features) of a float64 copy."""
    ref64 = copy.deepcopy(ref).double()
    x = torch.tensor(images, dtype=torch.float64)
    with torch.no_grad():
        tower = ref64.vision_model(x, **kwargs)
    features = _embeddings(ref64, x, **kwargs)
    return tower.last_hidden_state.numpy(), tower.pooler_output.numpy(), features.numpy()


def _check_features(model, params, ref, images, **kwargs):
    features, aux = jax.jit(lambda p, x: model.apply({"params": p}, x))(
        params, jnp.asarray(images.transpose(0, 2, 3, 1))
    )
    tokens, pooled, want = _features(ref, images, **kwargs)
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
    _check_features(model, params, ref, _images(28, 28))


@pytest.mark.parametrize("size", [(42, 35), (21, 21)])
@pytest.mark.parametrize("family", WHOLE)
def test_whole_model_at_another_image_size_matches_interpolated_reference(family, size, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, image_size=size, scan_layers=True)
    _check_features(model, params, ref, _images(*size, seed=1), interpolate_pos_encoding=True)


@pytest.mark.parametrize("family", ["clip_model", "clip_projection"])
def test_clip_without_projection_gives_the_towers_pooler_output(family, request, tmp_path):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, projection=False)
    assert model.num_classes is None and "head" not in params
    images = _images(28, 28, seed=2)
    pooled, aux = model.apply({"params": params}, jnp.asarray(images.transpose(0, 2, 3, 1)))
    tokens, want, _ = _features(ref, images)
    np.testing.assert_allclose(np.asarray(aux["encoded"]), tokens, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), want, atol=ATOL, rtol=0)
    interop.save(model, params, tmp_path)  # the bare tower
    assert core.read_config(tmp_path)["architectures"] == ["CLIPVisionModel"]
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
    config = core.read_config(tmp_path)
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
    transformers.logging.set_verbosity_error()
    again = getattr(transformers, EXPORTED[family]).from_pretrained(tmp_path).eval()
    images = torch.tensor(_images(28, 28, seed=3))
    want, got = _embeddings(ref, images), _embeddings(again, images)
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
    state, config = core.read_state_dict(path), core.read_config(path)
    loader = interop.ARCHITECTURES[config["architectures"][0]]
    with pytest.raises(ValueError, match=message):
        loader(state, edit(config, changes))


@pytest.mark.parametrize("family", ["clip_model", "siglip_model"])
def test_whole_model_skips_only_the_text_tower_and_the_named_keys(family, request):
    """The text tower's keys and logit_scale (SigLIP: and logit_bias) are skipped by name (the
    loads above hold them); a stray key beside the vision tower's is refused, and a missing
    vision key is named."""
    _, path = request.getfixturevalue(family)
    state, config = core.read_state_dict(path), core.read_config(path)
    what = config["architectures"][0]
    loader = interop.ARCHITECTURES[what]
    stray = core.StateDict(state, origin="stray.safetensors")
    stray["vision_model.encoder.layers.0.extra.weight"] = np.zeros(3, np.float32)
    message = rf"^{what}: 1 unexpected key\(s\) in stray\.safetensors: 'vision_model\.encoder"
    with pytest.raises(ValueError, match=message):
        loader(stray, config)
    for key in ("vision_model.post_layernorm.weight", "visual_projection.weight"):
        if key in state:
            lacking = core.StateDict({k: v for k, v in state.items() if k != key})
            with pytest.raises(ValueError, match=rf"^{what}: 1 key\(s\) missing .*'{key}'"):
                loader(lacking, config)


def test_whole_model_export_refusals(clip_model):
    _, path = clip_model
    model, params = interop.load(path)
    message = r"CLIPVisionModelWithProjection needs a model with .*head_bias=False"
    with pytest.raises(ValueError, match=message):
        clip_family.to_clip_vision_projection(model.clone(head_bias=True), params)
    # A bias-free head on a tower that is not CLIP's has no architecture.
    with pytest.raises(ValueError, match="bias-free head"):
        interop.export(vit.Model("tiny/4", num_classes=3, head_bias=False), {})
    # config.json's image_size is one number: a non-square grid cannot be written.
    model, params = interop.load(path, image_size=(42, 35))
    with pytest.raises(ValueError, match=r"30 patches, no square grid"):
        interop.export(model, params)


def test_hf_vit_export_refuses_a_tower_option_it_has_no_key_for():
    """ViTForImageClassification has no bias-free head or CLIP pre-norm: named, not a missing
    or extra key later."""
    for change, name in ((dict(head_bias=False), "head_bias"), (dict(pre_norm=True), "pre_norm")):
        model = vit.Model(variant="Ti/16", num_classes=10, **change)
        with pytest.raises(ValueError, match=f"ViTForImageClassification needs .*{name}"):
            interop.to_hf_vit(model, {})
