"""The multi-head attention module (Linen) over tfjax.ops' attention maths.

Letters: B batch, T query length, S key/value length, N query heads, K key/value heads, H head
dim, D model width; E = N * H (or K * H), heads and head dim as one axis in the projections'
2-D matmuls.

`MultiHeadAttention(config)` holds the projections and the KV cache; what it computes between
them is `tfjax.ops.multihead` and `tfjax.ops.attention.dot_product_attention` (four backends, see
there), which this module re-exports with the sharding of the logical rules in context.
"""

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.nn.norms import make_norm
from tfjax.ops import attention as _ops
from tfjax.ops import multihead
from tfjax.ops.attention import (  # noqa: F401 (re-exported)
    CHUNKED_MIN_LENGTH,
    IMPLEMENTATIONS,
    SPLASH_MIN_LENGTH,
    attention_weights,
    choose_implementation,
    cudnn_unsupported_reason,
)
from tfjax.ops.cache import KVCache, write
from tfjax.ops.config import (  # noqa: F401 (re-exported)
    AttentionConfig,
    LayerAttention,
    default_kernel_init,  # noqa: F401 (re-exported)
)
from tfjax.ops.linear_attention import gate_output


@functools.wraps(_ops.dot_product_attention)
def dot_product_attention(q, k, v, **kwargs):
    # The kernels that run per shard take the layout the logical rules in context give.
    kwargs.setdefault("sharding", axes.attention_sharding())
    return _ops.dot_product_attention(q, k, v, **kwargs)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query heads, cross-attention and a KV cache.

    Self-attention: `mha(x)`; cross-attention: `mha(x, context)`. In `decode=True` mode the
    keys and values of self-attention are appended to a cache, so each call may pass one new
    token (or a prompt): either the "cache" collection, sized by the input the cache was
    initialised with, or an explicit `cache=` (a tfjax.ops.KVCache), which the call returns
    updated: `y, cache = mha(x, decode=True, cache=cache)`.
    Calling with `mutable=["intermediates"]` also stores the [B, N, T, S] attention weights as
    "attention_weights"; the default path never computes them separately.
    """

    config: AttentionConfig  # what it computes (heads, biases, positions, backend, ...)
    kernel_init: Callable = default_kernel_init  # for all four projections
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype of the parameters

    @nn.compact
    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        bias=None,
        segment_ids=None,
        context_segment_ids=None,
        is_causal: bool = False,
        positions=None,
        train: bool = False,
        decode: bool = False,
        variant=None,
        cache: KVCache | None = None,
    ):
        """Attends from x to itself (context None) or to context.

        Args:
          x: [B, T, D] queries' input.
          context: [B, S, D'] keys' and values' input for cross-attention.
          mask: boolean, broadcastable to [B, N, T, S], True where a query may attend.
          bias: float, broadcastable to [B, N, T, S], added to the logits (T5's relative
            position bias; decoding: the queries against the whole cache's S keys).
          segment_ids: [B, T] ints: packed or padded rows (see dot_product_attention); the
            kernels take them without a [T, S] mask.
          context_segment_ids: [B, S] the context's ids (cross-attention).
          is_causal: self-attention sees only earlier and current positions.
          positions: [B, T] or [T] positions for RoPE / ALiBi; 0..T-1 (or the cache index
            onwards when decoding) when None.
          train: enables attention dropout (rng stream "dropout").
          decode: use and update the KV cache (self-attention only).
          variant: with several config.variants, the index of the one this call uses: an int,
            or a traced int32 scalar (a scanned stack's layer), which picks by `lax.switch`.
          cache: decode=True: this layer's KVCache [B, S, K, H], in place of the collection.
        Returns:
          [B, T, out_features]; with `cache`, ([B, T, out_features], the updated cache).
        """
        self_attention = context is None
        context = x if self_attention else context
        self._check_call(x, context, decode, cache, variant)
        decoding = decode and self_attention
        offset = self._cache_index(cache) if decoding else 0
        if positions is None:
            positions = offset + jnp.arange(x.shape[1])
        q, k, v = self._project_qkv(x, context)
        q, k, segment_ids, kv_segment_ids = multihead.prepare(
            q, k, self.config, self_attention, positions, variant, segment_ids, context_segment_ids
        )
        if decoding:
            if segment_ids is not None:
                raise ValueError(
                    "MultiHeadAttention: decode=True takes a mask, not segment_ids (the cache "
                    "keeps no ids)"
                )
            k, v, cache = self._update_cache(k, v, offset, cache)
        rate = self.config.dropout_rate if train else 0.0
        sow = self.is_mutable_collection("intermediates")
        sinks = self._sinks() if self.config.sinks else None
        out, weights = multihead.attend(
            q,
            k,
            v,
            self.config,
            positions=positions,
            self_attention=self_attention,
            decode_offset=offset if decoding else None,
            variant=variant,
            dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
            sharding=axes.attention_sharding(),
            with_weights=sow,
            mask=mask,
            bias=bias,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            is_causal=is_causal,
            sinks=sinks,
        )
        if sow:
            self.sow("intermediates", "attention_weights", weights)
        if self.config.output_gate:  # Qwen3.5: the output times sigmoid(x gate_kernel)
            n, h = out.shape[2:]
            out = gate_output(out, self._project("gate", x, n, h, axes.HEADS))
        out = self._project_out(out, x.shape[-1])
        return out if cache is None else (out, cache)

    def _check_call(self, x, context, decode, cache, variant):
        if x.ndim != 3:
            raise ValueError(f"MultiHeadAttention: x must be [B, T, D], got shape {x.shape}")
        if self.config.head_dim is None and x.shape[-1] % self.config.num_heads:
            raise ValueError(
                f"num_heads={self.config.num_heads} must divide the width {x.shape[-1]} (or set "
                "head_dim)"
            )
        if context.ndim != 3:
            raise ValueError(f"MultiHeadAttention: context must be [B, S, D], got {context.shape}")
        if cache is not None and not (decode and context is x):
            raise ValueError("MultiHeadAttention: a cache is for self-attention with decode=True")
        multihead.check_variant(self.config, variant)

    def _project_qkv(self, x, context):
        """Queries [B, T, N, H] from x, keys and values [B, S, K, H] from context (q and k
        normed per head with qk_norm; not yet rotated)."""
        n, kh = self.config.num_heads, self.config.kv_heads
        h = self.config.head_width(x.shape[-1])
        q = self._project("query", x, n, h, axes.HEADS)
        k = self._project("key", context, kh, h, axes.KV_HEADS)
        v = self._project("value", context, kh, h, axes.KV_HEADS)
        q = nn.with_logical_constraint(q, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        if self.config.qk_norm:
            q, k = self._head_norm("query_norm")(q), self._head_norm("key_norm")(k)
        return q, k, v

    def _head_norm(self, name):
        """RMSNorm over H with one scale [H] shared by all heads."""
        return make_norm(
            self.config.qk_norm_kind,
            eps=self.config.norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            axis_name=axes.HEAD_DIM,
        )

    def _project(self, name, x, heads, head_dim, head_axis):
        """[B, T, D] -> [B, T, heads, head_dim] by the `{name}_kernel` [D, heads, head_dim]."""
        d = x.shape[-1]
        kernel = self.param(
            f"{name}_kernel",
            nn.with_logical_partitioning(self.kernel_init, (axes.EMBED, head_axis, axes.HEAD_DIM)),
            (d, heads, head_dim),
            self.param_dtype,
        )
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        qkv_bias = self.config.qkv_bias
        bias = None
        if self.config.use_bias if qkv_bias is None else qkv_bias:
            bias = self._bias(f"{name}_bias", (heads, head_dim), (head_axis, axes.HEAD_DIM))
        # [B, T, N|K, H]
        return multihead.project(x, kernel, heads, head_dim, bias)

    def _bias(self, name, shape, names):
        """A zero-initialised bias parameter of `shape`."""
        return self.param(
            name,
            nn.with_logical_partitioning(nn.initializers.zeros, names),
            shape,
            self.param_dtype,
        )

    def _project_out(self, out, width):
        """[B, T, N, H] -> [B, T, out_features] (out_features: `width` when None)."""
        n, h = out.shape[2:]
        out_features = self.config.out_features or width
        out_kernel = self.param(
            "out_kernel",
            nn.with_logical_partitioning(self.kernel_init, (axes.HEADS, axes.HEAD_DIM, axes.EMBED)),
            (n, h, out_features),
            self.param_dtype,
        )
        out, out_kernel = nn.dtypes.promote_dtype(out, out_kernel, dtype=self.dtype)
        bias = None
        if self.config.use_bias:
            bias = self._bias("out_bias", (out_features,), (axes.EMBED,))
        # [B, T, D]
        return multihead.project_out(out, out_kernel, out_features, bias)

    def _sinks(self):
        """The attention sinks [N], one logit per query head (zero-initialised: at init each
        row's denominator gains exp(0 - its maximum logit))."""
        return self.param(
            "sinks",
            nn.with_logical_partitioning(nn.initializers.zeros, (axes.HEADS,)),
            (self.config.num_heads,),
            self.param_dtype,
        )

    def _cache_index(self, cache):
        """Where this call's tokens go in the cache: the explicit cache's index, else the
        collection's (0 before the cache exists)."""
        if cache is not None:
            return cache.index
        if not self.has_variable("cache", "cache_index"):
            return 0
        return self.get_variable("cache", "cache_index")

    def _update_cache(self, k, v, offset, cache):
        """(keys, values, the explicit cache updated or None): this call's keys/values written
        at `offset`, the whole cache's returned (keys at 0..; the caller masks what is not yet
        written, causally).

        In the collection, at initialisation (no cache yet) the cache is created with the
        input's length, which sets the maximum decode length, and the call computes ordinary
        causal attention.
        """
        if cache is not None:
            cache = write(cache, k, v)
            return cache.keys, cache.values, cache
        initialized = self.has_variable("cache", "cached_key")
        cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if initialized:
            written = write(KVCache(cached_k.value, cached_v.value, offset), k, v)
            cached_k.value, cached_v.value, index.value = written
            k, v = written.keys, written.values
        return k, v, None
