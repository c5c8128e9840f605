"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`) <->
`tfjax.models.decoder`.

    model, params = from_gemma2("path/to/gemma-2-2b")   # config.json + weights
    model, params = from_gemma3(state_dict, config)      # or a state dict and a config
    state, config = to_gemma3(model, params)              # back to Hugging Face keys and config

Key mapping, layer i (under "model."):
  layers.i.input_layernorm / post_attention_layernorm  -> self_attention_norm / _post_norm
  layers.i.pre_feedforward_layernorm / post_feedforward_layernorm -> mlp_norm / mlp_post_norm
  layers.i.self_attn.{q,k,v}_proj [N*H, D]  -> self_attention/{query,key,value}_kernel [D, N, H]
  layers.i.self_attn.o_proj [D, N*H]        -> self_attention/out_kernel [N, H, D]
  layers.i.self_attn.{q,k}_norm (Gemma 3)   -> self_attention/{query,key}_norm
  layers.i.mlp.{gate,up,down}_proj          -> mlp/wi_0, wi_1, wo
  embed_tokens, norm                        -> embed, decoder/final_norm; lm_head tied
Every norm weight w is Gemma's offset from one (x / rms(x) * (1 + w)): norm="rms_plus_one"
keeps it as it is, so the weights convert without arithmetic and round trips are exact.

config.json's layer_types (one "sliding_attention" or "full_attention" per layer) becomes the
shortest repeating `attention_pattern` of "local" and "global" that gives it (Gemma 2:
("local", "global"); Gemma 3: five local, one global); the export writes the whole list.
Gemma 2's one rope_parameters is both kinds of layer's (rope_scaling and local_rope_scaling);
Gemma 3's has one entry per layer type: "full_attention" is rope_base and rope_scaling,
"sliding_attention" local_rope_base and local_rope_scaling.

What is refused, by key: attention biases, bidirectional attention, rope types other than
Llama's (core.decoders.ROPE_TYPES), and Gemma 3's attn_logit_softcapping (transformers' Gemma 3 does
not apply it, so which model such a checkpoint means is unclear).
"""

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import (
    SIZES,
    attention_pattern_of,
    decoder_family,
    every_nth_global,
    layer_types_field,
    llama_rules,
    rope_field,
    spelled_out,
    training_fields,
)
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.tables import Family, Field, Fixed
from tfjax.models import decoder

__all__ = ["from_gemma2", "from_gemma3", "to_gemma2", "to_gemma3"]

ACTIVATIONS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}


def _from_window_pattern(every, fields) -> tuple[str, ...]:
    """Older Gemma 3 configs' sliding_window_pattern: every `every`-th layer global."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"sliding_window_pattern={every!r} is not supported; needs an int >= 1")
    return attention_pattern_of(every_nth_global(every, fields["num_layers"]), fields)


def _head_dim(fields) -> int:
    return fields["head_dim"] or fields["width"] // fields["num_heads"]


def _gemma(architecture, model_type, *config, requires, defaults, max_len) -> Family:
    """A Gemma family: the entries all share, `config` the family's own (read in between)."""
    return decoder_family(
        architecture,
        model_type,
        (
            *SIZES,
            Field("head_dim", "head_dim", 256),
            Field("intermediate_size", "mlp_dim"),
            Field("max_position_embeddings", "max_len", max_len),
            Field("hidden_activation", "activation", "gelu_pytorch_tanh", values=ACTIVATIONS),
            Field("rms_norm_eps", "norm_eps", 1e-6),
            Field("query_pre_attn_scalar", "attention_scalar", 256, write=False),
            Fixed(
                "query_pre_attn_scalar",
                lambda f: f["attention_scalar"] or _head_dim(f),
                read=False,
            ),
            # transformers' defaults for a missing key (sliding_window 4096, Gemma 2's soft caps
            # 50 and 30) are not taken: core reads a missing key and null alike, and its configs
            # write them all.
            Field("sliding_window", "sliding_window", None),
            *config,
            Field("final_logit_softcapping", "final_logit_softcap", None),
            *training_fields(tie=True),
            Fixed("attention_bias", False, why="tfjax's Gemma has no attention biases"),
            Fixed("use_bidirectional_attention", False, why="tfjax's decoder is causal"),
        ),
        rules=llama_rules,
        requires={
            "position": "rope",
            "norm": "rms_plus_one",
            "norm_position": "sandwich",
            "scale_embeddings": True,
            "use_bias": False,
            "qkv_bias": None,
            "attention_sinks": False,
            **requires,
        },
        defaults=defaults,
        ignore=("*rotary_emb.*inv_freq", "*embed_scale"),
    )


GEMMA2 = _gemma(
    "Gemma2ForCausalLM",
    "gemma2",
    *layer_types_field(2),
    # one RoPE for every layer, as Llama's rope_parameters (or the older rope_theta); tfjax's
    # local layers have a scaling of their own (Gemma 3's: none), here the same
    rope_field("rope_parameters", "rope_scaling"),
    rope_field("rope_parameters", "local_rope_scaling"),
    Field("rope_parameters.rope_theta", "rope_base", None),
    Field("rope_theta", "rope_base", None, write=False),
    Field("attn_logit_softcapping", "attention_softcap", None),
    requires={"qk_norm": False, "local_rope_base": None},
    defaults={"rope_base": 10_000.0},
    max_len=8192,
)

_FULL, _SLIDING = "rope_parameters.full_attention", "rope_parameters.sliding_attention"
GEMMA3 = _gemma(
    "Gemma3ForCausalLM",
    "gemma3_text",
    Field(
        "sliding_window_pattern",
        "attention_pattern",
        None,
        to_model=_from_window_pattern,
        write=False,
    ),
    *layer_types_field(6),
    # rope_parameters by layer type (transformers 5); older configs: rope_theta, rope_scaling
    # (the global layers') and rope_local_base_freq.
    rope_field(_FULL, "rope_scaling"),
    Field(f"{_FULL}.rope_theta", "rope_base", None),
    Field("rope_theta", "rope_base", None, write=False),
    rope_field("rope_scaling", "rope_scaling", write=False),
    rope_field(_SLIDING, "local_rope_scaling"),
    Field(f"{_SLIDING}.rope_theta", "local_rope_base", None, write=False),
    Field("rope_local_base_freq", "local_rope_base", None, write=False),
    Fixed(f"{_SLIDING}.rope_theta", lambda f: f["local_rope_base"] or f["rope_base"], read=False),
    Fixed(
        "attn_logit_softcapping",
        None,
        why="transformers' Gemma 3 does not apply it, so which model is meant is unclear",
    ),
    requires={"qk_norm": True, "attention_softcap": None},
    defaults={"rope_base": 1_000_000.0, "local_rope_base": 10_000.0},
    max_len=131_072,
)


from_gemma2, to_gemma2 = convert.converters(GEMMA2, "gemma2", spelled_out)
from_gemma3, to_gemma3 = convert.converters(GEMMA3, "gemma3", spelled_out)


def export_family(model: decoder.Decoder) -> Family:
    """GEMMA3 or GEMMA2 for a decoder with Gemma's sandwich norms, by qk_norm."""
    return GEMMA3 if model.qk_norm else GEMMA2


CONVERTS = Converts(
    rows=(
        Row(
            "Gemma 2",
            "`from_gemma2` / `to_gemma2`",
            "decoder",
            "(norms before and after each sub-layer, RMSNorm with (1 + w), embeddings times "
            "sqrt(D), GeGLU (tanh), attention and final logit soft-capping, local / global "
            "`attention_pattern`, one RoPE for both, scaled or not)",
            loads={GEMMA2.architecture: from_gemma2},
        ),
        Row(
            "Gemma 3, text part",
            "`from_gemma3` / `to_gemma3`",
            "decoder",
            "(Gemma 2's, no soft caps, q/k norms with (1 + w), per-layer-type RoPE: "
            "`local_rope_base`, linear scaling on the global layers)",
            loads={GEMMA3.architecture: from_gemma3},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=lambda m: (
                m.norm_position == "sandwich" and not m.num_experts and m.kv_lora_rank is None
            ),
            export=convert.exporter(export_family, spelled_out),
            family=export_family,
            needs="Gemma 2 / 3: a norm before and after each sub-layer (norm_position='sandwich') "
            "and a dense FFN",
        ),
    ),
)
