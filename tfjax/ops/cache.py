"""The KV cache of decoding as a pytree the caller holds (beside Flax's "cache" collection).

Letters: L layers, B batch, S cache length (the longest sequence decoded), K kv heads, H head dim.

A caller makes the cache with `init_cache` (zeros, laid out as it asks: its own dtype, a
sharding), passes it with each decoding call and gets the updated cache back, so the memory and
its layout are the caller's. A layer's cache is one `KVCache`; a stack's is one per layer, as its
parameters are: a tuple of L caches (unrolled layers) or one `KVCache` whose every leaf has a
leading layer axis [L, ...] (scanned layers). Multi-head latent attention (an AttentionConfig
with `latent`; tfjax.ops.mla) caches a `LatentCache` instead: per token its latent [R] and its
rotated shared key part [Hr], not per-head keys and values. A Gated DeltaNet layer (Qwen3.5's
linear attention) keeps a fixed-size tfjax.ops.linear_attention.RecurrentState in its place.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tfjax.ops.linear_attention import RecurrentState


class KVCache(NamedTuple):
    """One self-attention layer's keys and values at positions 0..S-1, of which the first
    `index` hold tokens (the attention masks the others, causally)."""

    keys: jax.Array  # [B, S, K, H] (RoPE applied)
    values: jax.Array  # [B, S, K, H]
    index: jax.Array  # [] int32: how many positions are written; the next token goes there


class LatentCache(NamedTuple):
    """One latent attention layer's cache (tfjax.ops.mla) at positions 0..S-1, of which the
    first `index` hold tokens: R the latent (kv_rank), Hr the shared rotated key part."""

    latent: jax.Array  # [B, S, R] (after its RMSNorm)
    rope_keys: jax.Array  # [B, S, Hr] (RoPE applied)
    index: jax.Array  # [] int32: how many positions are written; the next token goes there


CACHES = (KVCache, LatentCache)  # one layer's cache, of either kind


def init_cache(
    config,
    batch_size: int,
    length: int,
    width: int,
    *,
    num_layers: int | None = None,
    scanned: bool = False,
    dtype=jnp.float32,
    sharding=None,
):
    """An empty cache for attention `config` (an AttentionConfig) on inputs of `width` D.

    Args:
      length: S, the longest sequence (prompt and generated tokens) it holds.
      num_layers: None for one layer's KVCache; else a stack's (see the module docstring).
      scanned: the stack's layers are scanned: one KVCache with [L, ...] leaves.
      dtype: of the keys and values (the model's compute dtype keeps its numbers exactly).
      sharding: where one layer's keys and values [B, S, K, H] live (a jax.sharding.Sharding,
        e.g. a NamedSharding with the batch split); scanned stacks keep the layer axis unsplit.
    """
    if config.latent is not None:  # [B, S, R] and [B, S, Hr]; a sharding's [B, S] part
        lat = config.latent
        shapes = [(batch_size, length, lat.kv_rank), (batch_size, length, lat.rope_dim)]
        kind, sharding = LatentCache, _first_axes(sharding, 2)
    else:
        shape = (batch_size, length, config.kv_heads, config.head_width(width))
        shapes, kind = [shape, shape], KVCache
    if num_layers is None:
        return _zeros(kind, shapes, dtype, sharding)
    if not scanned:
        return tuple(_zeros(kind, shapes, dtype, sharding) for _ in range(num_layers))
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
        )
    return _zeros(kind, [(num_layers, *s) for s in shapes], dtype, sharding)


def _first_axes(sharding, n: int):
    """A NamedSharding of [B, S, K, H] keys cut to its first n axes' spec (others as given)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[:n])
        return jax.sharding.NamedSharding(sharding.mesh, spec)
    return sharding


def _zeros(kind, shapes, dtype, sharding):
    """A `kind` cache of zeros with leaves of `shapes`, index 0 for each leading axis before B
    (the layers' of a scanned stack)."""
    lead = shapes[0][: -4 if kind is KVCache else -3]
    return kind(*(jnp.zeros(s, dtype, device=sharding) for s in shapes), jnp.zeros(lead, jnp.int32))


def write(cache: KVCache, k, v) -> KVCache:
    """One layer's cache with k, v [B, T, K, H] written at positions index..index + T - 1."""
    start = (0, cache.index, 0, 0)
    return KVCache(
        lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), start),
        lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), start),
        cache.index + k.shape[1],
    )


def write_latent(cache: LatentCache, latent, rope_keys) -> LatentCache:
    """One latent layer's cache with latent [B, T, R] and rope_keys [B, T, Hr] written at
    positions index..index + T - 1."""
    start = (0, cache.index, 0)
    return LatentCache(
        lax.dynamic_update_slice(cache.latent, latent.astype(cache.latent.dtype), start),
        lax.dynamic_update_slice(cache.rope_keys, rope_keys.astype(cache.rope_keys.dtype), start),
        cache.index + latent.shape[1],
    )


def _layer_cache(cache):
    """One layer's cache from a layer's or a stack's (a tuple of them, maybe nested per stack):
    the first attention cache (KVCache or LatentCache), else the first RecurrentState (a stack
    of Gated DeltaNet layers only, tfjax.ops.linear_attention), else None."""
    if isinstance(cache, CACHES):
        return cache
    if isinstance(cache, RecurrentState):
        return None
    states = []
    for part in cache:
        if isinstance(part, RecurrentState):
            states.append(part)
        elif (found := _layer_cache(part)) is not None:
            return found
    return states[0] if states else None


def next_position(cache) -> jax.Array:
    """Where a layer's or a stack's cache puts the next token: how many it holds, [] int32 (the
    attention layers', which a stack's recurrent states count alike)."""
    cache = cache if isinstance(cache, RecurrentState) else _layer_cache(cache)
    return cache.index if cache.index.ndim == 0 else cache.index[0]


def max_length(cache) -> int:
    """S: the positions a layer's or a stack's cache has room for (its attention layers')."""
    cache = _layer_cache(cache)
    if not isinstance(cache, CACHES):
        raise ValueError("max_length: the cache has no attention layer (recurrent states only)")
    return cache[0].shape[-3 if isinstance(cache, KVCache) else -2]


def query_positions(length: int, positions=None, cache=None, counter=None) -> jax.Array:
    """The positions of `length` new tokens: `positions` when given ([T] or [B, T]); else [T]
    after what the explicit `cache` holds; else `counter(length)` when given (a Linen model's
    "cache" collection counting them); else 0 .. length - 1."""
    if positions is not None:
        return positions
    if cache is not None:
        return next_position(cache) + jnp.arange(length)
    if counter is not None:
        return counter(length)
    return jnp.arange(length)
