"""The nn pieces Gemma needs, against plain jnp formulas: RMSNorm with (1 + w), soft-capped
attention (xla and chunked, forward and gradients), the kernels' refusals, layer variants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import nn as tnn
from tfjax.models import decoder
from tfjax.nn import attention, norms


def test_rms_norm_plus_one_is_the_formula():
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    w = 0.5 * jax.random.normal(jax.random.key(1), (8,))
    module = norms.make_norm(
        "rms_plus_one", eps=1e-6, dtype=None, param_dtype=jnp.float32, name="n"
    )
    got = module.apply({"params": {"scale": w}}, x)
    want = x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * (1 + w)
    np.testing.assert_allclose(got, want, atol=1e-6)
    init = tnn.blocks.nn.unbox(module.init(jax.random.key(0), x))["params"]["scale"]
    assert not init.any()  # the identity at init


def _plain(q, k, v, cap, window):
    """softmax(cap * tanh(q k^T / sqrt(H) / cap), causal, windowed) v, multi-head (K = N)."""
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = cap * jnp.tanh(logits / cap)
    t = jnp.arange(q.shape[1])
    allowed = (t[:, None] >= t[None]) & (t[:, None] - t[None] < window)
    weights = jax.nn.softmax(jnp.where(allowed, logits, -1e30), -1)
    return jnp.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_soft_capped_attention_is_the_formula_with_its_gradients(implementation):
    q, k, v = (3.0 * jax.random.normal(jax.random.key(i), (2, 11, 2, 8)) for i in range(3))

    def ours(q, k, v):
        return tnn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            window=4,
            softcap=2.0,
            implementation=implementation,
            chunk_size=4,
        )

    def plain(q, k, v):
        return _plain(q, k, v, 2.0, 4)

    np.testing.assert_allclose(ours(q, k, v), plain(q, k, v), atol=2e-6)
    g_ours = jax.grad(lambda *a: (ours(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    g_plain = jax.grad(lambda *a: (plain(*a) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ours, g_plain, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-5)


def test_kernels_refuse_a_soft_cap_by_name_and_the_automatic_choice_falls_back():
    q = jnp.zeros((1, 2048, 2, 128), jnp.bfloat16)
    assert "softcap" in attention.cudnn_unsupported_reason(q, q, platform="gpu", softcap=50.0)
    assert "soft cap" in tnn.splash.unsupported_reason(
        mask=None, bias=None, dropout_rate=0.0, softcap=50.0
    )
    assert attention.choose_implementation(q, q, platform="tpu", softcap=50.0) == "xla"
    assert attention.choose_implementation(q, q, platform="gpu", softcap=50.0) == "xla"
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        tnn.dot_product_attention(q, q, q, softcap=-1.0)


def test_scanned_and_unrolled_layer_variants_agree():
    """Gemma 3's pattern over 7 layers (a period of 6 and one more): local and global layers
    with their own RoPE, scanned by index, give the unrolled numbers."""
    kw = dict(
        variant="gemma-3-1b",
        vocab_size=50,
        width=32,
        num_layers=7,
        num_heads=4,
        head_dim=8,
        mlp_dim=48,
        sliding_window=3,
        rope_base=1000.0,
    )
    unrolled, scanned = decoder.Model(**kw), decoder.Model(**kw, scan_layers=True)
    assert unrolled.layer_variants()[1] == (0, 0, 0, 0, 0, 1, 0)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 50)
    params = jax.tree.map(
        lambda p: p + 0.2 * jax.random.normal(jax.random.key(1), p.shape),
        tnn.blocks.nn.unbox(unrolled.init(jax.random.key(0), tokens)["params"]),
    )
    a, _ = unrolled.apply({"params": params}, tokens)
    b, _ = scanned.apply({"params": tnn.unrolled_to_scanned(params)}, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)
    c, _ = unrolled.clone(local_rope_base=None).apply({"params": params}, tokens)
    assert np.abs(np.asarray(a - c)).max() > 1e-3  # the local layers' own RoPE base acts


def test_attention_pattern_is_checked():
    with pytest.raises(ValueError, match="attention_pattern=.*one of \\('local', 'global'\\)"):
        decoder.Model(vocab_size=8, attention_pattern=("sliding",))
    with pytest.raises(ValueError, match="local layers, which need sliding_window"):
        decoder.Model(vocab_size=8, attention_pattern=("local", "global"))
