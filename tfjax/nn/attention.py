"""Scaled dot-product attention (four backends) and the multi-head attention module.

Letters: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per kv head (N = K * G), H head dim, D model width, C key chunk length.

`dot_product_attention` computes softmax(Q K^T / sqrt(H)) V with grouped-query heads:
- "xla": the plain formula; materialises the [B, N, T, S] weights.
- "cudnn": cuDNN's fused flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16).
- "splash": the Pallas splash (flash) attention kernel for TPUs (tfjax.nn.splash): causal and
  segment-id masks, no dense mask, bias or dropout.
- "chunked": exact online softmax over key chunks with a hand-written backward pass that
  recomputes the weights chunk by chunk, so forward and backward memory grow linearly in S.
  Runs on every backend.
- None: `choose_implementation` picks one for the platform being compiled for (see there).

Packed and padded rows are best given as segment ids (`segment_ids`, `kv_segment_ids`): the
kernels compare ids block by block, where a dense [B, 1, T, S] mask is read whole.
"""

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tfjax.nn import axes, masks, position, splash

IMPLEMENTATIONS = ("xla", "cudnn", "splash", "chunked")
# With implementation=None, key lengths from here on use "chunked" (when no fused kernel
# applies): below it the [B, N, T, S] weights are small.
CHUNKED_MIN_LENGTH = 4096
# On TPUs, key lengths from here on use "splash": two of its blocks (splash.BLOCK), where a
# causal mask first lets it skip blocks (3 of 4 computed at 1,024, 10 of 16 at 2,048), while the
# plain path computes all of [T, S]; below it one block covers everything and the compiled peak
# memory of the modern-small step is the same either way (benchmarks/attention_kernels.py).
SPLASH_MIN_LENGTH = 1024
DEFAULT_CHUNK_SIZE = 512

# Masked logits get the most negative finite value, as in jax.nn and Flax: a query with every
# key masked then averages all values uniformly instead of producing NaN.
_MASKED = float(jnp.finfo(jnp.float32).min)


def _einsum_f32(spec, a, b):
    """einsum(spec, a, b) accumulated and returned in float32; for bf16 operands its backward
    pass also runs bf16 matmuls (see _einsum_f32_low)."""
    if a.dtype == b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _einsum_f32_low(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32_low(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_f32_low_fwd(spec, a, b):
    return _einsum_f32_low(spec, a, b), (a, b)


def _einsum_f32_low_bwd(spec, residuals, g):
    # The float32 cotangent is rounded to the operands' dtype: autodiff would otherwise emit
    # f32 x bf16 matmuls, which JAX lowers for GPUs as float32 matmuls (the TPU's default
    # precision rounds them to bf16 anyway, so on TPUs this changes nothing).
    a, b = residuals
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
    return vjp(g.astype(jnp.result_type(a, b)))


_einsum_f32_low.defvjp(_einsum_f32_low_fwd, _einsum_f32_low_bwd)


def _check_inputs(q, k, v, mask, bias, segment_ids, kv_segment_ids, implementation,
                  dropout_rate, dropout_rng):  # fmt: skip
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation={implementation!r} is unknown; allowed: None, "
            + ", ".join(repr(i) for i in IMPLEMENTATIONS)
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]), got {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must agree on batch (B) and head dim (H)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"the number of kv heads ({k.shape[2]}) must divide the number of query heads "
            f"({q.shape[2]})"
        )
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None and x.ndim > 4:
            raise ValueError(f"{name} must broadcast to [B, N, T, S], got shape {x.shape}")
    for name, x, shape in (("segment_ids [B, T]", segment_ids, q.shape[:2]),
                           ("kv_segment_ids [B, S]", kv_segment_ids, k.shape[:2])):  # fmt: skip
        if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{name} must be integers of shape {shape}, got {x.dtype} {x.shape}")
    if kv_segment_ids is None and segment_ids is not None and k.shape[1] != q.shape[1]:
        raise ValueError("segment_ids with keys of another length (S != T) need kv_segment_ids")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs a dropout_rng")


def target_platform() -> str:
    """ "cpu", "gpu" or "tpu": what the computation being traced is compiled for.

    The devices of the mesh in context (`tfjax.sharding.logical_context` sets it around every
    step), so that compiling for a TPU slice or a GPU node from a CPU host chooses what a run
    there would; JAX's default backend without a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def choose_implementation(q, k, *, mask=None, bias=None, dropout_rate=0.0,
                          platform: str | None = None) -> str:  # fmt: skip
    """The implementation `implementation=None` runs, for the target platform (the one place
    where that is decided): cuDNN on GPUs where it applies; from SPLASH_MIN_LENGTH keys the
    splash kernel on TPUs where it applies; from CHUNKED_MIN_LENGTH keys "chunked"; else "xla".
    """
    platform = platform or target_platform()
    s = k.shape[1]
    if platform == "gpu" and _cudnn_unsupported_reason(q, k, dropout_rate, platform) is None:
        return "cudnn"
    if (
        platform == "tpu"
        and s >= SPLASH_MIN_LENGTH
        and splash.unsupported_reason(mask=mask, bias=bias, dropout_rate=dropout_rate) is None
    ):
        return "splash"
    return "chunked" if s >= CHUNKED_MIN_LENGTH else "xla"


def _sharded_alike(q, k, v):
    """q, k and v with one layout, batch and heads split as the rules split activations (cuDNN's
    partitioner refuses others: a decode step's cached keys otherwise keep the cache's layout);
    kv heads repeated when they do not split like the query heads."""
    k, v = splash.split_like_query_heads(k, v, q.shape[2], axis=2)
    names = (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None)
    return tuple(nn.with_logical_constraint(x, names) for x in (q, k, v))


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def _cudnn_unsupported_reason(q, k, dropout_rate, platform) -> str | None:
    """Why cuDNN cannot run this call, or None when it can."""
    if platform != "gpu":
        return f"it needs a GPU and the target is {platform!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 inputs, got {q.dtype}"
    if dropout_rate > 0.0:
        return "jax.nn.dot_product_attention has no dropout"
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"it needs a head dim that is a multiple of 8 and at most 128, got {q.shape[-1]}"
    if q.shape[1] % 2 or k.shape[1] % 2:
        # jax.nn refuses it in the backward pass, traced after this function has returned.
        return f"its backward pass needs even lengths, got T={q.shape[1]}, S={k.shape[1]}"
    return None


def _group(x, num_kv_heads):
    """Broadcastable [b, n, t, s] mask or bias -> [b, k, g, t, s] for grouped heads."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def _masked_logits(logits, mask, bias, is_causal, k_offset=0, key_length=None):
    """Bias and masks applied to [B, K, G, T, C] (or [B, N, T, C]) logits whose keys start at
    k_offset; mask and bias broadcast against the logits.

    Returns (logits, allowed): `allowed` is the boolean [.., T, C] pattern of attendable
    pairs (None when everything is), which the chunked backward pass needs, as masked logits
    are constants that must receive no gradient.
    """
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    allowed = mask
    t, c = logits.shape[-2:]
    if is_causal:
        causal = (k_offset + jnp.arange(c))[None, :] <= jnp.arange(t)[:, None]
        allowed = causal if allowed is None else jnp.logical_and(allowed, causal)
    if allowed is not None:
        logits = jnp.where(allowed, logits, _MASKED)
    if key_length is not None:  # keys past the real length are padding: exactly zero weight
        logits = jnp.where(k_offset + jnp.arange(c) < key_length, logits, -jnp.inf)
    return logits, allowed


def attention_weights(q, k, *, mask=None, bias=None, is_causal=False, scale=None):
    """[B, N, T, S] softmax weights in float32 (for inspection; the "xla" path uses the same
    logits but normalises its output instead)."""
    b, t, n, _ = q.shape
    weights = jax.nn.softmax(_head_major_logits(q, k, mask, bias, is_causal, scale), axis=-1)
    return weights.reshape(b, n, t, k.shape[1])


def _head_major_logits(q, k, mask, bias, is_causal, scale):
    """Masked float32 logits [B, N, T, S] (plain multi-head) or [B, K, G, T, S] (grouped)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    scale = h**-0.5 if scale is None else scale
    # Scaled on q ([B, T, N, H]), not on the logits ([B, N, T, S]): XLA:CPU materialised the
    # scale broadcast to the logits' shape for each layer's fused QK^T (ViT-S/16 step 0.97x,
    # paired rounds). As in flax.linen's attention, the product is rounded in q's dtype.
    q = q * jnp.asarray(scale, q.dtype)
    # The matmuls run on head-major operands ([B, N, T, H], [B, K, G, T, H]): when XLA:CPU
    # folds the [B, T, N, H] layout into the dots instead, it runs them up to 1.8x slower
    # (ViT-S/16 attention forward, batch 8: 14.2 vs 7.7 ms; benchmarks/attention_layouts.py).
    # [B, K, S, H]
    kt = jnp.swapaxes(k, 1, 2)
    if kh == n:
        # Plain multi-head attention: 4-D einsums. The grouped 5-D form with G = 1 computes the
        # same, but XLA:CPU lays its [B, K, 1, T, S] operands out with extra copies of the
        # weights and their gradient (12 more [B, N, T, S] copies per step in a 6-layer
        # decoder; benchmarks/train_step_vs_torch.py).
        # [B, N, T, S]
        logits = _einsum_f32("bnth,bnsh->bnts", jnp.swapaxes(q, 1, 2), kt)
        return _masked_logits(logits, mask, bias, is_causal)[0]
    # [B, K, G, T, H]
    qg = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    # [B, K, G, T, S]
    logits = _einsum_f32("bkgth,bksh->bkgts", qg, kt)
    return _masked_logits(logits, _group(mask, kh), _group(bias, kh), is_causal)[0]


def _xla_attention(q, k, v, mask, bias, is_causal, scale, dropout_rate, dropout_rng):
    b, t, n, h = q.shape
    kh = k.shape[2]
    # [B, N, T, S] or [B, K, G, T, S]
    logits = _head_major_logits(q, k, mask, bias, is_causal, scale)
    # The softmax's division is applied to the [.., T, H] output rather than to the [.., T, S]
    # weights, as flash attention does: one pass fewer over the largest tensor, and no
    # [.., T, S] broadcast of the row sums, which XLA:CPU materialised (ViT-S/16 step 0.98x,
    # GPT-2 0.99x, paired rounds).
    unnormalised = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    row_sums = unnormalised.sum(-1, keepdims=True)
    if dropout_rate > 0.0:  # on the weights, whose row sums stay those before dropout
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, (b, n, t, k.shape[1]))
        keep = keep.reshape(unnormalised.shape)
        unnormalised = jnp.where(keep, unnormalised / (1.0 - dropout_rate), 0.0)
    # [B, K, S, H] (head-major, as in _head_major_logits)
    vt = jnp.swapaxes(v, 1, 2)
    weights = unnormalised.astype(v.dtype)
    if kh == n:
        # [B, N, T, H] -> [B, T, N, H]
        out = _einsum_f32("bnts,bnsh->bnth", weights, vt)
        return jnp.swapaxes(out / row_sums, 1, 2).astype(v.dtype)
    # [B, K, G, T, H] -> [B, T, K, G, H]
    out = _einsum_f32("bkgts,bksh->bkgth", weights, vt)
    return (out / row_sums).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(v.dtype)


# ----------------------------------------------------------------------------------------------
# Chunked (flash-style) attention: online softmax forward, recomputing backward.


def _chunk_keys(x, chunk, num_chunks):
    """[B, S, K, H] -> [nc, B, C, K, H], zero-padded to nc * C keys."""
    b, s, kh, h = x.shape
    x = jnp.pad(x, ((0, 0), (0, num_chunks * chunk - s), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, num_chunks, chunk, kh, h), 1, 0)


def _chunk_last(x, chunk, num_chunks, fill):
    """Grouped [b, k, g, t, S] mask or bias -> [nc, b, k, g, t, C]; None or S == 1 pass as is."""
    if x is None or x.shape[-1] == 1:
        return x
    pad = num_chunks * chunk - x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * 4 + [(0, pad)], constant_values=fill)
    return jnp.moveaxis(x.reshape(*x.shape[:-1], num_chunks, chunk), -2, 0)


def _split_chunked(x):
    """(per-chunk xs for scan, constant) for a value that is either chunked or broadcast."""
    if x is None or x.ndim == 5:  # [b, k, g, t, 1]: the same for every chunk
        return None, x
    return x, None


def _reduce_to(x, shape):
    """Sums x over the axes where `shape` has size 1 (the reverse of broadcasting)."""
    dims = tuple(
        i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1
    )
    return jnp.sum(x, axis=dims, keepdims=True)


def _chunk_probs(qg, kc, j, mask_c, bias_c, ids_c, rng, statics):
    """Scaled, masked logits [B, K, G, T, C] of chunk j, the allowed pattern, the dropout keep
    mask (or None). ids_c: (query ids [B, T], chunk j's key ids [B, C]) or None."""
    is_causal, scale, rate, chunk, key_length = statics
    logits = jnp.einsum("bkgth,bckh->bkgtc", qg, kc, preferred_element_type=jnp.float32)
    if ids_c is not None:
        # [B, 1, 1, T, C], built per chunk: no [B, T, S] mask exists at any time.
        same = masks.segment_mask(*ids_c)[:, :, None]
        mask_c = same if mask_c is None else jnp.logical_and(mask_c, same)
    logits, allowed = _masked_logits(
        logits * scale, mask_c, bias_c, is_causal, k_offset=j * chunk, key_length=key_length
    )
    keep = None
    if rate > 0.0:
        keep = jax.random.bernoulli(jax.random.fold_in(rng, j), 1.0 - rate, logits.shape)
    return logits, allowed, keep


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(qg, kc, vc, mask, bias, ids, rng, statics):
    return _flash_fwd(qg, kc, vc, mask, bias, ids, rng, statics)[0]


def _chunk_ids(ids, kv_ids_j):
    return None if ids is None else (ids[0], kv_ids_j)


def _flash_fwd(qg, kc, vc, mask, bias, ids, rng, statics):
    """ids: (query ids [B, T], key ids by chunk [nc, B, C]) or None."""
    rate = statics[2]
    mask_xs, mask_const = _split_chunked(mask)
    bias_xs, bias_const = _split_chunked(bias)
    b, kh, g, t, h = qg.shape

    def body(carry, xs):
        m, l, acc = carry
        j, k_j, v_j, mask_j, bias_j, ids_j = xs
        mask_j = mask_const if mask_j is None else mask_j
        bias_j = bias_const if bias_j is None else bias_j
        logits, _, keep = _chunk_probs(
            qg, k_j, j, mask_j, bias_j, _chunk_ids(ids, ids_j), rng, statics
        )
        m_new = jnp.maximum(m, logits.max(-1))
        alpha = jnp.exp(m - m_new)
        # [B, K, G, T, C]
        p = jnp.exp(logits - m_new[..., None])
        l = alpha * l + p.sum(-1)
        if keep is not None:
            p = jnp.where(keep, p / (1.0 - rate), 0.0)
        # [B, K, G, T, H]
        pv = jnp.einsum(
            "bkgtc,bckh->bkgth", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
        )
        return (m_new, l, alpha[..., None] * acc + pv), None

    init = (
        jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, h), jnp.float32),
    )
    xs = (jnp.arange(kc.shape[0]), kc, vc, mask_xs, bias_xs, None if ids is None else ids[1])
    (m, l, acc), _ = lax.scan(body, init, xs)
    out = (acc / l[..., None]).astype(qg.dtype)
    # The softmax statistics [B, K, G, T]; kept apart (not as m + log l) because for a fully
    # masked row m is the most negative float, which would absorb log l.
    return out, (qg, kc, vc, mask, bias, ids, rng, out, m, l)


def _flash_bwd(statics, residuals, dout):
    is_causal, scale, rate, chunk, key_length = statics
    qg, kc, vc, mask, bias, ids, rng, out, m, l = residuals
    mask_xs, mask_const = _split_chunked(mask)
    bias_xs, bias_const = _split_chunked(bias)
    # The matmuls take operands in the inputs' dtype and accumulate in float32, as the forward
    # pass does (float32 operands would run as float32 matmuls on GPUs under a bf16 config).
    dt = jnp.result_type(qg, kc, vc)
    # [B, K, G, T]: rowsum(dO * O), the softmax-backward correction term.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dout = dout.astype(dt)

    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=jnp.float32)

    def body(carry, xs):
        dq, dbias_acc = carry
        j, k_j, v_j, mask_j, bias_j, ids_j = xs
        chunked_bias = bias_j is not None
        mask_j = mask_const if mask_j is None else mask_j
        bias_j = bias_const if bias_j is None else bias_j
        logits, allowed, keep = _chunk_probs(
            qg, k_j, j, mask_j, bias_j, _chunk_ids(ids, ids_j), rng, statics
        )
        # [B, K, G, T, C]
        p = jnp.exp(logits - m[..., None]) / l[..., None]
        p_drop = p if keep is None else jnp.where(keep, p / (1.0 - rate), 0.0)
        # [B, C, K, H]
        dv_j = mm("bkgtc,bkgth->bckh", p_drop, dout)
        # [B, K, G, T, C]
        dp = mm("bkgth,bckh->bkgtc", dout, v_j)
        if keep is not None:
            dp = jnp.where(keep, dp / (1.0 - rate), 0.0)
        ds = p * (dp - delta[..., None])
        if allowed is not None:
            ds = jnp.where(allowed, ds, 0.0)
        # [B, K, G, T, H]
        dq = dq + mm("bkgtc,bckh->bkgth", ds, k_j)
        # [B, C, K, H]
        dk_j = mm("bkgtc,bkgth->bckh", ds, qg) * scale
        dbias_j = None
        if bias is not None:
            if chunked_bias:
                dbias_j = _reduce_to(ds, bias_j.shape)
            else:
                dbias_acc = dbias_acc + _reduce_to(ds, bias_j.shape)
        return (dq, dbias_acc), (dk_j, dv_j, dbias_j)

    dbias0 = None if bias is None or bias_xs is not None else jnp.zeros(bias.shape, jnp.float32)
    xs = (jnp.arange(kc.shape[0]), kc, vc, mask_xs, bias_xs, None if ids is None else ids[1])
    (dq, dbias_const), (dk, dv, dbias_xs) = lax.scan(
        body, (jnp.zeros(qg.shape, jnp.float32), dbias0), xs
    )
    dbias = None
    if bias is not None:
        dbias = (dbias_const if bias_xs is None else dbias_xs).astype(bias.dtype)
    return (
        (dq * scale).astype(qg.dtype),
        dk.astype(kc.dtype),
        dv.astype(vc.dtype),
        None,
        dbias,
        None,
        None,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


def _chunked_attention(q, k, v, mask, bias, segment_ids, kv_segment_ids, is_causal, scale,
                       dropout_rate, dropout_rng, chunk_size):  # fmt: skip
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    chunk = min(chunk_size, s)
    num_chunks = math.ceil(s / chunk)
    # [B, K, G, T, H]
    qg = jnp.transpose(q.reshape(b, t, kh, n // kh, h), (0, 2, 3, 1, 4))
    # [nc, B, C, K, H]
    kc, vc = _chunk_keys(k, chunk, num_chunks), _chunk_keys(v, chunk, num_chunks)
    mask = _chunk_last(_group(mask, kh), chunk, num_chunks, False)
    bias = _chunk_last(_group(bias, kh), chunk, num_chunks, 0.0)
    ids = None
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        # [nc, B, C]: padded keys get id 0, which no query attends.
        kv_ids = jnp.pad(kv_ids, ((0, 0), (0, num_chunks * chunk - s)))
        ids = (segment_ids, jnp.moveaxis(kv_ids.reshape(b, num_chunks, chunk), 1, 0))
    rng = dropout_rng if dropout_rate > 0.0 else None
    key_length = s if num_chunks * chunk != s else None
    statics = (is_causal, scale, dropout_rate, chunk, key_length)
    out = _flash(qg, kc, vc, mask, bias, ids, rng, statics)
    # [B, K, G, T, H] -> [B, T, N, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def dot_product_attention(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    segment_ids=None,
    kv_segment_ids=None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    implementation: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """softmax(Q K^T * scale + bias, masked) V with grouped-query heads.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; K divides N (K = N: multi-head, K = 1: multi-query).
      mask: boolean, True where a query may attend, broadcastable to [B, N, T, S].
      bias: additive float bias broadcastable to [B, N, T, S] (ALiBi, relative positions).
      segment_ids: [B, T] ints for packed or padded rows: a query attends only to keys of its
        own id, and id 0 (padding) to none (as `masks.segment_mask`; ANDed with `mask`).
      kv_segment_ids: [B, S] the keys' ids; segment_ids when None (self-attention).
      is_causal: query t attends only keys s <= t; no [T, S] mask is materialised.
      scale: logit scale; 1/sqrt(H) when None.
      dropout_rate: dropout on the attention weights (needs dropout_rng).
      implementation: "xla", "cudnn", "splash", "chunked" or None (`choose_implementation`).
      chunk_size: key chunk length C of the "chunked" path.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    _check_inputs(q, k, v, mask, bias, segment_ids, kv_segment_ids, implementation,
                  dropout_rate, dropout_rng)  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    platform = target_platform()
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    requested = implementation
    if implementation is None:
        implementation = choose_implementation(
            q, k, mask=mask, bias=bias, dropout_rate=dropout_rate, platform=platform
        )
    if implementation == "splash":
        reason = splash.unsupported_reason(mask=mask, bias=bias, dropout_rate=dropout_rate)
        if reason is None and platform == "gpu":
            reason = "it is a TPU kernel and the target is a GPU"
        if reason:
            raise ValueError(f'implementation="splash" is not available: {reason}')
        return splash.splash_attention(
            q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
            is_causal=is_causal, scale=scale, interpret=platform != "tpu",
        )  # fmt: skip
    if implementation == "chunked":
        return _chunked_attention(q, k, v, mask, bias, segment_ids, kv_segment_ids, is_causal,
                                  scale, dropout_rate, dropout_rng, chunk_size)  # fmt: skip
    if segment_ids is not None:  # the other paths take a dense [B, 1, T, S] mask
        mask = masks.combine_masks(mask, masks.segment_mask(segment_ids, kv_segment_ids))
    if implementation == "cudnn":
        reason = _cudnn_unsupported_reason(q, k, dropout_rate, platform)
        if reason:
            raise ValueError(f'implementation="cudnn" is not available: {reason}')
        try:
            q, k, v = _sharded_alike(q, k, v)
            return jax.nn.dot_product_attention(
                q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                implementation="cudnn",
            )  # fmt: skip
        except Exception as e:  # an unsupported shape or cuDNN version: a slower path works
            if requested == "cudnn":
                raise
            _warn_once(f"cuDNN attention is not available ({str(e).splitlines()[0]}); "
                       "attention runs without it, with more memory")  # fmt: skip
            if k.shape[1] >= CHUNKED_MIN_LENGTH:
                return _chunked_attention(q, k, v, mask, bias, None, None, is_causal, scale,
                                          dropout_rate, dropout_rng, chunk_size)  # fmt: skip
    return _xla_attention(q, k, v, mask, bias, is_causal, scale, dropout_rate, dropout_rng)


# ----------------------------------------------------------------------------------------------
# The module.

default_kernel_init = nn.initializers.xavier_uniform()
POSITIONS = (None, "rope", "alibi")


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query heads, cross-attention and a KV cache.

    Self-attention: `mha(x)`; cross-attention: `mha(x, context)`. In `decode=True` mode the
    keys and values of self-attention are appended to a cache (collection "cache") sized by the
    input the cache was initialised with, so each call may pass one new token (or a prompt).
    Calling with `mutable=["intermediates"]` also stores the [B, N, T, S] attention weights as
    "attention_weights"; the default path never computes them separately.
    """

    num_heads: int  # N
    num_kv_heads: int | None = None  # K; num_heads when None, 1 for multi-query attention
    head_dim: int | None = None  # H; width // num_heads when None
    out_features: int | None = None  # output width; the input width when None
    use_bias: bool = True  # biases on the Q, K, V and output projections
    dropout_rate: float = 0.0  # dropout on the attention weights
    position: str | None = None  # None, "rope" or "alibi" (self-attention only)
    rope_base: float = 10_000.0  # RoPE wavelength base
    implementation: str | None = None  # see dot_product_attention
    kernel_init: Callable = default_kernel_init  # for all four projections
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype of the parameters

    def __post_init__(self):
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads <= 0 or self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                f"(allowed: the divisors of {self.num_heads})"
            )
        if self.position not in POSITIONS:
            raise ValueError(f"position={self.position!r} is unknown; allowed: {POSITIONS}")
        if self.implementation not in (None, *IMPLEMENTATIONS):
            raise ValueError(
                f"implementation={self.implementation!r} is unknown; allowed: None, "
                + ", ".join(repr(i) for i in IMPLEMENTATIONS)
            )
        super().__post_init__()

    def _proj(self, name, x, heads, head_dim, head_axis):
        d = x.shape[-1]
        kernel = self.param(
            f"{name}_kernel",
            nn.with_logical_partitioning(self.kernel_init, (axes.EMBED, head_axis, axes.HEAD_DIM)),
            (d, heads, head_dim),
            self.param_dtype,
        )
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        # A 2-D matmul with the kernel seen as [D, N H] (a free reshape): on the 3-D kernel,
        # XLA:CPU added a transposed copy of every projection kernel to each step (GPT-2 small:
        # 3% of the step, timed against the 3-D form in one process).
        # [B, T, N|K, H]
        y = jnp.einsum("btd,dk->btk", x, kernel.reshape(d, heads * head_dim))
        y = y.reshape(*x.shape[:2], heads, head_dim)
        if self.use_bias:
            b = self.param(
                f"{name}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (head_axis, axes.HEAD_DIM)),
                (heads, head_dim),
                self.param_dtype,
            )
            y = y + b.astype(y.dtype)
        return y

    @nn.compact
    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        segment_ids=None,
        context_segment_ids=None,
        is_causal: bool = False,
        positions=None,
        train: bool = False,
        decode: bool = False,
    ):
        """Attends from x to itself (context None) or to context.

        Args:
          x: [B, T, D] queries' input.
          context: [B, S, D'] keys' and values' input for cross-attention.
          mask: boolean, broadcastable to [B, N, T, S], True where a query may attend.
          segment_ids: [B, T] ints: packed or padded rows (see dot_product_attention); the
            kernels take them without a [T, S] mask.
          context_segment_ids: [B, S] the context's ids (cross-attention).
          is_causal: self-attention sees only earlier and current positions.
          positions: [B, T] or [T] positions for RoPE / ALiBi; 0..T-1 (or the cache index
            onwards when decoding) when None.
          train: enables attention dropout (rng stream "dropout").
          decode: use and update the KV cache (self-attention only).
        Returns:
          [B, T, out_features].
        """
        if x.ndim != 3:
            raise ValueError(f"MultiHeadAttention: x must be [B, T, D], got shape {x.shape}")
        width = x.shape[-1]
        if self.head_dim is None and width % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must divide the width {width} (or set head_dim)"
            )
        n = self.num_heads
        kh = self.num_kv_heads or n
        h = self.head_dim or width // n
        self_attention = context is None
        context = x if self_attention else context
        if context.ndim != 3:
            raise ValueError(f"MultiHeadAttention: context must be [B, S, D], got {context.shape}")

        q = self._proj("query", x, n, h, axes.HEADS)
        k = self._proj("key", context, kh, h, axes.KV_HEADS)
        v = self._proj("value", context, kh, h, axes.KV_HEADS)
        q = nn.with_logical_constraint(q, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))

        t = x.shape[1]
        decoding = decode and self_attention
        offset = self._cache_index() if decoding else 0
        if positions is None:
            positions = offset + jnp.arange(t)
        if self_attention and self.position == "rope":
            q = position.rope(q, positions, base=self.rope_base)
            k = position.rope(k, positions, base=self.rope_base)
        kv_segment_ids = segment_ids if self_attention else context_segment_ids
        if not self_attention and (segment_ids is None) != (kv_segment_ids is None):
            # One side given: the other side's rows are all real (id 1).
            if segment_ids is None:
                segment_ids = jnp.ones(x.shape[:2], jnp.int32)
            else:
                kv_segment_ids = jnp.ones(context.shape[:2], jnp.int32)
        if decoding:
            if segment_ids is not None:
                raise ValueError(
                    "MultiHeadAttention: decode=True takes a mask, not segment_ids (the cache "
                    "keeps no ids)"
                )
            k, v, mask = self._update_cache(k, v, mask, offset)
            is_causal = False  # the cache mask is causal already
        bias = None
        if self_attention and self.position == "alibi":
            bias = position.alibi_bias(n, positions, jnp.arange(k.shape[1]))

        dropout_rng = None
        rate = self.dropout_rate if train else 0.0
        if rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        if self.is_mutable_collection("intermediates"):
            dense = mask
            if segment_ids is not None:
                dense = masks.combine_masks(mask, masks.segment_mask(segment_ids, kv_segment_ids))
            self.sow(
                "intermediates",
                "attention_weights",
                attention_weights(q, k, mask=dense, bias=bias, is_causal=is_causal),
            )
        out = dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            is_causal=is_causal,
            dropout_rate=rate,
            dropout_rng=dropout_rng,
            implementation=self.implementation,
        )
        out_kernel = self.param(
            "out_kernel",
            nn.with_logical_partitioning(self.kernel_init, (axes.HEADS, axes.HEAD_DIM, axes.EMBED)),
            (n, h, self.out_features or width),
            self.param_dtype,
        )
        out, out_kernel = nn.dtypes.promote_dtype(out, out_kernel, dtype=self.dtype)
        # [B, T, D] (a 2-D matmul, as in _proj)
        out = out.reshape(*out.shape[:2], n * h)
        y = jnp.einsum("btk,kd->btd", out, out_kernel.reshape(n * h, out_kernel.shape[-1]))
        if self.use_bias:
            b = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
                (self.out_features or width,),
                self.param_dtype,
            )
            y = y + b.astype(y.dtype)
        return y

    def _cache_index(self):
        """Where this call's tokens go in the cache: 0 before the cache exists."""
        if not self.has_variable("cache", "cache_index"):
            return 0
        return self.get_variable("cache", "cache_index")

    def _update_cache(self, k, v, mask, offset):
        """Writes this call's keys/values at `offset`; returns the whole cache and its mask.

        At initialisation (no cache yet) the cache is created with the input's length, which
        sets the maximum decode length, and the call computes ordinary causal attention.
        """
        initialized = self.has_variable("cache", "cached_key")
        cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        t = k.shape[1]
        if not initialized:
            return k, v, combine_causal(mask, t, t, 0)
        start = (0, offset, 0, 0)
        cached_k.value = lax.dynamic_update_slice(
            cached_k.value, k.astype(cached_k.value.dtype), start
        )
        cached_v.value = lax.dynamic_update_slice(
            cached_v.value, v.astype(cached_v.value.dtype), start
        )
        index.value = offset + t
        return (
            cached_k.value,
            cached_v.value,
            combine_causal(mask, t, cached_k.value.shape[1], offset),
        )


def combine_causal(mask, query_length, key_length, offset):
    """mask AND (key position <= offset + query position), as [B|1, 1, T, S]."""
    qpos = offset + jnp.arange(query_length)[:, None]
    kpos = jnp.arange(key_length)[None, :]
    causal = (kpos <= qpos)[None, None]
    return causal if mask is None else jnp.logical_and(mask, causal)
