"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) <-> `tfjax.models.decoder` with multi-head latent
attention (kv_lora_rank; tfjax.ops.mla) and a mixture of experts routed as DeepSeek-V3 routes.

    model, params = from_deepseek_v3("path/to/checkpoint")   # config.json + weights
    state, config = to_deepseek_v3(model, params)            # back to Hugging Face keys

Key mapping, layer i (under "model."; embeddings, final norm, head and the two layer norms as
Llama's), N heads of Hn unrotated and Hr rotated query/key channels, Hq = Hn + Hr, Hv values:
  self_attn.q_proj [N*Hq, D]             -> self_attention/query_kernel [D, N, Hq]   (or:)
  self_attn.q_a_proj [Rq, D]             -> self_attention/query_down_kernel [D, Rq]
  self_attn.q_a_layernorm [Rq]           -> self_attention/query_latent_norm
  self_attn.q_b_proj [N*Hq, Rq]          -> self_attention/query_up_kernel [Rq, N, Hq]
  self_attn.kv_a_proj_with_mqa [R+Hr, D] -> self_attention/kv_down_kernel [D, R+Hr]
  self_attn.kv_a_layernorm [R]           -> self_attention/kv_latent_norm
  self_attn.kv_b_proj [N*(Hn+Hv), R]     -> self_attention/key_up_kernel [R, N, Hn] and
                                            value_up_kernel [R, N, Hv] (each head's rows split)
  self_attn.o_proj [D, N*Hv]             -> self_attention/out_kernel [N, Hv, D]
  mlp.{gate,up,down}_proj                -> mlp/wi_0, wi_1, wo (the first_k_dense_replace layers)
  mlp.gate.weight [E, D]                 -> mlp/router/kernel [D, E]
  mlp.gate.e_score_correction_bias [E]   -> mlp/router_score_bias (not trained)
  mlp.experts.j.{gate,up,down}_proj      -> mlp/experts/wi_0, wi_1, wo [j] (or transformers 5's
                                            fused gate_up_proj / down_proj, as families.moe)
  mlp.shared_experts.{gate,up,down}_proj -> mlp/shared/wi_0, wi_1, wo
DeepSeek rotates interleaved channel pairs (rope_interleave): the Hr rotated rows of each
query head and of the shared key part are permuted on load to tfjax's rotate-half layout (the
even channels, then the odd ones), which gives the same attention; the export permutes them
back, so round trips are bitwise.

Config: hidden_size, intermediate_size (the dense layers), moe_intermediate_size ->
expert_mlp_dim, n_routed_experts -> num_experts, n_shared_experts -> shared_expert_dim (times
moe_intermediate_size), num_experts_per_tok, n_group -> router_groups, topk_group ->
router_groups_kept, routed_scaling_factor -> router_scale, norm_topk_prob ->
router_renormalize, first_k_dense_replace -> first_dense_layers, q_lora_rank (null: queries
straight from the input), kv_lora_rank, qk_nope_head_dim -> head_dim, qk_rope_head_dim,
v_head_dim, rope_parameters (YaRN's mscale_all_dim: the attention logits' extra scale),
tie_word_embeddings, rms_norm_eps (the latents' norms: 1e-6, as DeepSeek's). Refused by key
before any tensor is read: attention_bias, rope_interleave=false, a rope type tfjax lacks,
num_key_value_heads other than the heads, scoring_func / topk_method of DeepSeek's own code
other than sigmoid / noaux_tc, moe_layer_freq other than 1, quantization_config (the Hub's FP8
files). The multi-token-prediction layer (num_nextn_predict_layers) is not part of the model: the
published files' model.layers.61 is skipped by name (and counted in a log line), as
transformers skips it.
"""

import jax.numpy as jnp

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import (
    LLAMA_ROPE,
    NO_GEMMA_OPTIONS,
    PLAIN_LAYERS,
    SIZES,
    decoder_family,
    ends_rules,
    expert_rules,
    fused_layout,
    gated_mlp,
    layer_keys,
    layer_paths,
    refuse_quantized,
    spelled_out,
    training_fields,
)
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Rule, identity, interleaved_rope, linear, linear_out
from tfjax.interop.core.tables import Family, Field, Fixed, table_config, table_fields
from tfjax.models import decoder

__all__ = ["from_deepseek_v3", "to_deepseek_v3"]


def _kv_up(key, paths, hn: int) -> Rule:
    """kv_b_proj [N*(Hn+Hv), R] (each head's Hn key rows, then its Hv value rows) <-> key_up
    [R, N, Hn] and value_up [R, N, Hv]."""

    def to_jax(x, shapes):
        n = shapes[0][1]
        heads = x.reshape(n, -1, x.shape[-1])  # [N, Hn+Hv, R]
        return heads[:, :hn].transpose(2, 0, 1), heads[:, hn:].transpose(2, 0, 1)

    def to_torch(k, v):
        heads = jnp.concatenate([k.transpose(1, 2, 0), v.transpose(1, 2, 0)], axis=1)
        return (heads.reshape(-1, heads.shape[-1]),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def _attention(model: decoder.Decoder, a: str, att: tuple) -> list[Rule]:
    """One layer's latent attention (keys under `a`, params under `att`)."""
    hn, hr, r = model.head_dim, model.qk_rope_head_dim, model.kv_lora_rank
    hq = hn + hr
    if model.q_lora_rank is None:
        rules = [interleaved_rope(f"{a}q_proj.weight", (*att, "query_kernel"), hq, hr)]
    else:
        rules = [
            linear(f"{a}q_a_proj.weight", (*att, "query_down_kernel")),
            identity(f"{a}q_a_layernorm.weight", (*att, "query_latent_norm")),
            interleaved_rope(f"{a}q_b_proj.weight", (*att, "query_up_kernel"), hq, hr),
        ]
    return rules + [
        # the shared key part's rows [R + Hr, D], the last Hr interleaved
        interleaved_rope(f"{a}kv_a_proj_with_mqa.weight", (*att, "kv_down_kernel"), r + hr, hr),
        identity(f"{a}kv_a_layernorm.weight", (*att, "kv_latent_norm")),
        _kv_up(f"{a}kv_b_proj.weight", [(*att, "key_up_kernel"), (*att, "value_up_kernel")], hn),
        linear_out(f"{a}o_proj.weight", (*att, "out_kernel")),
    ]


def _experts(model, h: str, path: tuple, fused: bool) -> list[Rule]:
    m = f"{h}mlp."
    rules = [
        linear(f"{m}gate.weight", (*path, "router", "kernel")),
        identity(f"{m}gate.e_score_correction_bias", (*path, "router_score_bias")),
        *expert_rules(f"{m}experts.", path, model.num_experts, fused=fused),
    ]
    if model.shared_expert_dim:
        rules += gated_mlp(f"{m}shared_experts.", (*path, "shared"))
    return rules


def deepseek_v3_rules(model: decoder.Decoder, prefix="model.", *, fused=False) -> list[Rule]:
    """DeepSeek-V3's state-dict keys (see the module docstring)."""
    rules = ends_rules(model, prefix)
    for i, layer in enumerate(layer_paths(model)):
        h = f"{prefix}layers.{i}."
        rules += [
            identity(f"{h}input_layernorm.weight", (*layer, "self_attention_norm", "scale")),
            identity(f"{h}post_attention_layernorm.weight", (*layer, "mlp_norm", "scale")),
            *_attention(model, f"{h}self_attn.", (*layer, "self_attention")),
        ]
        if i >= model.first_dense_layers:
            rules += _experts(model, h, (*layer, "mlp"), fused)
        else:
            rules += gated_mlp(f"{h}mlp.", (*layer, "mlp"))
    return rules


def _read(family: Family, c: dict) -> dict:
    """The table's fields, with n_shared_experts as the shared experts' width; quantized
    weights (the Hub's FP8 files) refused before any is read."""
    refuse_quantized(family, c, " (dequantize the checkpoint to bfloat16 first)")
    fields = table_fields(family, c)
    shared = c.get("n_shared_experts")
    shared = 1 if shared is None else shared
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"{family.architecture}: n_shared_experts={shared!r} is not supported")
    fields["shared_expert_dim"] = shared * fields["expert_mlp_dim"]
    if fields.get("num_kv_heads", fields["num_heads"]) != fields["num_heads"]:
        raise ValueError(
            f"{family.architecture}: num_key_value_heads={fields['num_kv_heads']} is not "
            f"supported (needs num_attention_heads={fields['num_heads']}: latent attention "
            "gives every head its own key)"
        )
    return fields


def _write(family: Family, model: decoder.Decoder) -> dict:
    """The table's config, with the shared experts' width as n_shared_experts."""
    what = family.architecture
    if not model.num_experts:
        raise ValueError(f"{what} needs a mixture of experts (num_experts > 0)")
    shared, width = model.shared_expert_dim, model.expert_mlp_dim
    if shared % width:
        raise ValueError(
            f"{what} holds shared experts of moe_intermediate_size each: shared_expert_dim="
            f"{shared} must be a multiple of expert_mlp_dim={width}"
        )
    config = table_config(family, model)
    config["n_shared_experts"] = shared // width
    return config


def _some(key: str, least: int = 1):
    def check(n, fields):
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ValueError(f"{key}={n!r} is not supported (needs an int >= {least})")
        return n

    return check


DEEPSEEK_V3 = decoder_family(
    "DeepseekV3ForCausalLM",
    "deepseek_v3",
    (
        *SIZES,
        Field("intermediate_size", "mlp_dim"),
        Field("moe_intermediate_size", "expert_mlp_dim", 2048),
        Field("n_routed_experts", "num_experts", 256, to_model=_some("n_routed_experts")),
        Field("num_experts_per_tok", "experts_per_token", 8, to_model=_some("num_experts_per_tok")),
        Field("n_group", "router_groups", 8, to_model=_some("n_group")),
        Field("topk_group", "router_groups_kept", 4, to_model=_some("topk_group")),
        Field("routed_scaling_factor", "router_scale", 2.5),
        Field("norm_topk_prob", "router_renormalize", True, values={False: False, True: True}),
        Field(
            "first_k_dense_replace",
            "first_dense_layers",
            3,
            to_model=_some("first_k_dense_replace", 0),
        ),
        Field("q_lora_rank", "q_lora_rank", None),
        Field("kv_lora_rank", "kv_lora_rank", 512),
        Field("qk_nope_head_dim", "head_dim", 128),
        Field("qk_rope_head_dim", "qk_rope_head_dim", 64),
        Field("v_head_dim", "v_head_dim", 128),
        *layer_keys(4096, 1e-6),
        *LLAMA_ROPE,
        *training_fields(),
        Fixed("attention_bias", False, why="tfjax's latent attention has no biases"),
        Fixed(
            "rope_interleave",
            True,
            why="the converter permutes DeepSeek's interleaved RoPE rows to tfjax's layout",
        ),
        Fixed("scoring_func", "sigmoid", why="DeepSeek-V3 scores its experts by sigmoid"),
        Fixed("topk_method", "noaux_tc", why="group-limited choice with a correction bias"),
        Fixed("moe_layer_freq", 1, why="every layer after the dense ones has experts"),
    ),
    rules=deepseek_v3_rules,
    requires={
        **PLAIN_LAYERS,
        "router_score": "sigmoid",
        "router_score_bias": True,
        "router_bias": False,
        "shared_expert_gate": False,
        "attention_pattern": None,
        "sliding_window": None,
        **NO_GEMMA_OPTIONS,
    },
    defaults={"rope_base": 10_000.0},
    # The published files' multi-token-prediction layer (num_nextn_predict_layers: one, after
    # the 61 layers), which the model does not hold; transformers skips the same keys. Only
    # keys no rule reads are skipped: a model of more layers reads its own layer 61.
    skip=("model.layers.61.*",),
    layout=fused_layout,
    read=_read,
    write=_write,
)


def _written(model: decoder.Decoder) -> decoder.Decoder:
    """The model as its config writes it: sizes spelled out (the heads' keys are the heads')."""
    model = spelled_out(model)
    return model.clone(v_head_dim=model.v_head_dim or model.head_dim)


from_deepseek_v3, to_deepseek_v3 = convert.converters(DEEPSEEK_V3, "deepseek_v3", _written)


CONVERTS = Converts(
    rows=(
        Row(
            "DeepSeek-V3",
            "`from_deepseek_v3` / `to_deepseek_v3`",
            "decoder",
            "with `kv_lora_rank` (multi-head latent attention, queries through `q_lora_rank` or "
            "not, YaRN's `mscale_all_dim`; interleaved RoPE rows permuted to rotate-half) and "
            "`num_experts` (sigmoid routing with `router_score_bias`, `router_groups` / "
            "`router_groups_kept`, `router_scale`, a shared expert, `first_dense_layers`); "
            "decoding caches the latent (`tfjax.ops.LatentCache`); logits 2.5e-6 from float64 "
            "transformers",
            loads={DEEPSEEK_V3.architecture: from_deepseek_v3},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=lambda m: m.kv_lora_rank is not None,
            export=to_deepseek_v3,
            family=lambda model: DEEPSEEK_V3,
            needs="DeepSeek-V3: multi-head latent attention (kv_lora_rank) with a mixture of "
            "experts",
        ),
    ),
)
