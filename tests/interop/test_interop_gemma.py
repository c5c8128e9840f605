"""Gemma 2 and Gemma 3 (text) against transformers: logits, greedy generation with the KV cache,
round trips, refusals, and the published presets' parameter counts.

Small random models are built from configs (no download); float32 logits must be within 1e-5
of a float64 copy of the reference.
"""

import copy
import math

import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical
from interop_references import ATOL, V, apply, greedy_reference, tokens, torch, transformers

from tfjax import decode, interop
from tfjax.interop.core import tables
from tfjax.interop.core.decoders import spelled_out
from tfjax.interop.families import gemma
from tfjax.models import decoder


def _sizes(**changes):
    return dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        max_position_embeddings=48,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        query_pre_attn_scalar=12,  # not head_dim: the scale is the config's
        sliding_window=4,  # the tests' 10 to 17 positions reach past it
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
        **changes,
    )


def _randomise_norms(ref):
    """Norm offsets w that are not zero, so (1 + w) and every norm's place show."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return ref


@references.reference
def gemma2():
    """Three layers (local, global, local) with soft caps small enough to act, and a RoPE
    scaled linearly (transformers' Gemma 2 has one RoPE for both kinds of layer)."""
    torch.manual_seed(10)
    config = transformers.Gemma2Config(
        **_sizes(
            num_hidden_layers=3,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        )
    )
    return _randomise_norms(transformers.Gemma2ForCausalLM(config).eval())


@references.reference
def gemma3():
    """Four layers (local, local, global, local: a period of 3 and one more), each kind with its
    RoPE (the global one scaled), q/k norms, a final soft cap."""
    torch.manual_seed(11)
    config = transformers.Gemma3TextConfig(
        **_sizes(
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
            final_logit_softcapping=3.0,
        )
    )
    return _randomise_norms(transformers.Gemma3ForCausalLM(config).eval())


FAMILIES = ["gemma2", "gemma3"]


def _reference_logits(ref, tokens, mask=None):
    ref64 = copy.deepcopy(ref).double()
    mask = np.ones(tokens.shape, bool) if mask is None else mask
    with torch.no_grad():
        return ref64(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()


def test_the_fixtures_use_what_they_test(gemma2, gemma3):
    m2, _ = interop.load(gemma2[1])
    m3, _ = interop.load(gemma3[1])
    assert m2.attention_pattern == ("local", "global") and m2.attention_softcap == 2.0
    assert m2.rope_scaling.kind == "linear" and m2.local_rope_scaling == m2.rope_scaling
    assert m3.attention_pattern == ("local", "local", "global") and m3.qk_norm
    assert (m3.rope_base, m3.local_rope_base) == (1000.0, 50.0)
    assert m3.rope_scaling.kind == "linear" and m3.local_rope_scaling is None
    assert m2.attention_scalar == m3.attention_scalar == 12


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    # Unpadded rows: transformers' float64 Gemma gives NaN rows for a right-padded batch.
    ids = tokens((2, 10))
    want = _reference_logits(ref, ids)
    got = apply(model, params, jnp.asarray(ids))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_soft_caps_and_window_act_in_the_compared_logits(gemma2):
    """Without the caps, or without the window, the logits differ: the test above sees them."""
    ref, path = gemma2
    model, params = interop.load(path)
    ids = tokens((1, 12))
    want = _reference_logits(ref, ids)
    for change in (
        {"attention_softcap": None},
        {"final_logit_softcap": None},
        {"attention_pattern": ("global",)},
    ):
        got = apply(model.clone(**change), params, jnp.asarray(ids))
        assert np.abs(got - want).max() > 1e-2, change


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, scan_layers, request):
    """12 new tokens after 5 (past the window of 4), with the KV cache, token for token."""
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    prompts, max_new = tokens((3, 5), seed=7), 12
    want = greedy_reference(ref, prompts, max_new, eos=V + 5)
    assert len(set(want.ravel().tolist())) > 3, "degenerate reference; change the seed"
    eos = min(set(range(3, V)) - set(want.ravel().tolist()))  # none emitted: all 12 compared
    got, _ = decode.generate(model, params, prompts, max_new_tokens=max_new, eos_id=eos)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_padded_prompts_matches_each_row_alone(family, side, request):
    """Prompts of 5, 2 and 4 tokens in one padded batch (scanned layers): each row's 9 tokens
    are the reference's for that prompt alone."""
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=True)
    references.check_padded_prompts(ref, model, params, side)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact_and_transformers_reads_it(family, request, tmp_path):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=True)
    interop.save(model, params, tmp_path)
    model2, params2 = interop.load(tmp_path, scan_layers=True)
    assert model2 == model
    assert_params_identical(params, params2)
    original, exported = interop.read_state_dict(path), interop.read_state_dict(tmp_path)
    assert set(exported) == set(original) - {"lm_head.weight"}
    for key, value in exported.items():
        assert np.array_equal(value, original[key]), key
    back = type(ref).from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = tokens((2, 9), seed=3)
    np.testing.assert_allclose(
        _reference_logits(back, ids), _reference_logits(ref, ids), atol=1e-12, rtol=0
    )
    assert back.config.layer_types == ref.config.layer_types


def test_older_gemma3_config_keys_mean_the_same_model(gemma3):
    """Hub configs written before transformers 5: rope_theta, rope_scaling, rope_local_base_freq
    and sliding_window_pattern instead of rope_parameters by layer type and layer_types."""
    _, path = gemma3
    config = interop.read_config(path)
    model, _ = interop.load(path)
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1000.0,
        rope_local_base_freq=50.0,
        sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert tables.build(gemma.GEMMA3, old) == model


def _refused(family, path, match, **changes):
    config = {**interop.read_config(path), **changes}
    with pytest.raises(ValueError, match=match):
        tables.build(family, config)


def test_unsupported_options_are_refused_by_key(gemma2, gemma3):
    g2, g3 = gemma2[1], gemma3[1]
    _refused(gemma.GEMMA2, g2, r"attention_bias=True is not supported", attention_bias=True)
    _refused(
        gemma.GEMMA2,
        g2,
        r"use_bidirectional_attention=True is not supported",
        use_bidirectional_attention=True,
    )
    _refused(
        gemma.GEMMA2,
        g2,
        r"hidden_activation='relu' is not supported; allowed: "
        r"\('gelu_pytorch_tanh'",
        hidden_activation="relu",
    )
    _refused(
        gemma.GEMMA2,
        g2,
        r"layer_types has \['chunked_attention'\].*allowed",
        layer_types=["chunked_attention"] * 3,
    )
    _refused(gemma.GEMMA2, g2, r"sliding_window is null", sliding_window=None)
    _refused(
        gemma.GEMMA3,
        g3,
        r"attn_logit_softcapping=50.0 is not supported \(needs None\)",
        attn_logit_softcapping=50.0,
    )
    _refused(
        gemma.GEMMA3,
        g3,
        r"rope_type='longrope' is not supported",
        rope_parameters={
            "full_attention": {"rope_type": "longrope", "rope_theta": 1.0},
            "sliding_attention": {"rope_type": "default"},
        },
    )


def test_export_refuses_a_model_gemma_cannot_express():
    model = decoder.Model(
        variant="gemma-2-2b",
        vocab_size=V,
        width=32,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        mlp_dim=48,
        qkv_bias=True,
    )
    with pytest.raises(ValueError, match="Gemma2ForCausalLM needs a model with .*qkv_bias=None"):
        tables.hf_config(gemma.GEMMA2, model)


# ----------------------------------------------------------------------------------------------
# Presets: parameter counts from shapes alone.

# (billions, decimals the card gives), from each model card on huggingface.co: Gemma 2 2B's
# "2.6B" (2,614,341,888), 9B's "9.24B", 27B's "27.2B" (27,227,128,320); Gemma 3 1B's "1B"
# (999,885,952).
CARDS = {
    "gemma-2-2b": (2.6, 1),
    "gemma-2-9b": (9.24, 2),
    "gemma-2-27b": (27.2, 1),
    "gemma-3-1b": (1.0, 1),
}

# Gemma 3 4B, 12B and 27B's cards ("4.3B", "12.2B", "27.4B") count the whole
# Gemma3ForConditionalGeneration: the text part (the preset) plus a SigLIP so400m/14 vision
# tower at 896 px without its pooling head and a projector to the text width, ~0.42B. The
# tower's config is the checkpoints' vision_config; the 4B's total is 4,300,079,472.
MULTIMODAL_CARDS = {"gemma-3-4b": (4.3, 1), "gemma-3-12b": (12.2, 1), "gemma-3-27b": (27.4, 1)}
VISION_CONFIG = dict(
    model_type="siglip_vision_model",
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    patch_size=14,
    image_size=896,
    vision_use_head=False,
)


def _count(model) -> int:
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def test_every_gemma_preset_is_counted():
    gemmas = {v for v in decoder.VARIANTS if v.startswith("gemma-")}
    assert gemmas == set(CARDS) | set(MULTIMODAL_CARDS)


# tests/models/test_presets.py checks the presets' exported configs against transformers'
# own models.
@pytest.mark.parametrize("variant", sorted(CARDS))
def test_presets_have_the_model_cards_parameter_counts(variant):
    billions, decimals = CARDS[variant]
    n = _count(decoder.Model(variant=variant))
    assert abs(n / 1e9 - billions) < 10**-decimals, n


@pytest.mark.parametrize("variant", sorted(MULTIMODAL_CARDS))
def test_gemma3_text_presets_with_the_vision_tower_have_the_model_cards_counts(variant):
    billions, decimals = MULTIMODAL_CARDS[variant]
    model = decoder.Model(variant=variant)
    text = tables.hf_config(gemma.GEMMA3, spelled_out(model))
    del text["architectures"]  # Gemma3ForCausalLM's; here the text part of the whole model
    config = transformers.Gemma3Config(text_config=text, vision_config=VISION_CONFIG)
    with torch.device("meta"):
        reference = transformers.Gemma3ForConditionalGeneration(config)
    language_model = reference.model.language_model
    assert sum(p.numel() for p in language_model.parameters()) == _count(model)
    n = sum(p.numel() for p in reference.parameters())
    assert abs(n / 1e9 - billions) < 10**-decimals, n
