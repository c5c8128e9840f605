"""Mixtral, Qwen3-MoE and GPT-OSS (tfjax.interop.families.moe) against transformers: logits,
greedy generation with the KV cache, round trips in the Hub's layout, transformers 5's fused
experts, the router's numbers, the load-balancing loss's weight, GPT-OSS's configs, presets,
and refusals."""

import copy
import json

import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical
from interop_references import V, tokens, torch, transformers

from tfjax import interop
from tfjax.interop import pretrained
from tfjax.interop.core import rules, tables
from tfjax.interop.core.decoders import spelled_out
from tfjax.models import decoder
from tfjax.nn import position
from tfjax.ops import moe

# Four experts of which each token takes two; the reference's experts run in transformers'
# eager loop (every routed token through its experts, nothing dropped), as tfjax's dispatch.
SIZES = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    vocab_size=V,
    max_position_embeddings=48,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    initializer_range=0.2,  # large weights: varied routes and greedy continuations
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _eager(ref):
    ref.set_experts_implementation("eager")  # its grouped_mm takes no float64
    return ref.eval()


@references.reference
def mixtral():
    """Mixtral: 2 layers of 4 experts (width 48), a sliding window of 4 that the tests' 10 to 17
    positions reach past, head_dim 8."""
    torch.manual_seed(11)
    config = transformers.MixtralConfig(
        **SIZES,
        num_hidden_layers=2,
        intermediate_size=48,
        num_local_experts=4,
        sliding_window=4,
        head_dim=8,
    )
    return _eager(transformers.MixtralForCausalLM(config))


@references.reference
def qwen3_moe():
    """Qwen3-MoE: a dense first layer (mlp_only_layers=[0], width 48), then one of 4 experts of
    width 16 whose top-2 scores are not renormalised (norm_topk_prob=False), q/k norms (random
    scales), head_dim 16 != 32 / 4, tied head."""
    torch.manual_seed(12)
    config = transformers.Qwen3MoeConfig(
        **SIZES,
        num_hidden_layers=2,
        intermediate_size=48,
        num_experts=4,
        moe_intermediate_size=16,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        head_dim=16,
        tie_word_embeddings=True,
    )
    ref = _eager(transformers.Qwen3MoeForCausalLM(config))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return ref


# GPT-OSS's RoPE is YaRN; here 4x its 12 pretraining positions, without rounding the ramp.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 12,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "rope_theta": 500.0,
}


@references.reference
def gpt_oss():
    """GPT-OSS: 2 layers, sliding (a window of 4, which the tests' 10 to 17 positions reach
    past) then full attention, each with 4 experts of width 16, YaRN RoPE, and a clamped SwiGLU
    of gain 1.5 and clamp 1.0 (not GPT-OSS's 1.702 and 7.0, so reading them shows, and the
    clamps act on this model's activations); the biases (transformers' init: zeros) and the
    attention sinks random, so each shows in the logits."""
    torch.manual_seed(13)
    config = transformers.GptOssConfig(
        **{**SIZES, "rope_parameters": YARN},
        num_hidden_layers=2,
        intermediate_size=16,
        num_local_experts=4,
        sliding_window=4,
        head_dim=8,
        swiglu_alpha=1.5,
        swiglu_limit=1.0,
    )
    ref = _eager(transformers.GptOssForCausalLM(config))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
    return ref


FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]


# Scanned: Qwen3-MoE's two stacks (the dense first layer, then the experts' layers); GPT-OSS's
# one stack whose layers alternate sliding and full attention (a scanned variant index).
@pytest.mark.parametrize(
    ("family", "scan_layers"),
    [
        ("mixtral", False),
        ("qwen3_moe", False),
        ("qwen3_moe", True),
        ("gpt_oss", False),
        ("gpt_oss", True),
    ],
)
def test_logits_match_reference(family, scan_layers, request):
    references.check_decoder_logits(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, request):
    """With the KV cache, token for token, stopping at an EOS the reference emits mid-way."""
    references.check_greedy_generation(*request.getfixturevalue(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compared_batch_routes_tokens_to_every_expert(family, request):
    """Every expert of every mixture-of-experts layer gets tokens of the batch the logits are
    compared on, so each expert's converted weights show in them."""
    ref, _ = request.getfixturevalue(family)
    ids, _ = references.padded_batch()
    with torch.no_grad():
        routers = ref(torch.tensor(ids), output_router_logits=True).router_logits
    assert len(routers) == (1 if family == "qwen3_moe" else 2)
    for logits in routers:
        assert set(torch.topk(logits, 2, dim=-1).indices.ravel().tolist()) == {0, 1, 2, 3}


def test_qwen3_moe_norm_topk_prob_acts_in_the_compared_logits(qwen3_moe):
    """norm_topk_prob=False (the top-2 scores as they are) is read as router_renormalize=False,
    and it shows in the compared logits: the reference with renormalised scores gives others."""
    ref, path = qwen3_moe
    assert pretrained.pretrained_model(path).router_renormalize is False
    ids, mask = references.padded_batch()
    renormalised = copy.deepcopy(ref)
    routers = [m for m in renormalised.modules() if hasattr(m, "norm_topk_prob")]
    assert len(routers) == 1
    routers[0].norm_topk_prob = True
    with torch.no_grad():
        x, m = torch.tensor(ids), torch.tensor(mask.astype(np.int64))
        want, other = (r(x, attention_mask=m).logits.numpy() for r in (ref, renormalised))
    assert np.abs(other[mask] - want[mask]).max() > 1e-2


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_safetensors_is_bitwise(family, scan_layers, request, tmp_path):
    """The export holds the reference file's tensors bit for bit under its keys: the Hub's
    layout, one tensor per expert."""
    references.check_round_trip(request.getfixturevalue(family)[1], scan_layers, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    references.check_transformers_reads_export(*request.getfixturevalue(family), tmp_path)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_transformers_5_fused_experts_load_as_the_hub_layout(family, request, tmp_path):
    """save_pretrained(save_original_format=False) writes each layer's experts fused
    (experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F]): the same params load."""
    ref, path = request.getfixturevalue(family)
    references.quiet()
    ref.save_pretrained(tmp_path, save_original_format=False)
    keys = interop.read_state_dict(tmp_path).keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert not any(".experts.0." in k for k in keys)
    model, params = interop.load(path, scan_layers=True)
    fused_model, fused = interop.load(tmp_path, scan_layers=True)
    assert fused_model == model
    assert_params_identical(fused, params)


def test_a_run_streams_the_loaded_params_from_either_layout(qwen3_moe, tmp_path):
    """What a run's init_from reads (stream_pretrained_params, scanned: Qwen3-MoE's two stacks
    filled layer by layer) is what load gives, from the Hub's layout and the fused one."""
    ref, path = qwen3_moe
    references.quiet()
    ref.save_pretrained(tmp_path, save_original_format=False)
    model = pretrained.pretrained_model(path, scan_layers=True)
    want = rules.flatten(pretrained.pretrained_params(path, model))
    for directory in (path, tmp_path):
        streamed = dict(pretrained.stream_pretrained_params(directory, model))
        assert streamed.keys() == want.keys()
        for key, value in want.items():
            assert np.array_equal(streamed[key], value), (directory, key)


def test_a_run_streams_gpt_oss_params_as_load_gives_them(gpt_oss):
    """What a run's init_from reads of GPT-OSS (scanned: each stacked parameter filled layer by
    layer, the fused experts split as they are read) is what load gives."""
    _, path = gpt_oss
    model = pretrained.pretrained_model(path, scan_layers=True)
    want = rules.flatten(pretrained.pretrained_params(path, model))
    streamed = dict(pretrained.stream_pretrained_params(path, model))
    assert streamed.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(streamed[key], value), key


# ----------------------------------------------------------------------------------------------
# The load-balancing loss: router_aux_loss_coef, which transformers adds when
# output_router_logits is on, is the weight of the same loss in tfjax.


def test_load_balance_weight_is_router_aux_loss_coef_when_transformers_adds_the_loss(
    qwen3_moe, tmp_path
):
    ref, path = qwen3_moe
    config = interop.read_config(path)
    assert pretrained.pretrained_model(path).load_balance_loss_weight == 0.0  # output off
    on = {**config, "output_router_logits": True, "router_aux_loss_coef": 0.02}
    (tmp_path / "config.json").write_text(json.dumps(on))
    model = pretrained.pretrained_model(tmp_path)
    assert model.load_balance_loss_weight == 0.02
    written = interop.export(model, pretrained.pretrained_params(path, model))[1]
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.02)
    # One mixture-of-experts layer: transformers' aux_loss is tfjax's loss of its router logits.
    ids = tokens((2, 10))
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_router_logits=True)
    (logits,) = out.router_logits
    _, experts, scores = moe.route(jnp.asarray(logits.numpy()), 2, renormalize=False)
    got = moe.load_balance_loss(scores, experts, 4)
    np.testing.assert_allclose(float(got), out.aux_loss.item(), rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# The published presets: their exported config.json builds, in transformers, a model with the
# preset's parameter count, and loads back as the same model.


@pytest.mark.parametrize(
    "variant", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b"]
)
def test_preset_exports_a_config_transformers_builds_with_the_same_count(variant):
    model = spelled_out(decoder.Model(variant=variant))
    exporter = interop.REGISTRY.exporter(model)
    config = tables.hf_config(exporter.family(model), model)
    assert config["architectures"] == [exporter.family(model).architecture]
    assert decoder.Model(**tables.model_fields(exporter.family(model), config)) == model
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config)
        )
    assert type(reference).__name__ == config["architectures"][0]
    scanned = model.clone(scan_layers=True)  # one layer traced
    shapes = jax.eval_shape(lambda: scanned.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    assert count == sum(p.numel() for p in reference.parameters())


# ----------------------------------------------------------------------------------------------
# Bad input: each error names the key, its value and what tfjax supports.


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "qwen3_moe",
            {"mlp_only_layers": [1]},
            r"Qwen3MoeForCausalLM: mlp_only_layers=\[1\] is not supported: tfjax's dense layers "
            r"are the first ones \(first_dense_layers\)",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [0, 1]},
            r"mlp_only_layers=\[0, 1\] makes all 2 layers dense .*Qwen3ForCausalLM",
        ),
        (
            "qwen3_moe",
            {"decoder_sparse_step": 2},
            r"Qwen3MoeForCausalLM: decoder_sparse_step=2 is not supported \(needs 1\)",
        ),
        (
            "qwen3_moe",
            {"attention_bias": True},
            r"attention_bias=True is not supported \(needs False\) \(tfjax's use_bias puts",
        ),
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 4},
            r"Qwen3MoeForCausalLM: use_sliding_window=True is not supported \(needs False\)",
        ),
        (
            "qwen3_moe",
            {"num_experts": 4, "num_local_experts": 8},
            r"num_local_experts=8 differs from num_experts=4",
        ),
        (
            "mixtral",
            {"router_jitter_noise": 0.1},
            r"MixtralForCausalLM: router_jitter_noise=0\.1 is not supported \(needs 0\.0\)",
        ),
        (
            "mixtral",
            {"num_experts_per_tok": 5},
            r"MixtralForCausalLM: num_experts_per_tok=5 is not supported \(needs 1 to the 4",
        ),
        ("mixtral", {"num_local_experts": 0}, r"num_local_experts=0 is not supported"),
        (
            "gpt_oss",
            {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}},
            r"GptOssForCausalLM: quantization_config \(quant_method='mxfp4'\) is not supported: "
            r"tfjax loads float weights\. Dequantize with transformers first: .*"
            r"quantization_config=Mxfp4Config\(dequantize=True\).*save_pretrained",
        ),
        (
            "gpt_oss",
            {"attention_bias": False},
            r"GptOssForCausalLM: attention_bias=False is not supported \(needs True\) \(tfjax's "
            r"use_bias puts biases on the attention and the experts together",
        ),
        (
            "gpt_oss",
            {"layer_types": ["sliding_attention", "chunked_attention"]},
            r"GptOssForCausalLM: layer_types has \['chunked_attention'\], which is not supported",
        ),
        (
            "gpt_oss",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0}},
            r"GptOssForCausalLM: rope_type='longrope' is not supported; allowed: ",
        ),
        (
            "gpt_oss",
            {"swiglu_limit": -1.0},
            r"GptOssForCausalLM: swiglu_limit=-1\.0 is not supported \(needs a positive number\)",
        ),
        (
            "mixtral",
            {"output_router_logits": True, "router_aux_loss_coef": -1},
            r"router_aux_loss_coef=-1 is not supported \(needs a number >= 0\)",
        ),
    ],
)
def test_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    references.check_config_refused(request.getfixturevalue(family)[1], changes, message)


def test_a_missing_expert_is_named(mixtral):
    _, path = mixtral
    state = dict(interop.read_state_dict(path))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(ValueError, match=r"1 key\(s\) missing .*experts\.3\.w2\.weight"):
        interop.from_mixtral(state, interop.read_config(path))


def test_mixtures_of_experts_without_a_converter_are_refused_by_name(tmp_path):
    """DeepSeek-V2 loads nowhere (V3 does: test_interop_deepseek): interop.load names the
    architecture."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV2ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures=\['DeepseekV2ForCausalLM'\] has no conv"):
        interop.load(tmp_path)


def test_a_tfjax_mixture_of_experts_exports_as_mixtral_by_its_fields(tmp_path):
    """moe-tiny (no q/k norms) is written as a Mixtral, whose one FFN width is the experts'
    (mlp_dim, which no layer of it uses, is not kept), and loads back bit for bit; dense first
    layers, which Mixtral has no key for, are refused by name."""
    model = decoder.Model(variant="moe-tiny", vocab_size=V)
    shapes = rules.param_shapes(model, tables.TOKENS)
    rs = np.random.RandomState(0)
    params = rules.unflatten({k: rs.randn(*s.shape).astype(s.dtype) for k, s in shapes.items()})
    interop.save(model, params, tmp_path)
    assert interop.read_config(tmp_path)["architectures"] == ["MixtralForCausalLM"]
    again, loaded = interop.load(tmp_path)
    assert again == spelled_out(model).clone(mlp_dim=model.expert_mlp_dim)
    assert_params_identical(loaded, params)
    dense_first = model.clone(num_layers=3, first_dense_layers=1)
    with pytest.raises(ValueError, match=r"MixtralForCausalLM needs a model with .*first_dense_la"):
        interop.export(dense_first, {})


# ----------------------------------------------------------------------------------------------
# GPT-OSS: what its files may leave out, and what shows in the compared logits.


def test_gpt_oss_configs_read_as_transformers_reads_them(gpt_oss):
    """A config as the Hub's files have it (transformers 4: rope_scaling and rope_theta, no
    swiglu_alpha, keys transformers does not read) and one that names no RoPE, layer_types,
    sliding_window, head_dim or swiglu values give the model of the config transformers makes
    of them (GptOssConfig's YaRN of base 150,000, alternating layers from a sliding first one,
    its window of 128 and head_dim 64); the Hub's spelling is the same model as transformers 5's."""
    _, path = gpt_oss
    config = interop.read_config(path)
    hub = {k: v for k, v in config.items() if k not in ("rope_parameters", "swiglu_alpha")}
    hub |= {
        "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"},
        "rope_theta": YARN["rope_theta"],
        "experts_per_token": 2,
        "initial_context_length": 12,
    }
    names = ("rope_parameters", "layer_types", "sliding_window", "head_dim", "swiglu_alpha")
    bare = {k: v for k, v in config.items() if k not in (*names, "swiglu_limit")}
    family = interop.from_gpt_oss.family
    for edited in (hub, bare):
        theirs = transformers.GptOssConfig(**edited).to_dict()
        assert tables.model_fields(family, edited) == tables.model_fields(family, theirs)
    loaded = pretrained.pretrained_model(path)
    assert decoder.Model(**tables.model_fields(family, hub)) == loaded.clone(swiglu_alpha=1.702)
    defaults = tables.model_fields(family, bare)
    assert defaults["rope_base"] == 150_000.0 and defaults["rope_scaling"].factor == 32.0
    assert defaults["local_rope_scaling"] == defaults["rope_scaling"]
    assert (defaults["attention_pattern"], defaults["sliding_window"]) == (("local", "global"), 128)


def test_gpt_oss_sinks_biases_clamp_and_windows_act_in_the_compared_logits(gpt_oss):
    """Each of GPT-OSS's own pieces changes the reference's logits on the compared batch, so
    the logits test sees a converter that drops or misreads it: sinks, attention and expert
    biases, the router's bias, the clamp and gain of its SwiGLU, the sliding window; and in
    tfjax the sliding layers' YaRN (tfjax's local layers have a RoPE of their own)."""
    ref, path = gpt_oss
    ids, mask = references.padded_batch()
    x, m = torch.tensor(ids), torch.tensor(mask.astype(np.int64))

    def logits(model):
        with torch.no_grad():
            return model(x, attention_mask=m).logits.numpy()[mask]

    want = logits(ref)
    layer = ref.model.layers[0]
    changes = {
        "sinks": lambda r: r.model.layers[0].self_attn.sinks.fill_(-1e4),
        "attention biases": lambda r: r.model.layers[0].self_attn.q_proj.bias.zero_(),
        "router bias": lambda r: r.model.layers[0].mlp.router.bias.zero_(),
        "expert biases": lambda r: r.model.layers[0].mlp.experts.gate_up_proj_bias.zero_(),
        "clamp": lambda r: setattr(r.model.layers[0].mlp.experts, "limit", 7.0),
        "gain": lambda r: setattr(r.model.layers[0].mlp.experts, "alpha", 1.702),
        "window": lambda r: setattr(r.model.layers[0].self_attn, "sliding_window", None),
    }
    assert layer.self_attn.sliding_window == 4
    for name, change in changes.items():
        other = copy.deepcopy(ref)
        with torch.no_grad():
            change(other)
        if name == "window":  # transformers masks by the config's layer types
            other.config.layer_types = ["full_attention"] * 2
        assert np.abs(logits(other) - want).max() > 1e-2, name
    model, params = interop.load(path)
    assert model.local_rope_scaling == model.rope_scaling is not None
    unscaled = model.clone(local_rope_scaling=None)
    got = references.apply(unscaled, params, jnp.asarray(ids))[mask]
    assert np.abs(got - want).max() > 1e-2


def test_a_tfjax_model_with_sinks_and_experts_exports_as_gpt_oss(tmp_path):
    """moe-tiny with attention sinks, biases, a biased router and the clamped SwiGLU, every
    layer windowed (no attention_pattern) and YaRN RoPE, is written as a GptOssForCausalLM
    (layer_types all sliding, one RoPE) that loads back bit for bit and computes the same
    logits."""
    yarn = position.RopeScaling("yarn", 4.0, 12, beta_fast=32.0, beta_slow=1.0, truncate=False)
    model = decoder.Model(
        variant="moe-tiny",
        vocab_size=V,
        attention_sinks=True,
        use_bias=True,
        router_bias=True,
        activation="swiglu_clamped",
        sliding_window=4,
        rope_scaling=yarn,
    )
    shapes = rules.param_shapes(model, tables.TOKENS)
    rs = np.random.RandomState(0)
    params = rules.unflatten({k: rs.randn(*s.shape).astype(s.dtype) for k, s in shapes.items()})
    interop.save(model, params, tmp_path)
    config = interop.read_config(tmp_path)
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention"] * 2
    again, loaded = interop.load(tmp_path)
    assert again.attention_pattern == ("local",) and again.local_rope_scaling == yarn
    assert_params_identical(loaded, params)
    ids = jnp.asarray(tokens((2, 9)))
    np.testing.assert_array_equal(
        references.apply(again, loaded, ids), references.apply(model, params, ids)
    )
