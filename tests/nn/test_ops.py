"""tfjax.ops: maths without Flax, the layer configs (checked once, hashable), the explicit KV
cache of a single attention layer."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import nn as tnn
from tfjax.ops import AttentionConfig, BlockConfig, KVCache, LayerAttention, MlpConfig, init_cache


def test_import_loads_no_flax():
    code = (
        "import sys, tfjax.ops\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'flax']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_configs_are_hashable_values_and_vary_by_replace():
    block = BlockConfig(
        AttentionConfig(4, num_kv_heads=2, position="rope", variants=(LayerAttention(8),)),
        MlpConfig(32, "swiglu", use_bias=False),
        causal=True,
    )
    same = BlockConfig(
        AttentionConfig(4, num_kv_heads=2, position="rope", variants=(LayerAttention(8),)),
        MlpConfig(32, "swiglu", use_bias=False),
        causal=True,
    )
    assert block == same and hash(block) == hash(same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.causal = False  # type: ignore[misc]
    cross = block.attention.for_cross_attention()
    assert cross.position is None and cross.variants == (LayerAttention(),)
    assert cross.num_kv_heads == 2 and block.mlp.gated and not MlpConfig(8).gated
    assert dataclasses.replace(block, norm="rms").norm == "rms"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: AttentionConfig(4, num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (lambda: AttentionConfig(4, position="xpos"), "position='xpos' is unknown; allowed"),
        (lambda: AttentionConfig(4, qk_norm_kind="l2"), "qk_norm_kind='l2' is unknown"),
        (lambda: AttentionConfig(4, softcap=0.0), "softcap must be a positive number"),
        (lambda: AttentionConfig(4, implementation="flash"), "implementation='flash'"),
        (lambda: AttentionConfig(4, variants=()), "variants must be a non-empty tuple"),
        (lambda: AttentionConfig(4, dropout_rate=1.0), r"dropout_rate must be in \[0, 1\)"),
        (lambda: LayerAttention(0), "sliding_window must be a positive int"),
        (lambda: MlpConfig(8, "tanh"), "activation='tanh' is unknown; allowed"),
        (lambda: BlockConfig(AttentionConfig(4), MlpConfig(8), norm="batch"), "norm='batch'"),
        (lambda: BlockConfig(AttentionConfig(4), 8), "mlp must be a MlpConfig"),
    ],
)
def test_configs_name_the_field_and_what_is_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("position", [None, "rope", "alibi"])
def test_attention_explicit_cache_equals_the_collection(position):
    config = AttentionConfig(
        4, num_kv_heads=2, position=position, variants=(LayerAttention(sliding_window=3),)
    )
    mha = tnn.MultiHeadAttention(config)
    x = jax.random.normal(jax.random.key(0), (2, 7, 16))
    params = mha.init(jax.random.key(1), x)["params"]
    collection = mha.init(jax.random.key(1), x, decode=True)["cache"]
    cache = init_cache(config, 2, 7, 16)
    assert isinstance(cache, KVCache) and cache.keys.shape == (2, 7, 2, 4)
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        want, mut = mha.apply(
            {"params": params, "cache": collection}, x[:, lo:hi], decode=True, mutable=["cache"]
        )
        collection = mut["cache"]
        got, cache = mha.apply({"params": params}, x[:, lo:hi], decode=True, cache=cache)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache.keys, collection["cached_key"])
    assert int(cache.index) == 7
    with pytest.raises(ValueError, match="a cache is for self-attention with decode=True"):
        mha.apply({"params": params}, x, cache=cache)


def test_dot_product_attention_is_the_same_function_in_ops_and_nn():
    from tfjax import ops

    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 4))
    a = ops.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_array_equal(a, tnn.dot_product_attention(q, q, q, is_causal=True))
    assert jnp.issubdtype(a.dtype, jnp.floating)


def test_head_matmul_gives_autodiffs_gradients_made_together():
    """tfjax.ops.head.matmul: autodiff's numbers; an optimization barrier over the input's and
    the kernel's gradients, and with a frozen kernel no kernel gradient at all."""
    from tfjax.ops import head

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)

    def loss(x, w, matmul):
        return jnp.sum(jnp.sin(matmul(x, w)))

    plain = lambda x, w: jnp.einsum("btd,dv->btv", x, w)  # noqa: E731
    want = jax.grad(loss, (0, 1))(x, w, plain)
    got = jax.grad(loss, (0, 1))(x, w, head.matmul)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(x, w, head.matmul), want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss, 1)(x, w, head.matmul), want[1], rtol=1e-6, atol=1e-6)
    both = str(jax.make_jaxpr(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, head.matmul))
    frozen = str(jax.make_jaxpr(jax.grad(loss), static_argnums=2)(x, w, head.matmul))
    assert "optimization_barrier" in both
    assert "optimization_barrier" not in frozen and frozen.count("dot_general") == 2  # fwd, dx
