"""Multi-head attention for an AttentionConfig, given its parameters: the projections, RoPE on
the heads, the per-layer variants (Gemma's local and global layers, Llama 4's chunked and NoPE
ones), ALiBi, the decoding mask, then dot_product_attention. A module system holds the
parameters (tfjax.nn.MultiHeadAttention in Linen, tfjax.nnx.Attention in NNX).

Letters: B batch, T query length, S key/value length, N query heads, K key/value heads, H head
dim.
"""

import functools

import jax.numpy as jnp
from jax import lax

from tfjax.ops import masks, norms, position
from tfjax.ops.attention import attention_weights, dot_product_attention


def project(x, kernel, heads: int, head_dim: int, bias=None):
    """[B, T, D] -> [B, T, heads, head_dim] by kernel [D, heads, head_dim] (+ bias [heads,
    head_dim]): the query, key and value projections, in the operands' (already promoted)
    dtype. The shapes come from the arguments, not the kernel: an interceptor (Qwix's QLoRA)
    may hand over a kernel that is already the 2-D [D, E] one."""
    d = x.shape[-1]
    # One 2-D matmul with the kernel seen as [D, E] (a free reshape), the form of a plain
    # dense layer.
    # [B, T, E]
    y = jnp.einsum("btd,de->bte", x, kernel.reshape(d, heads * head_dim))
    # [B, T, N|K, H]
    y = y.reshape(*x.shape[:2], heads, head_dim)
    return y if bias is None else y + bias.astype(y.dtype)


def project_out(out, kernel, out_features: int, bias=None):
    """[B, T, N, H] -> [B, T, out_features] by kernel [N, H, out_features] (+ bias
    [out_features]): the output projection (the shapes from the arguments, as in project)."""
    n, h = out.shape[2:]
    # [B, T, E] (a 2-D matmul, as in project)
    out = out.reshape(*out.shape[:2], n * h)
    # [B, T, D']
    y = jnp.einsum("bte,ed->btd", out, kernel.reshape(n * h, out_features))
    return y if bias is None else y + bias.astype(y.dtype)


def by_variant(variant, choices, fn):
    """fn(choices[variant]): directly for one choice or a Python int, else by `lax.switch` on
    the traced index (every branch traced, one run)."""
    if len(choices) == 1:
        return fn(choices[0])
    if isinstance(variant, int):
        return fn(choices[variant])
    return lax.switch(variant, [functools.partial(fn, c) for c in choices])


def check_variant(config, variant) -> None:
    """Several variants need the call to name one."""
    if len(config.variants) > 1 and variant is None:
        raise ValueError(
            f"MultiHeadAttention: {len(config.variants)} variants need the call's `variant` "
            "(an index)"
        )


def rotate(q, k, positions, config, variant=None):
    """Self-attention's q [B, T, N, H] and k [B, T, K, H] made ready as the variant says (see
    LayerAttention): rotated by RoPE at `positions` ([B, T] or [T]) when config.position is
    "rope" and the variant rotates (with its base and scaling; only the first
    config.rotary_dim(H) channels of each head); then divided by their RMS over H
    (unit_qk_norm) and q scaled by the attention temperature at its position
    (temperature_floor), as Llama 4's layers."""
    variants = config.variants
    if config.position != "rope" and not any(_after_rope(v) for v in variants):
        return q, k

    rotary = config.rotary_dim(q.shape[-1])

    def one(choice):
        def rope(y):  # the first `rotary` channels of each head (all but with a partial factor)
            y_rot = position.rope(
                y[..., :rotary], positions, base=choice.rope_base, scaling=choice.rope_scaling
            )
            return y_rot if rotary == y.shape[-1] else jnp.concatenate([y_rot, y[..., rotary:]], -1)

        q_, k_ = (rope(q), rope(k)) if config.position == "rope" and choice.rope else (q, k)
        if choice.unit_qk_norm:
            q_, k_ = (norms.unit_rms(y, eps=config.norm_eps) for y in (q_, k_))
        if choice.temperature_floor is not None:
            # [T] or [B, T]
            scales = position.attention_temperature(
                positions, choice.temperature_floor, choice.temperature_scale
            )
            q_ = (q_ * scales[..., None, None]).astype(q.dtype)
        return q_, k_

    return by_variant(variant, variants, one)


def _after_rope(choice) -> bool:
    """Whether a variant changes q or k besides RoPE (Llama 4's norm and temperature)."""
    return choice.unit_qk_norm or choice.temperature_floor is not None


def ids_on_both_sides(segment_ids, kv_segment_ids, query_shape, key_shape):
    """Cross-attention's (query ids, key ids): when one side has ids and the other none, the
    other side's rows [B, T] or [B, S] are all real (id 1)."""
    if segment_ids is None and kv_segment_ids is not None:
        segment_ids = jnp.ones(query_shape, jnp.int32)
    elif kv_segment_ids is None and segment_ids is not None:
        kv_segment_ids = jnp.ones(key_shape, jnp.int32)
    return segment_ids, kv_segment_ids


def prepare(q, k, config, self_attention, positions, variant, segment_ids, kv_segment_ids):
    """Projected q [B, T, N, H] and k [B, S, K, H] made ready to attend: self-attention's
    rotated (`rotate`) with the keys' ids the queries'; cross-attention's ids on both sides
    (`ids_on_both_sides`). Returns (q, k, segment_ids, kv_segment_ids)."""
    if self_attention:
        q, k = rotate(q, k, positions, config, variant)
        return q, k, segment_ids, segment_ids
    segment_ids, kv_segment_ids = ids_on_both_sides(
        segment_ids, kv_segment_ids, q.shape[:2], k.shape[:2]
    )
    return q, k, segment_ids, kv_segment_ids


def attend(
    q,
    k,
    v,
    config,
    *,
    positions,
    self_attention: bool = True,
    decode_offset=None,
    variant=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    sharding=None,
    with_weights: bool = False,
    **pattern,
):
    """The attention output [B, T, N, H] of q [B, T, N, H] on k, v [B, S, K, H], and its
    [B, N, T, S] weights (with_weights; else None).

    Args:
      config: the AttentionConfig (position, variants, logit options, implementation).
      positions: the queries' positions ([B, T] or [T]), for ALiBi and chunks (a variant's
        `chunk`: the keys' are the same, or when decoding the cache's slots 0..S-1).
      self_attention: False for cross-attention: no ALiBi, no window.
      decode_offset: decoding: the position of q's first token; the keys are a whole cache at
        0..S-1, masked causally (and by the window) here.
      variant: the index into config.variants (an int or a traced int32 scalar).
      sharding: as in dot_product_attention.
      **pattern: mask, bias, segment_ids, kv_segment_ids, is_causal, sinks
        (dot_product_attention's).
    """
    if self_attention and config.position == "alibi":
        alibi = position.alibi_bias(q.shape[2], positions, jnp.arange(k.shape[1]))
        pattern["bias"] = alibi if pattern.get("bias") is None else pattern["bias"] + alibi

    def one(choice):
        window = choice.sliding_window if self_attention else None
        p = dict(pattern, window=window, **config.logit_options())
        if self_attention and choice.chunk is not None:  # Llama 4: within the query's chunk
            keys = positions if decode_offset is None else jnp.arange(k.shape[1])
            chunks = masks.chunk_mask(positions, keys, choice.chunk)
            p["mask"] = masks.combine_masks(p.get("mask"), chunks)
        if decode_offset is not None:  # the queries at offset.., the whole cache's keys at 0..
            causal = masks.block_mask(
                decode_offset + jnp.arange(q.shape[1]),
                jnp.arange(k.shape[1]),
                is_causal=True,
                window=window,
            )
            p.update(mask=masks.combine_masks(p.get("mask"), causal), is_causal=False, window=None)
        weights = attention_weights(q, k, **p) if with_weights else None
        out = dot_product_attention(
            q,
            k,
            v,
            **p,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            implementation=config.implementation,
            sharding=sharding,
        )
        return out, weights

    return by_variant(variant, config.variants, one)
