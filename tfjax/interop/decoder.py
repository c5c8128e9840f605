"""GPT-2 (`GPT2LMHeadModel`) and Llama (`LlamaForCausalLM`) <-> `tfjax.models.decoder`.

    model, params = from_gpt2("path/to/gpt2")        # a directory with config.json + weights
    model, params = from_llama(state_dict, config)   # or a state dict and a config (dict or HF)
    logits, _ = model.apply({"params": params}, tokens)
    state, config = to_gpt2(model, params)           # back to Hugging Face keys and config

Key mapping, layer i (GPT-2 under "transformer.", Llama under "model."):
  GPT-2  h.i.ln_1 / ln_2                 -> decoder/layers_i/self_attention_norm, mlp_norm
         h.i.attn.c_attn [D, 3D] (Conv1D) -> self_attention/{query,key,value}_kernel [D, N, H]
         h.i.attn.c_proj [D, D]           -> self_attention/out_kernel [N, H, D]
         h.i.mlp.c_fc, c_proj             -> mlp/wi, mlp/wo (Conv1D is [in, out] already)
         wte, wpe, ln_f                   -> embed, pos_embed, decoder/final_norm; lm_head tied
  Llama  layers.i.self_attn.{q,k,v}_proj [N*H, D] -> self_attention/{query,key,value}_kernel
         layers.i.self_attn.o_proj [D, N*H]       -> self_attention/out_kernel [N, H, D]
         layers.i.mlp.{gate,up,down}_proj          -> mlp/wi_0, wi_1, wo
         layers.i.{input,post_attention}_layernorm -> self_attention_norm, mlp_norm (RMS)
         embed_tokens, norm, lm_head               -> embed, decoder/final_norm, output_proj
Both use RoPE's rotate-half layout, so no permutation of q/k rows is needed for Llama.
"""

import math

from tfjax.interop import core
from tfjax.interop.core import Field, Fixed
from tfjax.models import decoder
from tfjax.nn import position

GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
LLAMA_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


def tied_head(embedding: str):
    """The lm_head must equal the token embedding (key under the prefix) when tied."""

    def tied(model, prefix):
        return {"lm_head.weight": f"{prefix}{embedding}"} if model.tie_embeddings else {}

    return tied


def spelled_out(model: decoder.Decoder) -> decoder.Decoder:
    """The model with its None sizes as the numbers they mean (a config holds numbers)."""
    return model.clone(
        mlp_dim=model.mlp_dim or 4 * model.width,
        num_kv_heads=model.num_kv_heads or model.num_heads,
        head_dim=model.head_dim or model.width // model.num_heads,
    )


# ----------------------------------------------------------------------------------------------
# GPT-2.


def gpt2_rules(model: decoder.Decoder, prefix="transformer.") -> list[core.Rule]:
    p = prefix
    rules = [
        core.identity(f"{p}wte.weight", ("embed", "embedding")),
        core.identity(f"{p}wpe.weight", ("pos_embed", "embedding")),
        *core.norm(f"{p}ln_f", ("decoder", "final_norm")),
    ]
    if not model.tie_embeddings:
        rules.append(core.linear("lm_head.weight", ("output_proj", "kernel")))
    for i in range(model.num_layers):
        h, layer = f"{p}h.{i}.", ("decoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [
            *core.norm(f"{h}ln_1", (*layer, "self_attention_norm")),
            core.merged_rows(
                f"{h}attn.c_attn.weight", [(*att, f"{n}_kernel") for n in ("query", "key", "value")]
            ),
            core.merged_rows(
                f"{h}attn.c_attn.bias", [(*att, f"{n}_bias") for n in ("query", "key", "value")]
            ),
            core.rows_out(f"{h}attn.c_proj.weight", (*att, "out_kernel")),
            core.identity(f"{h}attn.c_proj.bias", (*att, "out_bias")),
            *core.norm(f"{h}ln_2", (*layer, "mlp_norm")),
            # GPT-2's Conv1D weights are [in, out] already.
            core.identity(f"{h}mlp.c_fc.weight", (*layer, "mlp", "wi", "kernel")),
            core.identity(f"{h}mlp.c_fc.bias", (*layer, "mlp", "wi", "bias")),
            core.identity(f"{h}mlp.c_proj.weight", (*layer, "mlp", "wo", "kernel")),
            core.identity(f"{h}mlp.c_proj.bias", (*layer, "mlp", "wo", "bias")),
        ]
    return rules


GPT2 = core.Family(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    model=decoder.Model,
    config=(
        Field("vocab_size", "vocab_size"),
        Field("n_embd", "width"),
        Field("n_layer", "num_layers"),
        Field("n_head", "num_heads"),
        Field("n_head", "num_kv_heads", read=False),  # no grouped-query attention in GPT-2
        Field("n_inner", "mlp_dim", lambda f: 4 * f["width"]),
        Field("n_positions", "max_len", 1024),
        Field("activation_function", "activation", "gelu_new", values=GPT2_ACTIVATIONS),
        Field("layer_norm_epsilon", "norm_eps", 1e-5),
        Field("tie_word_embeddings", "tie_embeddings", True),
        Field("resid_pdrop", "dropout_rate", 0.1),
        Field("embd_pdrop", "dropout_rate", read=False),  # tfjax has one rate for both
        Field("attn_pdrop", "attention_dropout_rate", 0.1),
        Field("initializer_range", "init_stddev", 0.02),
        Fixed("scale_attn_weights", True),
        Fixed("scale_attn_by_inverse_layer_idx", False),
        Fixed("add_cross_attention", False),
    ),
    rules=gpt2_rules,
    prefix="transformer.",
    bare="h.",
    requires={
        "position": "learned",
        "norm": "layer",
        "use_bias": True,
        "qkv_bias": None,
        "qk_norm": False,
        "sliding_window": None,
    },
    ignore=("*.attn.bias", "*.attn.masked_bias"),
    tied=tied_head("wte.weight"),
)


def from_gpt2(source, config=None, **overrides):
    """(tfjax decoder, params) from a GPT-2 checkpoint directory or (state dict, config).

    `overrides` set model fields (scan_layers=True, dtype, implementation, ...).
    """
    return core.from_hf(GPT2, source, config, **overrides)


def _check_gpt2_heads(model: decoder.Decoder) -> None:
    if model.head_dim not in (None, model.width // model.num_heads):
        raise ValueError(
            f"GPT2LMHeadModel has head_dim = n_embd / n_head = {model.width // model.num_heads}; "
            f"the model's head_dim={model.head_dim}"
        )


def to_gpt2(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a GPT-2-shaped tfjax decoder."""
    _check_gpt2_heads(model)
    return core.to_hf(GPT2, spelled_out(model), params)


# ----------------------------------------------------------------------------------------------
# Llama.


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


def llama_rules(model: decoder.Decoder, prefix="model.") -> list[core.Rule]:
    """Llama's state-dict keys, which Mistral, Qwen and Gemma share (Gemma: four norms)."""
    p = prefix
    norms = LAYER_NORMS[model.norm_position]
    rules = [
        core.identity(f"{p}embed_tokens.weight", ("embed", "embedding")),
        core.identity(f"{p}norm.weight", ("decoder", "final_norm", "scale")),
    ]
    if not model.tie_embeddings:
        rules.append(core.linear("lm_head.weight", ("output_proj", "kernel")))
    for i in range(model.num_layers):
        h, layer = f"{p}layers.{i}.", ("decoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [core.identity(f"{h}{k}.weight", (*layer, v, "scale")) for k, v in norms.items()]
        rules += [
            core.linear(f"{h}self_attn.q_proj.weight", (*att, "query_kernel")),
            core.linear(f"{h}self_attn.k_proj.weight", (*att, "key_kernel")),
            core.linear(f"{h}self_attn.v_proj.weight", (*att, "value_kernel")),
            core.linear_out(f"{h}self_attn.o_proj.weight", (*att, "out_kernel")),
            core.linear(f"{h}mlp.gate_proj.weight", (*layer, "mlp", "wi_0", "kernel")),
            core.linear(f"{h}mlp.up_proj.weight", (*layer, "mlp", "wi_1", "kernel")),
            core.linear(f"{h}mlp.down_proj.weight", (*layer, "mlp", "wo", "kernel")),
        ]
        if model.qk_norm:  # Qwen 3: one [H] scale for every query head, one for every key head
            rules += [
                core.identity(f"{h}self_attn.q_norm.weight", (*att, "query_norm", "scale")),
                core.identity(f"{h}self_attn.k_norm.weight", (*att, "key_norm", "scale")),
            ]
        if model.use_bias if model.qkv_bias is None else model.qkv_bias:
            rules += [
                core.reshaped(f"{h}self_attn.q_proj.bias", (*att, "query_bias")),
                core.reshaped(f"{h}self_attn.k_proj.bias", (*att, "key_bias")),
                core.reshaped(f"{h}self_attn.v_proj.bias", (*att, "value_bias")),
            ]
        if model.use_bias:
            rules += [
                core.identity(f"{h}self_attn.o_proj.bias", (*att, "out_bias")),
                core.identity(f"{h}mlp.gate_proj.bias", (*layer, "mlp", "wi_0", "bias")),
                core.identity(f"{h}mlp.up_proj.bias", (*layer, "mlp", "wi_1", "bias")),
                core.identity(f"{h}mlp.down_proj.bias", (*layer, "mlp", "wo", "bias")),
            ]
    return rules


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


# The sizes every Llama-shaped config names alike (Llama, Mistral, Qwen, Gemma).
SIZES = (
    Field("vocab_size", "vocab_size"),
    Field("hidden_size", "width"),
    Field("num_hidden_layers", "num_layers"),
    Field("num_attention_heads", "num_heads"),
    Field("num_key_value_heads", "num_kv_heads", lambda f: f["num_heads"]),
)


def _llama_like(architecture, model_type, *config, requires=None) -> core.Family:
    """A Llama-shaped family: RoPE, RMSNorm, gated FFN, grouped-query attention, Llama's key
    names; `config` adds the family's own entries, `requires` its fixed model fields."""
    return core.Family(
        architecture=architecture,
        model_type=model_type,
        model=decoder.Model,
        config=(
            *SIZES,
            Field("head_dim", "head_dim", lambda f: f["width"] // f["num_heads"]),
            Field("intermediate_size", "mlp_dim"),
            Field("max_position_embeddings", "max_len", 2048),
            Field("hidden_act", "activation", "silu", values=LLAMA_ACTIVATIONS),
            Field("rms_norm_eps", "norm_eps", 1e-6),
            # transformers 5 writes rope_parameters (the scaling first: it writes the whole
            # dict); older configs, and older readers, rope_theta and rope_scaling.
            Field(
                "rope_parameters",
                "rope_scaling",
                None,
                to_model=rope_scaling_of,
                to_config=rope_parameters_of,
            ),
            Field("rope_scaling", "rope_scaling", None, to_model=rope_scaling_of, write=False),
            Field("rope_parameters.rope_theta", "rope_base", None),
            Field("rope_theta", "rope_base", None),
            Field("attention_dropout", "attention_dropout_rate", 0.0),
            Field("tie_word_embeddings", "tie_embeddings", False),
            Field("initializer_range", "init_stddev", 0.02),
            *config,
        ),
        rules=llama_rules,
        prefix="model.",
        bare="layers.",
        requires={"position": "rope", "norm": "rms", **(requires or {})},
        defaults={"rope_base": 10_000.0, "dropout_rate": 0.0},
        ignore=("*rotary_emb.inv_freq",),
        tied=tied_head("embed_tokens.weight"),
    )


def _full_attention_layers(fields):
    return ["full_attention"] * fields["num_layers"]


# Qwen 2.5 and 3 configs name a sliding window that their published checkpoints leave off.
_NO_SLIDING_WINDOW = (
    Fixed("use_sliding_window", False, why="tfjax's decoder attends to the whole context"),
    Fixed("sliding_window", None, write=False),
    Fixed("layer_types", _full_attention_layers, why="every layer full attention"),
)

LLAMA = _llama_like(
    "LlamaForCausalLM",
    "llama",
    Field("attention_bias", "use_bias", False),
    Field("mlp_bias", "use_bias", False),
    Fixed("pretraining_tp", 1),
    requires={"qkv_bias": None, "qk_norm": False, "sliding_window": None},
)
# Mistral: Llama's layout with sliding-window attention (in training masks and the KV cache).
MISTRAL = _llama_like(
    "MistralForCausalLM",
    "mistral",
    Field("sliding_window", "sliding_window", None),
    requires={"use_bias": False, "qkv_bias": None, "qk_norm": False},
)
# Qwen 2 / 2.5: biases on the query, key and value projections only.
QWEN2 = _llama_like(
    "Qwen2ForCausalLM",
    "qwen2",
    *_NO_SLIDING_WINDOW,
    requires={"use_bias": False, "qkv_bias": True, "qk_norm": False, "sliding_window": None},
)
# Qwen 3: RMSNorm on each query and key head, before RoPE; head_dim need not be D / N.
QWEN3 = _llama_like(
    "Qwen3ForCausalLM",
    "qwen3",
    Field("attention_bias", "use_bias", False),
    *_NO_SLIDING_WINDOW,
    requires={"qkv_bias": None, "qk_norm": True, "sliding_window": None},
)


def from_llama(source, config=None, **overrides):
    """(tfjax decoder, params) from a Llama checkpoint directory or (state dict, config)."""
    return core.from_hf(LLAMA, source, config, **overrides)


def to_llama(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a Llama-shaped tfjax decoder."""
    return core.to_hf(LLAMA, spelled_out(model), params)


def from_mistral(source, config=None, **overrides):
    """(tfjax decoder, params) from a Mistral checkpoint (MistralForCausalLM)."""
    return core.from_hf(MISTRAL, source, config, **overrides)


def to_mistral(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a Mistral-shaped tfjax decoder."""
    return core.to_hf(MISTRAL, spelled_out(model), params)


def from_qwen2(source, config=None, **overrides):
    """(tfjax decoder, params) from a Qwen 2 / 2.5 checkpoint (Qwen2ForCausalLM)."""
    return core.from_hf(QWEN2, source, config, **overrides)


def to_qwen2(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a Qwen2-shaped tfjax decoder."""
    return core.to_hf(QWEN2, spelled_out(model), params)


def from_qwen3(source, config=None, **overrides):
    """(tfjax decoder, params) from a Qwen 3 checkpoint (Qwen3ForCausalLM)."""
    return core.from_hf(QWEN3, source, config, **overrides)


def to_qwen3(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a Qwen3-shaped tfjax decoder."""
    return core.to_hf(QWEN3, spelled_out(model), params)


def export_family(model: decoder.Decoder) -> core.Family:
    """The Hugging Face family a tfjax decoder exports as, by its fields."""
    if model.norm_position == "sandwich":  # Gemma 2 / 3
        from tfjax.interop import gemma  # noqa: PLC0415 (gemma imports this module)

        return gemma.export_family(model)
    if model.position == "learned":
        _check_gpt2_heads(model)
        return GPT2
    if model.sliding_window is not None:
        return MISTRAL
    if model.qk_norm:
        return QWEN3
    if model.qkv_bias and not model.use_bias:
        return QWEN2
    return LLAMA
