"""The KV cache of decoding as a pytree the caller holds (beside Flax's "cache" collection).

Letters: L layers, B batch, S cache length (the longest sequence decoded), K kv heads, H head dim.

A caller makes the cache with `init_cache` (zeros, laid out as it asks: its own dtype, a
sharding), passes it with each decoding call and gets the updated cache back, so the memory and
its layout are the caller's. A layer's cache is one `KVCache`; a stack's is one per layer, as its
parameters are: a tuple of L caches (unrolled layers) or one `KVCache` whose every leaf has a
leading layer axis [L, ...] (scanned layers).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class KVCache(NamedTuple):
    """One self-attention layer's keys and values at positions 0..S-1, of which the first
    `index` hold tokens (the attention masks the others, causally)."""

    keys: jax.Array  # [B, S, K, H] (RoPE applied)
    values: jax.Array  # [B, S, K, H]
    index: jax.Array  # [] int32: how many positions are written; the next token goes there


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
    shape = (batch_size, length, config.kv_heads, config.head_width(width))
    if num_layers is None:
        return _zeros(shape, dtype, sharding)
    if not scanned:
        return tuple(_zeros(shape, dtype, sharding) for _ in range(num_layers))
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
        )
    return _zeros((num_layers, *shape), dtype, sharding)


def _zeros(shape, dtype, sharding) -> KVCache:
    """A KVCache of zeros with `shape` keys and values, index 0 for each leading axis before B."""
    return KVCache(
        jnp.zeros(shape, dtype, device=sharding),
        jnp.zeros(shape, dtype, device=sharding),
        jnp.zeros(shape[:-4], jnp.int32),
    )


def write(cache: KVCache, k, v) -> KVCache:
    """One layer's cache with k, v [B, T, K, H] written at positions index..index + T - 1."""
    start = (0, cache.index, 0, 0)
    return KVCache(
        lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), start),
        lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), start),
        cache.index + k.shape[1],
    )


def next_position(cache) -> jax.Array:
    """Where a layer's or a stack's cache puts the next token: how many it holds, [] int32."""
    if not isinstance(cache, KVCache):
        cache = cache[0]
    return cache.index if cache.index.ndim == 0 else cache.index[0]


def max_length(cache) -> int:
    """S: the positions a layer's or a stack's cache has room for."""
    if not isinstance(cache, KVCache):
        cache = cache[0]
    return cache.keys.shape[-3]


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
