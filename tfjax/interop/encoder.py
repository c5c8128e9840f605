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

import jax.numpy as jnp

from tfjax.interop import core
from tfjax.interop.decoder import _load
from tfjax.models import encoder

ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh"}
ARCHITECTURES = {"BertForMaskedLM": "mlm", "BertForSequenceClassification": "classifier"}


def _head(c, head):
    if head is not None:
        return head
    for arch in c.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"BERT: the config's architectures {c.get('architectures')} name no known head "
        f"({', '.join(ARCHITECTURES)}); pass head='mlm' or head='classifier'"
    )


def bert_model(config, head: str | None = None, **overrides) -> encoder.Encoder:
    """The tfjax encoder with a BertConfig's sizes, epsilon and head."""
    c = core.as_config(config)
    head = _head(c, head)
    what = "BertForMaskedLM" if head == "mlm" else "BertForSequenceClassification"
    act = c.get("hidden_act", "gelu")
    if act not in ACTIVATIONS or (head == "mlm" and act != "gelu"):
        raise ValueError(
            f"{what}: hidden_act={act!r} is not supported; allowed: "
            f"{('gelu',) if head == 'mlm' else tuple(ACTIVATIONS)} (the masked-LM head of "
            "tfjax's encoder uses exact GELU)"
        )
    kind = c.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{what}: position_embedding_type={kind!r} is not supported")
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise ValueError(f"{what}: decoder BERT (is_decoder / add_cross_attention) is unsupported")
    fields = dict(
        vocab_size=core.get(c, "vocab_size", what=what),
        width=core.get(c, "hidden_size", what=what),
        num_layers=core.get(c, "num_hidden_layers", what=what),
        num_heads=core.get(c, "num_attention_heads", what=what),
        mlp_dim=core.get(c, "intermediate_size", what=what),
        max_len=core.get(c, "max_position_embeddings", 512, what=what),
        type_vocab_size=c.get("type_vocab_size", 2),
        head=head,
        num_classes=core.num_labels(c),
        dropout_rate=c.get("hidden_dropout_prob", 0.1),
        attention_dropout_rate=c.get("attention_probs_dropout_prob", 0.1),
        activation=ACTIVATIONS[act],
        norm_eps=core.get(c, "layer_norm_eps", 1e-12, what=what),
        init_stddev=c.get("initializer_range", 0.02),
    )
    return encoder.Model(**{**fields, **overrides})


def _norm(key, path):
    return [
        core.identity(f"{key}.weight", (*path, "scale")),
        core.identity(f"{key}.bias", (*path, "bias")),
    ]


def _dense(key, path):
    return [
        core.linear(f"{key}.weight", (*path, "kernel")),
        core.identity(f"{key}.bias", (*path, "bias")),
    ]


def bert_rules(model: encoder.Encoder) -> list[core.Rule]:
    e = "bert.embeddings."
    rules = [
        core.identity(f"{e}word_embeddings.weight", ("embed", "embedding")),
        core.identity(f"{e}position_embeddings.weight", ("pos_embed", "embedding")),
        *_norm(f"{e}LayerNorm", ("embed_norm",)),
    ]
    if model.type_vocab_size:
        rules.append(core.identity(f"{e}token_type_embeddings.weight", ("type_embed", "embedding")))
    for i in range(model.num_layers):
        h, layer = f"bert.encoder.layer.{i}.", ("encoder", f"layers_{i}")
        att = (*layer, "self_attention")
        for name in ("query", "key", "value"):
            rules += [
                core.linear(f"{h}attention.self.{name}.weight", (*att, f"{name}_kernel")),
                core.reshaped(f"{h}attention.self.{name}.bias", (*att, f"{name}_bias")),
            ]
        rules += [
            core.linear_out(f"{h}attention.output.dense.weight", (*att, "out_kernel")),
            core.identity(f"{h}attention.output.dense.bias", (*att, "out_bias")),
            *_norm(f"{h}attention.output.LayerNorm", (*layer, "self_attention_norm")),
            *_dense(f"{h}intermediate.dense", (*layer, "mlp", "wi")),
            *_dense(f"{h}output.dense", (*layer, "mlp", "wo")),
            *_norm(f"{h}output.LayerNorm", (*layer, "mlp_norm")),
        ]
    if model.head == "mlm":
        c = "cls.predictions."
        rules += [
            *_dense(f"{c}transform.dense", ("mlm_dense",)),
            *_norm(f"{c}transform.LayerNorm", ("mlm_norm",)),
            core.identity(f"{c}bias", ("mlm_bias",)),
        ]
    else:
        rules += [*_dense("bert.pooler.dense", ("pooler",)), *_dense("classifier", ("classifier",))]
    return rules


def _renamed(state: core.StateDict) -> core.StateDict:
    """TF-era names (LayerNorm.gamma / beta) as weight / bias."""
    out = core.StateDict(origin=state.origin)
    for k, v in state.items():
        new = k
        if ".LayerNorm.gamma" in k or ".LayerNorm.beta" in k:
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
    state, c = _load(source, config)
    state = _renamed(state)
    model = bert_model(c, head, **overrides)
    what = "BertForMaskedLM" if model.head == "mlm" else "BertForSequenceClassification"
    tied = None
    if model.head == "mlm":
        tied = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
        if "cls.predictions.decoder.bias" in state:  # the same tensor as cls.predictions.bias
            tied["cls.predictions.decoder.bias"] = "cls.predictions.bias"
    params = core.import_state(
        state,
        bert_rules(model),
        core.param_shapes(model, jnp.ones((1, 1), jnp.int32)),
        what=what,
        ignore=("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"),
        tied=tied,
    )
    return model, core.finish(model, params)


def bert_config(model: encoder.Encoder) -> dict:
    """A BertConfig dict for a tfjax encoder."""
    if model.norm_position != "post":
        raise ValueError("BERT is post-LN; the model has norm_position='pre'")
    act = {v: k for k, v in ACTIVATIONS.items()}[model.activation]
    arch = "BertForMaskedLM" if model.head == "mlm" else "BertForSequenceClassification"
    return {
        "architectures": [arch],
        "model_type": "bert",
        "vocab_size": model.vocab_size,
        "hidden_size": model.width,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "intermediate_size": model.mlp_dim,
        "max_position_embeddings": model.max_len,
        "type_vocab_size": model.type_vocab_size,
        "hidden_act": act,
        "hidden_dropout_prob": model.dropout_rate,
        "attention_probs_dropout_prob": model.attention_dropout_rate,
        "layer_norm_eps": model.norm_eps,
        "initializer_range": model.init_stddev,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "id2label": {str(i): f"LABEL_{i}" for i in range(model.num_classes)},
        "label2id": {f"LABEL_{i}": i for i in range(model.num_classes)},
    }


def to_bert(model: encoder.Encoder, params):
    """({Hugging Face key: numpy array}, config dict) for a tfjax encoder."""
    return core.export_state(core.unrolled(model, params), bert_rules(model)), bert_config(model)
