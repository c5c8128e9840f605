"""Mixtral (`MixtralForCausalLM`), Qwen3-MoE (`Qwen3MoeForCausalLM`) and GPT-OSS
(`GptOssForCausalLM`), Llama-shaped decoders whose FFN is a mixture of experts <->
`tfjax.models.decoder` with num_experts.

    model, params = from_mixtral("path/to/Mixtral-8x7B-v0.1")   # config.json + weights
    model, params = from_qwen3_moe(state_dict, config)           # or a state dict and a config
    state, config = to_qwen3_moe(model, params)                  # back to Hugging Face keys
    model, params = from_gpt_oss("path/to/gpt-oss-20b-bf16")     # float weights, not MXFP4

Key mapping, layer i (under "model."): attention, norms, embeddings and head as Llama's
(`core.decoders.llama_rules`; Qwen3-MoE with Qwen 3's self_attn.q_norm / k_norm), and the FFN
of a mixture-of-experts layer, E experts j of width F, as the Hub's files and transformers'
save_pretrained hold it:
  Mixtral    block_sparse_moe.gate [E, D]                 -> mlp/router/kernel [D, E]
             block_sparse_moe.experts.j.{w1,w3,w2}         -> mlp/experts/{wi_0,wi_1,wo}[j]
  Qwen3-MoE  mlp.gate [E, D]                              -> mlp/router/kernel [D, E]
             mlp.experts.j.{gate,up,down}_proj             -> mlp/experts/{wi_0,wi_1,wo}[j]
(each expert's torch Linear [out, in] is its slice [in, out] of the stacked kernel). Or fused,
as transformers 5 holds them in memory (save_pretrained(save_original_format=False)):
             mlp.gate [E, D]                              -> mlp/router/kernel [D, E]
             mlp.experts.gate_up_proj [E, 2F, D]           -> mlp/experts/wi_0, wi_1 [E, D, F]
                                                             (the first F rows the gate's)
             mlp.experts.down_proj [E, D, F]               -> mlp/experts/wo [E, F, D]
Load reads either layout (the keys decide); export writes the Hub's, which transformers 4 and 5
both read. A dense layer of Qwen3-MoE (mlp_only_layers, the first n: dense_decoder/layers_i) is
Llama's mlp.{gate,up,down}_proj.

The router is the same function on both sides: softmax over the E logits in float32 (tfjax: the
compute dtype or float32, the wider), top-k, the k scores divided by their sum (Mixtral always;
Qwen3-MoE with norm_topk_prob, else as they are); both dispatch dropless (no capacity).

Config: num_local_experts (Qwen3-MoE: num_experts) -> num_experts, num_experts_per_tok ->
experts_per_token, Mixtral's intermediate_size -> expert_mlp_dim (and mlp_dim: it has no dense
layer), Qwen3-MoE's moe_intermediate_size -> expert_mlp_dim, intermediate_size -> mlp_dim (its
dense layers), norm_topk_prob -> router_renormalize, mlp_only_layers [0, .., n-1] ->
first_dense_layers n. router_aux_loss_coef is load_balance_loss_weight when
output_router_logits is true (transformers adds the loss only then), else the weight is 0; the
two losses are the same when routing is balanced, but transformers pools the experts' loads over
all layers' tokens where tfjax averages each layer's loss. tfjax's router_z_loss_weight (a
training option transformers lacks) is not written. Refused by key: decoder_sparse_step other
than 1 and mlp_only_layers that are not the first layers (tfjax's dense layers come first),
router_jitter_noise, Qwen3-MoE's attention_bias and sliding window.

GPT-OSS: Llama's keys with biases on all four attention projections and the attention sinks
(self_attn.sinks [N] -> self_attention/sinks, attention_sinks=True), and its FFN, whose experts
transformers keeps fused, in [in, out] order, and with biases:
  mlp.router.weight [E, D], bias [E]       -> mlp/router/kernel [D, E], bias [E]
  mlp.experts.gate_up_proj [E, D, 2F]      -> mlp/experts/wi_0, wi_1 [E, D, F] (the gate the
                                              even columns, the up projection the odd ones)
  mlp.experts.gate_up_proj_bias [E, 2F]    -> mlp/experts/wi_0_bias, wi_1_bias [E, F] (alike)
  mlp.experts.down_proj [E, F, D], _bias   -> mlp/experts/wo [E, F, D], wo_bias [E, D]
The experts' activation is the clamped SwiGLU (activation "swiglu_clamped", its gain and clamp
swiglu_alpha and swiglu_limit); the router takes the top-k logits and a softmax over those k,
the same numbers as tfjax's softmax over the E, top-k and renormalisation (the softmax is
monotone, and exp(l_i) / sum_k exp(l_j) is the renormalised share either way). layer_types (by
default alternating, the first layer sliding) -> attention_pattern ("local", "global"), the
sliding layers' window sliding_window; a config without RoPE keys means GptOssConfig's YaRN
(factor 32 of 4,096 positions, base 150,000). Refused by key: quantization_config (the Hub's
files hold the experts in MXFP4; transformers dequantizes them: load with
quantization_config=Mxfp4Config(dequantize=True) and save_pretrained), attention_bias=False
(tfjax's use_bias puts biases on the attention and the experts together), and what the Llama
table refuses (rope types tfjax lacks).
"""

import math

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import (
    NO_GEMMA_OPTIONS,
    SIZES,
    layer_types_field,
    llama_family,
    llama_rules,
    rope_field,
    spelled_out,
    tied_head,
)
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import (
    dense,
    fused_expert_halves,
    fused_experts,
    identity,
    interleaved,
    linear,
    per_expert,
)
from tfjax.interop.core.tables import Family, Field, Fixed, table_config, table_fields
from tfjax.models import decoder
from tfjax.ops.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from tfjax.specs.decoder import LLAMA4_ONLY, non_default

__all__ = [
    "from_gpt_oss",
    "from_mixtral",
    "from_qwen3_moe",
    "to_gpt_oss",
    "to_mixtral",
    "to_qwen3_moe",
]

# What both families fix: softmax routing without a bias, no shared experts, no biases, every
# layer the same attention.
_ROUTER = {
    "use_bias": False,
    "qkv_bias": None,
    "router_score": "softmax",
    "router_bias": False,
    "shared_expert_dim": 0,
    "shared_expert_gate": False,
    "attention_pattern": None,
}
_EXPERT_KERNELS = ("wi_0", "wi_1", "wo")  # the gate, up and down projections


def _experts(module: str, names: tuple[str, str, str], num_experts: int, fused: bool):
    """(layer i's key prefix, its FFN's path) -> the router's and experts' rules: the Hub's
    layout (`module`.gate, `module`.experts.j.<names>), or transformers 5's fused one."""

    def rules(h, path):
        kernels = [(*path, "experts", k) for k in _EXPERT_KERNELS]
        if fused:
            return [
                linear(f"{h}mlp.gate.weight", (*path, "router", "kernel")),
                fused_expert_halves(f"{h}mlp.experts.gate_up_proj", kernels[:2]),
                fused_experts(f"{h}mlp.experts.down_proj", kernels[2]),
            ]
        m = f"{h}{module}."
        out = [linear(f"{m}gate.weight", (*path, "router", "kernel"))]
        for name, kernel in zip(names, kernels, strict=True):
            keys = [f"{m}experts.{j}.{name}.weight" for j in range(num_experts)]
            out.append(per_expert(keys, kernel))
        return out

    return rules


def mixtral_rules(model: decoder.Decoder, prefix="model.", *, fused=False):
    """Mixtral's keys: Llama's, and block_sparse_moe's gate and experts w1, w3, w2."""
    experts = _experts("block_sparse_moe", ("w1", "w3", "w2"), model.num_experts, fused)
    return llama_rules(model, prefix, experts=experts)


def qwen3_moe_rules(model: decoder.Decoder, prefix="model.", *, fused=False):
    """Qwen3-MoE's keys: Qwen 3's, and mlp's gate and experts' gate, up and down projections."""
    names = ("gate_proj", "up_proj", "down_proj")
    return llama_rules(model, prefix, experts=_experts("mlp", names, model.num_experts, fused))


def _layout(state) -> dict:
    """transformers 5's fused experts when the checkpoint holds them, else the Hub's."""
    return {"fused": any(k.endswith(".experts.gate_up_proj") for k in state)}


def _some_experts(key: str):
    def check(n, fields):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{key}={n!r} is not supported (needs >= 1 experts)")
        return n

    return check


def _positive(key: str):
    def check(x, fields):
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x < math.inf:
            raise ValueError(f"{key}={x!r} is not supported (needs a positive number)")
        return float(x)

    return check


def _top_k(k, fields):
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= fields["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok={k!r} is not supported (needs 1 to the "
            f"{fields['num_experts']} experts)"
        )
    return k


def _first_layers(layers, fields) -> int:
    """mlp_only_layers -> first_dense_layers: they must be the first n layers, and not all."""
    n = fields["num_layers"]
    valid = isinstance(layers, list | tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    )
    if not valid or sorted(layers) != list(range(len(layers))):
        raise ValueError(
            f"mlp_only_layers={layers!r} is not supported: tfjax's dense layers are the first "
            "ones (first_dense_layers), so it must be [] or [0, 1, ..., n - 1]"
        )
    if len(layers) >= n:
        raise ValueError(
            f"mlp_only_layers={layers!r} makes all {n} layers dense (no mixture of experts); "
            "load it as a Qwen3ForCausalLM"
        )
    return len(layers)


def _top_k_field(default: int) -> Field:
    return Field("num_experts_per_tok", "experts_per_token", default, to_model=_top_k)


def _read(family: Family, c: dict) -> dict:
    """The table's fields plus the load-balancing loss's weight: router_aux_loss_coef when
    output_router_logits is true, else 0 (transformers adds the loss only then)."""
    fields = table_fields(family, c)
    on, coef = c.get("output_router_logits"), c.get("router_aux_loss_coef")
    if on not in (None, False, True):
        raise ValueError(
            f"{family.architecture}: output_router_logits={on!r} is not supported; allowed: "
            "(False, True)"
        )
    if on:
        coef = 0.001 if coef is None else coef  # transformers' default
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef >= 0:
            raise ValueError(
                f"{family.architecture}: router_aux_loss_coef={coef!r} is not supported "
                "(needs a number >= 0)"
            )
        fields["load_balance_loss_weight"] = float(coef)
    return fields


def _write(family: Family, model: decoder.Decoder) -> dict:
    """The table's config plus output_router_logits (and router_aux_loss_coef) from the
    load-balancing loss's weight; tfjax's router z-loss has no key."""
    config = table_config(family, model)
    weight = model.load_balance_loss_weight
    config["output_router_logits"] = weight > 0
    if weight > 0:
        config["router_aux_loss_coef"] = weight
    return config


# Mixtral: Mistral's attention (sliding window), every layer a mixture of experts of width
# intermediate_size, renormalised softmax routing.
MIXTRAL = llama_family(
    "MixtralForCausalLM",
    "mixtral",
    Field("sliding_window", "sliding_window", None),
    Field("intermediate_size", "expert_mlp_dim"),
    Field("num_local_experts", "num_experts", 8, to_model=_some_experts("num_local_experts")),
    _top_k_field(2),
    Fixed("router_jitter_noise", 0.0, why="tfjax's router does not jitter its input"),
    requires={**_ROUTER, "qk_norm": False, "first_dense_layers": 0, "router_renormalize": True},
    rules=mixtral_rules,
    layout=_layout,
    read=_read,
    write=_write,
    eps=1e-5,
    max_len=4096 * 32,
    rope_base=1_000_000.0,
)
# Qwen3-MoE: Qwen 3's attention (q/k norms, head_dim), experts of moe_intermediate_size, the
# first layers optionally dense (intermediate_size).
QWEN3_MOE = llama_family(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    Fixed("attention_bias", False, why="tfjax's use_bias puts biases on the experts too"),
    Fixed("use_sliding_window", False, why="tfjax's decoder attends to the whole context"),
    Fixed("sliding_window", None, read=False),  # transformers ignores it without the above
    Field("moe_intermediate_size", "expert_mlp_dim", 768),
    # transformers 5 writes num_local_experts, the Hub's files and transformers 4 num_experts
    Field(
        "num_local_experts",
        "num_experts",
        None,
        to_model=_some_experts("num_local_experts"),
        write=False,
    ),
    Field(
        "num_experts",
        "num_experts",
        lambda f: f.get("num_experts", 128),
        to_model=_some_experts("num_experts"),
    ),
    _top_k_field(8),
    Field("norm_topk_prob", "router_renormalize", False, values={False: False, True: True}),
    Fixed(
        "decoder_sparse_step",
        1,
        why="tfjax's dense layers are the first ones (mlp_only_layers); a step puts them "
        "between the mixture-of-experts layers",
    ),
    Field(
        "mlp_only_layers",
        "first_dense_layers",
        (),
        to_model=_first_layers,
        to_config=lambda n: list(range(n)),
    ),
    requires={**_ROUTER, "qk_norm": True, "sliding_window": None},
    rules=qwen3_moe_rules,
    layout=_layout,
    read=_read,
    write=_write,
    max_len=32768,
)


def gpt_oss_rules(model: decoder.Decoder, prefix="model."):
    """GPT-OSS's keys: Llama's (with biases and sinks), and mlp's router with its bias and the
    fused experts, gate and up projections interleaved, with biases."""

    def experts(h, path):
        m, e = f"{h}mlp.", (*path, "experts")
        return [
            *dense(f"{m}router", (*path, "router")),
            interleaved(f"{m}experts.gate_up_proj", [(*e, "wi_0"), (*e, "wi_1")]),
            interleaved(f"{m}experts.gate_up_proj_bias", [(*e, "wi_0_bias"), (*e, "wi_1_bias")]),
            identity(f"{m}experts.down_proj", (*e, "wo")),
            identity(f"{m}experts.down_proj_bias", (*e, "wo_bias")),
        ]

    return llama_rules(model, prefix, experts=experts)


# GptOssConfig's RoPE when config.json names none (its base is the family's default rope_base).
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def _read_gpt_oss(family: Family, c: dict) -> dict:
    """`_read`, after refusing quantized weights (before any is read) and filling in
    GptOssConfig's YaRN where the config names no RoPE."""
    quantized = c.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ValueError(
            f"{family.architecture}: quantization_config (quant_method={method!r}) is not "
            "supported: tfjax loads float weights. Dequantize with transformers first: "
            "GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config("
            "dequantize=True), dtype=torch.bfloat16).save_pretrained(new_path), then load "
            "new_path"
        )
    if c.get("rope_parameters") is None and c.get("rope_scaling") is None:
        c = {**c, "rope_scaling": _GPT_OSS_ROPE}
    return _read(family, c)


# GPT-OSS: biases everywhere, attention sinks, alternating sliding and full layers, every layer
# a mixture of experts (the clamped SwiGLU) behind a biased router.
GPT_OSS = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    model=decoder.Model,
    config=(
        *SIZES,
        Field("head_dim", "head_dim", 64),
        Field("intermediate_size", "mlp_dim"),  # no layer is dense: the experts' width
        Field("intermediate_size", "expert_mlp_dim"),
        Field("max_position_embeddings", "max_len", 131072),
        Field("rms_norm_eps", "norm_eps", 1e-5),
        # One RoPE for the sliding and the full layers: tfjax's local layers have their own
        # scaling (Gemma 3's have none), here the same.
        rope_field("rope_parameters", "rope_scaling"),
        rope_field("rope_parameters", "local_rope_scaling"),
        rope_field("rope_scaling", "rope_scaling", write=False),
        rope_field("rope_scaling", "local_rope_scaling", write=False),
        Field("rope_parameters.rope_theta", "rope_base", None),
        Field("rope_theta", "rope_base", None),
        Field("sliding_window", "sliding_window", 128),
        *layer_types_field(2),
        Field("attention_dropout", "attention_dropout_rate", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", False),
        Field("initializer_range", "init_stddev", 0.02),
        Field("num_local_experts", "num_experts", 128, to_model=_some_experts("num_local_experts")),
        _top_k_field(4),
        Field("swiglu_alpha", "swiglu_alpha", SWIGLU_ALPHA, to_model=_positive("swiglu_alpha")),
        Field("swiglu_limit", "swiglu_limit", SWIGLU_LIMIT, to_model=_positive("swiglu_limit")),
        Fixed(
            "attention_bias",
            True,
            why="tfjax's use_bias puts biases on the attention and the experts together, and "
            "GPT-OSS's experts always have them",
        ),
        Fixed("hidden_act", "silu", read=False),  # written for readers; the experts ignore it
    ),
    rules=gpt_oss_rules,
    prefix="model.",
    bare="layers.",
    requires={
        "position": "rope",
        "norm": "rms",
        "norm_position": "pre",
        "use_bias": True,
        "qkv_bias": None,
        "qk_norm": False,
        "attention_sinks": True,
        "activation": "swiglu_clamped",
        "router_score": "softmax",
        "router_renormalize": True,
        "router_bias": True,
        "shared_expert_dim": 0,
        "shared_expert_gate": False,
        "first_dense_layers": 0,
        **NO_GEMMA_OPTIONS,
    },
    defaults={"rope_base": 150_000.0, "dropout_rate": 0.0},
    ignore=("*rotary_emb.inv_freq",),
    tied=tied_head("embed_tokens.weight"),
    read=_read_gpt_oss,
    write=_write,
)


def export_family(model: decoder.Decoder) -> Family:
    """The family a tfjax mixture of experts exports as, by its fields: GPT-OSS with attention
    sinks, Qwen3-MoE with q/k norms, else Mixtral (each table refuses what it cannot hold, by
    name)."""
    if model.attention_sinks:
        return GPT_OSS
    return QWEN3_MOE if model.qk_norm else MIXTRAL


def _written(model: decoder.Decoder) -> decoder.Decoder:
    """The model as its config writes it: sizes spelled out; for Mixtral and GPT-OSS, which
    have one FFN width, mlp_dim the experts' (no layer is dense, so mlp_dim changes nothing);
    for GPT-OSS, layers all of one kind (no attention_pattern) as a pattern of that kind with
    the same RoPE (the function it computes), which its layer_types and one RoPE spell."""
    model = spelled_out(model)
    family = export_family(model)
    if family is not QWEN3_MOE and not model.first_dense_layers:
        model = model.clone(mlp_dim=model.expert_mlp_dim)
    if family is GPT_OSS and model.attention_pattern is None:
        kind = "global" if model.sliding_window is None else "local"
        model = model.clone(attention_pattern=(kind,), local_rope_scaling=model.rope_scaling)
    return model


from_mixtral, to_mixtral = convert.converters(MIXTRAL, "mixtral", _written)
from_qwen3_moe, to_qwen3_moe = convert.converters(QWEN3_MOE, "qwen3_moe", _written)
from_gpt_oss, to_gpt_oss = convert.converters(GPT_OSS, "gpt_oss", _written)


def _export(model: decoder.Decoder, params):
    return convert.to_hf(export_family(model), _written(model), params)


def _is_moe(m) -> bool:
    return bool(
        m.num_experts
        and m.position != "learned"
        and m.norm_position != "sandwich"
        and m.router_score == "softmax"
        and not m.router_bias
        and not m.shared_expert_dim
        and not m.use_bias
        and not m.attention_sinks
        and m.kv_lora_rank is None
        and not non_default(m, LLAMA4_ONLY)  # Llama 4's layers: families.llama4
    )


def _is_gpt_oss(m) -> bool:
    llama4 = non_default(m, LLAMA4_ONLY)
    return bool(m.num_experts and m.attention_sinks and m.kv_lora_rank is None and not llama4)


CONVERTS = Converts(
    rows=(
        Row(
            "Mixtral",
            "`from_mixtral` / `to_mixtral`",
            "decoder",
            "with `num_experts` (every FFN a mixture of experts, top-k softmax routing "
            "renormalised; Mistral's `sliding_window`); logits 1.8e-6 from float64 transformers",
            loads={MIXTRAL.architecture: from_mixtral},
        ),
        Row(
            "Qwen3-MoE",
            "`from_qwen3_moe` / `to_qwen3_moe`",
            "decoder",
            "with `num_experts` (Qwen 3's attention; `expert_mlp_dim`, `router_renormalize` from "
            "`norm_topk_prob`, dense first layers from `mlp_only_layers`: `first_dense_layers`); "
            "logits 2.0e-6 from float64 transformers",
            loads={QWEN3_MOE.architecture: from_qwen3_moe},
        ),
        Row(
            "GPT-OSS (float weights, not the Hub's MXFP4)",
            "`from_gpt_oss` / `to_gpt_oss`",
            "decoder",
            "with `num_experts` (`attention_sinks`, biases everywhere, sliding and full layers "
            "from `layer_types`: `attention_pattern`, one YaRN RoPE for both, `router_bias`, the "
            "clamped SwiGLU with `swiglu_alpha` / `swiglu_limit`); logits 1.2e-6 from float64 "
            "transformers",
            loads={GPT_OSS.architecture: from_gpt_oss},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=_is_gpt_oss,
            export=_export,
            family=export_family,
            needs="GPT-OSS: a mixture of experts (num_experts) with attention sinks",
        ),
        Exporter(
            decoder.Decoder,
            when=_is_moe,
            export=_export,
            family=export_family,
            needs="Mixtral, Qwen3-MoE: a mixture of experts (num_experts) with softmax routing, "
            "no router bias, no shared experts, no biases, no attention sinks, positions other "
            "than learned ones and one norm before each sub-layer",
        ),
    ),
)
