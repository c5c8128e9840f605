"""Llama 4 (tfjax.interop.families.llama4) against transformers: logits (unrolled and scanned),
greedy generation with the KV cache (chunked RoPE layers, NoPE layers with the temperature),
padded prompts, round trips, transformers reading the export, Linen == NNX, packed rows, the
image-text checkpoint's text model, and refusals."""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import V, torch, transformers
from safetensors import safe_open

from tfjax import decode, interop
from tfjax.interop import pretrained
from tfjax.interop.core import tables
from tfjax.interop.core.decoders import spelled_out
from tfjax.interop.families import llama4
from tfjax.models import decoder

# Small Llama 4 text models: 4 heads of 8 (2 key/value heads), chunks of 4 positions on the RoPE
# layers (prompts of 5 and 12 new tokens cross several), the NoPE layers' temperature from
# position 2 on (floor_scale 3, attn_scale 0.5: large, so that it shows), experts of 16 and a
# shared one, dense layers of 48.
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    attention_chunk_size=4,
    floor_scale=3,
    attn_scale=0.5,
    max_position_embeddings=64,
    initializer_range=0.2,  # large weights: varied routes and greedy continuations
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _build(seed, model=transformers.Llama4ForCausalLM, **config):
    torch.manual_seed(seed)
    ref = model(transformers.Llama4TextConfig(**SIZES, **config))
    with torch.no_grad():  # norm scales that are not the identity, so a swapped one shows
        for name, p in ref.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return ref.eval()


@references.reference
def llama4_scout():
    """Scout's kind of layers: every layer's FFN experts (2 a token here), q/k norms on the
    RoPE layers, a NoPE layer every second (no_rope_layer_interval), Llama 3.1's RoPE
    scaling."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    return _build(
        41,
        num_hidden_layers=4,
        num_experts_per_tok=2,
        no_rope_layer_interval=2,
        rope_parameters=rope,
    )


@references.reference
def llama4_maverick():
    """Maverick's kind: experts in every second layer (dense ones between), no q/k norm; the
    third layer NoPE (no_rope_layers), without the temperature; a tied head."""
    return _build(
        42,
        num_hidden_layers=3,
        interleave_moe_layer_step=2,
        use_qk_norm=False,
        no_rope_layers=[1, 1, 0],
        attn_temperature_tuning=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )


FAMILIES = ["llama4_scout", "llama4_maverick"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(family, scan_layers, request):
    references.check_decoder_logits(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, request):
    """tfjax.decode with the KV cache, token for token: 17 positions cross four chunks."""
    references.check_greedy_generation(*request.getfixturevalue(family))


def test_the_configs_read_as_llama4s_layers(llama4_scout, llama4_maverick):
    scout = pretrained.pretrained_model(llama4_scout[1])
    assert (scout.attention_pattern, scout.global_rope) == (("local", "global"), False)
    assert (scout.attention_chunk_size, scout.qk_unit_norm) == (4, True)
    assert (scout.attention_temperature_floor, scout.attention_temperature_scale) == (3, 0.5)
    assert (scout.num_experts, scout.experts_per_token, scout.moe_layer_step) == (4, 2, 1)
    assert (scout.mlp_dim, scout.expert_mlp_dim, scout.shared_expert_dim) == (48, 16, 16)
    assert scout.router_weighs_inputs and scout.rope_scaling.kind == "llama3"
    assert [name for name, *_ in scout.stacks()] == ["decoder"]
    maverick = pretrained.pretrained_model(llama4_maverick[1])
    assert maverick.attention_pattern == ("local", "local", "global")
    assert (maverick.qk_unit_norm, maverick.attention_temperature_floor) == (False, None)
    # dense, experts, dense: a stack each
    assert [(first, n) for _, _, first, n in maverick.stacks()] == [(0, 1), (1, 1), (2, 1)]
    assert [maverick.spec.moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_safetensors_is_bitwise(family, request, tmp_path):
    """The export holds the reference file's tensors bit for bit (q/k rows permuted back)."""
    references.check_round_trip(request.getfixturevalue(family)[1], False, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    references.check_transformers_reads_export(*request.getfixturevalue(family), tmp_path)


def test_nnx_gives_linens_logits_and_tokens(llama4_maverick):
    """interop.as_nnx: Linen's logits, and through tfjax.decode's KV cache Linen's tokens."""
    model, params, nnx_model = references.check_nnx_logits(llama4_maverick[1])
    prompts = references.tokens((2, 5), seed=5)
    linen, _ = decode.generate(model, params, prompts, max_new_tokens=8, eos_id=V - 1)
    tokens, _ = decode.generate(nnx_model, prompts, max_new_tokens=8, eos_id=V - 1)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(linen))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompts_decode_as_each_prompt_alone(side, llama4_scout):
    """Prompts of 5, 2 and 4 tokens in one batch, padded: each row's chunks and temperature
    count from its own first token (transformers' generate of each prompt alone)."""
    ref, path = llama4_scout
    model, params = interop.load(path)
    references.check_padded_prompts(ref, model, params, side)


def test_packed_rows_give_each_segments_logits(llama4_scout):
    """Two sequences packed in one row (segment ids, positions restarting): their chunks and
    temperatures count from each one's start, as when each runs alone."""
    _, path = llama4_scout
    model, params = interop.load(path)
    a, b = references.tokens((1, 6), seed=3), references.tokens((1, 7), seed=4)
    packed = np.concatenate([a, b], axis=1)
    segments = np.array([[1] * 6 + [2] * 7])
    positions = np.array([list(range(6)) + list(range(7))])
    got = references.apply(
        model,
        params,
        jnp.asarray(packed),
        segment_ids=jnp.asarray(segments),
        positions=jnp.asarray(positions),
    )
    alone = [references.apply(model, params, jnp.asarray(x)) for x in (a, b)]
    np.testing.assert_allclose(got, np.concatenate(alone, axis=1), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, r"attention_bias=True is not supported \(needs False\)"),
        ({"attention_chunk_size": None}, r"attention_chunk_size=None is not supported"),
        (
            {"moe_layers": [0, 1, 2]},
            r"moe_layers=\[0, 1, 2\] is not supported \(needs \[0, 1, 2, 3\]",
        ),
        ({"layer_types": ["full_attention"] * 4}, r"layer_types=.* is not supported"),
        ({"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers=\[1, 2, 1, 0\] is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_by_key(changes, message, llama4_scout):
    references.check_config_refused(llama4_scout[1], changes, message)


@references.reference
def llama4_image_text():
    """Llama4ForConditionalGeneration: llama4_maverick's text model beside a 1-layer vision
    tower and its projector, untied (the wrapper's default)."""
    torch.manual_seed(43)
    text = transformers.Llama4TextConfig(
        **SIZES,
        num_hidden_layers=3,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 1, 0],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    vision = transformers.Llama4VisionConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    return transformers.Llama4ForConditionalGeneration(config).eval()


def test_the_image_text_checkpoint_loads_its_text_model(llama4_image_text, tmp_path, caplog):
    """The text part of a Llama4ForConditionalGeneration: its logits on text-only tokens, the
    vision tower and projector skipped by name and counted; the export is a Llama4ForCausalLM
    that transformers reads with the same logits."""
    ref, path = llama4_image_text
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert any(k.startswith("vision_model.") for k in f.keys())  # noqa: SIM118
    with caplog.at_level("INFO"):
        model, params = interop.load(path)
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "vision_model.*" in skipped and "multi_modal_projector.*" in skipped, skipped
    assert (model.num_layers, model.moe_layer_step, model.tie_embeddings) == (3, 2, False)
    ids = references.tokens((2, 9))
    with torch.no_grad():
        expected = ref.double()(torch.tensor(ids)).logits.numpy()
    got = references.apply(model, params, jnp.asarray(ids))
    np.testing.assert_allclose(got, expected, atol=references.ATOL)
    interop.save(model, params, str(tmp_path / "export"))
    assert interop.read_config(str(tmp_path / "export"))["architectures"] == ["Llama4ForCausalLM"]
    back = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        again = back.double()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(again, expected, atol=references.ATOL)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(global_rope=False), r"global_rope=False needs position='rope' and global layers"),
        (
            dict(attention_pattern=("global",), attention_temperature_floor=8),
            r"attention_temperature_floor applies to NoPE layers: set global_rope=False",
        ),
        (dict(attention_temperature_scale=0.2), r"attention_temperature_scale set, but"),
        (dict(attention_chunk_size=0), r"Decoder.attention_chunk_size must be an integer >= 1"),
        (dict(moe_layer_step=2), r"moe_layer_step set, but num_experts=0"),
        (
            dict(num_experts=4, moe_layer_step=2, first_dense_layers=1),
            r"moe_layer_step=2 does not take first_dense_layers",
        ),
        (dict(attention_pattern=("local", "global")), r"need sliding_window or attention_chunk"),
    ],
)
def test_the_spec_refuses_llama4_fields_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        decoder.Model("modern-tiny", vocab_size=V, **fields)


def test_a_model_with_llama4s_fields_exports_as_llama4_or_not_at_all():
    """Llama 4's exporter takes every model that sets one of its fields (no other family
    would write them) and refuses by name what Llama 4 cannot hold."""
    chunked = decoder.Model("moe-tiny", vocab_size=V, attention_chunk_size=4)
    exporter = interop.REGISTRY.exporter(chunked)
    assert exporter.family(chunked).architecture == "Llama4ForCausalLM"
    with pytest.raises(ValueError, match=r"Llama4ForCausalLM needs a model with .*router_score="):
        tables.hf_config(exporter.family(chunked), spelled_out(chunked))
    global_rope = decoder.Model("llama4-tiny", global_rope=True, attention_temperature_floor=None)
    with pytest.raises(ValueError, match=r"holds no global layers with RoPE"):
        tables.hf_config(llama4.LLAMA4, spelled_out(global_rope))
    assert tables.hf_config(llama4.LLAMA4, spelled_out(decoder.Model("llama4-tiny")))
