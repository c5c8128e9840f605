"""Qwen3.5-MoE (tfjax.interop.families.qwen3_5) against transformers: logits (unrolled and
scanned), greedy generation, round trips, transformers reading the export, Linen == NNX."""

import interop_references as references
import jax
import numpy as np
import pytest
from interop_references import V, torch, transformers

from tfjax import interop
from tfjax.interop import pretrained

# Four layers (linear, linear, linear, full: the default interval), each FFN 8 experts (2 a
# token) of 16 and a gated shared expert of 24.
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    max_position_embeddings=64,
    initializer_range=0.05,  # as test_interop_qwen3_5: the reference's float32 parts
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@references.reference
def qwen3_5_moe():
    torch.manual_seed(41)
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    config = transformers.Qwen3_5MoeTextConfig(**SIZES, rope_parameters=rope)
    ref = transformers.Qwen3_5MoeForCausalLM(config)
    ref.set_experts_implementation("eager")  # its grouped_mm takes no float64
    with torch.no_grad():  # random norm offsets and decays, and routers that pick varied experts
        for name, p in ref.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                p.copy_(p + 0.3 * torch.randn_like(p))
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(0.5 * torch.randn_like(p))
    return ref.eval()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_reference(scan_layers, qwen3_5_moe):
    references.check_decoder_logits(*qwen3_5_moe, scan_layers)


def test_greedy_generation_matches_reference(qwen3_5_moe):
    references.check_greedy_generation(*qwen3_5_moe)


def test_the_config_reads_as_qwen3_5_moe(qwen3_5_moe):
    model = pretrained.pretrained_model(qwen3_5_moe[1])
    assert (model.num_experts, model.experts_per_token, model.expert_mlp_dim) == (8, 2, 16)
    assert model.shared_expert_dim == 24 and model.shared_expert_gate
    assert model.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_round_trip_through_safetensors_is_bitwise(qwen3_5_moe, tmp_path):
    references.check_round_trip(qwen3_5_moe[1], False, tmp_path)


def test_exported_checkpoint_loads_in_transformers(qwen3_5_moe, tmp_path):
    references.check_transformers_reads_export(*qwen3_5_moe, tmp_path)


def test_nnx_gives_linens_logits(qwen3_5_moe):
    references.check_nnx_logits(qwen3_5_moe[1])


def test_fused_experts_load_as_the_per_expert_tensors(qwen3_5_moe):
    """transformers' in-memory layout (gate_up_proj [E, 2F, D], down_proj [E, D, F]) gives the
    params the saved per-expert tensors give."""
    path = qwen3_5_moe[1]
    state, config = dict(interop.read_state_dict(path)), interop.read_config(path)
    want_model, want = interop.load(path)
    fused = {k: np.asarray(v) for k, v in state.items() if ".experts." not in k}
    for i in range(SIZES["num_hidden_layers"]):
        m = f"model.layers.{i}.mlp.experts."

        def stack(name, m=m):
            return np.stack([state[f"{m}{j}.{name}.weight"] for j in range(SIZES["num_experts"])])

        fused[f"{m}gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], 1)
        fused[f"{m}down_proj"] = stack("down_proj")
    model, params = interop.from_qwen3_5_moe(fused, config)
    assert model == want_model
    jax.tree.map(np.testing.assert_array_equal, params, want)
