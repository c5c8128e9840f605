"""What the decoder-only families share: GPT-2, Llama (with Mistral and Qwen), Gemma and the
mixtures of experts (Mixtral, Qwen3-MoE, GPT-OSS).

`spelled_out` gives the model with its None sizes as numbers (a config holds numbers) and
`tied_head` the check that a tied lm_head equals the embedding. Llama's key layout, which
Mistral, Qwen and Gemma keep (Gemma with four norms a layer, `LAYER_NORMS["sandwich"]`):
  layers.i.self_attn.{q,k,v}_proj [N*H, D] -> decoder/layers_i/self_attention/
                                              {query,key,value}_kernel [D, N, H]
  layers.i.self_attn.o_proj [D, N*H]       -> self_attention/out_kernel [N, H, D]
  layers.i.self_attn.{q,k}_norm            -> self_attention/{query,key}_norm (qk_norm)
  layers.i.self_attn.sinks [N]             -> self_attention/sinks (attention_sinks, GPT-OSS)
  layers.i.mlp.{gate,up,down}_proj         -> mlp/wi_0, wi_1, wo
  layers.i.{input,post_attention}_layernorm -> self_attention_norm, mlp_norm
  embed_tokens, norm, lm_head              -> embed, decoder/final_norm, output_proj
A layer past a model's first_dense_layers is a mixture of experts, whose FFN keys the family's
`experts` rules give (`families.moe`; `expert_rules`: the experts fused or one tensor each);
layer i's params are under `layer_paths(model)[i]`. The configs' sizes (`SIZES`), per-layer
attention kinds (`layer_types_field`: layer_types <-> attention_pattern), RoPE parameters
(`rope_field`: rope_parameters or the older rope_scaling <-> `tfjax.nn.position.RopeScaling`;
`LLAMA_ROPE`, Llama's keys), the keys before them (`layer_keys`) and after them
(`training_fields`), the Family of a decoder under Llama's key names (`decoder_family`: Gemma,
DeepSeek-V3, GPT-OSS, Qwen3.5, Llama 4) and of a Llama-shaped one (`llama_family`: Llama,
Mistral, Qwen, Mixtral, Qwen3-MoE) are here too.
"""

import math
from collections.abc import Callable

from tfjax.interop.core.rules import (
    Rule,
    attention,
    fused_expert_halves,
    fused_experts,
    identity,
    linear,
    per_expert,
)
from tfjax.interop.core.tables import Family, Field, Fixed
from tfjax.models import decoder
from tfjax.nn import position


def spelled_out(model: decoder.Decoder) -> decoder.Decoder:
    """The model with its None sizes as the numbers they mean (a config holds numbers)."""
    mlp_dim = model.mlp_dim or 4 * model.width
    return model.clone(
        mlp_dim=mlp_dim,
        num_kv_heads=model.num_kv_heads or model.num_heads,
        head_dim=model.head_dim or model.width // model.num_heads,
        expert_mlp_dim=(model.expert_mlp_dim or mlp_dim) if model.num_experts else None,
    )


def tied_head(embedding: str):
    """The lm_head must equal the token embedding (key under the prefix) when tied."""

    def tied(model, prefix):
        return {"lm_head.weight": f"{prefix}{embedding}"} if model.tie_embeddings else {}

    return tied


# Each layer's norm weights: Llama's two, and Gemma's four (a norm before and after each
# sub-layer, norm_position="sandwich").
LAYER_NORMS = {
    "pre": {"input_layernorm": "self_attention_norm", "post_attention_layernorm": "mlp_norm"},
    "sandwich": {
        "input_layernorm": "self_attention_norm",
        "post_attention_layernorm": "self_attention_post_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "mlp_post_norm",
    },
}
_MLP = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


def layer_paths(model: decoder.Decoder) -> list[tuple[str, str]]:
    """Each layer's path in the unrolled params: (its stack, layers_j) by `model.stacks()` (the
    first_dense_layers under "dense_decoder", the others numbered from 0 again under "decoder";
    runs of one kind under "decoder_0", "decoder_1", ...)."""
    return [(name, f"layers_{j}") for name, _, _, n in model.stacks() for j in range(n)]


def ends_rules(model: decoder.Decoder, prefix="model.", last_stack: str = "decoder") -> list[Rule]:
    """The keys around a Llama-named decoder's layers: the token embedding, the final norm (in
    the `last_stack`) and, untied, the head."""
    rules = [
        identity(f"{prefix}embed_tokens.weight", ("embed", "embedding")),
        identity(f"{prefix}norm.weight", (last_stack, "final_norm", "scale")),
    ]
    if not model.tie_embeddings:
        rules.append(linear("lm_head.weight", ("output_proj", "kernel")))
    return rules


def gated_mlp(m: str, path: tuple, *, bias: bool = False) -> list[Rule]:
    """A gated FFN's keys `m`{gate,up,down}_proj (with `bias`, their biases too) <-> path/wi_0,
    wi_1, wo (a dense layer's FFN, or a mixture's shared expert)."""
    rules = []
    for theirs, ours in _MLP.items():
        rules.append(linear(f"{m}{theirs}.weight", (*path, ours, "kernel")))
        if bias:
            rules.append(identity(f"{m}{theirs}.bias", (*path, ours, "bias")))
    return rules


def expert_rules(
    m: str, path: tuple, num_experts: int, *, fused: bool, names: tuple = tuple(_MLP)
) -> list[Rule]:
    """A mixture's experts under `m` (".experts." ends it) <-> path/experts/wi_0, wi_1, wo [E,
    ...]: transformers 5's fused tensors (gate_up_proj, down_proj), or the Hub's one tensor an
    expert (j.<names>.weight, the gate, up and down projections' names)."""
    kernels = [(*path, "experts", k) for k in _MLP.values()]
    if fused:
        return [
            fused_expert_halves(f"{m}gate_up_proj", kernels[:2]),
            fused_experts(f"{m}down_proj", kernels[2]),
        ]
    return [
        per_expert([f"{m}{j}.{name}.weight" for j in range(num_experts)], kernel)
        for name, kernel in zip(names, kernels, strict=True)
    ]


def fused_layout(state) -> dict:
    """A mixture's rules' layout: transformers 5's fused experts when the checkpoint holds
    them, else the Hub's one tensor an expert."""
    return {"fused": any(k.endswith(".experts.gate_up_proj") for k in state)}


def refuse_quantized(family: Family, c: dict, advice: str):
    """A ValueError naming a config's quantization_config (the Hub's FP8 / MXFP4 files), before
    any tensor is read: tfjax loads float weights; `advice` follows, how to get them."""
    quantized = c.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ValueError(
            f"{family.architecture}: quantization_config (quant_method={method!r}) is not "
            f"supported: tfjax loads float weights{advice}"
        )


def llama_rules(
    model: decoder.Decoder, prefix="model.", *, experts: Callable | None = None
) -> list[Rule]:
    """Llama's state-dict keys, which Mistral, Qwen and Gemma share (Gemma: four norms); the FFN
    of a mixture-of-experts layer by `experts(layer i's key prefix, its FFN's path)`."""
    norms = LAYER_NORMS[model.norm_position]
    qkv_bias = model.use_bias if model.qkv_bias is None else model.qkv_bias
    rules = ends_rules(model, prefix)
    for i, layer in enumerate(layer_paths(model)):
        h = f"{prefix}layers.{i}."
        att = (*layer, "self_attention")
        rules += [identity(f"{h}{k}.weight", (*layer, v, "scale")) for k, v in norms.items()]
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        rules += attention(att, f"{h}self_attn.", names, qkv_bias=qkv_bias, out_bias=model.use_bias)
        if model.num_experts and i >= model.first_dense_layers:
            if experts is None:  # a converter bug: the family's rules must name the experts'
                raise ValueError(f"no key rules for the {model.num_experts} experts of layer {i}")
            rules += experts(h, (*layer, "mlp"))
        else:
            rules += gated_mlp(f"{h}mlp.", (*layer, "mlp"), bias=model.use_bias)
        if model.qk_norm:  # Qwen 3: one [H] scale for every query head, one for every key head
            rules += [
                identity(f"{h}self_attn.q_norm.weight", (*att, "query_norm", "scale")),
                identity(f"{h}self_attn.k_norm.weight", (*att, "key_norm", "scale")),
            ]
        if model.attention_sinks:  # GPT-OSS: one logit per query head [N]
            rules.append(identity(f"{h}self_attn.sinks", (*att, "sinks")))
    return rules


# Per-layer attention kinds: config.json's layer_types (Gemma 2 / 3, GPT-OSS), one
# "sliding_attention" or "full_attention" per layer <-> the decoder's attention_pattern.
LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}


def attention_pattern_of(layer_types, fields) -> tuple[str, ...]:
    """layer_types (one per layer) -> the shortest attention_pattern that repeats to it."""
    n = fields["num_layers"]
    if not isinstance(layer_types, list | tuple) or len(layer_types) != n:
        raise ValueError(f"layer_types={layer_types!r} must list one type per layer ({n})")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(
            f"layer_types has {unknown}, which is not supported; allowed: {tuple(LAYER_TYPES)}"
        )
    kinds = [LAYER_TYPES[t] for t in layer_types]
    if "local" in kinds and fields.get("sliding_window") is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    return tuple(kinds[:period])


def layer_types_of(fields) -> list[str]:
    """The model's attention_pattern (None: every layer as sliding_window says) as layer_types."""
    pattern = fields["attention_pattern"]
    if pattern is None:
        pattern = ("local",) if fields["sliding_window"] is not None else ("global",)
    names = {v: k for k, v in LAYER_TYPES.items()}
    return [names[pattern[i % len(pattern)]] for i in range(fields["num_layers"])]


def every_nth_global(every: int, num_layers: int) -> list[str]:
    """transformers' default layer_types: every `every`-th layer global, the others local."""
    return [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)
    ]


def _default_layer_types(every: int):
    """layer_types' default: the one an earlier key gave (Gemma 3's sliding_window_pattern),
    else transformers' default."""

    def default(fields):
        if "attention_pattern" in fields:
            return layer_types_of(fields)
        return every_nth_global(every, fields["num_layers"])

    return default


def layer_types_field(every: int) -> tuple[Field, Fixed]:
    """layer_types <-> attention_pattern: read as the shortest pattern that repeats to it (a
    config without it means transformers' default, every `every`-th layer global), written as
    the whole list (after sliding_window, which its local layers need)."""
    return (
        Field(
            "layer_types",
            "attention_pattern",
            _default_layer_types(every),
            to_model=attention_pattern_of,
            write=False,
        ),
        Fixed("layer_types", layer_types_of, read=False),
    )


ROPE_TYPES = ("default", *position.SCALING_KINDS)
# The keys each rope_type reads beyond rope_type and rope_theta; any other key is refused, so a
# scaling transformers adds later is never read as a different one.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
ROPE_FIELDS = {  # config key -> RopeScaling field
    "factor": "factor",
    "original_max_position_embeddings": "original_length",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
    "mscale_all_dim": "mscale_all_dim",  # read by latent attention only (DeepSeek)
}


def rope_scaling_of(params: dict, fields) -> position.RopeScaling | None:
    """rope_parameters (or the older rope_scaling) -> RopeScaling, None for "default"."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type={kind!r} is not supported; allowed: {ROPE_TYPES}")
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - {"rope_type", "type", "rope_theta", *ROPE_KEYS[kind]})
    partial = given.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (needs 1.0)")
    unknown = [k for k in unknown if k != "partial_rotary_factor"]
    if unknown:
        raise ValueError(
            f"rope_type={kind!r} with {unknown} is not supported; it reads {ROPE_KEYS[kind]}"
        )
    if kind == "default":
        return None
    scaling = {ROPE_FIELDS[k]: v for k, v in given.items() if k in ROPE_FIELDS}
    if kind in ("linear", "dynamic"):  # dynamic grows past max_position_embeddings (as HF)
        scaling["original_length"] = fields["max_len"]
    elif "original_length" not in scaling:
        raise ValueError(f"rope_type={kind!r} needs original_max_position_embeddings")
    if kind == "yarn":
        scaling.setdefault("factor", fields["max_len"] / scaling["original_length"])
        mscale, mscale_all = given.get("mscale"), given.get("mscale_all_dim")
        if scaling.get("attention_factor") is None and mscale and mscale_all:
            scaling["attention_factor"] = _yarn_mscale(scaling["factor"], mscale) / _yarn_mscale(
                scaling["factor"], mscale_all
            )
    if "factor" not in scaling:
        raise ValueError(f"rope_type={kind!r} needs factor")
    return position.RopeScaling(kind, **scaling)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_parameters_of(scaling: position.RopeScaling | None) -> dict:
    """RopeScaling -> the rope_parameters keys of its kind (rope_theta is written apart)."""
    if scaling is None:
        return {"rope_type": "default"}
    out = {"rope_type": scaling.kind}
    for key in ROPE_KEYS[scaling.kind]:
        if key in ROPE_FIELDS and getattr(scaling, ROPE_FIELDS[key]) is not None:
            out[key] = getattr(scaling, ROPE_FIELDS[key])
    return out


def rope_field(key: str, field: str, **options) -> Field:
    """A rope_parameters-shaped config key <-> a RopeScaling field (None: no scaling)."""
    return Field(
        key, field, None, to_model=rope_scaling_of, to_config=rope_parameters_of, **options
    )


# The sizes every Llama-shaped config names alike (Llama, Mistral, Qwen, Gemma).
SIZES = (
    Field("vocab_size", "vocab_size"),
    Field("hidden_size", "width"),
    Field("num_hidden_layers", "num_layers"),
    Field("num_attention_heads", "num_heads"),
    Field("num_key_value_heads", "num_kv_heads", lambda f: f["num_heads"]),
)
# Llama's RoPE keys: transformers 5 writes rope_parameters (the scaling first: it writes the
# whole dict); older configs, and older readers, rope_theta and rope_scaling.
LLAMA_ROPE = (
    rope_field("rope_parameters", "rope_scaling"),
    rope_field("rope_scaling", "rope_scaling", write=False),
    Field("rope_parameters.rope_theta", "rope_base", None),
    Field("rope_theta", "rope_base", None),
)


def layer_keys(max_len, eps: float, activations=None) -> tuple[Field, ...]:
    """The context length, FFN activation and norm epsilon as Llama-shaped configs name them
    (max_position_embeddings, hidden_act, rms_norm_eps); `max_len` and `eps` what a config
    without them means, `activations` the hidden_act values taken (SiLU alone when None)."""
    return (
        Field("max_position_embeddings", "max_len", max_len),
        Field("hidden_act", "activation", "silu", values=activations or {"silu": "swiglu"}),
        Field("rms_norm_eps", "norm_eps", eps),
    )


def training_fields(tie: bool = False) -> tuple[Field, ...]:
    """The keys every Llama-shaped config names alike after its sizes and positions: attention
    dropout, tied embeddings (`tie` when the key is absent) and the init scale."""
    return (
        Field("attention_dropout", "attention_dropout_rate", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", tie),
        Field("initializer_range", "init_stddev", 0.02),
    )


LLAMA_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


# The plain layers of a Llama-shaped decoder: RoPE, RMSNorm before each sub-layer, no biases,
# no per-head norms, no attention sinks (the families that fix them: DeepSeek-V3, Llama 4).
PLAIN_LAYERS = {
    "position": "rope",
    "norm": "rms",
    "norm_position": "pre",
    "use_bias": False,
    "qkv_bias": None,
    "qk_norm": False,
    "attention_sinks": False,
}
# Gemma's attention and embedding options as a decoder without them has them: the families
# that fix them (a model that sets any exports as Gemma, or not at all).
NO_GEMMA_OPTIONS = {
    "local_rope_base": None,
    "attention_scalar": None,
    "attention_softcap": None,
    "final_logit_softcap": None,
    "scale_embeddings": False,
}


def decoder_family(
    architecture,
    model_type,
    config,
    *,
    rules,
    requires,
    defaults=None,
    ignore=("*rotary_emb.inv_freq",),
    **options,
) -> Family:
    """A decoder family under Llama's key names: "model." before them (a bare base model's keys
    start "layers."), the head tied to embed_tokens when tied, no dropout unless the config says
    so; `defaults` adds model fields its config does not hold, `ignore` the buffers' keys,
    `options` other Family fields."""
    return Family(
        architecture=architecture,
        model_type=model_type,
        model=decoder.Model,
        config=config,
        rules=rules,
        prefix="model.",
        bare="layers.",
        requires=requires,
        defaults={"dropout_rate": 0.0, **(defaults or {})},
        ignore=ignore,
        tied=tied_head("embed_tokens.weight"),
        **options,
    )


def llama_family(
    architecture,
    model_type,
    *config,
    requires=None,
    rules=llama_rules,
    eps=1e-6,
    max_len=2048,
    rope_base=10_000.0,
    **options,
) -> Family:
    """A Llama-shaped family: RoPE, RMSNorm, gated FFN, grouped-query attention, Llama's key
    names; `config` adds the family's own entries, `requires` its fixed model fields; `eps`,
    `max_len` and `rope_base` are what its config class means when the key is absent;
    `options` other Family fields (a mixture of experts' `rules`, `layout`, `read`, `write`)."""
    return decoder_family(
        architecture,
        model_type,
        (
            *SIZES,
            Field("head_dim", "head_dim", lambda f: f["width"] // f["num_heads"]),
            Field("intermediate_size", "mlp_dim"),
            *layer_keys(max_len, eps, LLAMA_ACTIVATIONS),
            *LLAMA_ROPE,
            *training_fields(),
            *config,
        ),
        rules=rules,
        requires={"position": "rope", "norm": "rms", "attention_sinks": False, **(requires or {})},
        defaults={"rope_base": rope_base},
        **options,
    )
