"""Llama (`LlamaForCausalLM`) and the families that keep its layout, Mistral
(`MistralForCausalLM`) and Qwen 2 / 2.5 / 3 (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`) <->
`tfjax.models.decoder` with RoPE, RMSNorm and a gated FFN.

    model, params = from_llama("path/to/llama")      # a directory with config.json + weights
    model, params = from_qwen3(state_dict, config)   # or a state dict and a config (dict or HF)
    logits, _ = model.apply({"params": params}, tokens)
    state, config = to_llama(model, params)          # back to Hugging Face keys and config

Key mapping, layer i (under "model."; `core.decoders.llama_rules`):
  layers.i.self_attn.{q,k,v}_proj [N*H, D] -> decoder/layers_i/self_attention/
                                              {query,key,value}_kernel [D, N, H]
  layers.i.self_attn.o_proj [D, N*H]       -> self_attention/out_kernel [N, H, D]
  layers.i.mlp.{gate,up,down}_proj          -> mlp/wi_0, wi_1, wo
  layers.i.{input,post_attention}_layernorm -> self_attention_norm, mlp_norm (RMS)
  embed_tokens, norm, lm_head               -> embed, decoder/final_norm, output_proj
Mistral adds a sliding window (no keys), Qwen 2 biases on q, k and v (q_proj.bias, ...), Qwen 3
a norm on each query and key head (self_attn.q_norm, k_norm -> query_norm, key_norm). RoPE's
rotate-half layout is tfjax's, so no permutation of q/k rows is needed.
"""

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import llama_family, spelled_out
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.tables import Family, Field, Fixed
from tfjax.models import decoder
from tfjax.specs.decoder import LLAMA4_ONLY, non_default

__all__ = [
    "from_llama",
    "from_mistral",
    "from_qwen2",
    "from_qwen3",
    "to_llama",
    "to_mistral",
    "to_qwen2",
    "to_qwen3",
]


def _full_attention_layers(fields):
    return ["full_attention"] * fields["num_layers"]


# Qwen 2.5 and 3 configs name a sliding window that their published checkpoints leave off.
_NO_SLIDING_WINDOW = (
    Fixed("use_sliding_window", False, why="tfjax's decoder attends to the whole context"),
    # Without use_sliding_window transformers sets the window to None, whatever the file says:
    # Qwen2.5-7B's config.json has use_sliding_window false and sliding_window 131072.
    Fixed("sliding_window", None, read=False),
    Fixed("layer_types", _full_attention_layers, why="every layer full attention"),
)

LLAMA = llama_family(
    "LlamaForCausalLM",
    "llama",
    Field("attention_bias", "use_bias", False),
    Field("mlp_bias", "use_bias", False),
    Fixed("pretraining_tp", 1),
    requires={"qkv_bias": None, "qk_norm": False, "sliding_window": None},
)
# Mistral: Llama's layout with sliding-window attention (in training masks and the KV cache).
MISTRAL = llama_family(
    "MistralForCausalLM",
    "mistral",
    Field("sliding_window", "sliding_window", None),
    requires={"use_bias": False, "qkv_bias": None, "qk_norm": False},
)
# Qwen 2 / 2.5: biases on the query, key and value projections only.
QWEN2 = llama_family(
    "Qwen2ForCausalLM",
    "qwen2",
    *_NO_SLIDING_WINDOW,
    requires={"use_bias": False, "qkv_bias": True, "qk_norm": False, "sliding_window": None},
)
# Qwen 3: RMSNorm on each query and key head, before RoPE; head_dim need not be D / N.
QWEN3 = llama_family(
    "Qwen3ForCausalLM",
    "qwen3",
    Field("attention_bias", "use_bias", False),
    *_NO_SLIDING_WINDOW,
    requires={"qkv_bias": None, "qk_norm": True, "sliding_window": None},
)

from_llama, to_llama = convert.converters(LLAMA, "llama", spelled_out)
from_mistral, to_mistral = convert.converters(MISTRAL, "mistral", spelled_out)
from_qwen2, to_qwen2 = convert.converters(QWEN2, "qwen2", spelled_out)
from_qwen3, to_qwen3 = convert.converters(QWEN3, "qwen3", spelled_out)


def export_family(model: decoder.Decoder) -> Family:
    """The Llama-shaped family a tfjax decoder exports as, by its fields."""
    if model.sliding_window is not None:
        return MISTRAL
    if model.qk_norm:
        return QWEN3
    if model.qkv_bias and not model.use_bias:
        return QWEN2
    return LLAMA


def _export(model: decoder.Decoder, params):
    return convert.to_hf(export_family(model), spelled_out(model), params)


CONVERTS = Converts(
    rows=(
        Row(
            "Llama 1 - 3.x",
            "`from_llama` / `to_llama`",
            "decoder",
            "(RoPE, SwiGLU, grouped-query; `rope_scaling`: llama3, linear, dynamic, yarn; tied or "
            "untied head)",
            loads={LLAMA.architecture: from_llama},
        ),
        Row(
            "Mistral",
            "`from_mistral` / `to_mistral`",
            "decoder",
            "(`sliding_window` in training masks and the KV cache)",
            loads={MISTRAL.architecture: from_mistral},
        ),
        Row(
            "Qwen 2 / 2.5",
            "`from_qwen2` / `to_qwen2`",
            "decoder",
            "(`qkv_bias`: biases on q, k, v only)",
            loads={QWEN2.architecture: from_qwen2},
        ),
        Row(
            "Qwen 3",
            "`from_qwen3` / `to_qwen3`",
            "decoder",
            "(`qk_norm`: RMSNorm per q/k head; `head_dim` != D / N)",
            loads={QWEN3.architecture: from_qwen3},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=lambda m: (
                m.position != "learned"
                and m.norm_position != "sandwich"
                and not m.num_experts
                and m.kv_lora_rank is None
                and m.layer_types is None  # Qwen3.5's layers: families.qwen3_5
                and not m.attention_output_gate
                and not non_default(m, LLAMA4_ONLY)  # Llama 4's layers: families.llama4
            ),
            export=_export,
            family=export_family,
            needs="Llama, Mistral, Qwen: positions other than learned ones and one norm before "
            "each sub-layer, a dense FFN (mixtures of experts are not exported yet)",
        ),
    ),
)
