"""tfjax.nnx's encoder against tfjax.models.encoder (Linen): the same parameter tree (paths,
shapes, dtypes, logical names), and from the same parameters the same outputs and gradients,
unrolled and scanned, over configs that cover the family's options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_checks import assert_same_function, assert_same_tree, close

from tfjax.models import encoder as linen
from tfjax.nnx import models
from tfjax.nnx.models import encoder

VOCAB = 64
TINY = dict(vocab_size=VOCAB, width=32, num_heads=4, mlp_dim=48, max_len=16, num_layers=2)
CONFIGS = {
    # BERT: post-LN, exact GELU, token types, the masked-LM head tied to the embeddings
    "bert-mlm": dict(TINY, dropout_rate=0.0, attention_dropout_rate=0.0),
    # a classifier (pooler and head) over pre-LN SwiGLU blocks without token types, with remat
    "classifier": dict(
        TINY,
        head="classifier",
        num_classes=3,
        type_vocab_size=0,
        norm_position="pre",
        activation="swiglu",
        remat_policy="full",
    ),
}


def _models(name, scan_layers):
    fields = dict(CONFIGS[name], scan_layers=scan_layers)
    return linen.Model(**fields), encoder.Model(rngs=nnx.Rngs(1), **fields)


def _inputs():
    tokens = np.random.RandomState(0).randint(1, VOCAB, (2, 9))
    tokens[1, 6:] = 0  # padding
    types = np.zeros_like(tokens)
    types[:, 4:] = 1
    return jnp.asarray(tokens), jnp.asarray(types)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_same_tree_outputs_and_gradients(name, scan_layers):
    lm, model = _models(name, scan_layers)
    tokens, types = _inputs()
    kwargs = dict(token_types=types) if lm.type_vocab_size else {}
    params = lm.init(jax.random.key(0), tokens, **kwargs)["params"]
    assert_same_tree(params, model)
    out, aux = assert_same_function(lm, model, nn.meta.unbox(params), tokens, **kwargs)
    assert out.shape == ((2, 9, VOCAB) if lm.head == "mlm" else (2, 3))
    if lm.head == "mlm":  # the head's states, then the projection alone
        hidden, _ = model(tokens, apply_head=False, **kwargs)
        close(model.logits(hidden), out)


def test_dropout_in_training_only_and_errors_as_linen():
    model = encoder.Model(rngs=nnx.Rngs(1), **dict(CONFIGS["bert-mlm"], dropout_rate=0.5))
    tokens, _ = _inputs()
    evaluated, _ = model(tokens)
    first, _ = model(tokens, train=True, rngs=nnx.Rngs(dropout=3))
    again, _ = model(tokens, train=True, rngs=nnx.Rngs(dropout=3))
    close(first, again)
    assert not np.allclose(first, evaluated)
    with pytest.raises(ValueError, match="tokens are 17 long; max_len=16"):
        model(jnp.ones((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="Encoder.head must be one of"):
        encoder.Model("tiny", vocab_size=VOCAB, head="nope", rngs=nnx.Rngs(0))
    classifier = _models("classifier", False)[1]
    with pytest.raises(ValueError, match="apply_head=False is for head='mlm'"):
        classifier(tokens, apply_head=False)


def test_from_linen_and_the_published_preset():
    """models.from_linen makes the family's NNX model; bert-base's tree, abstractly."""
    lm = linen.Model("bert-base", vocab_size=30522, scan_layers=True)
    model = nnx.eval_shape(lambda: models.from_linen(lm, rngs=nnx.Rngs(0)))
    assert isinstance(model, encoder.Encoder)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens))["params"]
    assert_same_tree(params, model)
