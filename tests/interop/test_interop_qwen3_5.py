"""Qwen3.5 (tfjax.interop.families.qwen3_5) against transformers: logits (unrolled and scanned),
greedy generation through the recurrent states and KV caches, round trips, transformers reading
the export, Linen == NNX, and refusals."""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import V, torch, transformers
from safetensors import safe_open

from tfjax import interop
from tfjax.interop import pretrained
from tfjax.ops import KVCache
from tfjax.ops.linear_attention import RecurrentState

# Five layers: linear, linear, full, linear, full (runs of 2, 1, 1, 1); 4 heads of 16 (RoPE on
# a quarter), 2 key/value heads; linear attention of 2 key heads (8) and 4 value heads (8).
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=64,
    initializer_range=0.05,  # logits near 1: the reference runs its delta rule and norms in
    # float32 even in float64, whose rounding larger weights amplify past 1e-5
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _build(seed, **config):
    torch.manual_seed(seed)
    ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SIZES, **config))
    with torch.no_grad():  # random norm offsets and decays, so each shows
        for name, p in ref.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                p.copy_(p + 0.3 * torch.randn_like(p))
    return ref.eval()


@references.reference
def qwen3_5_layer_types():
    """layer_types listed: runs of different lengths, partial rotary 0.25, theta 500."""
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    return _build(31, layer_types=[*TYPES, "full_attention"], rope_parameters=rope)


@references.reference
def qwen3_5_interval():
    """Every second layer full (full_attention_interval), RoPE on half of each head, tied."""
    rope = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}
    return _build(32, full_attention_interval=2, rope_parameters=rope, tie_word_embeddings=True)


FAMILIES = ["qwen3_5_layer_types", "qwen3_5_interval"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(family, scan_layers, request):
    references.check_decoder_logits(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, request):
    """tfjax.decode through the linear layers' recurrent states and the full layers' KV caches,
    token for token."""
    references.check_greedy_generation(*request.getfixturevalue(family))


def test_the_config_reads_as_qwen3_5_and_the_cache_mixes_kinds(qwen3_5_layer_types):
    _, path = qwen3_5_layer_types
    model = pretrained.pretrained_model(path)
    assert model.layer_types == (*TYPES, "full_attention")
    assert (model.partial_rotary_factor, model.rope_base, model.norm) == (
        0.25,
        500.0,
        "rms_plus_one",
    )
    assert [n for _, _, _, n in model.stacks()] == [2, 1, 1, 1]
    cache = model.init_cache(2, 10)
    kinds = [type(c) for c in cache]
    assert kinds == [RecurrentState, RecurrentState, KVCache, RecurrentState, KVCache]
    assert cache[0].state.shape == (2, 4, 8, 8) and cache[2].keys.shape == (2, 10, 2, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_safetensors_is_bitwise(family, request, tmp_path):
    references.check_round_trip(request.getfixturevalue(family)[1], False, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    references.check_transformers_reads_export(*request.getfixturevalue(family), tmp_path)


def test_nnx_gives_linens_logits(qwen3_5_layer_types):
    references.check_nnx_logits(qwen3_5_layer_types[1])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, r"attention_bias=True is not supported \(needs False\)"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0}},
            r"rope_type='yarn' is not supported",
        ),
        (
            {"layer_types": [*TYPES, "sliding_attention"]},
            r"layer_types has \['sliding_attention'\]",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_by_key(changes, message, qwen3_5_layer_types):
    references.check_config_refused(qwen3_5_layer_types[1], changes, message)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompts_decode_as_each_prompt_alone(side, qwen3_5_layer_types):
    """Prompts of 5, 2 and 4 tokens in one batch, padded: the recurrent states see each row's
    prompt tokens only."""
    ref, path = qwen3_5_layer_types
    model, params = interop.load(path)
    references.check_padded_prompts(ref, model, params, side)


@references.reference
def qwen3_5_image_text():
    """Qwen3_5ForConditionalGeneration: qwen3_5_layer_types' text model beside a 1-layer vision
    tower, untied (the wrapper's default)."""
    torch.manual_seed(33)
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    text = transformers.Qwen3_5TextConfig(**SIZES, layer_types=[*TYPES, "full_attention"])
    text.rope_parameters = rope
    vision = transformers.Qwen3_5VisionConfig(
        depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32
    )
    config = transformers.Qwen3_5Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
    )
    return transformers.Qwen3_5ForConditionalGeneration(config).eval()


def test_the_image_text_checkpoint_loads_its_text_model(qwen3_5_image_text, tmp_path, caplog):
    """The text part of a Qwen3_5ForConditionalGeneration: its logits on text-only tokens, the
    vision tower and a multi-token-prediction head (the published files hold one) skipped by
    name and counted; the export is a Qwen3_5ForCausalLM that transformers reads with the same
    logits."""
    ref, path = qwen3_5_image_text
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open's API)
    assert any(k.startswith("model.visual.") for k in state)
    state["mtp.fc.weight"] = torch.zeros(32, 64)
    interop.write_safetensors(state, str(tmp_path), interop.read_config(path))
    with caplog.at_level("INFO"):
        model, params = interop.load(str(tmp_path))
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "visual.*" in skipped and "mtp.*" in skipped, skipped
    assert (model.num_layers, model.layer_types[-1], model.tie_embeddings) == (
        5,
        "full_attention",
        False,
    )
    ids = references.tokens((2, 9))
    with torch.no_grad():
        expected = ref.double()(torch.tensor(ids)).logits.numpy()
    got = references.apply(model, params, jnp.asarray(ids))
    np.testing.assert_allclose(got, expected, atol=references.ATOL)
    interop.save(model, params, str(tmp_path / "export"))
    assert interop.read_config(str(tmp_path / "export"))["architectures"] == ["Qwen3_5ForCausalLM"]
    back = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        again = back.double()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(again, expected, atol=references.ATOL)
