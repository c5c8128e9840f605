"""Attention masks as pure functions.

Every mask is boolean, True where a query may attend to a key, with shape [B, 1, T, S]
(broadcastable to [B, N, T, S], the convention of `jax.nn.dot_product_attention` and Flax).
Combine masks with `combine_masks`, which ANDs them and ignores `None`; `block_mask` builds
the causal and segment patterns of any block of queries and keys, which the attention kernels
use chunk by chunk instead of reading a whole [T, S] mask.
"""

import jax.numpy as jnp

# Masked logits get the most negative finite value, as in jax.nn and Flax: a query with every
# key masked then averages all values uniformly instead of producing NaN.
MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


def masked_logits(logits, mask):
    """logits where mask is True, MASKED_LOGIT elsewhere (logits as they are when mask is None)."""
    return logits if mask is None else jnp.where(mask, logits, MASKED_LOGIT)


def block_mask(
    query_positions,
    key_positions,
    *,
    is_causal=False,
    window=None,
    segment_ids=None,
    kv_segment_ids=None,
):
    """[B|1, 1, T, S] mask of queries at `query_positions` [T] against keys at `key_positions`
    [S]: a block of a longer sequence, or all of it. None when nothing is masked.

    Args:
      is_causal: a query attends to keys at its own position and before.
      window: a query at p attends only to keys after p - window (sliding-window attention,
        Mistral, Gemma's local layers: with is_causal, the `window` positions up to p).
      segment_ids: [B, T] the queries' ids; kv_segment_ids: [B, S] the keys' ids (see
        `segment_mask`; segment_ids when None).
    """
    # [T, S]
    behind = query_positions[:, None] - key_positions[None, :]
    causal = (behind >= 0)[None, None] if is_causal else None
    near = (behind < window)[None, None] if window is not None else None
    same = None if segment_ids is None else segment_mask(segment_ids, kv_segment_ids)
    return combine_masks(causal, near, same)


def chunk_mask(query_positions, key_positions, chunk: int):
    """[B|1, 1, T, S] mask of chunked attention (Llama 4's RoPE layers): a query at position p
    attends only to keys in its own chunk, positions c * chunk .. (c + 1) * chunk - 1 for
    c = p // chunk (with a causal mask, those up to p).

    Args:
      query_positions: [T] or [B, T] the queries' positions (a packed row's restart at each
        segment, so the chunks do too); key_positions: [S] or [B, S] the keys'.
    """
    q, k = (jnp.asarray(p) // chunk for p in (query_positions, key_positions))
    q, k = (p if p.ndim == 2 else p[None] for p in (q, k))
    return (q[:, :, None] == k[:, None, :])[:, None]


def causal_mask(length: int, *, offset=0) -> jnp.ndarray:
    """[1, 1, T, T] lower-triangular mask: query t attends to keys 0..t (+ offset)."""
    return block_mask(jnp.arange(length) + offset, jnp.arange(length), is_causal=True)


def padding_mask(query_tokens, key_tokens=None, *, pad_id: int = 0) -> jnp.ndarray:
    """[B, 1, T, S] mask that is False where the query or the key is padding.

    Args:
      query_tokens: [B, T] int ids.
      key_tokens: [B, S] int ids; the query tokens when None (self-attention).
    """
    key_tokens = query_tokens if key_tokens is None else key_tokens
    q = query_tokens != pad_id
    k = key_tokens != pad_id
    return q[:, None, :, None] & k[:, None, None, :]


def key_padding_mask(key_tokens, *, pad_id: int = 0) -> jnp.ndarray:
    """[B, 1, 1, S] mask that hides padded keys only (queries on padding still see real keys)."""
    return (key_tokens != pad_id)[:, None, None, :]


def segment_mask(query_segment_ids, key_segment_ids=None) -> jnp.ndarray:
    """[B, 1, T, S] mask for packed sequences: attend only within the same segment.

    Segment ids are 1..n for the examples packed in a row and 0 for padding; padding attends
    to nothing and nothing attends to padding.
    """
    key_segment_ids = query_segment_ids if key_segment_ids is None else key_segment_ids
    q = query_segment_ids[:, None, :, None]
    k = key_segment_ids[:, None, None, :]
    return (q == k) & (q != 0)


def padding_ids(tokens, *, pad_id: int = 0) -> jnp.ndarray:
    """[B, T] int32 segment ids of unpacked rows: 1 for tokens, 0 for padding. As segment ids
    (`segment_mask`, or `segment_ids=` of the attention functions, which need no [T, S] mask)
    they mean what `padding_mask` means."""
    return (tokens != pad_id).astype(jnp.int32)


def ids_or_padding(segment_ids, tokens):
    """The given `segment_ids`, else `padding_ids(tokens)` of unpacked rows (None without
    tokens either)."""
    if segment_ids is not None or tokens is None:
        return segment_ids
    return padding_ids(tokens)


def combine_masks(*masks):
    """AND of the given masks (None entries skipped); None when all are None."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = jnp.logical_and(out, m)
    return out
