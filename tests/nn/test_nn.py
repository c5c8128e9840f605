"""Positions, masks, FFN, embeddings and blocks against their formulas."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import nn as tnn
from tfjax.nn import masks, position


def test_sinusoidal_is_the_papers_formula():
    d, positions = 16, np.arange(50)
    pe = np.asarray(tnn.sinusoidal(positions, d))
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


def test_sincos_2d_layout():
    pe = np.asarray(tnn.sincos_2d(3, 4, 8))
    assert pe.shape == (12, 8)
    # Row-major grid: patch (y=1, x=2) is row 6; its first quarter is sin(y * omega).
    omega = 1.0 / 10000 ** (np.arange(2) / 1)
    np.testing.assert_allclose(pe[6, :2], np.sin(1 * omega), atol=1e-6)
    np.testing.assert_allclose(pe[6, 4:6], np.sin(2 * omega), atol=1e-6)


def test_rope_is_a_rotation_that_encodes_relative_position():
    x = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    y = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    # Norm preserved.
    r = position.rope(x, jnp.array([[5]]))
    np.testing.assert_allclose(jnp.linalg.norm(r), jnp.linalg.norm(x), rtol=1e-5)

    # <rope(x, m), rope(y, n)> depends on m - n only.
    def dot(m, n):
        return float(
            jnp.sum(position.rope(x, jnp.array([[m]])) * position.rope(y, jnp.array([[n]])))
        )

    assert dot(3, 1) == pytest.approx(dot(10, 8), abs=1e-4)
    assert dot(3, 1) != pytest.approx(dot(3, 2), abs=1e-4)
    # Pair (i, i + H/2) rotated by pos * base^(-2i/H): check channel 0 by hand.
    pos, h = 5, 8
    c, s = math.cos(pos), math.sin(pos)
    want = x[0, 0, 0, 0] * c - x[0, 0, 0, h // 2] * s
    assert float(r[0, 0, 0, 0]) == pytest.approx(float(want), abs=1e-5)


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(position.alibi_slopes(8), [2 ** -(i + 1) for i in range(8)])
    s = position.alibi_slopes(6)  # 4 from the power of two below, 2 interleaved from 8
    np.testing.assert_allclose(s, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    b = position.alibi_bias(2, jnp.arange(3), jnp.arange(3))
    assert b.shape == (1, 2, 3, 3)
    assert float(b[0, 0, 2, 0]) == pytest.approx(-2 * position.alibi_slopes(2)[0])


def test_masks():
    tokens = jnp.array([[5, 6, 0]])
    pm = masks.padding_mask(tokens)
    assert pm.shape == (1, 1, 3, 3) and pm[0, 0].tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    segs = jnp.array([[1, 1, 2, 0]])
    sm = masks.segment_mask(segs)[0, 0]
    assert sm.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    cm = masks.combine_masks(masks.segment_mask(segs), masks.causal_mask(4), None)[0, 0]
    assert cm.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert masks.combine_masks(None, None) is None


def test_block_masks_tile_the_full_mask():
    """Blocks of queries and keys (as the chunked kernel and the KV cache build them) give the
    pieces of the full causal and segment mask; nothing to mask gives None."""
    segs = jnp.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 0, 0]])
    full = masks.combine_masks(masks.segment_mask(segs), masks.causal_mask(6))
    pos = jnp.arange(6)
    for q, k in (
        (slice(0, 6), slice(0, 6)),
        (slice(2, 5), slice(0, 4)),
        (slice(4, 6), slice(3, 6)),
    ):
        block = masks.block_mask(
            pos[q], pos[k], is_causal=True, segment_ids=segs[:, q], kv_segment_ids=segs[:, k]
        )
        np.testing.assert_array_equal(block, full[:, :, q, k])
    np.testing.assert_array_equal(
        masks.block_mask(pos + 2, pos, is_causal=True), masks.causal_mask(6, offset=2)
    )
    assert masks.block_mask(pos, pos) is None
    logits = jnp.ones((1, 1, 6, 6))
    masked = masks.masked_logits(logits, masks.causal_mask(6))
    assert masked[0, 0, 0, 1] == masks.MASKED_LOGIT and masked[0, 0, 1, 0] == 1.0
    assert masks.masked_logits(logits, None) is logits


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh"])
def test_mlp_formula(act):
    mlp = tnn.Mlp(tnn.MlpConfig(12, act))
    x = jax.random.normal(jax.random.key(0), (2, 3, 5))
    p = jax.tree.map(np.asarray, nn.unbox(mlp.init(jax.random.key(1), x))["params"])
    fn = {
        "relu": lambda h: np.maximum(h, 0),
        "gelu": lambda h: jax.nn.gelu(h, approximate=False),
        "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
    }[act]
    want = fn(x @ p["wi"]["kernel"] + p["wi"]["bias"]) @ p["wo"]["kernel"] + p["wo"]["bias"]
    np.testing.assert_allclose(mlp.apply({"params": p}, x), want, atol=1e-5)


@pytest.mark.parametrize(
    "act,fn", [("swiglu", jax.nn.silu), ("geglu", lambda h: jax.nn.gelu(h, approximate=False))]
)
def test_gated_mlp_formula(act, fn):
    mlp = tnn.GatedMlp(tnn.MlpConfig(12, act, use_bias=False))
    x = jax.random.normal(jax.random.key(0), (2, 3, 5))
    p = jax.tree.map(np.asarray, nn.unbox(mlp.init(jax.random.key(1), x))["params"])
    want = (fn(x @ p["wi_0"]["kernel"]) * (x @ p["wi_1"]["kernel"])) @ p["wo"]["kernel"]
    np.testing.assert_allclose(mlp.apply({"params": p}, x), want, atol=1e-5)


def test_gelu_is_the_exact_gelu_in_value_gradient_and_dtype():
    x = jnp.linspace(-12.0, 12.0, 4001)
    np.testing.assert_allclose(tnn.gelu(x), jax.nn.gelu(x, approximate=False), atol=1e-6)
    grad = jax.vmap(jax.grad(tnn.gelu))(x)
    want = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(x)
    np.testing.assert_allclose(grad, want, atol=1e-6)
    # Phi(1) = 0.8413447460685429 (the normal CDF)
    np.testing.assert_allclose(tnn.gelu(jnp.float32(1.0)), 0.8413447460685429, rtol=1e-6)
    assert tnn.gelu(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_ffn_bad_activation():
    with pytest.raises(ValueError, match="activation='tanh' is unknown"):
        tnn.Mlp(tnn.MlpConfig(4, "tanh"))
    with pytest.raises(ValueError, match="activation='relu' is unknown"):
        tnn.GatedMlp(tnn.MlpConfig(4, "relu"))


def test_embed_scales_and_ties():
    emb = tnn.Embed(vocab_size=10, width=16, scale_by_sqrt_width=True)
    ids = jnp.array([[1, 2, 3]])
    v = emb.init(jax.random.key(0), ids)
    table = nn.unbox(v)["params"]["embedding"]
    np.testing.assert_allclose(emb.apply(v, ids), table[ids] * 4.0, rtol=1e-6)
    x = jax.random.normal(jax.random.key(1), (1, 3, 16))
    np.testing.assert_allclose(emb.apply(v, x, method="attend"), x @ table.T, rtol=1e-5)
    with pytest.raises(ValueError, match="token ids must be integers"):
        emb.apply(v, ids.astype(jnp.float32))


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_block_residual_layout(norm_position):
    """With attention and FFN outputs zeroed, a block reduces to its residual/norm skeleton."""
    config = tnn.BlockConfig(
        tnn.AttentionConfig(2), tnn.MlpConfig(8), norm_position=norm_position, norm="rms"
    )
    blk = tnn.Block(config)
    x = jax.random.normal(jax.random.key(0), (1, 4, 6)) * 3 + 1
    params = nn.unbox(blk.init(jax.random.key(1), x))["params"]
    zero = jax.tree_util.tree_map_with_path(
        lambda path, a: (
            jnp.zeros_like(a) if "out_kernel" in str(path) or "'wo'" in str(path) else a
        ),
        params,
    )
    y = blk.apply({"params": zero}, x)
    rms = lambda a: a / np.sqrt(np.mean(np.square(a), -1, keepdims=True) + 1e-6)  # noqa: E731
    np.testing.assert_allclose(y, x if norm_position == "pre" else rms(rms(x)), atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_and_unrolled_stacks_agree(remat):
    blk = tnn.BlockConfig(tnn.AttentionConfig(4, position="rope"), tnn.MlpConfig(32), causal=True)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    unrolled = tnn.Stack(blk, 3, remat_policy=remat)
    scanned = tnn.Stack(blk, 3, scan_layers=True, remat_policy=remat)
    p_scan = nn.unbox(scanned.init(jax.random.key(1), x))["params"]
    p_unr = tnn.scanned_to_unrolled(p_scan)
    assert set(p_unr) == {"layers_0", "layers_1", "layers_2", "final_norm"}
    y_scan = scanned.apply({"params": p_scan}, x)
    y_unr = unrolled.apply({"params": p_unr}, x)
    np.testing.assert_allclose(y_scan, y_unr, atol=1e-5)
    # Round trip is exact, and gradients agree too.
    back = tnn.unrolled_to_scanned(p_unr)
    assert jax.tree.all(jax.tree.map(np.array_equal, back, p_scan))
    g_scan = jax.grad(lambda p: scanned.apply({"params": p}, x).sum())(p_scan)
    g_unr = jax.grad(lambda p: unrolled.apply({"params": p}, x).sum())(p_unr)
    for a, b in zip(
        jax.tree.leaves(tnn.scanned_to_unrolled(g_scan)), jax.tree.leaves(g_unr), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_scanned_params_carry_the_layers_axis():
    blk = tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(32))
    v = tnn.Stack(blk, 3, scan_layers=True).init(jax.random.key(0), jnp.ones((1, 2, 16)))
    spec = nn.get_partition_spec(v)["params"]["layers"]["mlp"]["wi"]["kernel"]
    assert tuple(spec) == ("layers", "embed", "mlp")


def test_stack_bad_fields():
    blk = tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(32))
    with pytest.raises(ValueError, match="remat_policy='some' is unknown"):
        tnn.Stack(blk, 2, remat_policy="some")
    with pytest.raises(ValueError, match="norm_position='middle' is unknown"):
        tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(8), norm_position="middle")
    with pytest.raises(ValueError, match="norm='batch' is unknown"):
        tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(8), norm="batch")
