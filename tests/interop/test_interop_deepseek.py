"""DeepSeek-V3 (tfjax.interop.families.deepseek) against transformers: logits (queries through a
latent and straight from the input), greedy generation with the latent cache, round trips,
transformers reading the export, scanned == unrolled, Linen == NNX, and refusals."""

import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import V, torch, transformers
from safetensors import safe_open

from tfjax import interop
from tfjax.interop import pretrained
from tfjax.interop.core import rules, tables
from tfjax.interop.core.decoders import spelled_out
from tfjax.models import decoder
from tfjax.ops import LatentCache

# Two layers: a dense first one (first_k_dense_replace=1), then 8 experts in 4 groups of which
# tokens may use the best 2 (2 experts each, routed_scaling_factor 2.5) and a shared expert;
# latent attention of 4 heads: unrotated 8, rotated 4, values 6, latent 16 (queries 12).
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    max_position_embeddings=48,
    initializer_range=0.2,  # large weights: varied routes and greedy continuations
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# YaRN with DeepSeek's mscale / mscale_all_dim, 4x its 12 pretraining positions
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 12,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
    "rope_theta": 500.0,
}


def _build(seed, **config):
    torch.manual_seed(seed)
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SIZES, **config))
    ref.set_experts_implementation("eager")  # its grouped_mm takes no float64
    with torch.no_grad():  # random correction biases and norm scales, so each shows
        for name, p in ref.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return ref.eval()


@references.reference
def deepseek_q_latent():
    """Queries through a latent of 12 (q_lora_rank), YaRN with mscale_all_dim."""
    return _build(21, q_lora_rank=12, rope_parameters=YARN)


@references.reference
def deepseek_q_direct():
    """Queries straight from the input (q_lora_rank null), plain RoPE, tied head."""
    return _build(
        22,
        q_lora_rank=None,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=True,
    )


FAMILIES = ["deepseek_q_latent", "deepseek_q_direct"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(family, scan_layers, request):
    references.check_decoder_logits(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, request):
    """tfjax.decode with the latent cache (absorbed form), token for token."""
    references.check_greedy_generation(*request.getfixturevalue(family))


def test_the_cache_holds_latents_and_the_config_reads_as_deepseek(deepseek_q_latent):
    _, path = deepseek_q_latent
    model = pretrained.pretrained_model(path)
    assert (model.kv_lora_rank, model.q_lora_rank, model.qk_rope_head_dim) == (16, 12, 4)
    assert (model.head_dim, model.v_head_dim, model.first_dense_layers) == (8, 6, 1)
    assert (model.router_groups, model.router_groups_kept, model.router_scale) == (4, 2, 2.5)
    assert model.shared_expert_dim == 16 and model.router_score_bias
    assert model.rope_scaling.mscale_all_dim == 0.7
    cache = model.init_cache(2, 10)
    assert all(isinstance(c, LatentCache) for c in cache)
    assert cache[0].latent.shape == (2, 10, 16) and cache[0].rope_keys.shape == (2, 10, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_safetensors_is_bitwise(family, request, tmp_path):
    """The export holds the reference file's tensors bit for bit (RoPE rows permuted back)."""
    references.check_round_trip(request.getfixturevalue(family)[1], False, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    references.check_transformers_reads_export(*request.getfixturevalue(family), tmp_path)


def test_nnx_gives_linens_logits(deepseek_q_latent):
    references.check_nnx_logits(deepseek_q_latent[1])


def test_preset_exports_a_config_transformers_builds_with_the_same_count():
    """deepseek-v3's exported config.json builds, in transformers (on the meta device), a model
    with the preset's parameters (the routers' correction biases are buffers there), and loads
    back as the same model."""
    model = spelled_out(decoder.Model("deepseek-v3"))
    family = interop.REGISTRY.exporter(model).family(model)
    config = tables.hf_config(family, model)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["rope_parameters"]["mscale_all_dim"] == 1.0
    assert decoder.Model(**tables.model_fields(family, config)) == model
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config)
        )
    scanned = model.clone(scan_layers=True)  # one layer of each stack traced
    shapes = jax.eval_shape(lambda: scanned.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    biases = (model.num_layers - model.first_dense_layers) * model.num_experts
    assert count - biases == sum(p.numel() for p in reference.parameters())
    assert sum(b.numel() for n, b in reference.named_buffers() if "e_score" in n) == biases


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_bias": True}, r"attention_bias=True is not supported \(needs False\)"),
        ({"rope_interleave": False}, r"rope_interleave=False is not supported \(needs True\)"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0}},
            r"rope_type='longrope' is not supported",
        ),
        ({"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported"),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
        ({"topk_group": 5}, r"groups_kept=5 must be in \[1, groups=4\]"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config \(quant_method='fp8'\) is not supported",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_key(changes, message, deepseek_q_latent):
    references.check_config_refused(deepseek_q_latent[1], changes, message)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompts_decode_as_each_prompt_alone(side, deepseek_q_latent):
    """Prompts of 5, 2 and 4 tokens in one batch, padded: the latent cache's absorbed form
    takes the padding mask as the expanded form does."""
    ref, path = deepseek_q_latent
    model, params = interop.load(path)
    references.check_padded_prompts(ref, model, params, side)


def test_scanned_gives_the_unrolled_logits(deepseek_q_latent):
    _, path = deepseek_q_latent
    ids = jnp.asarray(references.tokens((2, 9)))
    unrolled, scanned = (interop.load(path, scan_layers=s) for s in (False, True))
    want, got = (references.apply(m, p, ids) for m, p in (unrolled, scanned))
    np.testing.assert_allclose(got, want, atol=1e-6 * max(1.0, np.abs(want).max()), rtol=1e-6)


def test_a_run_streams_the_loaded_params(deepseek_q_latent):
    """What a run's init_from reads (scanned: both stacks filled layer by layer, kv_b_proj split
    and the RoPE rows permuted as they are read) is what load gives."""
    _, path = deepseek_q_latent
    model = pretrained.pretrained_model(path, scan_layers=True)
    want = rules.flatten(pretrained.pretrained_params(path, model))
    streamed = dict(pretrained.stream_pretrained_params(path, model))
    assert streamed.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(streamed[key], value), key


def test_the_multi_token_prediction_layer_is_skipped_by_name(deepseek_q_latent, tmp_path, caplog):
    """The published files' model.layers.61 (the multi-token-prediction module, which the model
    does not hold) is skipped and counted, as transformers skips it; the logits are the same."""
    ref, path = deepseek_q_latent
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open's API)
    state["model.layers.61.eh_proj.weight"] = torch.zeros(32, 64)
    state["model.layers.61.enorm.weight"] = torch.ones(32)
    interop.write_safetensors(state, str(tmp_path), interop.read_config(path))
    with caplog.at_level("INFO"):
        model, params = interop.load(str(tmp_path))
    assert "model.layers.61.* (2)" in " ".join(r.getMessage() for r in caplog.records)
    want_model, want = interop.load(path)
    assert model == want_model
    jax.tree.map(np.testing.assert_array_equal, params, want)
