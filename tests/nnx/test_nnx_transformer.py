"""tfjax.nnx's encoder-decoder Transformer against tfjax.models.transformer (Linen): the same
parameter tree (paths, shapes, dtypes, logical names), and from the same parameters the same
outputs, gradients and decoding steps (the explicit cache), unrolled and scanned, for the
paper's model, T5 v1.1 (relative position bias) and a Marian-like variant."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_checks import assert_same_function, assert_same_tree, close

from tfjax.models import transformer as linen
from tfjax.nnx import models
from tfjax.nnx.models import transformer

VOCAB = 64
TINY = dict(vocab_size=VOCAB, width=32, num_layers=2, num_heads=4, mlp_dim=48)
CONFIGS = {
    # Vaswani et al.: post-LN, ReLU, sinusoids on sqrt(D)-scaled embeddings, one matrix for
    # source, target and output
    "paper": dict(TINY, dropout_rate=0.0),
    # T5 v1.1: pre-RMSNorm, no biases, a relative position bias per stack, unscaled logits,
    # gated GELU, an output projection of its own, head_dim apart from width / heads
    "t5": dict(
        linen.T5,
        **TINY,
        head_dim=16,
        relative_buckets=8,
        relative_max_distance=16,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        mlp_dropout_rate=0.0,
    ),
    # Marian-like: a target embedding of its own (tied to the output), a logits bias, a final
    # norm after the post-LN stacks, SiLU, remat
    "marian": dict(
        TINY,
        dropout_rate=0.0,
        activation="silu",
        share_embeddings=False,
        tie_embeddings=True,
        logits_bias=True,
        final_norm=True,
        remat_policy="dots",
    ),
}


def _models(name, scan_layers, **more):
    fields = dict(CONFIGS[name], scan_layers=scan_layers, **more)
    return linen.Model(**fields), transformer.Model(rngs=nnx.Rngs(1), **fields)


def _batch():
    rs = np.random.RandomState(0)
    inputs, targets = rs.randint(1, VOCAB, (2, 9)), rs.randint(1, VOCAB, (2, 7))
    inputs[1, 6:] = 0  # padding
    targets[0, 5:] = 0
    return jnp.asarray(inputs), jnp.asarray(targets)


@functools.cache
def _pair(name, scan_layers):
    """(Linen model, NNX model given its parameters, the parameters), the trees compared: one
    per config and layout, made once for the module's tests."""
    lm, model = _models(name, scan_layers)
    params = lm.init(jax.random.key(0), *_batch())["params"]
    assert_same_tree(params, model)
    params = nn.meta.unbox(params)
    models.load_params(model, params)
    return lm, model, params


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_same_tree_outputs_and_gradients(name, scan_layers):
    lm, model, params = _pair(name, scan_layers)
    inputs, targets = _batch()
    (logits, aux) = assert_same_function(lm, model, params, inputs, targets)
    assert logits.shape == (2, 7, VOCAB) and aux["encoded"].shape == (2, 9, 32)
    # Packed rows: segment ids and positions of their own.
    packed = dict(
        inputs_segment_ids=jnp.asarray([[1] * 5 + [2] * 4, [1] * 9]),
        targets_segment_ids=jnp.asarray([[1] * 4 + [2] * 3, [1] * 7]),
        inputs_positions=jnp.asarray([list(range(5)) + list(range(4)), list(range(9))]),
        targets_positions=jnp.asarray([list(range(4)) + list(range(3)), list(range(7))]),
    )
    want, _ = lm.apply({"params": params}, inputs, targets, **packed)
    close(model(inputs, targets, **packed)[0], want)


# T5 (its bias against the cache's slots) in both layouts, the paper's model scanned
@pytest.mark.parametrize("name, scan_layers", [("t5", False), ("t5", True), ("paper", True)])
def test_encode_then_decode_with_the_explicit_cache_matches_linen(name, scan_layers):
    lm, model, params = _pair(name, scan_layers)
    inputs, targets = _batch()
    variables = {"params": params}
    encoded = model.encode(inputs)
    close(encoded, lm.apply(variables, inputs, method="encode"))
    want_cache, cache = lm.init_cache(2, 8), model.init_cache(2, 8)
    tokens = jnp.pad(targets, ((0, 0), (1, 0)))[:, :7]  # shifted right
    for step in (tokens[:, :3], tokens[:, 3:4], tokens[:, 4:7]):
        (want, _), want_cache = lm.apply(
            variables, encoded, inputs, step, decode=True, cache=want_cache, method="decode"
        )
        (got, _), cache = model.decode(encoded, inputs, step, decode=True, cache=cache)
        close(got, want)
    jax.tree.map(close, cache, want_cache)
    # The last step's logits are those of the teacher-forced pass (no target padding there).
    full, _ = model.decode(encoded, inputs, tokens)
    close(got, full[:, 4:7])


def test_dropout_in_training_only_and_errors():
    _, model = _models("t5", True, dropout_rate=0.5)
    inputs, targets = _batch()
    evaluated, _ = model(inputs, targets)
    first, _ = model(inputs, targets, train=True, rngs=nnx.Rngs(dropout=3))
    again, _ = model(inputs, targets, train=True, rngs=nnx.Rngs(dropout=3))
    close(first, again)
    assert not np.allclose(first, evaluated)
    with pytest.raises(ValueError, match="decode=True: tfjax.nnx decodes with the explicit cache"):
        model.decode(model.encode(inputs), inputs, targets[:, :1], decode=True)
    with pytest.raises(ValueError, match="Transformer.position must be one of"):
        transformer.Model("tiny", vocab_size=VOCAB, position="learned", rngs=nnx.Rngs(0))


def test_flan_t5_preset_has_linens_tree():
    lm = linen.Model("flan-t5-small", scan_layers=True)
    model = nnx.eval_shape(lambda: models.from_linen(lm, rngs=nnx.Rngs(0)))
    assert isinstance(model, transformer.Transformer)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens, tokens))["params"]
    assert_same_tree(params, model)
