"""Scaled dot-product attention (four backends) and the multi-head attention module.

Letters: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per kv head (N = K * G), H head dim, D model width; E = N * H (or K * H), heads
and head dim as one axis in the projections' 2-D matmuls.

`dot_product_attention` computes softmax(Q K^T / sqrt(H)) V with grouped-query heads (and
optionally Gemma 2's soft cap on the logits, softcap * tanh(logits / softcap)):
- "xla": the plain formula (`_xla_attention`, below); materialises the [B, N, T, S] weights.
- "cudnn": cuDNN's fused flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16).
- "splash": the Pallas splash (flash) attention kernel for TPUs (tfjax.nn.splash): causal and
  segment-id masks, no dense mask, bias or dropout.
- "chunked": exact online softmax over key chunks with a hand-written backward pass that
  recomputes the weights chunk by chunk, so forward and backward memory grow linearly in S
  (tfjax.nn.chunked). Runs on every backend.
- None: `choose_implementation` picks one for the platform being compiled for (see there).

Packed and padded rows are best given as segment ids (`segment_ids`, `kv_segment_ids`): the
kernels compare ids block by block, where a dense [B, 1, T, S] mask is read whole.
"""

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tfjax.nn import axes, chunked, masks, position, splash
from tfjax.nn.norms import make_norm
from tfjax.nn.position import RopeScaling

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

# ----------------------------------------------------------------------------------------------
# The formula ("xla"): softmax(Q K^T * scale + bias, masked) V, written out.


def check_softcap(softcap) -> None:
    """Raises unless `softcap` is None or a positive number."""
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def _head_groups(num_heads, num_kv_heads):
    """How the einsums lay the query heads over the kv heads: (the query heads' axes, their
    einsum letters, the kv heads' letters).

    Grouped heads split N into [K, G], G query heads reading each kv head. Plain multi-head
    attention (K = N) keeps one head axis: the grouped form with G = 1 computes the same with
    a unit axis in every operand, which the plain form does not carry.
    """
    if num_kv_heads == num_heads:
        return (num_heads,), "n", "n"
    return (num_kv_heads, num_heads // num_kv_heads), "kg", "k"


def _heads_first(q, groups):
    """[B, T, N, H] -> [B, *groups, T, H]: head-major, as the matmuls take their operands."""
    b, t, _, h = q.shape
    # [B, T, *groups, H]
    q = q.reshape(b, t, *groups, h)
    return jnp.moveaxis(q, 1, -2)


def _heads_last(x):
    """[B, *groups, T, H] -> [B, T, N, H], the inverse of _heads_first."""
    # [B, T, *groups, H]
    x = jnp.moveaxis(x, -2, 1)
    b, t, h = x.shape[0], x.shape[1], x.shape[-1]
    # [B, T, N, H]
    return x.reshape(b, t, -1, h)


def _grouped_like_heads(x, groups):
    """A mask or bias broadcastable to [B, N, T, S] -> [b, *groups, t, s] (1s where x has 1)."""
    if x is None:
        return None
    # [b, n, t, s]
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    return x.reshape(b, *(groups if n > 1 else (1,) * len(groups)), t, s)


def _logits(
    q, k, *, mask, bias, segment_ids, kv_segment_ids, is_causal, window, scale, softcap=None
):
    """Capped, biased, masked float32 logits [B, *groups, T, S] (see _head_groups) and the head
    letters."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups, q_heads, kv_heads = _head_groups(n, kh)
    scale = h**-0.5 if scale is None else scale
    # Scale q ([B, T, N, H]), not the [B, N, T, S] logits: T*N*H multiplies instead of T*N*S.
    # As in flax.linen's attention, the product is rounded in q's dtype.
    q = q * jnp.asarray(scale, q.dtype)
    # The matmuls take head-major operands, [B, *groups, T, H] and [B, N|K, S, H]: batch and
    # heads lead, the contracted H is last (the layouts measured: benchmarks/attention_layouts.py).
    # [B, N|K, S, H]
    kt = jnp.swapaxes(k, 1, 2)
    # [B, N, T, S] or [B, K, G, T, S]
    logits = _einsum_f32(f"b{q_heads}th,b{kv_heads}sh->b{q_heads}ts", _heads_first(q, groups), kt)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + _grouped_like_heads(bias, groups).astype(jnp.float32)
    # [B|1, N|1, T, S]
    allowed = masks.combine_masks(
        mask,
        masks.block_mask(
            jnp.arange(t),
            jnp.arange(s),
            is_causal=is_causal,
            window=window,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
        ),
    )
    return masks.masked_logits(logits, _grouped_like_heads(allowed, groups)), q_heads, kv_heads


def attention_weights(
    q,
    k,
    *,
    mask=None,
    bias=None,
    segment_ids=None,
    kv_segment_ids=None,
    is_causal=False,
    window=None,
    scale=None,
    softcap=None,
):
    """[B, N, T, S] softmax weights in float32 (for inspection; the "xla" path uses the same
    logits but normalises its output instead). Arguments as in dot_product_attention."""
    b, t, n, _ = q.shape
    logits, _, _ = _logits(
        q,
        k,
        mask=mask,
        bias=bias,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        is_causal=is_causal,
        window=window,
        scale=scale,
        softcap=softcap,
    )
    # [B, *groups, T, S] -> [B, N, T, S]
    return jax.nn.softmax(logits, axis=-1).reshape(b, n, t, k.shape[1])


def _xla_attention(
    q,
    k,
    v,
    mask,
    bias,
    segment_ids,
    kv_segment_ids,
    is_causal,
    window,
    scale,
    softcap,
    dropout_rate,
    dropout_rng,
):
    b, t, n, _ = q.shape
    # [B, *groups, T, S]
    logits, q_heads, kv_heads = _logits(
        q,
        k,
        mask=mask,
        bias=bias,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        is_causal=is_causal,
        window=window,
        scale=scale,
        softcap=softcap,
    )
    # The softmax's division is applied to the [.., T, H] output rather than to the [.., T, S]
    # weights, as flash attention does: one pass fewer over the largest tensor, and no
    # [.., T, S] broadcast of the row sums.
    unnormalised = jnp.exp(logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True)))
    row_sums = unnormalised.sum(-1, keepdims=True)
    if dropout_rate > 0.0:  # on the weights, whose row sums stay those before dropout
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, (b, n, t, k.shape[1]))
        keep = keep.reshape(unnormalised.shape)
        unnormalised = jnp.where(keep, unnormalised / (1.0 - dropout_rate), 0.0)
    # [B, N|K, S, H] (head-major, as in _logits)
    vt = jnp.swapaxes(v, 1, 2)
    weights = unnormalised.astype(v.dtype)
    # [B, *groups, T, H]
    out = _einsum_f32(f"b{q_heads}ts,b{kv_heads}sh->b{q_heads}th", weights, vt)
    return _heads_last(out / row_sums).astype(v.dtype)


def _chunked_attention(
    q,
    k,
    v,
    mask,
    bias,
    segment_ids,
    kv_segment_ids,
    is_causal,
    window,
    scale,
    softcap,
    dropout_rate,
    dropout_rng,
    chunk_size,
):
    """The chunked kernel (tfjax.nn.chunked) on [B, T, N, H] queries; its einsums take them
    grouped by kv head, [B, K, G, T, H], G = 1 included."""
    n, kh = q.shape[2], k.shape[2]
    groups = (kh, n // kh)
    # [B, K, G, T, H]
    out = chunked.chunked_attention(
        _heads_first(q, groups),
        k,
        v,
        mask=_grouped_like_heads(mask, groups),
        bias=_grouped_like_heads(bias, groups),
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        is_causal=is_causal,
        window=window,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        chunk_size=chunk_size,
        softcap=softcap,
    )
    # [B, T, N, H]
    return _heads_last(out)


# ----------------------------------------------------------------------------------------------
# The backends: which one runs, and the call.


def check_implementation(implementation) -> None:
    """Raises when `implementation` names no backend (None, the automatic choice, is one)."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"implementation={implementation!r} is unknown; allowed: None, "
            + ", ".join(repr(i) for i in IMPLEMENTATIONS)
        )


def _check_inputs(
    q,
    k,
    v,
    mask,
    bias,
    segment_ids,
    kv_segment_ids,
    window,
    softcap,
    implementation,
    dropout_rate,
    dropout_rng,
):
    check_implementation(implementation)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys per query) or None, got {window!r}")
    check_softcap(softcap)
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
    for name, x, shape in (
        ("segment_ids [B, T]", segment_ids, q.shape[:2]),
        ("kv_segment_ids [B, S]", kv_segment_ids, k.shape[:2]),
    ):
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


def cudnn_unsupported_reason(
    q, k, dropout_rate=0.0, platform: str | None = None, window=None, softcap=None
) -> str | None:
    """Why cuDNN cannot run this call on `platform` (the target's when None), or None when it
    can."""
    platform = platform or target_platform()
    if platform != "gpu":
        return f"it needs a GPU and the target is {platform!r}"
    if window is not None:  # jax.nn's local_window_size is not wired in (no GPU to test it)
        return "tfjax does not pass a sliding window to it yet"
    if softcap is not None:
        return "jax.nn.dot_product_attention has no logit soft-capping (softcap)"
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


def _unavailable_reason(
    implementation, q, k, mask, bias, window, dropout_rate, platform, softcap=None
) -> str | None:
    """Why `implementation` cannot run this call on `platform`, or None when it can."""
    if implementation == "cudnn":
        return cudnn_unsupported_reason(q, k, dropout_rate, platform, window, softcap)
    if implementation == "splash":
        reason = splash.unsupported_reason(
            mask=mask, bias=bias, window=window, dropout_rate=dropout_rate, softcap=softcap
        )
        if reason is None and platform == "gpu":
            reason = "it is a TPU kernel and the target is a GPU"
        return reason
    return None


def _unfused(key_length: int) -> str:
    """The implementation without a fused kernel: "chunked" for long keys, else "xla"."""
    return "chunked" if key_length >= CHUNKED_MIN_LENGTH else "xla"


def choose_implementation(
    q,
    k,
    *,
    mask=None,
    bias=None,
    window=None,
    dropout_rate=0.0,
    platform: str | None = None,
    softcap=None,
) -> str:
    """The implementation `implementation=None` runs, for the target platform (the one place
    where that is decided): cuDNN on GPUs where it applies; from SPLASH_MIN_LENGTH keys the
    splash kernel on TPUs where it applies; from CHUNKED_MIN_LENGTH keys "chunked"; else "xla".
    """
    platform = platform or target_platform()
    s = k.shape[1]
    args = (q, k, mask, bias, window, dropout_rate, platform, softcap)
    if platform == "gpu" and _unavailable_reason("cudnn", *args) is None:
        return "cudnn"
    if (
        platform == "tpu"
        and s >= SPLASH_MIN_LENGTH
        and _unavailable_reason("splash", *args) is None
    ):
        return "splash"
    return _unfused(s)


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


def _cudnn_attention(
    q, k, v, mask, bias, segment_ids, kv_segment_ids, is_causal, scale, requested: bool
):
    """cuDNN's fused attention; None when it fails and was not `requested` by name (then a
    slower path runs)."""
    if segment_ids is not None:  # it takes a dense [B, 1, T, S] mask
        mask = masks.combine_masks(mask, masks.segment_mask(segment_ids, kv_segment_ids))
    try:
        q, k, v = _sharded_alike(q, k, v)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            scale=scale,
            is_causal=is_causal,
            implementation="cudnn",
        )
    except Exception as e:  # an unsupported shape or cuDNN version: a slower path works
        if requested:
            raise
        _warn_once(
            f"cuDNN attention is not available ({str(e).splitlines()[0]}); "
            "attention runs without it, with more memory"
        )
        return None


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
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    implementation: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """softmax(cap(Q K^T * scale) + bias, masked) V with grouped-query heads.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; K divides N (K = N: multi-head, K = 1: multi-query).
      mask: boolean, True where a query may attend, broadcastable to [B, N, T, S].
      bias: additive float bias broadcastable to [B, N, T, S] (ALiBi, relative positions).
      segment_ids: [B, T] ints for packed or padded rows: a query attends only to keys of its
        own id, and id 0 (padding) to none (as `masks.segment_mask`; ANDed with `mask`).
      kv_segment_ids: [B, S] the keys' ids; segment_ids when None (self-attention).
      is_causal: query t attends only keys s <= t; no [T, S] mask is materialised.
      window: query t attends only keys s > t - window (sliding-window attention; with
        is_causal the `window` keys up to t), built like is_causal.
      scale: logit scale; 1/sqrt(H) when None.
      softcap: None, or the soft cap of the scaled logits: cap(x) = softcap * tanh(x / softcap)
        (Gemma 2; splash and cuDNN do not take it, so the automatic choice passes them over).
      dropout_rate: dropout on the attention weights (needs dropout_rng).
      implementation: "xla", "cudnn", "splash", "chunked" or None (`choose_implementation`).
      chunk_size: key chunk length C of the "chunked" path.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    _check_inputs(
        q,
        k,
        v,
        mask,
        bias,
        segment_ids,
        kv_segment_ids,
        window,
        softcap,
        implementation,
        dropout_rate,
        dropout_rng,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    platform = target_platform()
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    requested = implementation is not None
    if implementation is None:
        implementation = choose_implementation(
            q,
            k,
            mask=mask,
            bias=bias,
            window=window,
            dropout_rate=dropout_rate,
            platform=platform,
            softcap=softcap,
        )
    else:
        reason = _unavailable_reason(
            implementation, q, k, mask, bias, window, dropout_rate, platform, softcap
        )
        if reason:
            raise ValueError(f'implementation="{implementation}" is not available: {reason}')
    if implementation == "splash":
        return splash.splash_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            is_causal=is_causal,
            scale=scale,
            interpret=platform != "tpu",
        )
    if implementation == "cudnn":
        out = _cudnn_attention(
            q, k, v, mask, bias, segment_ids, kv_segment_ids, is_causal, scale, requested
        )
        if out is not None:
            return out
        implementation = _unfused(k.shape[1])
    if implementation == "chunked":
        return _chunked_attention(
            q,
            k,
            v,
            mask,
            bias,
            segment_ids,
            kv_segment_ids,
            is_causal,
            window,
            scale,
            softcap,
            dropout_rate,
            dropout_rng,
            chunk_size,
        )
    return _xla_attention(
        q,
        k,
        v,
        mask,
        bias,
        segment_ids,
        kv_segment_ids,
        is_causal,
        window,
        scale,
        softcap,
        dropout_rate,
        dropout_rng,
    )


# ----------------------------------------------------------------------------------------------
# The module.

default_kernel_init = nn.initializers.xavier_uniform()
POSITIONS = (None, "rope", "alibi")
QK_NORMS = ("rms", "rms_plus_one")


class LayerAttention(NamedTuple):
    """What may differ between the self-attention of a stack's layers while their parameters
    have one shape: Gemma's local (sliding-window) and global layers, each with its RoPE."""

    sliding_window: int | None = None  # keys within the last this many positions; all when None
    rope_base: float = 10_000.0  # RoPE wavelength base
    rope_scaling: RopeScaling | None = None  # RoPE past the training length


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
    qkv_bias: bool | None = (
        None  # biases on Q, K, V (Qwen 2: not on the output); use_bias when None
    )
    qk_norm: bool = False  # RMSNorm of each query and key head over H, before RoPE (Qwen 3)
    qk_norm_kind: str = "rms"  # qk_norm's norm: "rms" or "rms_plus_one" (Gemma 3)
    norm_eps: float = 1e-6  # qk_norm's epsilon
    dropout_rate: float = 0.0  # dropout on the attention weights
    position: str | None = None  # None, "rope" or "alibi" (self-attention only)
    rope_base: float = 10_000.0  # RoPE wavelength base
    rope_scaling: RopeScaling | None = None  # RoPE past the training length (Llama 3.1)
    sliding_window: int | None = None  # self-attention sees only the last this many positions
    variants: tuple[LayerAttention, ...] = ()  # per-layer alternatives to the three fields
    # above, one picked by each call's `variant` (Gemma's local and global layers); () for none
    scale: float | None = None  # logit scale; head_dim**-0.5 when None (Gemma: a config's)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
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
        if self.qk_norm_kind not in QK_NORMS:
            raise ValueError(f"qk_norm_kind={self.qk_norm_kind!r} is unknown; allowed: {QK_NORMS}")
        check_implementation(self.implementation)
        check_softcap(self.softcap)
        super().__post_init__()

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
          variant: with `variants`, the index of the one this call uses: an int, or a traced
            int32 scalar (a scanned stack's layer), which picks by `lax.switch`.
        Returns:
          [B, T, out_features].
        """
        self_attention = context is None
        context = x if self_attention else context
        self._check_shapes(x, context)
        decoding = decode and self_attention
        offset = self._cache_index() if decoding else 0
        if positions is None:
            positions = offset + jnp.arange(x.shape[1])
        choices = self.variants or (
            LayerAttention(self.sliding_window, self.rope_base, self.rope_scaling),
        )
        if len(choices) > 1 and variant is None:
            raise ValueError(
                f"MultiHeadAttention: {len(choices)} variants need the call's `variant` (an index)"
            )
        q, k, v = self._project_qkv(x, context)
        if self_attention and self.position == "rope":

            def rotate(choice):
                return tuple(
                    position.rope(y, positions, base=choice.rope_base, scaling=choice.rope_scaling)
                    for y in (q, k)
                )

            q, k = _by_variant(variant, choices, rotate)
        if self_attention:
            kv_segment_ids = segment_ids
        else:
            segment_ids, kv_segment_ids = _ids_on_both_sides(
                segment_ids, context_segment_ids, x, context
            )
        if decoding:
            if segment_ids is not None:
                raise ValueError(
                    "MultiHeadAttention: decode=True takes a mask, not segment_ids (the cache "
                    "keeps no ids)"
                )
            k, v = self._update_cache(k, v, offset)
        if self_attention and self.position == "alibi":
            alibi = position.alibi_bias(q.shape[2], positions, jnp.arange(k.shape[1]))
            bias = alibi if bias is None else bias + alibi
        rate = self.dropout_rate if train else 0.0
        dropout_rng = self.make_rng("dropout") if rate > 0.0 else None
        sow = self.is_mutable_collection("intermediates")

        def attend(choice):
            window = choice.sliding_window if self_attention else None
            patterns = dict(
                mask=mask,
                bias=bias,
                segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids,
                is_causal=is_causal,
                window=window,
                scale=self.scale,
                softcap=self.softcap,
            )
            if decoding:  # the queries at offset.., the whole cache's keys at 0..
                causal = masks.block_mask(
                    offset + jnp.arange(q.shape[1]),
                    jnp.arange(k.shape[1]),
                    is_causal=True,
                    window=window,
                )
                patterns.update(
                    mask=masks.combine_masks(mask, causal), is_causal=False, window=None
                )
            weights = attention_weights(q, k, **patterns) if sow else None
            out = dot_product_attention(
                q,
                k,
                v,
                **patterns,
                dropout_rate=rate,
                dropout_rng=dropout_rng,
                implementation=self.implementation,
            )
            return out, weights

        out, weights = _by_variant(variant, choices, attend)
        if sow:
            self.sow("intermediates", "attention_weights", weights)
        return self._project_out(out, x.shape[-1])

    def _check_shapes(self, x, context):
        if x.ndim != 3:
            raise ValueError(f"MultiHeadAttention: x must be [B, T, D], got shape {x.shape}")
        if self.head_dim is None and x.shape[-1] % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must divide the width {x.shape[-1]} (or set head_dim)"
            )
        if context.ndim != 3:
            raise ValueError(f"MultiHeadAttention: context must be [B, S, D], got {context.shape}")

    def _project_qkv(self, x, context):
        """Queries [B, T, N, H] from x, keys and values [B, S, K, H] from context (q and k
        normed per head with qk_norm; not yet rotated)."""
        n = self.num_heads
        kh = self.num_kv_heads or n
        h = self.head_dim or x.shape[-1] // n
        q = self._project("query", x, n, h, axes.HEADS)
        k = self._project("key", context, kh, h, axes.KV_HEADS)
        v = self._project("value", context, kh, h, axes.KV_HEADS)
        q = nn.with_logical_constraint(q, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        if self.qk_norm:
            q, k = self._head_norm("query_norm")(q), self._head_norm("key_norm")(k)
        return q, k, v

    def _head_norm(self, name):
        """RMSNorm over H with one scale [H] shared by all heads."""
        return make_norm(
            self.qk_norm_kind,
            eps=self.norm_eps,
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
        # One 2-D matmul with the kernel seen as [D, E] (a free reshape), the form of a plain
        # dense layer.
        # [B, T, E]
        y = jnp.einsum("btd,de->bte", x, kernel.reshape(d, heads * head_dim))
        # [B, T, N|K, H]
        y = y.reshape(*x.shape[:2], heads, head_dim)
        if self.use_bias if self.qkv_bias is None else self.qkv_bias:
            b = self.param(
                f"{name}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (head_axis, axes.HEAD_DIM)),
                (heads, head_dim),
                self.param_dtype,
            )
            y = y + b.astype(y.dtype)
        return y

    def _project_out(self, out, width):
        """[B, T, N, H] -> [B, T, out_features] (out_features: `width` when None)."""
        n, h = out.shape[2:]
        out_features = self.out_features or width
        out_kernel = self.param(
            "out_kernel",
            nn.with_logical_partitioning(self.kernel_init, (axes.HEADS, axes.HEAD_DIM, axes.EMBED)),
            (n, h, out_features),
            self.param_dtype,
        )
        out, out_kernel = nn.dtypes.promote_dtype(out, out_kernel, dtype=self.dtype)
        # [B, T, E] (a 2-D matmul, as in _project)
        out = out.reshape(*out.shape[:2], n * h)
        # [B, T, D]
        y = jnp.einsum("bte,ed->btd", out, out_kernel.reshape(n * h, out_features))
        if self.use_bias:
            b = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
                (out_features,),
                self.param_dtype,
            )
            y = y + b.astype(y.dtype)
        return y

    def _cache_index(self):
        """Where this call's tokens go in the cache: 0 before the cache exists."""
        if not self.has_variable("cache", "cache_index"):
            return 0
        return self.get_variable("cache", "cache_index")

    def _update_cache(self, k, v, offset):
        """Writes this call's keys/values at `offset`; returns the whole cache (keys at 0..; the
        caller masks what is not yet written, causally).

        At initialisation (no cache yet) the cache is created with the input's length, which
        sets the maximum decode length, and the call computes ordinary causal attention.
        """
        initialized = self.has_variable("cache", "cached_key")
        cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        t = k.shape[1]
        if initialized:
            start = (0, offset, 0, 0)
            cached_k.value = lax.dynamic_update_slice(
                cached_k.value, k.astype(cached_k.value.dtype), start
            )
            cached_v.value = lax.dynamic_update_slice(
                cached_v.value, v.astype(cached_v.value.dtype), start
            )
            index.value = offset + t
            k, v = cached_k.value, cached_v.value
        return k, v


def _by_variant(variant, choices, fn):
    """fn(choices[variant]): directly for one choice or a Python int, else by `lax.switch` on
    the traced index (every branch traced, one run)."""
    if len(choices) == 1:
        return fn(choices[0])
    if isinstance(variant, int):
        return fn(choices[variant])
    return lax.switch(variant, [functools.partial(fn, c) for c in choices])


def _ids_on_both_sides(segment_ids, kv_segment_ids, x, context):
    """Cross-attention's (query ids, key ids): when one side has ids and the other none, the
    other side's rows are all real (id 1)."""
    if segment_ids is None and kv_segment_ids is not None:
        segment_ids = jnp.ones(x.shape[:2], jnp.int32)
    elif kv_segment_ids is None and segment_ids is not None:
        kv_segment_ids = jnp.ones(context.shape[:2], jnp.int32)
    return segment_ids, kv_segment_ids
