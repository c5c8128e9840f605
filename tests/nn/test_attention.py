"""Attention maths against a plain jnp reference and jax.nn.dot_product_attention."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tfjax.nn import attention, masks, position
from tfjax.nn.attention import MultiHeadAttention, dot_product_attention
from tfjax.ops.config import AttentionConfig, LayerAttention

CPU_IMPLS = ("xla", "chunked", None)


def reference(q, k, v, mask=None, bias=None):
    """softmax(Q K^T / sqrt(H) + bias) V written out per head, kv heads repeated."""
    n, kh = q.shape[2], k.shape[2]
    k = jnp.repeat(k, n // kh, axis=2)
    v = jnp.repeat(v, n // kh, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -1e30)
    w = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", w, v)


def qkv(b=2, t=7, s=7, n=4, kh=4, h=8, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (b, t, n, h), dtype),
        jax.random.normal(kk, (b, s, kh, h), dtype),
        jax.random.normal(kv, (b, s, kh, h), dtype),
    )


def make_masks(b, t):
    lengths = jnp.array([t, t - 3])[:b]
    tokens = jnp.where(jnp.arange(t)[None] < lengths[:, None], 1, 0)
    segs = jnp.array([[1] * 3 + [2] * (t - 3), [1] * 2 + [2] * 2 + [0] * (t - 4)])[:b]
    return {
        "none": None,
        "causal": masks.causal_mask(t),
        "padding": masks.key_padding_mask(tokens),
        "segment": masks.combine_masks(masks.segment_mask(segs), masks.causal_mask(t)),
    }


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "segment"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_matches_reference_and_jax(impl, kind, heads):
    n, kh = heads
    q, k, v = qkv(n=n, kh=kh, t=9, s=9)
    mask = make_masks(2, 9)[kind]
    # A chunk of 4 keys over 9 keys: several chunks and a padded last one.
    kw = {"chunk_size": 4} if impl == "chunked" else {}
    out = dot_product_attention(q, k, v, mask=mask, implementation=impl, **kw)
    ref = reference(q, k, v, mask)
    valid = np.ones(out.shape, bool)
    if kind == "segment":  # rows of padding attend to nothing: their output is unspecified
        valid[1, 4:] = False
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref)[valid], atol=1e-5)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(theirs)[valid], atol=1e-5)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_is_causal_flag_equals_causal_mask(impl):
    q, k, v = qkv(t=11, s=11)
    kw = {"chunk_size": 4} if impl == "chunked" else {}
    a = dot_product_attention(q, k, v, is_causal=True, implementation=impl, **kw)
    b = reference(q, k, v, masks.causal_mask(11))
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_bias_and_cross_lengths(impl):
    q, k, v = qkv(t=5, s=13, n=4, kh=2)
    bias = position.alibi_bias(4, jnp.arange(5), jnp.arange(13))
    kw = {"chunk_size": 4} if impl == "chunked" else {}
    out = dot_product_attention(q, k, v, bias=bias, implementation=impl, **kw)
    np.testing.assert_allclose(out, reference(q, k, v, bias=bias), atol=1e-5)


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "segment"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_chunked_gradients_match_xla(kind, heads):
    n, kh = heads
    q, k, v = qkv(n=n, kh=kh, t=9, s=9, seed=1)
    mask = make_masks(2, 9)[kind]
    bias = 0.1 * jax.random.normal(jax.random.key(3), (1, n, 9, 9))
    cot = jax.random.normal(jax.random.key(4), q.shape)

    def loss(impl, q, k, v, bias):
        out = dot_product_attention(
            q, k, v, mask=mask, bias=bias, implementation=impl, chunk_size=4
        )
        return jnp.sum(out * cot)

    g_xla = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3))(q, k, v, bias)
    g_chk = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for a, b in zip(g_xla, g_chk, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_chunked_dropout_is_consistent_in_backward():
    """The backward pass regenerates the forward's dropout pattern: check grads numerically."""
    q, k, v = qkv(b=1, t=6, s=6, n=2, kh=2, h=4)
    rng = jax.random.key(7)

    def f(q):
        out = dot_product_attention(
            q, k, v, dropout_rate=0.3, dropout_rng=rng, implementation="chunked", chunk_size=4
        )
        return jnp.sum(jnp.sin(out))

    check_grads(f, (q,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)
    # Same rng, same output; dropout changes the output.
    assert np.array_equal(f(q), f(q))
    plain = jnp.sum(jnp.sin(dot_product_attention(q, k, v, implementation="chunked")))
    assert not np.allclose(f(q), plain)


def test_fully_masked_rows_are_finite():
    q, k, v = qkv()
    mask = jnp.zeros((2, 1, 7, 7), bool)
    for impl in CPU_IMPLS:
        out = dot_product_attention(q, k, v, mask=mask, implementation=impl)
        assert np.isfinite(np.asarray(out)).all(), impl


def test_auto_uses_chunked_for_long_keys():
    q, k, v = qkv(b=1, t=4, s=attention.CHUNKED_MIN_LENGTH, n=1, kh=1, h=4)
    auto = jax.make_jaxpr(lambda *a: dot_product_attention(*a))(q, k, v)
    assert "custom_vjp_call" in str(auto)
    np.testing.assert_allclose(dot_product_attention(q, k, v), reference(q, k, v), atol=1e-5)


def test_bad_inputs_name_the_field():
    q, k, v = qkv(n=4, kh=3, h=8)
    with pytest.raises(ValueError, match="kv heads"):
        dot_product_attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="implementation='flash'.*allowed"):
        dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="rank 4"):
        dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="floating"):
        dot_product_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match="mask must be boolean"):
        dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 7, 7)))
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.1)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match='implementation="cudnn" is not available.*GPU'):
            dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        MultiHeadAttention(AttentionConfig(num_heads=4, num_kv_heads=3))
    with pytest.raises(ValueError, match="num_heads=3 must divide the width 32"):
        MultiHeadAttention(AttentionConfig(num_heads=3)).init(
            jax.random.key(0), jnp.ones((1, 2, 32))
        )
    with pytest.raises(ValueError, match="position='xpos' is unknown"):
        MultiHeadAttention(AttentionConfig(num_heads=4, position="xpos"))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_cudnn_matches_xla_on_gpu(heads):
    n, kh = heads
    q, k, v = qkv(b=2, t=128, s=128, n=n, kh=kh, h=64, dtype=jnp.bfloat16)
    a = dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    b = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)


# ---------------------------------------------------------------------------------------------
# The module.


def test_module_matches_formula_with_its_own_weights():
    mha = MultiHeadAttention(AttentionConfig(num_heads=4, num_kv_heads=2))
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    params = nn.unbox(mha.init(jax.random.key(1), x))["params"]
    p = jax.tree.map(np.asarray, params)
    q = np.einsum("btd,dnh->btnh", x, p["query_kernel"]) + p["query_bias"]
    k = np.einsum("btd,dnh->btnh", x, p["key_kernel"]) + p["key_bias"]
    v = np.einsum("btd,dnh->btnh", x, p["value_kernel"]) + p["value_bias"]
    o = reference(q, k, v, masks.causal_mask(6))
    want = np.einsum("btnh,nhd->btd", o, p["out_kernel"]) + p["out_bias"]
    got = mha.apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_self_attention_is_permutation_equivariant_without_positions():
    x = jax.random.normal(jax.random.key(0), (1, 8, 16))
    perm = jax.random.permutation(jax.random.key(1), 8)
    for pos, equivariant in ((None, True), ("rope", False), ("alibi", False)):
        mha = MultiHeadAttention(AttentionConfig(num_heads=4, position=pos))
        v = mha.init(jax.random.key(2), x)
        y, yp = mha.apply(v, x), mha.apply(v, x[:, perm])
        assert np.allclose(y[:, perm], yp, atol=1e-5) == equivariant, pos


def test_attention_weights_are_exposed_only_on_request():
    mha = MultiHeadAttention(AttentionConfig(num_heads=4))
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    v = mha.init(jax.random.key(1), x)
    y, state = mha.apply(v, x, is_causal=True, mutable=["intermediates"])
    (w,) = state["intermediates"]["attention_weights"]
    assert w.shape == (2, 4, 5, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert np.all(np.asarray(w)[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0)
    np.testing.assert_array_equal(y, mha.apply(v, x, is_causal=True))


@pytest.mark.parametrize("pos", [None, "rope", "alibi"])
@pytest.mark.parametrize("kv", [4, 1])
def test_kv_cache_matches_full_forward(pos, kv):
    mha = MultiHeadAttention(AttentionConfig(num_heads=4, num_kv_heads=kv, position=pos))
    x = jax.random.normal(jax.random.key(0), (2, 7, 16))
    params = mha.init(jax.random.key(1), x)["params"]
    full = mha.apply({"params": params}, x, is_causal=True)
    cache = mha.init(jax.random.key(1), x, decode=True)["cache"]
    # A 3-token prompt in one call, then one token at a time.
    outs = []
    for lo, hi in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
        y, mut = mha.apply(
            {"params": params, "cache": cache}, x[:, lo:hi], decode=True, mutable=["cache"]
        )
        cache = mut["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_bf16_attention_trains_with_bf16_matmuls_only(implementation):
    """Forward and backward: no matmul takes a float32 operand (JAX lowers those for GPUs as
    float32 matmuls); products still accumulate in float32."""
    from tfjax.runner import aot

    q, k, v = qkv(b=2, t=64, s=64, n=4, kh=2, h=16, dtype=jnp.bfloat16)

    def loss(q, k, v):
        out = dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation, chunk_size=16
        )
        return jnp.sum(out.astype(jnp.float32))

    stablehlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).as_text()
    assert "dot_general" in stablehlo and aot.f32_dot_fraction(stablehlo) == 0.0


@pytest.mark.parametrize("impl", ["xla", "chunked", None])
@pytest.mark.parametrize("kh", [4, 2])
def test_sliding_window_matches_the_formula_with_a_banded_mask(impl, kh):
    """window=W: query t attends keys t-W+1..t; with segment ids too; chunks of 3 keys cut the
    band at every offset."""
    q, k, v = qkv(b=2, t=11, s=11, kh=kh)
    t = np.arange(11)
    band = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] < 4)
    ids = jnp.array([[1] * 7 + [2] * 4, [1] * 9 + [0] * 2])
    same = np.asarray(masks.segment_mask(ids))
    want = reference(q, k, v, mask=jnp.asarray(band[None, None] & same))
    got = dot_product_attention(
        q, k, v, is_causal=True, window=4, segment_ids=ids, implementation=impl, chunk_size=3
    )
    rows = np.asarray(ids) != 0  # padded queries attend nothing (any output)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=1e-5)


def test_sliding_window_in_the_kv_cache_matches_the_full_forward():
    window = (LayerAttention(sliding_window=3),)
    config = AttentionConfig(num_heads=4, num_kv_heads=2, position="rope", variants=window)
    mha = MultiHeadAttention(config)
    x = jax.random.normal(jax.random.key(1), (2, 9, 16))
    params = mha.init(jax.random.key(0), x)["params"]
    full = mha.apply({"params": params}, x, is_causal=True)
    cache = mha.init(jax.random.key(0), x, decode=True)["cache"]
    steps = []
    for i in range(9):
        out, mutated = mha.apply(
            {"params": params, "cache": cache}, x[:, i : i + 1], decode=True, mutable=["cache"]
        )
        cache = mutated["cache"]
        steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)
    unwindowed = mha.clone(config=dataclasses.replace(config, variants=(LayerAttention(),)))
    unwindowed = unwindowed.apply({"params": params}, x, is_causal=True)
    assert not np.allclose(unwindowed[:, 3:], full[:, 3:], atol=1e-3)  # the window acted


def test_sliding_window_is_refused_by_splash_and_cudnn_by_name():
    q, k, v = qkv(t=8, s=8)
    with pytest.raises(ValueError, match='"splash" is not available: .*sliding window'):
        dot_product_attention(q, k, v, is_causal=True, window=4, implementation="splash")
    with pytest.raises(ValueError, match="window must be a positive int"):
        dot_product_attention(q, k, v, is_causal=True, window=0)


# ---------------------------------------------------------------------------------------------
# Attention sinks (GPT-OSS): a logit per query head in each row's denominator, with no value.


def with_sinks(q, k, v, sinks, allowed):
    """The plain formula with the sinks as one more key column whose value is dropped (as
    transformers' GPT-OSS writes it); `allowed` [B, 1, T, S]."""
    n, kh = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(allowed, logits, -1e30)
    column = jnp.broadcast_to(sinks[None, :, None, None], (*logits.shape[:3], 1))
    weights = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash", None])
def test_attention_sinks_are_the_formula_with_their_gradients(impl):
    """Grouped heads, causal, packed rows with a padded tail (whose queries attend nothing and
    give 0: all weight on the sink), a window where the kernel takes one; outputs and the
    gradients of q, k, v and the sinks. Splash runs its TPU kernel in interpret mode."""
    q, k, v = qkv(t=11, s=11, n=4, kh=2, seed=5)
    sinks = 2.0 * jax.random.normal(jax.random.key(6), (4,))
    ids = jnp.array([[1] * 7 + [2] * 4, [1] * 9 + [0] * 2])
    window = None if impl == "splash" else 4
    t = np.arange(11)
    allowed = (t[:, None] >= t[None]) & (t[:, None] - t[None] < (window or 11))
    allowed = jnp.asarray(allowed[None, None] & np.asarray(masks.segment_mask(ids)))
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def ours(q, k, v, sinks):
        return dot_product_attention(
            q,
            k,
            v,
            sinks=sinks,
            is_causal=True,
            window=window,
            segment_ids=ids,
            implementation=impl,
            chunk_size=4,
        )

    def value_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * cot), (0, 1, 2, 3)))

    want = jax.jit(with_sinks)(q, k, v, sinks, allowed)
    np.testing.assert_allclose(jax.jit(ours)(q, k, v, sinks), want, atol=2e-6)
    assert not np.asarray(want)[1, 9:].any()  # the padded queries: nothing but the sink
    _, grads = value_and_grads(ours)(q, k, v, sinks)
    _, expected = value_and_grads(lambda *a: with_sinks(*a, allowed))(q, k, v, sinks)
    for got, exp in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, exp, atol=2e-5)
    assert np.abs(grads[3]).min() > 1e-3  # every sink's gradient is there
    plain = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, window=window, implementation=impl
        )
    )(q, k, v)
    assert not np.allclose(want[0], plain[0], atol=1e-2)  # the sinks act


def test_attention_sinks_in_the_module_its_weights_and_the_kv_cache():
    """sinks=True: a "sinks" parameter [N] named by the heads' logical axis (it shards with
    them); the exposed weights sum to 1 minus the sink's share; decoding with the KV cache, a
    prompt then one token at a time, equals the full forward."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, position="rope", sinks=True)
    mha = MultiHeadAttention(config)
    x = jax.random.normal(jax.random.key(0), (2, 7, 16))
    boxed = mha.init(jax.random.key(1), x)["params"]
    assert boxed["sinks"].names == ("heads",) and boxed["sinks"].value.shape == (4,)
    params = dict(nn.unbox(boxed), sinks=jnp.array([3.0, -1.0, 0.5, 2.0]))
    full, state = jax.jit(
        lambda p: mha.apply({"params": p}, x, is_causal=True, mutable=["intermediates"])
    )(params)
    (w,) = state["intermediates"]["attention_weights"]
    sums = np.asarray(w.sum(-1))  # [B, N, T]
    assert (sums < 1).all() and (sums[:, 0] < sums[:, 1]).all()  # a larger sink takes more
    plain = MultiHeadAttention(dataclasses.replace(config, sinks=False))
    without = dict(params)
    del without["sinks"]
    assert not np.allclose(plain.apply({"params": without}, x, is_causal=True), full, atol=1e-3)
    cache = mha.init(jax.random.key(1), x, decode=True)["cache"]
    step = jax.jit(
        lambda v, x: mha.apply(v, x, decode=True, mutable=["cache"])  # prompt, then one token
    )
    outs = []
    for lo, hi in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
        y, mutated = step({"params": params, "cache": cache}, x[:, lo:hi])
        cache = mutated["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)


def test_sinks_of_the_wrong_shape_are_named():
    q = jnp.zeros((1, 3, 4, 8))
    with pytest.raises(ValueError, match=r"sinks must be one float logit per query head, shape"):
        dot_product_attention(q, q, q, sinks=jnp.zeros((2,)))
