"""tfjax's Linen modules inside a user's Flax NNX model, through `flax.nnx.bridge.ToNNX`.

tfjax parameters carry logical axis names (`nn.with_logical_partitioning`). The bridge turns
each into an `nnx.Param` whose `out_sharding` metadata holds those names, and with NNX's eager
sharding on (the default) it shards every variable as it is created, which needs a mesh and
rules that map the names onto it. So a model is built either
  * without a mesh, under `nnx.use_eager_sharding(False)`: the names stay as metadata only; or
  * on a mesh, under `jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)`: every parameter
    is created already sharded, by the user's rules for tfjax's logical names.
Either way the modules compute exactly what the Linen modules compute with the same parameters.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax import nn as tnn
from tfjax.models import encoder
from tfjax.nn import axes, masks

VOCAB, WIDTH, CLASSES = 50, 32, 3
ATTENTION = tnn.AttentionConfig(num_heads=4)
BLOCK = tnn.BlockConfig(ATTENTION, tnn.MlpConfig(64), norm_position="post", dropout_rate=0.1)


class Classifier(nnx.Module):
    """A user's NNX model: an NNX embedding, tfjax's MultiHeadAttention and encoder Block
    (Linen, bridged), mean pooling and an NNX head."""

    def __init__(self, *, rngs: nnx.Rngs, example_batch: int = 1):
        # Linen modules learn their shapes from an example input. On a mesh its batch must
        # divide over the data axis: tfjax constrains activations' batch axis to it.
        example = jnp.zeros((example_batch, 1, WIDTH))
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.attention = bridge.ToNNX(tnn.MultiHeadAttention(ATTENTION), rngs=rngs)
        self.attention.lazy_init(example)
        block = tnn.Block(BLOCK)
        self.block = bridge.ToNNX(block, rngs=rngs).lazy_init(example)
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, tokens, *, train: bool = False):
        mask = masks.padding_mask(tokens)  # [B, 1, T, T]
        x = self.embed(tokens)  # [B, T, D]
        x = x + self.attention(x, mask=mask)
        x = self.block(x, mask=mask, train=train)
        return self.head(x.mean(axis=1))  # [B, C]


def _batch(seed=0, batch=8):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(1, VOCAB, (batch, 6))
    tokens[::2, 4:] = 0  # padding
    return jnp.asarray(tokens), jnp.asarray(rs.randint(0, CLASSES, batch))


def _build(seed=0) -> Classifier:
    with nnx.use_eager_sharding(False):  # no mesh: keep the logical names as metadata only
        return Classifier(rngs=nnx.Rngs(params=seed, dropout=seed + 1))


def _linen_params(bridged: bridge.ToNNX) -> dict:
    return nnx.to_pure_dict(nnx.state(bridged, nnx.Param))


def _loss(model, tokens, labels, train=False):
    logits = model(tokens, train=train)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_bridged_modules_compute_what_linen_computes():
    model = _build()
    tokens, _ = _batch()
    logits = model(tokens)
    assert logits.shape == (8, CLASSES)
    # The same parameters through the Linen modules themselves.
    mask = masks.padding_mask(tokens)
    x = model.embed(tokens)
    attention = tnn.MultiHeadAttention(ATTENTION)
    y = attention.apply({"params": _linen_params(model.attention)}, x, mask=mask)
    np.testing.assert_array_equal(model.attention(x, mask=mask), y)
    block = tnn.Block(BLOCK)
    z = block.apply({"params": _linen_params(model.block)}, x + y, mask=mask)
    np.testing.assert_array_equal(model.block(x + y, mask=mask), z)
    np.testing.assert_allclose(logits, model.head(z.mean(axis=1)), atol=1e-6, rtol=0)
    # The logical axis names travel with the NNX parameters.
    assert model.attention.query_kernel.get_metadata()["out_sharding"] == (
        axes.EMBED,
        axes.HEADS,
        axes.HEAD_DIM,
    )
    assert model.block.mlp["wi"]["kernel"].get_metadata()["out_sharding"] == (axes.EMBED, axes.MLP)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_whole_encoder_through_the_bridge(scan_layers):
    linen = encoder.Model(
        variant="tiny", vocab_size=VOCAB, head="classifier", num_classes=CLASSES
    ).clone(scan_layers=scan_layers)
    tokens, _ = _batch(1)
    with nnx.use_eager_sharding(False):
        model = bridge.ToNNX(linen, rngs=nnx.Rngs(0)).lazy_init(tokens)
    logits, aux = model(tokens)
    want, _ = linen.apply({"params": _linen_params(model)}, tokens)
    np.testing.assert_array_equal(logits, want)
    assert logits.shape == (8, CLASSES) and aux["encoded"].shape == (8, 6, 32)


@nnx.jit
def _train_step(model, optimizer, tokens, labels):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m, tokens, labels, train=True))(model)
    optimizer.update(model, grads)
    return loss


def test_one_optimizer_step_lowers_the_loss():
    model = _build()
    tokens, labels = _batch()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    before = _loss(model, tokens, labels)
    kernel = np.asarray(model.block.self_attention["query_kernel"][...])
    _train_step(model, optimizer, tokens, labels)
    after = _loss(model, tokens, labels)
    assert after < before
    # The gradients reached the tfjax parameters inside the bridge.
    assert not np.array_equal(model.block.self_attention["query_kernel"][...], kernel)


# The user's mesh has its own axis names; these rules map tfjax's logical names onto them:
# Megatron-style tensor parallelism over "model", data parallelism over "data".
USER_RULES = (
    (axes.BATCH, "data"),
    (axes.LENGTH, None),
    (axes.ACT_EMBED, None),
    (axes.ACT_HEADS, "model"),
    (axes.ACT_MLP, "model"),
    (axes.ACT_VOCAB, None),
    (axes.EMBED, None),
    (axes.MLP, "model"),
    (axes.HEADS, "model"),
    (axes.KV_HEADS, "model"),
    (axes.HEAD_DIM, None),
    (axes.VOCAB, None),
    (axes.NORM, None),
    (axes.LAYERS, None),
)


def test_sharded_on_a_user_mesh():
    # conftest asks XLA for 8 CPU devices; fewer means XLA_FLAGS was overridden.
    assert len(jax.devices()) >= 4, f"needs 4 devices, has {len(jax.devices())}"
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
    tokens, labels = _batch()
    reference = _build()
    want = reference(tokens)
    with jax.set_mesh(mesh), nn.logical_axis_rules(USER_RULES):
        model = Classifier(rngs=nnx.Rngs(params=0, dropout=1), example_batch=2)  # sharded
        assert model.attention.query_kernel[...].sharding.spec == P(None, "model", None)
        assert model.attention.out_kernel[...].sharding.spec == P("model", None, None)
        assert model.block.mlp["wi"]["kernel"][...].sharding.spec == P(None, "model")
        assert model.block.mlp["wo"]["kernel"][...].sharding.spec == P("model", None)
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        labels = jax.device_put(labels, NamedSharding(mesh, P("data")))
        got = nnx.jit(lambda m, t: m(t))(model, tokens)
        # Same seed, same initial values: the sharded model computes the same logits.
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        before = _loss(model, tokens, labels)
        _train_step(model, optimizer, tokens, labels)
        assert _loss(model, tokens, labels) < before
        # The step keeps the parameters where the rules put them.
        assert model.block.mlp["wi"]["kernel"][...].sharding.spec == P(None, "model")
