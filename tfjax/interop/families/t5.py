"""T5 v1.1 and Flan-T5 (`T5ForConditionalGeneration`) <-> `tfjax.models.transformer`.

    model, params = from_t5("path/to/flan-t5-base")      # config.json + weights
    logits, _ = model.apply({"params": params}, inputs, targets)  # [B, S], [B, T] -> [B, T, V]
    state, config = to_t5(model, params)                 # back to Hugging Face keys and config

T5 v1.1 (and Flan-T5, which keeps its layout) is the encoder-decoder with other fields
(`transformer.T5`): pre-LN stacks with RMSNorm and no biases anywhere, token embeddings shared
by both stacks and neither scaled nor added to positions, one learned relative position bias
per stack (T5's buckets) added to every layer's self-attention logits, unscaled attention
logits, a gated-GELU FFN, and an output projection of its own. Its ids suit tfjax as they are:
pad and the decoder's start token are 0, EOS is 1.

Key mapping, layer i (no prefix):
  shared [V, D]                                  -> embed/embedding (encoder and decoder)
  lm_head [V, D]                                 -> output_proj/kernel [D, V] (a file
                                                    without it: tie_embeddings=True, the
                                                    logits from `shared`, as transformers >= 5
                                                    ties a v1.1 head)
  {en,de}coder.block.i.layer.0.SelfAttention.{q,k,v} [N*H, D]
                                                 -> {en,de}coder/layers_i/self_attention/
                                                    {query,key,value}_kernel [D, N, H]
  ...SelfAttention.o [D, N*H]                    -> .../self_attention/out_kernel [N, H, D]
  {en,de}coder.block.0.layer.0.SelfAttention.relative_attention_bias [buckets, N]
                                                 -> {en,de}coder_position_bias/embedding
  decoder.block.i.layer.1.EncDecAttention.*      -> decoder/layers_i/cross_attention/*
  layer.0 / (decoder) layer.1 / last layer's layer_norm
                                                 -> self_attention_norm / cross_attention_norm /
                                                    mlp_norm
  ...DenseReluDense.wi_0, wi_1, wo (gated; wi, wo otherwise)
                                                 -> mlp/wi_0, wi_1, wo (mlp/wi, wo)
  {en,de}coder.final_layer_norm                  -> {en,de}coder/final_norm

What is refused, by key: the original T5's head (`tie_word_embeddings` true, or
`scale_decoder_outputs` true: logits from the shared embedding scaled by d_model^-1/2), encoder
and decoder depths that differ (`num_layers`, `num_decoder_layers`), pad or decoder start ids
other than 0, and FFN activations tfjax has no form of.
"""

from tfjax.interop.core import convert, files, tables
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Path, Rule, attention, identity, linear
from tfjax.interop.core.tables import TOKENS, Family, Field, Fixed
from tfjax.models import transformer

__all__ = ["from_t5", "to_t5"]

ARCHITECTURE = "T5ForConditionalGeneration"
# feed_forward_proj -> tfjax.nn.ffn activation ("gated-gelu" is transformers' gelu_new, the
# tanh form; T5 v1.1 and Flan-T5 use it).
ACTIVATIONS = {"gated-gelu": "geglu_tanh", "gated-silu": "swiglu", "relu": "relu", "gelu": "gelu"}
_GATED = {"geglu_tanh", "swiglu"}
_PROJECTIONS = ("q", "k", "v", "o")  # an attention layer's Linear layers (no biases anywhere)


def _mlp(key: str, path: Path, gated: bool) -> list[Rule]:
    inner = ("wi_0", "wi_1") if gated else ("wi",)
    return [linear(f"{key}.{w}.weight", (*path, w, "kernel")) for w in (*inner, "wo")]


def t5_rules(model: transformer.Transformer, prefix: str = "") -> list[Rule]:
    """The T5ForConditionalGeneration key rules (sublayers numbered as transformers does)."""
    gated = model.activation in _GATED
    rules = [identity(f"{prefix}shared.weight", ("embed", "embedding"))]
    if not model.tied:
        rules.append(linear("lm_head.weight", ("output_proj", "kernel")))
    for side in ("encoder", "decoder"):
        bias = f"{prefix}{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        rules += [
            identity(bias, (f"{side}_position_bias", "embedding")),
            identity(f"{prefix}{side}.final_layer_norm.weight", (side, "final_norm", "scale")),
        ]
        for i in range(model.num_layers):
            k, layer = f"{prefix}{side}.block.{i}.layer.", (side, f"layers_{i}")
            sublayers = [("SelfAttention", "self_attention")]
            if side == "decoder":
                sublayers.append(("EncDecAttention", "cross_attention"))
            for j, (name, ours) in enumerate(sublayers):
                key = f"{k}{j}.{name}."
                rules += attention(
                    (*layer, ours), key, _PROJECTIONS, qkv_bias=False, out_bias=False
                )
                rules.append(
                    identity(f"{k}{j}.layer_norm.weight", (*layer, f"{ours}_norm", "scale"))
                )
            j = len(sublayers)
            rules += _mlp(f"{k}{j}.DenseReluDense", (*layer, "mlp"), gated)
            rules.append(identity(f"{k}{j}.layer_norm.weight", (*layer, "mlp_norm", "scale")))
    return rules


def _tied(model, prefix):
    """Older files and in-memory state dicts also hold the shared matrix's copies."""
    copies = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return {f"{prefix}{k}": f"{prefix}shared.weight" for k in copies}


_ORIGINAL_HEAD = (
    "T5 v1.1 and Flan-T5 have an output projection of their own; the original T5's logits "
    "come from the shared embedding scaled by d_model^-1/2, which tfjax does not convert"
)

T5 = Family(
    architecture=ARCHITECTURE,
    model_type="t5",
    model=transformer.Model,
    config=(
        Field("vocab_size", "vocab_size"),
        Field("d_model", "width"),
        Field("d_kv", "head_dim"),
        Field("d_ff", "mlp_dim"),
        Field("num_layers", "num_layers"),
        Field("num_decoder_layers", "num_layers", None),
        Field("num_heads", "num_heads"),
        Field("relative_attention_num_buckets", "relative_buckets", 32),
        Field("relative_attention_max_distance", "relative_max_distance", 128),
        # transformers' T5 drops out attention weights and the FFN's hidden activations at the
        # same rate as everything else; save writes dropout_rate (training only) from the first
        Field("dropout_rate", "dropout_rate", 0.1),
        Field("dropout_rate", "attention_dropout_rate", 0.1, write=False),
        Field("dropout_rate", "mlp_dropout_rate", 0.1, write=False),
        Field("layer_norm_epsilon", "norm_eps", 1e-6),
        Field("feed_forward_proj", "activation", "relu", values=ACTIVATIONS),
        # read by _check_head: transformers >= 5 saves an untied v1.1 model as
        # tie_word_embeddings true with scale_decoder_outputs false
        Fixed("tie_word_embeddings", False, read=False),
        Fixed("pad_token_id", 0, default=0, why="tfjax pads with id 0"),
        Fixed("decoder_start_token_id", 0, default=0, why="tfjax's decoder starts from id 0"),
        Fixed("eos_token_id", 1, read=False),
        Fixed("is_encoder_decoder", True, read=False),
    ),
    rules=t5_rules,
    inputs=(TOKENS, TOKENS),
    defaults={"output_dropout": True},  # dropout after each stack's final norm, as transformers
    requires={
        "norm": "rms",
        "norm_position": "pre",
        "use_bias": False,
        "position": "relative",
        "scale_embeddings": False,
        "attention_scale": 1.0,
        "share_embeddings": True,
        "logits_bias": False,
        "final_norm": False,
    },
    # a relative bias transformers keeps in the first cross-attention layer of some files, unused
    ignore=("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",),
    tied=_tied,
)


def _check_head(config: dict):
    """Refuses the original T5's tied, rescaled head, which the config says by one of two keys
    (transformers >= 5 writes scale_decoder_outputs; published configs tie_word_embeddings)."""
    if "scale_decoder_outputs" in config:
        key, value = "scale_decoder_outputs", config["scale_decoder_outputs"]
        scaled = bool(value)
    else:
        key, value = "tie_word_embeddings", config.get("tie_word_embeddings")
        scaled = value is not False  # transformers: scaled unless it is false
    if scaled:
        said = f"{key}={value!r}" if value is not None else f"no {key} (meaning true)"
        raise ValueError(f"{ARCHITECTURE}: {said} is not supported ({_ORIGINAL_HEAD})")


def from_t5(source, config=None, **overrides):
    """(tfjax transformer, params) from a T5ForConditionalGeneration directory or (state dict,
    config). `overrides` set model fields (scan_layers=True, dtype, implementation, ...)."""
    state, c = files.load_source(source, config)
    _check_head(c)
    # transformers >= 5 ties a v1.1 head to `shared` (unscaled) when the file has no lm_head
    fields = {"tie_embeddings": "lm_head.weight" not in state, **overrides}
    model = tables.build(T5, c, **fields)
    return model, convert.import_params(T5, model, state)


def spelled_out(model: transformer.Transformer) -> transformer.Transformer:
    """The model with head_dim written out (None means width // num_heads)."""
    if model.head_dim is None:
        return model.clone(head_dim=model.width // model.num_heads)
    return model


def to_t5(model: transformer.Transformer, params):
    """({Hugging Face key: numpy array}, config dict) for a T5-shaped tfjax transformer."""
    return convert.to_hf(T5, spelled_out(model), params)


CONVERTS = Converts(
    rows=(
        Row(
            "T5 v1.1, Flan-T5",
            "`from_t5` / `to_t5`",
            "transformer",
            '(`position="relative"`: T5\'s bucketed relative bias, one per stack; RMSNorm pre-LN, '
            "no biases, unscaled embeddings and attention logits, gated GELU, untied head)",
            loads={T5.architecture: from_t5},
        ),
    ),
    exports=(
        Exporter(
            transformer.Transformer,
            when=lambda m: m.position == "relative",
            export=to_t5,
            family=lambda model: T5,
            needs="T5ForConditionalGeneration: T5's relative position bias (position='relative')",
        ),
    ),
)
