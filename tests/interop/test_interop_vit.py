"""Hugging Face ViT and timm's ViT (tfjax.interop.families.vit) against transformers: logits,
position embeddings resampled to other image sizes as torch interpolates them, timm's keys
(against timm itself: test_interop_timm.py), round trips, and refusals."""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import ATOL, apply, torch, transformers

from tfjax import interop
from tfjax.interop.core import posemb
from tfjax.models import vit


@references.reference
def hf_vit():
    torch.manual_seed(4)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        image_size=32,
        patch_size=8,
        num_labels=5,
    )
    ref = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # position embeddings that matter, so resampling errors would show
        pe = ref.vit.embeddings.position_embeddings
        pe.copy_(torch.randn_like(pe))
    return ref


def _images(h, w, seed=0):
    return np.random.RandomState(seed).randn(2, 3, h, w).astype(np.float32)


def _vit_logits(model, params, images_nchw):
    return apply(model, params, jnp.asarray(images_nchw.transpose(0, 2, 3, 1)))


def test_logits_match_reference(hf_vit):
    ref, path = hf_vit
    model, params = interop.load(path, scan_layers=True)
    images = _images(32, 32)
    with torch.no_grad():
        want = ref(torch.tensor(images)).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("size", [(48, 40), (24, 24)])
def test_resampled_posemb_matches_interpolate_pos_encoding(hf_vit, size):
    ref, path = hf_vit
    model, params = interop.from_hf_vit(path, image_size=size)
    assert params["pos_embed"].shape == (1, 1 + (size[0] // 8) * (size[1] // 8), 32)
    images = _images(*size, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor(images), interpolate_pos_encoding=True).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("size_in", "size_out"), [(4, 7), (7, 4), (3, 13), (6, 6)])
def test_bicubic_matrix_matches_torch_interpolate(size_in, size_out):
    x = np.random.RandomState(0).randn(1, 2, size_in, size_in).astype(np.float32)
    want = torch.nn.functional.interpolate(
        torch.tensor(x), size=(size_out, size_out), mode="bicubic", align_corners=False
    ).numpy()[0]
    m = posemb.bicubic_matrix(size_in, size_out)
    got = np.einsum("Hh,chw,Ww->cHW", m, x[0].astype(np.float64), m)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("antialias", [False, True])
def test_non_square_grid_resampled_as_torch_interpolates(antialias):
    """A 4 x 6 grid to 5 x 3 (one axis up, one down), plain and antialiased (timm's
    resample_abs_pos_embed), the class token's row kept."""
    table = np.random.RandomState(0).randn(1, 1 + 4 * 6, 2).astype(np.float32)
    grid = torch.tensor(table[:, 1:].reshape(1, 4, 6, 2)).permute(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(grid, size=(5, 3), mode="bicubic", antialias=antialias)
    want = want.permute(0, 2, 3, 1).reshape(1, 15, 2).numpy()
    got = posemb.resample_posemb(table, (5, 3), grid=(4, 6), antialias=antialias)
    np.testing.assert_array_equal(got[:, :1], table[:, :1])
    np.testing.assert_allclose(got[:, 1:], want, atol=1e-6, rtol=0)


def _timm_state(hf_state):
    """HF ViT weights under timm's documented VisionTransformer key names (qkv fused)."""
    s = {k: v.numpy() for k, v in hf_state.items()}
    out = {
        "cls_token": s["vit.embeddings.cls_token"],
        "pos_embed": s["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": s["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": s["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": s["vit.layernorm.weight"],
        "norm.bias": s["vit.layernorm.bias"],
        "head.weight": s["classifier.weight"],
        "head.bias": s["classifier.bias"],
    }
    for i in range(2):
        h = f"vit.encoder.layer.{i}."
        att = f"{h}attention.attention."
        for part in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{part}"] = np.concatenate(
                [s[f"{att}{n}.{part}"] for n in ("query", "key", "value")]
            )
            out[f"blocks.{i}.attn.proj.{part}"] = s[f"{h}attention.output.dense.{part}"]
            out[f"blocks.{i}.norm1.{part}"] = s[f"{h}layernorm_before.{part}"]
            out[f"blocks.{i}.norm2.{part}"] = s[f"{h}layernorm_after.{part}"]
            out[f"blocks.{i}.mlp.fc1.{part}"] = s[f"{h}intermediate.dense.{part}"]
            out[f"blocks.{i}.mlp.fc2.{part}"] = s[f"{h}output.dense.{part}"]
    return out


def test_timm_keys_match_hf_reference(hf_vit):
    """The key layout where timm is not installed; at the trained size, as timm resamples
    position embeddings otherwise than Hugging Face (antialiased): test_interop_timm.py
    compares with timm itself."""
    ref, path = hf_vit
    # transformers 5 renames ViT modules in memory; the saved file keeps the hub key names.
    hf_state = {k: torch.from_numpy(v) for k, v in interop.read_state_dict(path).items()}
    model, params = interop.from_timm_vit(
        _timm_state(hf_state), image_size=32, num_heads=4, norm_eps=1e-12
    )
    assert (model.width, model.num_layers, model.mlp_dim, model.num_classes) == (32, 2, 40, 5)
    images = _images(32, 32, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor(images)).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_round_trip_through_safetensors_is_bitwise(hf_vit, scan_layers, tmp_path):
    references.check_round_trip(hf_vit[1], scan_layers, tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qkv_bias": False}, r"qkv_bias=False is not supported \(needs True\)"),
        ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported \(needs 'gelu'\)"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(hf_vit, changes, message):
    """Each refusal names the key, its value and what tfjax supports."""
    references.check_config_refused(hf_vit[1], changes, message)


def test_export_refuses_a_tower_option_it_has_no_key_for():
    """ViTForImageClassification has no bias-free head or CLIP pre-norm: named, not a missing
    or extra key later."""
    for change, name in ((dict(head_bias=False), "head_bias"), (dict(pre_norm=True), "pre_norm")):
        model = vit.Model(variant="Ti/16", num_classes=10, **change)
        with pytest.raises(ValueError, match=f"ViTForImageClassification needs .*{name}"):
            interop.to_hf_vit(model, {})
