"""Gated DeltaNet linear attention (Qwen3.5's "linear_attention" layers) given its parameters,
its decoding state (`RecurrentState`), and the output gate and partial RoPE of Qwen3.5's gated
full-attention layers; a module system holds the parameters (tfjax.nnx.linear_attention in NNX,
tfjax.nn.linear_attention in Linen), by the names below.

Letters: B batch, T length, D width, K query/key heads, N value heads (K divides N: each key
head serves N/K consecutive value heads), Hk and Hv their head dims, W the convolution's width,
C = 2 K Hk + N Hv the convolved channels, L layers.

    q, k, v   x Wq [B, T, K, Hk], x Wk, x Wv [B, T, N, Hv]; then, concatenated, the depthwise
              causal convolution of width W and SiLU (tfjax.ops.delta_rule.causal_conv1d)
    beta      sigmoid(x Wb) [B, T, N]                   the rule's write rates
    g         -exp(a_log) softplus(x Wdt + dt_bias)     its log decays, in float32
    o         gated_delta_rule(q, k, v, g, beta)        q and k L2-normalised, q / sqrt(Hk)
    z         x Wz [B, T, N, Hv];  y = (rms(o) * out_norm * silu(z)) Wo          [B, T, D]

transformers' Qwen3.5 layer (Qwen3_5GatedDeltaNet) projects q, k, v in one matrix and z, b, a
in three more (Qwen3-Next fuses q, k, v, z per key-head group instead); tfjax keeps one kernel
per part with its head axes, so heads shard alike everywhere; tfjax.interop.core.
linear_attention converts between the two.

Parameters (shapes; logical axes in tfjax.ops.axes, None: replicated):
  query_kernel, key_kernel [D, K, Hk] (embed, kv_heads, head_dim)
  value_kernel, gate_kernel [D, N, Hv] (embed, heads, head_dim)
  query_conv, key_conv [W, K, Hk], value_conv [W, N, Hv] (None, heads axes as above)
  beta_kernel, dt_kernel [D, N] (embed, heads);  dt_bias, a_log [N] (heads)
  out_norm [Hv] (head_dim);  out_kernel [N, Hv, D] (heads, head_dim, embed)

Decoding keeps, per layer, a `RecurrentState` of fixed size whatever the context: the last W - 1
convolution inputs and the rule's state [N, Hk, Hv] per row.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tfjax.ops import axes, delta_rule, position
from tfjax.ops.norms import rms_norm


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """A Gated DeltaNet layer (Qwen3.5's linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim, rms_norm_eps)."""

    num_key_heads: int  # K, the queries' and keys' heads
    num_value_heads: int  # N, the values' heads and the state's; a multiple of K
    key_head_dim: int  # Hk
    value_head_dim: int  # Hv
    conv_kernel_size: int = 4  # W
    norm_eps: float = 1e-6  # the gated output norm's
    implementation: str | None = None  # the rule's (tfjax.ops.delta_rule.gated_delta_rule)
    chunk_size: int = delta_rule.DEFAULT_CHUNK_SIZE

    def __post_init__(self):
        for field in (
            "num_key_heads",
            "num_value_heads",
            "key_head_dim",
            "value_head_dim",
            "conv_kernel_size",
            "chunk_size",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"LinearAttentionConfig: {field} must be an int >= 1, got {value!r}"
                )
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"LinearAttentionConfig: num_value_heads={self.num_value_heads} must be a "
                f"multiple of num_key_heads={self.num_key_heads}"
            )
        eps = self.norm_eps
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"LinearAttentionConfig: norm_eps must be a number > 0, got {eps!r}")
        allowed = (None, *delta_rule.IMPLEMENTATIONS)
        if self.implementation not in allowed:
            raise ValueError(
                f"LinearAttentionConfig: implementation={self.implementation!r} is unknown; "
                f"allowed: {allowed}"
            )

    @property
    def key_width(self) -> int:
        """K Hk: the queries' (and the keys') channels."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_width(self) -> int:
        """N Hv: the values' channels."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        """C = 2 K Hk + N Hv, the convolved channels (queries, keys, values in this order)."""
        return 2 * self.key_width + self.value_width


def parameter_shapes(config: LinearAttentionConfig, width: int) -> dict:
    """{name: (shape, logical axes, initializer kind)} of a Gated DeltaNet layer's parameters on
    inputs of `width` D; kinds as `initializers`' keys."""
    kh, n, hk, hv, w = (
        config.num_key_heads,
        config.num_value_heads,
        config.key_head_dim,
        config.value_head_dim,
        config.conv_kernel_size,
    )
    keys, values = (axes.KV_HEADS, axes.HEAD_DIM), (axes.HEADS, axes.HEAD_DIM)
    return {
        "query_kernel": ((width, kh, hk), (axes.EMBED, *keys), "kernel"),
        "key_kernel": ((width, kh, hk), (axes.EMBED, *keys), "kernel"),
        "value_kernel": ((width, n, hv), (axes.EMBED, *values), "kernel"),
        "gate_kernel": ((width, n, hv), (axes.EMBED, *values), "kernel"),
        "query_conv": ((w, kh, hk), (None, *keys), "conv"),
        "key_conv": ((w, kh, hk), (None, *keys), "conv"),
        "value_conv": ((w, n, hv), (None, *values), "conv"),
        "beta_kernel": ((width, n), (axes.EMBED, axes.HEADS), "kernel"),
        "dt_kernel": ((width, n), (axes.EMBED, axes.HEADS), "kernel"),
        "dt_bias": ((n,), (axes.HEADS,), "ones"),
        "a_log": ((n,), (axes.HEADS,), "a_log"),
        "out_norm": ((hv,), (axes.HEAD_DIM,), "ones"),
        "out_kernel": ((n, hv, width), (*values, axes.EMBED), "kernel"),
    }


def initializers(kernel_init) -> dict:
    """{kind: init(key, shape, dtype)}: the projections' `kernel_init`; the convolution's
    uniform in +-1/sqrt(W) (PyTorch's Conv1d default); ones (norm scale, dt_bias, as
    transformers); a_log = log(A), A uniform in [0.01, 16] (transformers' Qwen3.5)."""

    def conv(key, shape, dtype):
        bound = shape[0] ** -0.5
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    def a_log(key, shape, dtype):
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)

    return {"kernel": kernel_init, "conv": conv, "ones": jax.nn.initializers.ones, "a_log": a_log}


class RecurrentState(NamedTuple):
    """One Gated DeltaNet layer's decoding state after `index` tokens; its size does not grow
    with them."""

    conv: jax.Array  # [B, W - 1, C] the last W - 1 convolution inputs (q, k, v channels)
    state: jax.Array  # [B, N, Hk, Hv] the delta rule's state (float32 unless asked)
    index: jax.Array  # [] int32: how many tokens it has seen (the next token's position)


def init_recurrent_state(
    config: LinearAttentionConfig,
    batch_size: int,
    *,
    num_layers: int | None = None,
    scanned: bool = False,
    dtype=jnp.float32,
    state_dtype=jnp.float32,
):
    """An empty (zero) RecurrentState for `config`, laid out as tfjax.ops.cache.init_cache lays
    out KV caches: one layer's when num_layers is None; else a tuple of num_layers (unrolled
    layers), or with `scanned` one RecurrentState whose leaves have a leading [L] axis.

    Args:
      dtype: the convolution inputs' (the model's compute dtype keeps them exactly).
      state_dtype: the rule's state's; float32, the rule's compute dtype, by default.
    """
    conv = (batch_size, config.conv_kernel_size - 1, config.conv_channels)
    n, hk, hv = config.num_value_heads, config.key_head_dim, config.value_head_dim

    def zeros(lead):
        return RecurrentState(
            jnp.zeros((*lead, *conv), dtype),
            jnp.zeros((*lead, batch_size, n, hk, hv), state_dtype),
            jnp.zeros(lead, jnp.int32),
        )

    if num_layers is None:
        return zeros(())
    if scanned:
        return zeros((num_layers,))
    return tuple(zeros(()) for _ in range(num_layers))


def conv_kernel(p: dict, config: LinearAttentionConfig) -> jax.Array:
    """[W, C]: the query, key and value convolutions as one depthwise kernel."""
    w = config.conv_kernel_size
    parts = (p[f"{name}_conv"].reshape(w, -1) for name in ("query", "key", "value"))
    return jnp.concatenate(list(parts), axis=-1)


def gated_deltanet(x, p: dict, config: LinearAttentionConfig, *, segment_ids=None, cache=None):
    """A Gated DeltaNet layer (see the module docstring) on x [B, T, D].

    Args:
      p: the parameters by name, in the compute dtype (x's).
      segment_ids: [B, T] ints for packed or padded rows (tfjax.ops.masks' convention): each
        segment starts from a zero state (the row's first from `cache`'s); padding (0) neither
        reads nor writes the state, and its outputs are zero.
      cache: a RecurrentState the T tokens continue (prefill from init_recurrent_state's,
        or decoding a token or a few).
    Returns:
      (y [B, T, D], the RecurrentState after the T tokens, or None without `cache`).
    """
    b, t, _ = x.shape
    kh, n = config.num_key_heads, config.num_value_heads
    q = jnp.einsum("btd,dkh->btkh", x, p["query_kernel"])
    k = jnp.einsum("btd,dkh->btkh", x, p["key_kernel"])
    v = jnp.einsum("btd,dnh->btnh", x, p["value_kernel"])
    mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], -1)
    mixed, conv_state = delta_rule.causal_conv1d(
        mixed,
        conv_kernel(p, config),
        state=None if cache is None else cache.conv.astype(x.dtype),
        segment_ids=segment_ids,
    )
    q, k, v = jnp.split(mixed, [config.key_width, 2 * config.key_width], axis=-1)
    q = q.reshape(b, t, kh, config.key_head_dim)
    k = k.reshape(b, t, kh, config.key_head_dim)
    v = v.reshape(b, t, n, config.value_head_dim)
    beta = jax.nn.sigmoid(jnp.einsum("btd,dn->btn", x, p["beta_kernel"]))
    dt = jnp.einsum("btd,dn->btn", x, p["dt_kernel"]).astype(jnp.float32)
    a = jnp.exp(p["a_log"].astype(jnp.float32))
    g = -a * jax.nn.softplus(dt + p["dt_bias"].astype(jnp.float32))
    out, state = delta_rule.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=None if cache is None else cache.state,
        segment_ids=segment_ids,
        implementation=config.implementation,
        chunk_size=config.chunk_size,
    )
    z = jnp.einsum("btd,dnh->btnh", x, p["gate_kernel"])
    out = gated_rms_norm(out, z, p["out_norm"], eps=config.norm_eps)
    y = jnp.einsum("btnh,nhd->btd", out, p["out_kernel"])
    if cache is None:
        return y, None
    new = RecurrentState(
        conv_state.astype(cache.conv.dtype), state.astype(cache.state.dtype), cache.index + t
    )
    return y, new


def gated_rms_norm(x, gate, w, *, eps: float):
    """rms_norm(x) * w * silu(gate) over the last axis (the gate in float32), in x's dtype:
    Gated DeltaNet's output norm (transformers' Qwen3_5RMSNormGated, norm before gate)."""
    out = rms_norm(x, w, eps=eps).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return out.astype(x.dtype)


# Qwen3.5's gated full attention. Its query projection gives each head 2H channels, the query's
# H then an output gate's H; the attention's output is multiplied by sigmoid(gate) before the
# output projection, and RoPE rotates only the first rotary_dim = partial_rotary_factor * H
# channels of each query and key head (their frequencies base^(-2i / rotary_dim)).


def gate_output(out, gate):
    """out * sigmoid(gate), both [B, T, N, H] (the gate in float32), in out's dtype: the gated
    attention's output before its output projection."""
    return (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)


def partial_rope(x, positions, rotary_dim: int, *, base: float = 10_000.0, scaling=None):
    """tfjax.ops.position.rope on the first `rotary_dim` channels of x [B, T, N, H] (even, at
    most H), the rest passed through: Qwen3.5's (and GLM's, Phi's) partial rotary."""
    h = x.shape[-1]
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 0 < rotary_dim <= h:
        raise ValueError(f"rotary_dim: {rotary_dim!r}, want an even int in (0, {h}]")
    rotated = position.rope(x[..., :rotary_dim], positions, base=base, scaling=scaling)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
