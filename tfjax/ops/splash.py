"""TPU splash attention: JAX's Pallas flash-attention kernel behind `dot_product_attention`.

Letters as in tfjax.ops.attention: B batch, T query length, S key length, N query heads,
K key/value heads, H head dim.

The kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) computes one example's
softmax(Q K^T) V block by block in the TPU's on-chip memory, forward and backward, skipping
blocks that a static causal mask hides; packed and padded rows come in as segment ids, which
it compares tile by tile. Neither the [T, S] weights nor any [T, S] mask is ever in HBM.

What it takes: causal or full attention, segment ids (equal ids attend; id 0 is padding and
attends to nothing, as in `tfjax.ops.masks.segment_mask`), grouped-query heads, T != S (also
with causal, top-left aligned as elsewhere in tfjax), attention sinks (one logit per query
head, which the kernel adds to each row's denominator and differentiates). Not a dense mask, a
bias or dropout: `unsupported_reason` names what is refused. Lengths that are not multiples of
the block are padded here (padded keys get an id no query has) and the padding sliced off.

Under a mesh the kernel runs per shard through `jax.shard_map`, batch and heads split as the
caller's `sharding` says (tfjax.nn resolves it from the logical rules in context); a kernel
call is opaque to XLA's partitioner, which would otherwise gather the whole batch onto every
device. Off TPUs it runs in Pallas's interpret mode (exact, slow): for tests on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as kernel

# Query and key block length. The kernel tiles by it (a multiple of the TPU's 128 lanes); MaxText
# uses 512 by default and larger for long contexts. Shorter inputs use one block of their
# length rounded up to 128.
BLOCK = 512
LANES = 128
_PADDED_QUERY, _PADDED_KEY = -2, -1  # segment ids of the rows and columns added as padding


def unsupported_reason(*, mask, bias, dropout_rate, window=None, softcap=None) -> str | None:
    """Why the kernel cannot compute this call, or None when it can."""
    if window is not None:  # the kernel's LocalMask is not wired in yet
        return "tfjax does not pass a sliding window to it yet"
    if softcap is not None:  # the kernel's attn_logits_soft_cap is not wired in yet
        return "tfjax does not pass a logit soft cap (softcap) to it yet"
    if mask is not None:
        return "it takes causal attention and segment ids, not a dense mask"
    if bias is not None:
        return "it has no additive bias (ALiBi, relative positions)"
    if dropout_rate > 0.0:
        return "it has no attention dropout"
    return None


def mesh_parts(mesh_axes) -> int:
    """Into how many parts the mesh in context splits an array axis laid over `mesh_axes` (a
    mesh axis name, a tuple of them, or None); 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh_axes is None:
        return 1
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    return math.prod(mesh.shape[a] for a in mesh_axes)


def split_like_query_heads(k, v, num_heads: int, axis: int, heads_axes):
    """k, v with their kv heads (on `axis`) repeated up to `num_heads` when the mesh axes of the
    query heads (`heads_axes`) split them into parts the kv heads do not divide: every shard then
    holds the kv heads its query heads read (a sharded kernel call, splash or cuDNN, needs that)."""
    parts = mesh_parts(heads_axes)
    if parts > 1 and k.shape[axis] % parts:
        k, v = (jnp.repeat(x, num_heads // k.shape[axis], axis=axis) for x in (k, v))
    return k, v


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _block(length: int) -> int:
    return min(BLOCK, _round_up(length, LANES))


def _pad_to(x, axis: int, length: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


@functools.lru_cache(maxsize=64)
def _make_kernel(num_heads, t, s, block_q, block_kv, is_causal, interpret):
    """The kernel for local shapes (cached: building it computes the block masks in NumPy).

    Built as constants even while a jit traces (the kernel turns its masks into jax arrays):
    else the cache would hand that trace's values to the next jit of these shapes."""
    with jax.ensure_compile_time_eval():
        return _build_kernel(num_heads, t, s, block_q, block_kv, is_causal, interpret)


def _build_kernel(num_heads, t, s, block_q, block_kv, is_causal, interpret):
    head_mask = kernel.CausalMask((t, s)) if is_causal else kernel.FullMask((t, s))
    blocks = kernel.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    return kernel.make_splash_mha(
        kernel.MultiHeadMask([head_mask] * num_heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def splash_attention(
    q,
    k,
    v,
    *,
    segment_ids=None,
    kv_segment_ids=None,
    is_causal=False,
    scale: float,
    sinks=None,
    interpret: bool = False,
    sharding=None,
):
    """softmax(Q K^T * scale) V by the splash kernel.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N.
      segment_ids: [B, T] ints or None; kv_segment_ids: [B, S] (segment_ids when None and
        S = T). A query attends to the keys of its own nonzero id.
      sinks: None, or [N] float32 logits, one per query head, in each row's denominator.
      interpret: run the kernel in Pallas's interpreter (any backend).
      sharding: a PartitionSpec, the mesh axes of [B, T, N, H] activations under the mesh in
        context: the kernel then runs per shard of batch and heads; None: on whole arrays.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, _ = q.shape
    s = k.shape[1]
    if kv_segment_ids is None and segment_ids is not None:
        if s != t:
            raise ValueError(f"splash attention: T={t} != S={s} needs kv_segment_ids")
        kv_segment_ids = segment_ids
    if segment_ids is None and kv_segment_ids is not None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    block_q, block_kv = _block(t), _block(s)
    tp, sp = _round_up(t, block_q), _round_up(s, block_kv)
    ids = None
    if segment_ids is not None or tp != t or sp != s:
        q_ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids
        kv_ids = jnp.ones((b, s), jnp.int32) if kv_segment_ids is None else kv_segment_ids
        # Padding (id 0) attends to nothing, as in masks.segment_mask; in the kernel equal ids
        # attend, so its queries get an id no key has.
        q_ids = jnp.where(q_ids == 0, _PADDED_QUERY, q_ids.astype(jnp.int32))
        ids = (
            _pad_to(q_ids, 1, tp, _PADDED_QUERY),
            _pad_to(kv_ids.astype(jnp.int32), 1, sp, _PADDED_KEY),
        )
    # Scaled on q, as in the other implementations (the kernel has no scale).
    q = q * jnp.asarray(scale, q.dtype)
    # [B, N, T, H] and [B, K, S, H]: the kernel's head-major layout.
    qh = _pad_to(jnp.swapaxes(q, 1, 2), 2, tp)
    kh = _pad_to(jnp.swapaxes(k, 1, 2), 2, sp)
    vh = _pad_to(jnp.swapaxes(v, 1, 2), 2, sp)

    def per_shard(qh, kh, vh, ids, sinks):
        run = _make_kernel(qh.shape[1], tp, sp, block_q, block_kv, is_causal, interpret)
        if ids is None:  # the batch mapped; the sinks, one per head, shared by its rows
            return jax.vmap(lambda q, k, v: run(q, k, v, None, sinks))(qh, kh, vh)
        return jax.vmap(lambda q, k, v, qi, ki: run(q, k, v, kernel.SegmentIds(qi, ki), sinks))(
            qh, kh, vh, *ids
        )

    out = _sharded(per_shard, qh, kh, vh, ids, sinks, sharding)
    # [B, N, T, H] -> [B, T, N, H]
    return jnp.swapaxes(out[:, :, :t], 1, 2)


def _sharded(per_shard, qh, kh, vh, ids, sinks, sharding):
    """per_shard(qh, kh, vh, ids, sinks) run on each shard of the context's mesh (batch and
    heads split as `sharding`, the activations' [B, T, N, H] spec, says; the sinks as the
    heads), or directly without them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or sharding is None:
        return per_shard(qh, kh, vh, ids, sinks)
    spec = jax.sharding.PartitionSpec
    batch, heads = sharding[0], sharding[2]
    kh, vh = split_like_query_heads(kh, vh, qh.shape[1], 1, heads)
    if qh.shape[0] % mesh_parts(batch):
        batch = None  # a batch that does not split (decoding one row): every shard takes all
    if qh.shape[1] % mesh_parts(heads):
        heads = None
    q_spec = spec(batch, heads, None, None)
    ids_spec = None if ids is None else (spec(batch, None), spec(batch, None))
    sinks_spec = None if sinks is None else spec(heads)
    return jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(q_spec, q_spec, q_spec, ids_spec, sinks_spec),
        out_specs=q_spec,
        check_vma=False,
    )(qh, kh, vh, ids, sinks)
