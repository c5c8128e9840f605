"""Chunked attention: the exact softmax(Q K^T) V, key chunk by key chunk, on every backend.

Letters as in tfjax.ops.attention: B batch, T query length, S key/value length, K key/value
heads, G query heads per kv head, H head dim, C key chunk length; nc the number of chunks.

The forward pass is flash attention's online softmax: a scan over key chunks keeps, per query,
the running maximum m of the logits, the running sum l of exp(logit - m) and the running
output; when a chunk raises the maximum, the sum and the output are rescaled by
exp(m_old - m_new). The backward pass keeps only m and l and recomputes each chunk's weights.
Neither pass holds more than one [T, C] block of weights per head, so memory grows linearly in
S. Causal and segment-id patterns are built chunk by chunk (`masks.block_mask`); a dense mask
or bias is cut into chunks. Attention sinks (a logit per head in every row's denominator, with
no value) start each row's running maximum at its sink and its running sum at exp(0) = 1; their
gradient, -p_sink * rowsum(dO * O) summed over rows, needs no pass over the chunks.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tfjax.ops import masks


class _Statics(NamedTuple):
    """The kernel's static arguments (hashable: custom_vjp's nondiff argument)."""

    is_causal: bool
    window: int | None
    scale: float
    rate: float  # dropout
    chunk: int  # C
    key_length: int | None  # S when the last chunk is padded, else None
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) when set


def chunked_attention(
    qg,
    k,
    v,
    *,
    mask,
    bias,
    segment_ids,
    kv_segment_ids,
    is_causal,
    window,
    scale,
    dropout_rate,
    dropout_rng,
    chunk_size,
    softcap=None,
    sinks=None,
):
    """softmax(cap(Q K^T * scale) + bias, masked) V over key chunks of chunk_size.

    Args:
      qg: [B, K, G, T, H] queries grouped by the kv head they read (G = 1: multi-head).
      k, v: [B, S, K, H].
      mask, bias: None or broadcastable to the grouped logits [B, K, G, T, S] with a rank of 5.
      segment_ids: [B, T] ints or None; kv_segment_ids: [B, S] (as `masks.segment_mask`).
      is_causal, window: as `masks.block_mask`.
      softcap: None, or cap(x) = softcap * tanh(x / softcap) on the scaled logits (Gemma 2).
      sinks: None, or [K, G] float32 logits, one per query head, in each row's denominator.
    Returns:
      [B, K, G, T, H] in qg's dtype.
    """
    b, s = k.shape[:2]
    chunk = min(chunk_size, s)
    num_chunks = math.ceil(s / chunk)
    # [nc, B, C, K, H]
    kc, vc = _chunk_keys(k, chunk, num_chunks), _chunk_keys(v, chunk, num_chunks)
    mask = _chunk_last(mask, chunk, num_chunks, False)
    bias = _chunk_last(bias, chunk, num_chunks, 0.0)
    ids = None
    if segment_ids is not None:
        kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        # Padded keys get id 0, which no query attends.
        kv_ids = jnp.pad(kv_ids, ((0, 0), (0, num_chunks * chunk - s)))
        # [nc, B, C]
        ids = (segment_ids, jnp.moveaxis(kv_ids.reshape(b, num_chunks, chunk), 1, 0))
    rng = dropout_rng if dropout_rate > 0.0 else None
    key_length = s if num_chunks * chunk != s else None
    statics = _Statics(is_causal, window, scale, dropout_rate, chunk, key_length, softcap)
    return _attend(qg, kc, vc, mask, bias, ids, rng, sinks, statics)


def _chunk_keys(x, chunk, num_chunks):
    """[B, S, K, H] -> [nc, B, C, K, H], zero-padded to nc * C keys."""
    b, s, kh, h = x.shape
    x = jnp.pad(x, ((0, 0), (0, num_chunks * chunk - s), (0, 0), (0, 0)))
    # [B, nc, C, K, H] -> [nc, B, C, K, H]
    return jnp.moveaxis(x.reshape(b, num_chunks, chunk, kh, h), 1, 0)


def _chunk_last(x, chunk, num_chunks, fill):
    """Grouped [b, k, g, t, S] mask or bias -> [nc, b, k, g, t, C]; None or S == 1 pass as is."""
    if x is None or x.shape[-1] == 1:
        return x
    pad = num_chunks * chunk - x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * 4 + [(0, pad)], constant_values=fill)
    # [b, k, g, t, nc, C] -> [nc, b, k, g, t, C]
    return jnp.moveaxis(x.reshape(*x.shape[:-1], num_chunks, chunk), -2, 0)


def _per_chunk(x):
    """(what the scan slices, what every chunk shares) for a mask or bias: a chunked [nc, ...]
    one is sliced; a [b, k, g, t, 1] one, the same for every chunk, is shared."""
    if x is None or x.ndim == 5:
        return None, x
    return x, None


def _reduce_to(x, shape):
    """Sums x over the axes where `shape` has size 1 (the reverse of broadcasting)."""
    dims = tuple(
        i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1
    )
    return jnp.sum(x, axis=dims, keepdims=True)


def _chunk_logits(qg, k_j, j, mask_j, bias_j, ids, kv_ids_j, rng, statics):
    """Chunk j's scaled, capped, biased, masked logits [B, K, G, T, C], the pattern of pairs
    that may attend (None when all may; masked logits are constants that get no gradient), the
    dropout keep mask (or None) and the soft cap's derivative [B, K, G, T, C] (or None)."""
    is_causal, window, scale, rate, chunk, key_length, softcap = statics
    # [B, K, G, T, C]
    logits = jnp.einsum("bkgth,bckh->bkgtc", qg, k_j, preferred_element_type=jnp.float32)
    logits = logits * scale
    dcap = None
    if softcap is not None:
        capped = jnp.tanh(logits / softcap)
        logits = softcap * capped
        dcap = 1.0 - capped * capped  # d cap(x) / dx
    if bias_j is not None:
        logits = logits + bias_j.astype(jnp.float32)
    key_positions = j * chunk + jnp.arange(chunk)
    # [B|1, 1, T, C]: this chunk's causal and segment pattern; no [T, S] mask ever exists.
    pattern = masks.block_mask(
        jnp.arange(qg.shape[3]),
        key_positions,
        is_causal=is_causal,
        window=window,
        segment_ids=None if ids is None else ids[0],
        kv_segment_ids=kv_ids_j,
    )
    # [B|1, 1, 1, T, C]: one pattern for all heads
    allowed = masks.combine_masks(mask_j, None if pattern is None else pattern[:, :, None])
    logits = masks.masked_logits(logits, allowed)
    if key_length is not None:  # keys that pad the last chunk: exactly zero weight
        logits = jnp.where(key_positions < key_length, logits, -jnp.inf)
    keep = None
    if rate > 0.0:
        keep = jax.random.bernoulli(jax.random.fold_in(rng, j), 1.0 - rate, logits.shape)
    return logits, allowed, keep, dcap


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attend(qg, kc, vc, mask, bias, ids, rng, sinks, statics):
    """ids: (query ids [B, T], key ids by chunk [nc, B, C]) or None."""
    return _attend_fwd(qg, kc, vc, mask, bias, ids, rng, sinks, statics)[0]


def _scan_inputs(kc, vc, mask, bias, ids):
    """What the scans over chunks slice: chunk index, keys, values, mask, bias, key ids."""
    return (
        jnp.arange(kc.shape[0]),
        kc,
        vc,
        _per_chunk(mask)[0],
        _per_chunk(bias)[0],
        None if ids is None else ids[1],
    )


def _attend_fwd(qg, kc, vc, mask, bias, ids, rng, sinks, statics):
    rate = statics.rate
    mask_shared, bias_shared = _per_chunk(mask)[1], _per_chunk(bias)[1]
    b, kh, g, t, h = qg.shape

    def body(carry, xs):
        m, l, acc = carry
        j, k_j, v_j, mask_j, bias_j, kv_ids_j = xs
        mask_j = mask_shared if mask_j is None else mask_j
        bias_j = bias_shared if bias_j is None else bias_j
        logits, _, keep, _ = _chunk_logits(qg, k_j, j, mask_j, bias_j, ids, kv_ids_j, rng, statics)
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

    # Each row's running maximum and sum: -inf and 0, or its sink's logit and exp(0).
    m0 = jnp.full((b, kh, g, t), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((b, kh, g, t), jnp.float32)
    if sinks is not None:
        m0 = jnp.broadcast_to(sinks[None, :, :, None].astype(jnp.float32), m0.shape)
        l0 = jnp.ones_like(l0)
    init = (m0, l0, jnp.zeros((b, kh, g, t, h), jnp.float32))
    (m, l, acc), _ = lax.scan(body, init, _scan_inputs(kc, vc, mask, bias, ids))
    out = (acc / l[..., None]).astype(qg.dtype)
    # The softmax statistics [B, K, G, T]; kept apart (not as m + log l) because for a fully
    # masked row m is the most negative float, which would absorb log l.
    return out, (qg, kc, vc, mask, bias, ids, rng, sinks, out, m, l)


def _attend_bwd(statics, residuals, dout):
    scale, rate = statics.scale, statics.rate
    qg, kc, vc, mask, bias, ids, rng, sinks, out, m, l = residuals
    mask_shared, bias_shared = _per_chunk(mask)[1], _per_chunk(bias)[1]
    bias_chunked = _per_chunk(bias)[0] is not None
    # The matmuls take operands in the inputs' dtype and accumulate in float32, as the forward
    # pass does (float32 operands would run as float32 matmuls on GPUs under a bf16 config).
    dt = jnp.result_type(qg, kc, vc)
    # [B, K, G, T]: rowsum(dO * O), the softmax-backward correction term.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dout = dout.astype(dt)

    def mm(spec, a, b):
        return jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=jnp.float32)

    def body(carry, xs):
        dq, dbias_shared = carry
        j, k_j, v_j, mask_j, bias_j, kv_ids_j = xs
        mask_j = mask_shared if mask_j is None else mask_j
        bias_j = bias_shared if bias_j is None else bias_j
        logits, allowed, keep, dcap = _chunk_logits(
            qg, k_j, j, mask_j, bias_j, ids, kv_ids_j, rng, statics
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
        # The bias is added after the cap; q and k are under it.
        ds_qk = ds if dcap is None else ds * dcap
        # [B, K, G, T, H]
        dq = dq + mm("bkgtc,bckh->bkgth", ds_qk, k_j)
        # [B, C, K, H]
        dk_j = mm("bkgtc,bkgth->bckh", ds_qk, qg) * scale
        dbias_j = None
        if bias is not None:
            if bias_chunked:
                dbias_j = _reduce_to(ds, bias_j.shape)
            else:
                dbias_shared = dbias_shared + _reduce_to(ds, bias_j.shape)
        return (dq, dbias_shared), (dk_j, dv_j, dbias_j)

    dbias0 = None
    if bias is not None and not bias_chunked:
        dbias0 = jnp.zeros(bias.shape, jnp.float32)
    (dq, dbias_shared), (dk, dv, dbias_chunks) = lax.scan(
        body, (jnp.zeros(qg.shape, jnp.float32), dbias0), _scan_inputs(kc, vc, mask, bias, ids)
    )
    dbias = None
    if bias is not None:
        dbias = (dbias_chunks if bias_chunked else dbias_shared).astype(bias.dtype)
    dsinks = None
    if sinks is not None:  # a sink's logit gets -p_sink * delta, p_sink = exp(sink - m) / l
        p_sink = jnp.exp(sinks[None, :, :, None] - m) / l
        dsinks = jnp.sum(-p_sink * delta, axis=(0, 3)).astype(sinks.dtype)
    return (
        (dq * scale).astype(qg.dtype),
        dk.astype(kc.dtype),
        dv.astype(vc.dtype),
        None,
        dbias,
        None,
        None,
        dsinks,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
