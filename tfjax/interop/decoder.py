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

import jax.numpy as jnp

from tfjax.interop import core
from tfjax.models import decoder

GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
LLAMA_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}


def _load(source, config):
    """(StateDict, config dict) from a directory, or a state dict plus a config."""
    if isinstance(source, dict):
        if config is None:
            raise ValueError("a state dict needs its config (a dict or a transformers config)")
        return core.as_state_dict(source), core.as_config(config)
    state = core.read_state_dict(source)
    return state, core.as_config(source if config is None else config)


def _tokens():
    return jnp.zeros((1, 1), jnp.int32)


# ----------------------------------------------------------------------------------------------
# GPT-2.


def gpt2_model(config, **overrides) -> decoder.Decoder:
    """The tfjax decoder with a GPT2Config's sizes, activation and epsilon."""
    c, what = core.as_config(config), "GPT2LMHeadModel"
    for key, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("scale_attn_weights", True),
    ):
        if c.get(key, ok) != ok:
            raise ValueError(f"{what}: config {key}={c[key]!r} is not supported (needs {ok})")
    act = c.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ValueError(
            f"{what}: activation_function={act!r} is not supported; allowed: "
            f"{tuple(GPT2_ACTIVATIONS)}"
        )
    width = core.get(c, "n_embd", what=what)
    fields = dict(
        vocab_size=core.get(c, "vocab_size", what=what),
        width=width,
        num_layers=core.get(c, "n_layer", what=what),
        num_heads=core.get(c, "n_head", what=what),
        mlp_dim=c.get("n_inner") or 4 * width,
        max_len=core.get(c, "n_positions", 1024, what=what),
        position="learned",
        activation=GPT2_ACTIVATIONS[act],
        norm="layer",
        norm_eps=core.get(c, "layer_norm_epsilon", 1e-5, what=what),
        use_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        dropout_rate=c.get("resid_pdrop", 0.1),
        attention_dropout_rate=c.get("attn_pdrop", 0.1),
        init_stddev=c.get("initializer_range", 0.02),
    )
    return decoder.Model(**{**fields, **overrides})


def _gpt2_prefix(state) -> str:
    if any(k.startswith("transformer.") for k in state) or not any(
        k.startswith("h.") for k in state
    ):
        return "transformer."
    return ""  # a bare GPT2Model


def gpt2_rules(model: decoder.Decoder, prefix="transformer.") -> list[core.Rule]:
    p = prefix
    rules = [
        core.identity(f"{p}wte.weight", ("embed", "embedding")),
        core.identity(f"{p}wpe.weight", ("pos_embed", "embedding")),
        core.identity(f"{p}ln_f.weight", ("decoder", "final_norm", "scale")),
        core.identity(f"{p}ln_f.bias", ("decoder", "final_norm", "bias")),
    ]
    if not model.tie_embeddings:
        rules.append(core.linear("lm_head.weight", ("output_proj", "kernel")))
    for i in range(model.num_layers):
        h, layer = f"{p}h.{i}.", ("decoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [
            core.identity(f"{h}ln_1.weight", (*layer, "self_attention_norm", "scale")),
            core.identity(f"{h}ln_1.bias", (*layer, "self_attention_norm", "bias")),
            core.merged_rows(
                f"{h}attn.c_attn.weight", [(*att, f"{n}_kernel") for n in ("query", "key", "value")]
            ),
            core.merged_rows(
                f"{h}attn.c_attn.bias", [(*att, f"{n}_bias") for n in ("query", "key", "value")]
            ),
            core.rows_out(f"{h}attn.c_proj.weight", (*att, "out_kernel")),
            core.identity(f"{h}attn.c_proj.bias", (*att, "out_bias")),
            core.identity(f"{h}ln_2.weight", (*layer, "mlp_norm", "scale")),
            core.identity(f"{h}ln_2.bias", (*layer, "mlp_norm", "bias")),
            core.identity(f"{h}mlp.c_fc.weight", (*layer, "mlp", "wi", "kernel")),
            core.identity(f"{h}mlp.c_fc.bias", (*layer, "mlp", "wi", "bias")),
            core.identity(f"{h}mlp.c_proj.weight", (*layer, "mlp", "wo", "kernel")),
            core.identity(f"{h}mlp.c_proj.bias", (*layer, "mlp", "wo", "bias")),
        ]
    return rules


def from_gpt2(source, config=None, **overrides):
    """(tfjax decoder, params) from a GPT-2 checkpoint directory or (state dict, config).

    `overrides` set model fields (scan_layers=True, dtype, implementation, ...).
    """
    state, c = _load(source, config)
    model = gpt2_model(c, **overrides)
    prefix = _gpt2_prefix(state)
    params = core.import_state(
        state,
        gpt2_rules(model, prefix),
        core.param_shapes(model, _tokens()),
        what="GPT2LMHeadModel",
        ignore=("*.attn.bias", "*.attn.masked_bias"),
        tied={"lm_head.weight": f"{prefix}wte.weight"} if model.tie_embeddings else None,
    )
    return model, core.finish(model, params)


def gpt2_config(model: decoder.Decoder) -> dict:
    """A GPT2Config dict for a GPT-2-shaped tfjax decoder."""
    if model.position != "learned" or model.norm != "layer" or not model.use_bias:
        raise ValueError(
            "to_gpt2 needs a GPT-2-shaped decoder (position='learned', norm='layer', "
            f"use_bias=True); got position={model.position!r}, norm={model.norm!r}, "
            f"use_bias={model.use_bias}"
        )
    if model.num_kv_heads not in (None, model.num_heads):
        raise ValueError("GPT-2 has no grouped-query attention; num_kv_heads must be None")
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}.get(model.activation)
    if act is None:
        raise ValueError(f"GPT-2 has no activation {model.activation!r}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_embd": model.width,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_inner": model.mlp_dim,
        "n_positions": model.max_len,
        "activation_function": act,
        "layer_norm_epsilon": model.norm_eps,
        "resid_pdrop": model.dropout_rate,
        "embd_pdrop": model.dropout_rate,
        "attn_pdrop": model.attention_dropout_rate,
        "initializer_range": model.init_stddev,
        "tie_word_embeddings": model.tie_embeddings,
    }


def to_gpt2(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a GPT-2-shaped tfjax decoder."""
    config = gpt2_config(model)
    return core.export_state(core.unrolled(model, params), gpt2_rules(model)), config


# ----------------------------------------------------------------------------------------------
# Llama.


def _rope_theta(c, what) -> float:
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"{what}: rope_type={kind!r} is not supported (only 'default')")
    return float(rope.get("rope_theta") or c.get("rope_theta") or 10_000.0)


def llama_model(config, **overrides) -> decoder.Decoder:
    """The tfjax decoder with a LlamaConfig's sizes, epsilon, RoPE base and heads."""
    c, what = core.as_config(config), "LlamaForCausalLM"
    act = c.get("hidden_act", "silu")
    if act not in LLAMA_ACTIVATIONS:
        raise ValueError(
            f"{what}: hidden_act={act!r} is not supported; allowed: {tuple(LLAMA_ACTIVATIONS)}"
        )
    if bool(c.get("attention_bias", False)) != bool(c.get("mlp_bias", False)):
        raise ValueError(
            f"{what}: attention_bias={c.get('attention_bias')} and mlp_bias={c.get('mlp_bias')} "
            "differ; tfjax's decoder has one use_bias for both"
        )
    width = core.get(c, "hidden_size", what=what)
    heads = core.get(c, "num_attention_heads", what=what)
    if c.get("head_dim") not in (None, width // heads) or width % heads:
        raise ValueError(
            f"{what}: head_dim={c.get('head_dim')} is not hidden_size / num_attention_heads = "
            f"{width} / {heads}; tfjax's decoder needs that"
        )
    if c.get("pretraining_tp", 1) != 1:
        raise ValueError(f"{what}: pretraining_tp={c['pretraining_tp']} is not supported")
    fields = dict(
        vocab_size=core.get(c, "vocab_size", what=what),
        width=width,
        num_layers=core.get(c, "num_hidden_layers", what=what),
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        mlp_dim=core.get(c, "intermediate_size", what=what),
        max_len=core.get(c, "max_position_embeddings", 2048, what=what),
        position="rope",
        rope_base=_rope_theta(c, what),
        activation=LLAMA_ACTIVATIONS[act],
        norm="rms",
        norm_eps=core.get(c, "rms_norm_eps", 1e-6, what=what),
        use_bias=bool(c.get("attention_bias", False)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        dropout_rate=0.0,
        attention_dropout_rate=float(c.get("attention_dropout", 0.0)),
        init_stddev=c.get("initializer_range", 0.02),
    )
    return decoder.Model(**{**fields, **overrides})


def llama_rules(model: decoder.Decoder, prefix="model.") -> list[core.Rule]:
    p = prefix
    rules = [
        core.identity(f"{p}embed_tokens.weight", ("embed", "embedding")),
        core.identity(f"{p}norm.weight", ("decoder", "final_norm", "scale")),
    ]
    if not model.tie_embeddings:
        rules.append(core.linear("lm_head.weight", ("output_proj", "kernel")))
    for i in range(model.num_layers):
        h, layer = f"{p}layers.{i}.", ("decoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [
            core.identity(f"{h}input_layernorm.weight", (*layer, "self_attention_norm", "scale")),
            core.identity(f"{h}post_attention_layernorm.weight", (*layer, "mlp_norm", "scale")),
            core.linear(f"{h}self_attn.q_proj.weight", (*att, "query_kernel")),
            core.linear(f"{h}self_attn.k_proj.weight", (*att, "key_kernel")),
            core.linear(f"{h}self_attn.v_proj.weight", (*att, "value_kernel")),
            core.linear_out(f"{h}self_attn.o_proj.weight", (*att, "out_kernel")),
            core.linear(f"{h}mlp.gate_proj.weight", (*layer, "mlp", "wi_0", "kernel")),
            core.linear(f"{h}mlp.up_proj.weight", (*layer, "mlp", "wi_1", "kernel")),
            core.linear(f"{h}mlp.down_proj.weight", (*layer, "mlp", "wo", "kernel")),
        ]
        if model.use_bias:
            rules += [
                core.reshaped(f"{h}self_attn.q_proj.bias", (*att, "query_bias")),
                core.reshaped(f"{h}self_attn.k_proj.bias", (*att, "key_bias")),
                core.reshaped(f"{h}self_attn.v_proj.bias", (*att, "value_bias")),
                core.identity(f"{h}self_attn.o_proj.bias", (*att, "out_bias")),
                core.identity(f"{h}mlp.gate_proj.bias", (*layer, "mlp", "wi_0", "bias")),
                core.identity(f"{h}mlp.up_proj.bias", (*layer, "mlp", "wi_1", "bias")),
                core.identity(f"{h}mlp.down_proj.bias", (*layer, "mlp", "wo", "bias")),
            ]
    return rules


def from_llama(source, config=None, **overrides):
    """(tfjax decoder, params) from a Llama checkpoint directory or (state dict, config)."""
    state, c = _load(source, config)
    model = llama_model(c, **overrides)
    has_model = any(k.startswith("model.") for k in state) or not any(
        k.startswith("layers.") for k in state
    )
    prefix = "model." if has_model else ""
    params = core.import_state(
        state,
        llama_rules(model, prefix),
        core.param_shapes(model, _tokens()),
        what="LlamaForCausalLM",
        ignore=("*rotary_emb.inv_freq",),
        tied={"lm_head.weight": f"{prefix}embed_tokens.weight"} if model.tie_embeddings else None,
    )
    return model, core.finish(model, params)


def llama_config(model: decoder.Decoder) -> dict:
    """A LlamaConfig dict for a Llama-shaped tfjax decoder."""
    if model.position != "rope" or model.norm != "rms":
        raise ValueError(
            "to_llama needs a Llama-shaped decoder (position='rope', norm='rms'); got "
            f"position={model.position!r}, norm={model.norm!r}"
        )
    act = {"swiglu": "silu", "geglu": "gelu"}.get(model.activation)
    if act is None:
        raise ValueError(f"Llama has no activation {model.activation!r} (needs swiglu or geglu)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.width,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "head_dim": model.width // model.num_heads,
        "intermediate_size": model.mlp_dim or 4 * model.width,
        "max_position_embeddings": model.max_len,
        "hidden_act": act,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "attention_bias": model.use_bias,
        "mlp_bias": model.use_bias,
        "attention_dropout": model.attention_dropout_rate,
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": model.init_stddev,
    }


def to_llama(model: decoder.Decoder, params):
    """({Hugging Face key: numpy array}, config dict) for a Llama-shaped tfjax decoder."""
    config = llama_config(model)
    return core.export_state(core.unrolled(model, params), llama_rules(model)), config
