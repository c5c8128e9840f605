"""GPT-2 (`GPT2LMHeadModel`) <-> `tfjax.models.decoder` with learned positions.

    model, params = from_gpt2("path/to/gpt2")        # a directory with config.json + weights
    model, params = from_gpt2(state_dict, config)    # or a state dict and a config (dict or HF)
    logits, _ = model.apply({"params": params}, tokens)
    state, config = to_gpt2(model, params)           # back to Hugging Face keys and config

Key mapping, layer i (under "transformer."; a bare GPT2Model's keys are read too):
  h.i.ln_1 / ln_2                 -> decoder/layers_i/self_attention_norm, mlp_norm
  h.i.attn.c_attn [D, 3D] (Conv1D) -> self_attention/{query,key,value}_kernel [D, N, H]
  h.i.attn.c_proj [D, D]           -> self_attention/out_kernel [N, H, D]
  h.i.mlp.c_fc, c_proj             -> mlp/wi, mlp/wo (Conv1D is [in, out] already)
  wte, wpe, ln_f                   -> embed, pos_embed, decoder/final_norm; lm_head tied
"""

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import spelled_out, tied_head
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import QKV, Rule, identity, linear, merged_rows, norm, rows_out
from tfjax.interop.core.tables import Family, Field, Fixed
from tfjax.models import decoder

__all__ = ["from_gpt2", "to_gpt2"]

ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}


def gpt2_rules(model: decoder.Decoder, prefix="transformer.") -> list[Rule]:
    p = prefix
    rules = [
        identity(f"{p}wte.weight", ("embed", "embedding")),
        identity(f"{p}wpe.weight", ("pos_embed", "embedding")),
        *norm(f"{p}ln_f", ("decoder", "final_norm")),
    ]
    if not model.tie_embeddings:
        rules.append(linear("lm_head.weight", ("output_proj", "kernel")))
    for i in range(model.num_layers):
        h, layer = f"{p}h.{i}.", ("decoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [
            *norm(f"{h}ln_1", (*layer, "self_attention_norm")),
            merged_rows(f"{h}attn.c_attn.weight", [(*att, f"{n}_kernel") for n in QKV]),
            merged_rows(f"{h}attn.c_attn.bias", [(*att, f"{n}_bias") for n in QKV]),
            rows_out(f"{h}attn.c_proj.weight", (*att, "out_kernel")),
            identity(f"{h}attn.c_proj.bias", (*att, "out_bias")),
            *norm(f"{h}ln_2", (*layer, "mlp_norm")),
        ]
        # GPT-2's Conv1D weights are [in, out] already: Dense kernels as they are.
        for theirs, ours in (("c_fc", "wi"), ("c_proj", "wo")):
            for part, name in (("weight", "kernel"), ("bias", "bias")):
                rules.append(identity(f"{h}mlp.{theirs}.{part}", (*layer, "mlp", ours, name)))
    return rules


GPT2 = Family(
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
        Field("activation_function", "activation", "gelu_new", values=ACTIVATIONS),
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
        "attention_sinks": False,
    },
    ignore=("*.attn.bias", "*.attn.masked_bias"),
    tied=tied_head("wte.weight"),
)


def _written(model: decoder.Decoder) -> decoder.Decoder:
    """The model spelled out, after checking its heads have GPT-2's size."""
    if model.head_dim not in (None, model.width // model.num_heads):
        raise ValueError(
            f"GPT2LMHeadModel has head_dim = n_embd / n_head = {model.width // model.num_heads}; "
            f"the model's head_dim={model.head_dim}"
        )
    return spelled_out(model)


from_gpt2, to_gpt2 = convert.converters(GPT2, "gpt2", _written)


CONVERTS = Converts(
    rows=(
        Row(
            "GPT-2",
            "`from_gpt2` / `to_gpt2`",
            "decoder",
            "(learned positions)",
            loads={GPT2.architecture: from_gpt2},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=lambda m: (
                m.position == "learned" and m.norm_position != "sandwich" and not m.num_experts
            ),
            export=to_gpt2,
            family=lambda model: GPT2,
            needs="GPT2LMHeadModel: learned positions (position='learned') and one norm before "
            "each sub-layer, a dense FFN",
        ),
    ),
)
