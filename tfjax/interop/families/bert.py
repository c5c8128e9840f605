"""BERT (`BertForMaskedLM`, `BertForSequenceClassification`) <-> `tfjax.models.encoder`.

    model, params = from_bert("path/to/bert")              # head from config "architectures"
    model, params = from_bert(state_dict, config, head="classifier")
    logits, _ = model.apply({"params": params}, tokens)    # 0 = padding, as in BERT's vocab
    state, config = to_bert(model, params)

Key mapping (under "bert."), layer i:
  embeddings.{word,position,token_type}_embeddings, LayerNorm -> embed, pos_embed, type_embed,
                                                                 embed_norm
  encoder.layer.i.attention.self.{query,key,value} [D, D] -> encoder/layers_i/self_attention/
                                                             {query,key,value}_kernel [D, N, H]
  encoder.layer.i.attention.output.dense, LayerNorm       -> self_attention/out_*, _norm
  encoder.layer.i.intermediate.dense, output.dense        -> mlp/wi, mlp/wo
  encoder.layer.i.output.LayerNorm                        -> mlp_norm
  cls.predictions.transform.dense, LayerNorm, bias        -> mlm_dense, mlm_norm, mlm_bias
  cls.predictions.decoder.weight                          -> tied to the word embeddings
  pooler.dense, classifier (no prefix)                    -> pooler, classifier
Old checkpoints name LayerNorm parameters gamma/beta; they are read as weight/bias.

tfjax's encoder masks padding by token id 0 (BERT's [PAD]); pass attention_mask = tokens != 0 to
the reference.
"""

import functools

from tfjax.interop.core import convert, files
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Rule, attention, dense, identity, mlp, norm
from tfjax.interop.core.tables import LABELS, Family, Field, Fixed, bert_like
from tfjax.models import encoder

__all__ = ["from_bert", "to_bert"]

ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh"}


def bert_rules(model: encoder.Encoder, prefix: str = "bert.") -> list[Rule]:
    e = f"{prefix}embeddings."
    rules = [
        identity(f"{e}word_embeddings.weight", ("embed", "embedding")),
        identity(f"{e}position_embeddings.weight", ("pos_embed", "embedding")),
        *norm(f"{e}LayerNorm", ("embed_norm",)),
    ]
    if model.type_vocab_size:
        rules.append(identity(f"{e}token_type_embeddings.weight", ("type_embed", "embedding")))
    names = ("self.query", "self.key", "self.value", "output.dense")
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layer.{i}.", ("encoder", f"layers_{i}")
        rules += [
            *attention((*layer, "self_attention"), f"{h}attention.", names),
            *norm(f"{h}attention.output.LayerNorm", (*layer, "self_attention_norm")),
            *mlp((*layer, "mlp"), f"{h}intermediate.dense", f"{h}output.dense"),
            *norm(f"{h}output.LayerNorm", (*layer, "mlp_norm")),
        ]
    if model.head == "mlm":
        c = "cls.predictions."
        rules += [
            *dense(f"{c}transform.dense", ("mlm_dense",)),
            *norm(f"{c}transform.LayerNorm", ("mlm_norm",)),
            identity(f"{c}bias", ("mlm_bias",)),
        ]
    else:
        rules += [
            *dense(f"{prefix}pooler.dense", ("pooler",)),
            *dense("classifier", ("classifier",)),
        ]
    return rules


def _mlm_tied(model, prefix):
    """The output matrix is the word embeddings; its bias the head's (present in some files)."""
    return {
        "cls.predictions.decoder.weight": f"{prefix}embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }


def _bert(architecture: str, head: str, activation: Field, tied) -> Family:
    """The two BERT heads share every key but the activations they support."""
    return Family(
        architecture=architecture,
        model_type="bert",
        model=encoder.Model,
        config=(
            Field("vocab_size", "vocab_size"),
            *bert_like(dropout=0.1, eps=1e-12),
            Field("intermediate_size", "mlp_dim"),
            Field("max_position_embeddings", "max_len", 512),
            Field("type_vocab_size", "type_vocab_size", 2),
            *LABELS,
            activation,
            Field("initializer_range", "init_stddev", 0.02),
            Fixed("position_embedding_type", "absolute"),
            Fixed("is_decoder", False, why="tfjax's encoder has no decoder BERT"),
            Fixed("add_cross_attention", False, why="tfjax's encoder has no decoder BERT"),
            Fixed("pad_token_id", 0, read=False),  # tfjax's encoder masks padding by id 0
            Fixed("tie_word_embeddings", True, read=False),
        ),
        rules=bert_rules,
        prefix="bert.",
        requires={"head": head, "norm_position": "post"},
        defaults={"num_classes": 2},
        ignore=("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"),
        tied=tied,
    )


BERT_MLM = _bert(
    "BertForMaskedLM",
    "mlm",
    Field(
        "hidden_act",
        "activation",
        "gelu",
        values={"gelu": "gelu"},
        why="the masked-LM head of tfjax's encoder uses exact GELU",
    ),
    _mlm_tied,
)
BERT_CLASSIFIER = _bert(
    "BertForSequenceClassification",
    "classifier",
    Field("hidden_act", "activation", "gelu", values=ACTIVATIONS),
    lambda model, prefix: {},
)
FAMILIES = {"mlm": BERT_MLM, "classifier": BERT_CLASSIFIER}  # by tfjax's encoder head


def _family(config: dict, head: str | None) -> Family:
    if head is None:
        archs = config.get("architectures") or ()
        for family in FAMILIES.values():
            if family.architecture in archs:
                return family
        raise ValueError(
            f"BERT: the config's architectures {config.get('architectures')} name no known head "
            f"({', '.join(f.architecture for f in FAMILIES.values())}); pass head='mlm' or "
            "head='classifier'"
        )
    if head not in FAMILIES:
        raise ValueError(f"BERT: head={head!r} is unknown; allowed: {tuple(FAMILIES)}")
    return FAMILIES[head]


def _renamed(state: files.StateDict) -> files.StateDict:
    """TF-era names (LayerNorm.gamma / beta) as weight / bias."""
    out = files.StateDict(origin=state.origin)
    for k, v in state.items():
        new = k.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(
            ".LayerNorm.beta", ".LayerNorm.bias"
        )
        if new in out:
            raise ValueError(f"BERT: {k!r} and {new!r} both in {state.where(k)}")
        out[new] = v
        out.files[new] = state.where(k)
    return out


def from_bert(source, config=None, *, head: str | None = None, **overrides):
    """(tfjax encoder, params) from a BERT checkpoint directory or (state dict, config).

    `head` is "mlm" or "classifier"; taken from the config's architectures when None.
    """
    state, c = files.load_source(source, config)
    family = _family(c, head)
    return convert.from_hf(family, _renamed(state), c, **overrides)


def to_bert(model: encoder.Encoder, params):
    """({Hugging Face key: numpy array}, config dict) for a tfjax encoder."""
    return convert.to_hf(_family({}, model.head), model, params)


CONVERTS = Converts(
    rows=(
        Row(
            "BERT",
            "`from_bert` / `to_bert`",
            "encoder",
            "(MLM or classifier head)",
            loads={
                BERT_MLM.architecture: functools.partial(from_bert, head="mlm"),
                BERT_CLASSIFIER.architecture: functools.partial(from_bert, head="classifier"),
            },
        ),
    ),
    exports=(
        Exporter(
            encoder.Encoder,
            when=lambda model: True,
            export=to_bert,
            family=lambda model: _family({}, model.head),
            needs="BERT: any tfjax encoder (its head picks the architecture)",
        ),
    ),
)
