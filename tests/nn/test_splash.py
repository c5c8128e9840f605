"""Splash attention, segment ids and the backend chosen for the target.

Numerics of the TPU kernel run in Pallas's interpret mode on the CPU, against a float64
NumPy reference; the same calls compile for a v5e slice with libtpu's compiler.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import sharding
from tfjax.nn import attention, masks
from tfjax.nn.attention import dot_product_attention
from tfjax.ops import splash
from tfjax.runner import aot


def reference64(q, k, v, allowed):
    """softmax(Q K^T / sqrt(H)) V in float64, kv heads repeated; `allowed` [B, 1, T, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    peak = np.max(logits, axis=-1, keepdims=True)
    w = np.exp(logits - np.where(np.isfinite(peak), peak, 0.0))
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bnts,bsnh->btnh", w, v)


def inputs(b, t, s, n, kh, h=64, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((b, t, n, h)).astype(np.float32)
    k, v = (r.standard_normal((b, s, kh, h)).astype(np.float32) for _ in range(2))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def packed_ids(b, t, seed=0):
    """[B, T] ids: row 0 three packed examples, row 1 one example then right padding (0)."""
    ids = np.zeros((b, t), np.int32)
    ids[0, : t // 3], ids[0, t // 3 : 2 * t // 3], ids[0, 2 * t // 3 :] = 1, 2, 3
    ids[1, : t - 5] = 1
    return jnp.asarray(ids)


def allowed_pattern(q_ids, kv_ids, t, s, is_causal):
    allowed = np.ones((q_ids.shape[0], 1, t, s), bool)
    if q_ids is not None:
        allowed &= np.asarray(masks.segment_mask(q_ids, kv_ids))
    if is_causal:
        allowed &= np.arange(s)[None, :] <= np.arange(t)[:, None]
    return allowed


def real_rows(q_ids):
    """[B, T, 1, 1]: queries that attend somewhere (padding rows are unspecified)."""
    return np.asarray(q_ids != 0)[:, :, None, None]


CASES = {  # (T, S, N, K, causal, packed): odd lengths, not multiples of a block
    "causal-packed-gqa": (37, 37, 4, 2, True, True),
    "full-padded-mqa": (29, 29, 4, 1, False, True),
    "causal-mha": (131, 131, 2, 2, True, False),
    "cross-t<s": (19, 45, 2, 1, False, True),
    "causal-t<s": (21, 40, 2, 2, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_matches_float64_reference(case):
    t, s, n, kh, is_causal, packed = CASES[case]
    q, k, v = inputs(2, t, s, n, kh)
    q_ids = packed_ids(2, t) if packed else jnp.ones((2, t), jnp.int32)
    kv_ids = packed_ids(2, s) if packed else jnp.ones((2, s), jnp.int32)
    kw = dict(is_causal=is_causal, implementation="splash")
    if packed:
        kw.update(segment_ids=q_ids, kv_segment_ids=kv_ids)
    want = reference64(q, k, v, allowed_pattern(q_ids, kv_ids, t, s, is_causal))
    real = real_rows(q_ids)

    def loss(q, k, v, impl):
        out = dot_product_attention(q, k, v, **(kw | {"implementation": impl}))
        return jnp.sum(jnp.where(real, out, 0.0) * jnp.cos(jnp.arange(out.shape[-1]))), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v, "splash")
    np.testing.assert_allclose(np.where(real, out, 0.0), np.where(real, want, 0.0), atol=2e-6)
    # Gradients against the plain formula's (float32, the same masks as a dense array).
    dense = jnp.asarray(allowed_pattern(q_ids, kv_ids, t, s, is_causal))

    def plain(q, k, v):
        out = dot_product_attention(q, k, v, mask=dense, implementation="xla")
        return jnp.sum(jnp.where(real, out, 0.0) * jnp.cos(jnp.arange(out.shape[-1])))

    expected = jax.grad(plain, (0, 1, 2))(q, k, v)
    for got, exp in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, exp, atol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "chunked", None])
def test_segment_ids_equal_the_dense_segment_mask(implementation):
    """Ids in, no [T, S] mask: the same outputs and gradients as masks.segment_mask."""
    t, n, kh = 23, 4, 2
    q, k, v = inputs(2, t, t, n, kh, h=8)
    ids = packed_ids(2, t)
    dense = masks.segment_mask(ids)
    real = real_rows(ids)

    def loss(q, k, v, **kw):
        out = dot_product_attention(
            q, k, v, is_causal=True, chunk_size=8, implementation=implementation, **kw
        )
        return jnp.sum(jnp.where(real, out, 0.0) ** 2)

    a = jax.value_and_grad(loss, (0, 1, 2))(q, k, v, segment_ids=ids)
    b = jax.value_and_grad(loss, (0, 1, 2))(q, k, v, mask=dense)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def _largest_boolean(text: str) -> int:
    """Elements of the largest boolean (pred) array in compiled HLO text."""
    sizes = [
        math.prod(int(d) for d in dims.split(",")) for dims in re.findall(r"pred\[([\d,]+)\]", text)
    ]
    return max(sizes, default=0)


def test_chunked_segment_ids_build_no_full_mask():
    """The chunked path with ids holds no [B, T, S]-sized boolean anywhere in its program (a
    dense mask is chunked whole: B T S booleans)."""
    b, t = 2, 1024
    q, k, v = inputs(b, t, t, 2, 2, h=8)  # N = 2 heads, chunks of C = 64 keys
    ids = packed_ids(b, t)

    def compiled(**kw):
        def f(q, k, v):
            out = dot_product_attention(
                q, k, v, is_causal=True, chunk_size=64, implementation="chunked", **kw
            )
            return out.sum()

        return jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v).compile().as_text()

    # At most one chunk's pattern for all heads, [B, N, T, C], inside the loop.
    assert _largest_boolean(compiled(segment_ids=ids)) <= b * 2 * t * 64
    assert _largest_boolean(compiled(mask=masks.segment_mask(ids))) >= b * t * t


def test_splash_refuses_what_it_cannot_compute():
    q, k, v = inputs(1, 8, 8, 2, 2, h=8)
    with pytest.raises(ValueError, match="splash.*dense mask"):
        dot_product_attention(q, k, v, mask=masks.causal_mask(8), implementation="splash")
    with pytest.raises(ValueError, match="splash.*bias"):
        dot_product_attention(q, k, v, bias=jnp.zeros((1, 1, 8, 8)), implementation="splash")
    with pytest.raises(ValueError, match="splash.*dropout"):
        dot_product_attention(
            q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="splash"
        )
    with pytest.raises(ValueError, match=r"segment_ids \[B, T\] must be integers"):
        dot_product_attention(q, k, v, segment_ids=jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="need kv_segment_ids"):
        dot_product_attention(q, k[:, :4], v[:, :4], segment_ids=jnp.ones((1, 8), jnp.int32))


def _mesh(topology, **sizes):
    return sharding.make_mesh(sizes, aot.topology_devices(topology))


def _chosen(mesh, t, dtype=jnp.bfloat16, **kw):
    q = jnp.zeros((2, t, 4, 64), dtype)
    with sharding.logical_context(mesh, sharding.DEFAULT_RULES):
        return attention.choose_implementation(q, q, **kw)


def test_the_target_chooses_the_backend_not_the_host():
    tpu = _mesh("v5e:2x2", data=-1)
    gpu = _mesh("h100:8", data=-1)
    cpu = sharding.make_mesh({"data": -1})
    n = attention.SPLASH_MIN_LENGTH
    assert _chosen(tpu, n) == "splash"
    assert _chosen(tpu, n // 2) == "xla"
    assert _chosen(tpu, attention.CHUNKED_MIN_LENGTH, mask=jnp.ones((1, 1, 1, 1), bool)) == (
        "chunked"
    )
    assert _chosen(gpu, 256) == "cudnn"
    assert _chosen(gpu, 256, dtype=jnp.float32) == "xla"  # cuDNN takes bf16/fp16 only
    assert _chosen(gpu, 197) == "xla"  # a ViT's 196 + 1 tokens: cuDNN's backward refuses odd T
    assert _chosen(cpu, n) == "xla"
    assert _chosen(cpu, attention.CHUNKED_MIN_LENGTH) == "chunked"


def _compiled_attention(
    mesh, implementation, *, b=8, t=2048, n=8, kh=2, h=128, bias=False, sinks=False
):
    """The text of a compiled forward + backward of causal packed attention on `mesh`; with
    `bias`, a float32 [1, N, T, T] logit bias (T5's relative one) and its gradient too; with
    `sinks`, float32 attention sinks [N] and their gradient."""
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def loss(q, k, v, ids, *extra):
        with sharding.logical_context(mesh, sharding.DEFAULT_RULES):
            out = dot_product_attention(
                q,
                k,
                v,
                segment_ids=ids,
                is_causal=True,
                bias=extra[0] if bias else None,
                sinks=extra[0] if sinks else None,
                implementation=implementation,
            )
            return jnp.sum(out.astype(jnp.float32))

    args = [
        jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=batch)
        for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h))
    ]
    args.append(jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=batch))
    if bias:
        args.append(jax.ShapeDtypeStruct((1, n, t, t), jnp.float32, sharding=replicated))
    if sinks:
        args.append(jax.ShapeDtypeStruct((n,), jnp.float32, sharding=replicated))
    wrt = (0, 1, 2, 4) if bias or sinks else (0, 1, 2)
    return jax.jit(jax.grad(loss, wrt)).lower(*args).compile().as_text()


@pytest.mark.parametrize("implementation", ["splash", None])
def test_splash_compiles_for_a_tpu_slice_per_shard(implementation):
    """Forward and backward kernels compile for v5e:2x2 with batch and heads sharded, and the
    batch is not gathered onto every chip (the kernel runs per shard)."""
    text = _compiled_attention(_mesh("v5e:2x2", data=2, tensor=2), implementation)
    assert "tpu_custom_call" in text
    assert "all-gather" not in text


def test_gpu_compile_from_this_host_uses_cudnn():
    """With cuDNN's library installed (make install-dev), an H100 compile on this CPU host runs
    cuDNN's fused attention forward and backward, as a run on the GPU would."""
    text = _compiled_attention(_mesh("h100:8", data=-1), None)
    assert "__cudnn$fmha" in text


def test_gpu_compile_takes_cudnn_with_a_relative_bias():
    """T5's float32 [1, N, T, T] relative bias (and its gradient) goes through cuDNN's fused
    attention with bf16 q, k, v, where splash refuses a bias."""
    mesh = _mesh("h100:8", data=-1)
    q = jnp.zeros((8, 256, 8, 64), jnp.bfloat16)
    bias = jnp.zeros((1, 8, 256, 256), jnp.float32)
    with sharding.logical_context(mesh, sharding.DEFAULT_RULES):
        assert attention.choose_implementation(q, q, bias=bias) == "cudnn"
    text = _compiled_attention(mesh, None, t=256, kh=8, h=64, bias=True)
    assert "__cudnn$fmha" in text


def test_attention_sinks_keep_cudnn_out_and_splash_in():
    """jax.nn's cuDNN attention has no sinks: the automatic choice for an H100 passes it over
    and an explicit request is refused by name; the splash kernel takes them, chosen for a TPU
    and compiled per shard with the heads (and the sinks) split over tensor."""
    gpu, tpu = _mesh("h100:8", data=-1), _mesh("v5e:2x2", data=-1)
    sinks = jnp.zeros((4,))
    assert _chosen(gpu, 256) == "cudnn"
    assert _chosen(gpu, 256, sinks=sinks) == "xla"
    assert _chosen(tpu, attention.SPLASH_MIN_LENGTH, sinks=sinks) == "splash"
    q = jnp.zeros((2, 256, 4, 64), jnp.bfloat16)
    with sharding.logical_context(gpu, sharding.DEFAULT_RULES):
        with pytest.raises(
            ValueError,
            match=r'implementation="cudnn" is not available: jax.nn.dot_product_attention has '
            r"no attention sinks",
        ):
            dot_product_attention(q, q, q, sinks=sinks, implementation="cudnn")
    text = _compiled_attention(_mesh("v5e:2x2", data=2, tensor=2), "splash", sinks=True)
    assert "tpu_custom_call" in text
    assert "all-gather" not in text


def test_a_kernel_built_inside_one_jit_serves_the_next():
    """The kernel of a shape is built once and cached; built while a jit traces (a train step),
    its block masks must be constants, not that trace's values, or the next jit of the same
    shapes (the eval step) fails with an escaped tracer."""
    splash._make_kernel.cache_clear()
    q, k, v = inputs(1, 24, 24, 2, 2, h=8)

    def attend(q, k, v):
        return dot_product_attention(q, k, v, is_causal=True, implementation="splash")

    first = jax.jit(attend)(q, k, v)
    second = jax.jit(lambda q, k, v: 2.0 * attend(q, k, v))(q, k, v)  # another trace
    np.testing.assert_allclose(second, 2.0 * first, rtol=1e-6)
