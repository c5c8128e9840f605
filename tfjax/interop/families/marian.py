"""Marian / Opus-MT (`MarianMTModel`) <-> `tfjax.models.transformer`, the paper's
encoder-decoder.

    model, params = from_marian("path/to/opus-mt", remap_ids=True)   # config.json + weights
    logits, _ = model.apply({"params": params}, inputs, targets)  # [B, S], [B, T] -> [B, T, V]
    state, config = to_marian(model, params)

Marian is the paper's layout (`core.encoder_decoder`): post-LN blocks, sinusoidal positions
added to token embeddings scaled by sqrt(d_model), a FFN with one activation (swish, i.e.
"silu", in Opus-MT), and a [V] output bias (`logits_bias=True`).

Token ids. tfjax uses token id 0 for padding and as the decoder's start token, and masks
padding by that id. Opus-MT checkpoints pad (and start decoding) with pad_token_id = V - 1 and
use 0 for EOS. `from_marian(..., remap_ids=True)` swaps ids 0 and pad_token_id in the
embedding rows, the output projection and the output bias (an exact relabelling, like the
width permutation below), so the tfjax model computes Marian's numbers on relabelled ids:
`marian_to_tfjax_ids` / `tfjax_to_marian_ids` map ids both ways (Marian's pad -> 0, Marian's
EOS 0 -> V - 1), and `to_marian(..., pad_token_id=V - 1)` swaps them back on export. Without
remap_ids a pad_token_id other than 0 is an error. Hugging Face's Opus-MT generation configs
also forbid generating the pad token (bad_words_ids); `tfjax.decode.generate` does not.

Key mapping, layer i (under "model."):
  shared [V, D]  (encoder/decoder embed_tokens, lm_head tied)   -> embed/embedding
  encoder.embed_tokens, decoder.embed_tokens, lm_head (not shared)
                                           -> embed, target_embed, output_proj
  {en,de}coder.layers.i.self_attn.{q,k,v}_proj [N*H, D]
                                           -> {en,de}coder/layers_i/self_attention/
                                              {query,key,value}_kernel [D, N, H]
  decoder.layers.i.encoder_attn.*           -> decoder/layers_i/cross_attention/*
  *.self_attn_layer_norm, encoder_attn_layer_norm, final_layer_norm
                                           -> self_attention_norm, cross_attention_norm,
                                              mlp_norm
  *.fc1, fc2                               -> mlp/wi, mlp/wo
  final_logits_bias [1, V]                 -> output_bias [V]
  (remap_ids: rows 0 and pad_token_id of shared / embed_tokens / lm_head and entries 0
   and pad_token_id of final_logits_bias swapped)

Sinusoid layout. The paper (and tfjax.nn.sinusoidal, and PyTorch's tutorial) interleaves the
channels: sin at even, cos at odd indices. Marian puts every sin in the first half and every cos
in the second, with the same frequencies. That is a fixed permutation of the model-width
channels, and a post-LN Transformer is equivariant under any such permutation (LayerNorm
statistics, residual sums and dot products do not depend on channel order). So `from_marian`
permutes the width axis of every parameter that has one (embeddings' columns, norms, the
attention and FFN projections' input rows and output columns) from Marian's order into the
interleaved one, and `to_marian` permutes back: an exact relabelling, so the logits agree and
round trips are bitwise, but tfjax's embedding columns are not Marian's column for column.
"""

import dataclasses

import numpy as np

from tfjax.interop.core import convert, files, tables
from tfjax.interop.core.encoder_decoder import PAPER_LAYOUT, Layout, stack_rules
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Path, Rule, identity, linear, reshaped_as, unrolled
from tfjax.interop.core.tables import TOKENS, Family, Field, Fixed
from tfjax.models import transformer

__all__ = [
    "from_marian",
    "marian_id_map",
    "marian_to_tfjax_ids",
    "tfjax_to_marian_ids",
    "to_marian",
]

# Hugging Face activation_function -> tfjax.nn.ffn activation (one-projection FFNs only); the
# first name of each is the one written on export.
MARIAN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}


MARIAN_LAYOUT = Layout(
    fused_qkv=False,
    cross_attn="encoder_attn",
    fc1="fc1",
    fc2="fc2",
    encoder_norms=("self_attn_layer_norm", "final_layer_norm"),
    decoder_norms=("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"),
)


# ----------------------------------------------------------------------------------------------
# The width permutation between Marian's half-split sinusoids and the interleaved ones.


def half_to_interleaved(width: int) -> np.ndarray:
    """perm with interleaved[..., c] = half_split[..., perm[c]]: [0, D/2, 1, D/2 + 1, ...]."""
    if width % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {width}")
    half = np.arange(width // 2)
    return np.stack([half, half + width // 2], axis=1).reshape(-1)


def _width_axis(path: Path) -> int | None:
    """The axis of a transformer parameter that runs over the model width D (None: none)."""
    parent, name = (path[-2] if len(path) > 1 else ""), path[-1]
    if name == "embedding":  # [V, D]
        return 1
    if parent == "output_proj" or parent.endswith("_norm"):  # [D, V]; [D]
        return 0
    if name in ("query_kernel", "key_kernel", "value_kernel", "out_bias"):  # [D, N, H]; [D]
        return 0
    if name == "out_kernel":  # [N, H, D]
        return 2
    if parent == "wi":  # kernel [D, F]; bias [F]
        return 0 if name == "kernel" else None
    if parent == "wo":  # kernel [F, D]; bias [D]
        return 1 if name == "kernel" else 0
    return None  # query/key/value biases [N, H]


def _vocab_axis(path: Path) -> int | None:
    """The axis of a transformer parameter that runs over the vocabulary V (None: none)."""
    parent, name = (path[-2] if len(path) > 1 else ""), path[-1]
    if name == "embedding":  # [V, D]
        return 0
    if parent == "output_proj":  # [D, V]
        return 1
    if name == "output_bias":  # [V]
        return 0
    return None


def _take(x, axis: int, index):
    return x[(slice(None),) * axis + (index,)]


def _permute(rules: list[Rule], perm: np.ndarray, axis_of) -> list[Rule]:
    """The rules with the axis `axis_of(path)` of every tfjax-side array permuted by `perm` on
    import (and by its inverse on export); exact, so round trips stay bitwise."""
    inv = np.argsort(perm)
    out = []
    for rule in rules:
        axes = [axis_of(p) for p in rule.paths]
        if all(a is None for a in axes):
            out.append(rule)
            continue

        def to_jax(*args, rule=rule, axes=axes):
            outs = rule.to_jax(*args)
            return tuple(
                o if a is None else _take(np.asarray(o), a, perm)
                for o, a in zip(outs, axes, strict=True)
            )

        def to_torch(*ys, rule=rule, axes=axes):
            return rule.to_torch(
                *(y if a is None else _take(y, a, inv) for y, a in zip(ys, axes, strict=True))
            )

        out.append(dataclasses.replace(rule, to_jax=to_jax, to_torch=to_torch))
    return out


# ----------------------------------------------------------------------------------------------
# Marian.


def _marian_pad_id(config: dict, vocab: int) -> int:
    """The config's pad_token_id, checked to be the decoder's start token too."""
    pad = config.get("pad_token_id")
    start = config.get("decoder_start_token_id")
    start = pad if start is None else start
    if pad is None or not 0 <= pad < vocab or start != pad:
        raise ValueError(
            f"MarianMTModel: pad_token_id={pad} and decoder_start_token_id={start}; tfjax's "
            f"transformer needs one id in [0, {vocab}) for both (it uses 0 for padding masks and "
            "as the decoder's start token)"
        )
    return pad


def _swap_zero(vocab: int, pad: int) -> np.ndarray:
    ids = np.arange(vocab)
    ids[[0, pad]] = ids[[pad, 0]]
    return ids


def marian_id_map(config) -> np.ndarray:
    """[V] ints: tfjax token id i is Marian token id map[i] in a model from
    `from_marian(..., remap_ids=True)`.

    tfjax's transformer pads with id 0 and starts decoding with it; Opus-MT models pad with
    pad_token_id = V - 1 (also their decoder start token) and end with eos_token_id = 0. The
    map swaps 0 and pad_token_id (the identity when pad is already 0), so it is its own
    inverse, Marian's pad becomes tfjax's 0, and Marian's EOS 0 becomes tfjax's pad_token_id.
    `config`: a MarianConfig, its dict, or a checkpoint directory.
    """
    c = files.as_config(config)
    vocab = c.get("vocab_size")
    if vocab is None:
        raise ValueError("MarianMTModel: the config has no 'vocab_size'")
    return _swap_zero(vocab, _marian_pad_id(c, vocab))


def marian_to_tfjax_ids(ids, config) -> np.ndarray:
    """Marian token ids (a MarianTokenizer's, padded with pad_token_id) -> tfjax ids, for a
    model loaded with remap_ids=True. Any shape."""
    return np.argsort(marian_id_map(config))[np.asarray(ids)]


def tfjax_to_marian_ids(ids, config) -> np.ndarray:
    """tfjax token ids (e.g. `decode.generate`'s, 0 after EOS) -> Marian ids, for decoding
    with a MarianTokenizer (which skips the pad id as a special token). Any shape."""
    return marian_id_map(config)[np.asarray(ids)]


def marian_rules(
    model: transformer.Transformer, prefix: str = "model.", pad_token_id: int = 0
) -> list[Rule]:
    """The Marian key rules; with pad_token_id != 0 the vocabulary rows of the embeddings, the
    output projection and the output bias are relabelled by `marian_id_map`."""
    if model.share_embeddings:
        rules = [identity(f"{prefix}shared.weight", ("embed", "embedding"))]
    else:
        rules = [
            identity(f"{prefix}encoder.embed_tokens.weight", ("embed", "embedding")),
            identity(f"{prefix}decoder.embed_tokens.weight", ("target_embed", "embedding")),
            linear("lm_head.weight", ("output_proj", "kernel")),
        ]
    if model.logits_bias:  # [1, V] <-> [V]
        rules.append(reshaped_as("final_logits_bias", ("output_bias",), lambda y: (1, -1)))
    rules += stack_rules(model.num_layers, MARIAN_LAYOUT, prefix)
    rules = _permute(rules, _swap_zero(model.vocab_size, pad_token_id), _vocab_axis)
    return _permute(rules, half_to_interleaved(model.width), _width_axis)


def _marian_tied(model, prefix):
    """Older files and in-memory state dicts also hold the shared matrix's three copies."""
    if not model.share_embeddings:
        return {}
    copies = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    tied = {f"{prefix}{k}": f"{prefix}shared.weight" for k in copies}
    return {**tied, "lm_head.weight": f"{prefix}shared.weight"}


MARIAN = Family(
    architecture="MarianMTModel",
    model_type="marian",
    model=transformer.Model,
    config=(
        Field("vocab_size", "vocab_size"),
        Field("decoder_vocab_size", "vocab_size", None),
        Field("d_model", "width"),
        Field("encoder_layers", "num_layers"),
        Field("decoder_layers", "num_layers"),
        Field("encoder_attention_heads", "num_heads"),
        Field("decoder_attention_heads", "num_heads"),
        Field("encoder_ffn_dim", "mlp_dim"),
        Field("decoder_ffn_dim", "mlp_dim"),
        Field(
            "activation_function",
            "activation",
            "gelu",
            values=MARIAN_ACTIVATIONS,
            why="the one-projection FFNs of tfjax.nn.ffn.Mlp",
        ),
        Field("dropout", "dropout_rate", 0.1),
        Field("attention_dropout", "attention_dropout_rate", 0.0),
        Fixed("activation_dropout", 0.0, read=False),
        Field("share_encoder_decoder_embeddings", "share_embeddings", True),
        Field("tie_word_embeddings", "share_embeddings", True),
        Fixed(
            "scale_embedding",
            True,
            default=False,
            why="tfjax's transformer multiplies token embeddings by sqrt(d_model), as the paper "
            "and Opus-MT models do",
        ),
        Fixed("is_encoder_decoder", True, read=False),
        Fixed("max_position_embeddings", 1024, read=False),  # tfjax's sinusoids have no limit
    ),
    rules=marian_rules,
    inputs=(TOKENS, TOKENS),
    prefix="model.",
    # Marian's LayerNorm epsilon is nn.LayerNorm's default, not in its config.
    requires={"norm_position": "post", "norm_eps": 1e-5, "final_norm": False, **PAPER_LAYOUT},
    ignore=("model.*.embed_positions.weight",),
    tied=_marian_tied,
)


def from_marian(source, config=None, *, remap_ids: bool = False, **overrides):
    """(tfjax transformer, params) from a MarianMTModel directory or (state dict, config).

    remap_ids: needed for checkpoints whose pad_token_id is not 0 (every Opus-MT model: pad
      V - 1, EOS 0). The embedding rows, output projection and output bias are relabelled so
      that tfjax's id 0 is Marian's pad / decoder start token; feed the model
      `marian_to_tfjax_ids(ids, config)`, use eos_id=int(marian_to_tfjax_ids(eos, config))
      with `tfjax.decode.generate`, and map its output back with `tfjax_to_marian_ids`.
    `overrides` set model fields (scan_layers=True, dtype, implementation, ...). A
    final_logits_bias in the checkpoint gives logits_bias=True (Marian's [V] output bias).
    """
    state, c = files.load_source(source, config)
    fields = {"logits_bias": "final_logits_bias" in state, **overrides}
    model = tables.build(MARIAN, c, **fields)
    pad = _marian_pad_id(c, model.vocab_size)
    if pad != 0 and not remap_ids:
        raise ValueError(
            f"MarianMTModel: pad_token_id={pad} (also the decoder's start token); tfjax's "
            "transformer uses token id 0 for both (padding masks and the decoder's start token). "
            f"Pass remap_ids=True to swap ids 0 and {pad} in the embeddings and the output layer, "
            "and map token ids with marian_to_tfjax_ids / tfjax_to_marian_ids"
        )
    rules = marian_rules(model, MARIAN.prefix, pad)
    return model, convert.import_params(MARIAN, model, state, rules=rules)


def to_marian(
    model: transformer.Transformer,
    params,
    *,
    pad_token_id: int = 0,
    eos_token_id: int | None = None,
):
    """({Hugging Face key: numpy array}, config dict) for a tfjax transformer.

    With the defaults the Marian ids are tfjax's. pad_token_id undoes `from_marian(...,
    remap_ids=True)` (swaps ids 0 and pad_token_id back; Opus-MT: V - 1); eos_token_id, in
    Marian's ids, is written to the config when given.
    """
    if not 0 <= pad_token_id < model.vocab_size:
        raise ValueError(f"pad_token_id={pad_token_id} is outside [0, {model.vocab_size})")
    rules = marian_rules(model, MARIAN.prefix, pad_token_id)
    state, config = convert.to_hf(MARIAN, model, params, rules=rules)
    config["pad_token_id"] = config["decoder_start_token_id"] = pad_token_id
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    if not model.logits_bias:  # MarianMTModel always has the buffer
        dtype = np.asarray(unrolled(model, params)["embed"]["embedding"]).dtype
        state["final_logits_bias"] = np.zeros((1, model.vocab_size), dtype)
    return state, config


CONVERTS = Converts(
    rows=(
        Row(
            "Marian / Opus-MT",
            "`from_marian` / `to_marian`",
            "transformer",
            "(swish FFN, output bias)",
            loads={MARIAN.architecture: from_marian},
        ),
    ),
    exports=(
        Exporter(
            transformer.Transformer,
            when=lambda m: m.position != "relative",
            export=to_marian,
            family=lambda model: MARIAN,
            needs="MarianMTModel: the paper's positions (not position='relative')",
        ),
    ),
)
