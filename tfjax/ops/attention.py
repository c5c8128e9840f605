"""Scaled dot-product attention with four backends, framework-free (JAX only).

Letters: B batch, T query length, S key/value length, N query heads, K key/value heads,
G query heads per kv head (N = K * G), H head dim, D model width; E = N * H (or K * H), heads
and head dim as one axis in the projections' 2-D matmuls.

`dot_product_attention` computes softmax(Q K^T / sqrt(H)) V with grouped-query heads (and
optionally Gemma 2's soft cap on the logits, softcap * tanh(logits / softcap), and GPT-OSS's
attention sinks: a learned logit per query head that joins every row's softmax denominator and
adds no value, so a query may give part of its weight to nothing):
- "xla": the plain formula (`_xla_attention`, below); materialises the [B, N, T, S] weights.
- "cudnn": cuDNN's fused flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16).
- "splash": the Pallas splash (flash) attention kernel for TPUs (tfjax.ops.splash): causal and
  segment-id masks, no dense mask, bias or dropout.
- "chunked": exact online softmax over key chunks with a hand-written backward pass that
  recomputes the weights chunk by chunk, so forward and backward memory grow linearly in S
  (tfjax.ops.chunked). Runs on every backend.
- None: `choose_implementation` picks one for the platform being compiled for (see there).

Packed and padded rows are best given as segment ids (`segment_ids`, `kv_segment_ids`): the
kernels compare ids block by block, where a dense [B, 1, T, S] mask is read whole.

The sharded kernels (splash, cuDNN) need to know how a mesh splits the activations: the caller
passes it as `sharding`, a PartitionSpec of [B, T, N, H] (tfjax.nn resolves it from the logical
axis rules in context), so nothing here depends on a module system.
"""

import functools
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tfjax.ops import activations, chunked, masks, splash

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


def check_window(window, name: str = "window") -> None:
    """Raises unless `window` (keys per query) is None or a positive int."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name} must be a positive int (keys per query) or None, got {window!r}")


class Pattern(NamedTuple):
    """What shapes a call's logits besides q and k: which pairs may attend, the additive bias,
    the scale and the soft cap (the arguments of the same names of dot_product_attention)."""

    mask: Any = None
    bias: Any = None
    segment_ids: Any = None
    kv_segment_ids: Any = None
    is_causal: bool = False
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: Any = None


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


def _logits(q, k, p: Pattern):
    """Capped, biased, masked float32 logits [B, *groups, T, S] (see _head_groups) and the head
    letters."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups, q_heads, kv_heads = _head_groups(n, kh)
    scale = h**-0.5 if p.scale is None else p.scale
    # Scale q ([B, T, N, H]), not the [B, N, T, S] logits: T*N*H multiplies instead of T*N*S.
    # As in flax.linen's attention, the product is rounded in q's dtype.
    q = q * jnp.asarray(scale, q.dtype)
    # The matmuls take head-major operands, [B, *groups, T, H] and [B, N|K, S, H]: batch and
    # heads lead, the contracted H is last (the layouts measured: benchmarks/attention_layouts.py).
    # [B, N|K, S, H]
    kt = jnp.swapaxes(k, 1, 2)
    # [B, N, T, S] or [B, K, G, T, S]
    logits = _einsum_f32(f"b{q_heads}th,b{kv_heads}sh->b{q_heads}ts", _heads_first(q, groups), kt)
    if p.softcap is not None:
        logits = activations.softcap(logits, p.softcap)
    if p.bias is not None:
        logits = logits + _grouped_like_heads(p.bias, groups).astype(jnp.float32)
    # [B|1, N|1, T, S]
    allowed = masks.combine_masks(
        p.mask,
        masks.block_mask(
            jnp.arange(t),
            jnp.arange(s),
            is_causal=p.is_causal,
            window=p.window,
            segment_ids=p.segment_ids,
            kv_segment_ids=p.kv_segment_ids,
        ),
    )
    return masks.masked_logits(logits, _grouped_like_heads(allowed, groups)), q_heads, kv_heads


def _unnormalised_softmax(logits, sinks):
    """(exp(logits - m), the row sums [.., T, 1]) of logits [B, *groups, T, S]: m the row
    maximum (no gradient: it cancels), the sums with each head's exp(sink - m) when `sinks`
    [N] (float32) are given, m then their maximum too."""
    peak = logits.max(-1, keepdims=True)
    if sinks is not None:
        # [1, *groups, 1, 1]
        sinks = sinks.reshape(1, *logits.shape[1:-2], 1, 1)
        peak = jnp.maximum(peak, sinks)
    peak = jax.lax.stop_gradient(peak)
    unnormalised = jnp.exp(logits - peak)
    row_sums = unnormalised.sum(-1, keepdims=True)
    if sinks is not None:
        row_sums = row_sums + jnp.exp(sinks - peak)
    return unnormalised, row_sums


def attention_weights(q, k, **pattern):
    """[B, N, T, S] softmax weights in float32 (for inspection; the "xla" path uses the same
    logits but normalises its output instead; with sinks a row sums to less than 1). Keyword
    arguments: Pattern's, as in dot_product_attention."""
    b, t, n, _ = q.shape
    p = Pattern(**pattern)
    logits, _, _ = _logits(q, k, p)
    unnormalised, row_sums = _unnormalised_softmax(logits, p.sinks)
    # [B, *groups, T, S] -> [B, N, T, S]
    return (unnormalised / row_sums).reshape(b, n, t, k.shape[1])


def _xla_attention(q, k, v, p: Pattern, dropout_rate, dropout_rng):
    b, t, n, _ = q.shape
    # [B, *groups, T, S]
    logits, q_heads, kv_heads = _logits(q, k, p)
    # The softmax's division is applied to the [.., T, H] output rather than to the [.., T, S]
    # weights, as flash attention does: one pass fewer over the largest tensor, and no
    # [.., T, S] broadcast of the row sums.
    unnormalised, row_sums = _unnormalised_softmax(logits, p.sinks)
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


def _chunked_attention(q, k, v, p: Pattern, dropout_rate, dropout_rng, chunk_size):
    """The chunked kernel (tfjax.ops.chunked) on [B, T, N, H] queries; its einsums take them
    grouped by kv head, [B, K, G, T, H], G = 1 included."""
    n, kh = q.shape[2], k.shape[2]
    groups = (kh, n // kh)
    # [B, K, G, T, H]
    out = chunked.chunked_attention(
        _heads_first(q, groups),
        k,
        v,
        mask=_grouped_like_heads(p.mask, groups),
        bias=_grouped_like_heads(p.bias, groups),
        segment_ids=p.segment_ids,
        kv_segment_ids=p.kv_segment_ids,
        is_causal=p.is_causal,
        window=p.window,
        scale=p.scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        chunk_size=chunk_size,
        softcap=p.softcap,
        sinks=None if p.sinks is None else p.sinks.reshape(groups),
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


def _check_inputs(q, k, v, p: Pattern, implementation, dropout_rate, dropout_rng):
    check_implementation(implementation)
    check_window(p.window)
    check_softcap(p.softcap)
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
    if p.mask is not None and p.mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {p.mask.dtype}")
    for name, x in (("mask", p.mask), ("bias", p.bias)):
        if x is not None and x.ndim > 4:
            raise ValueError(f"{name} must broadcast to [B, N, T, S], got shape {x.shape}")
    for name, x, shape in (
        ("segment_ids [B, T]", p.segment_ids, q.shape[:2]),
        ("kv_segment_ids [B, S]", p.kv_segment_ids, k.shape[:2]),
    ):
        if x is not None and (x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{name} must be integers of shape {shape}, got {x.dtype} {x.shape}")
    if p.kv_segment_ids is None and p.segment_ids is not None and k.shape[1] != q.shape[1]:
        raise ValueError("segment_ids with keys of another length (S != T) need kv_segment_ids")
    if p.sinks is not None and (
        p.sinks.shape != (q.shape[2],) or not jnp.issubdtype(p.sinks.dtype, jnp.floating)
    ):
        raise ValueError(
            f"sinks must be one float logit per query head, shape ({q.shape[2]},), got "
            f"{p.sinks.dtype} {p.sinks.shape}"
        )
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
    q, k, dropout_rate=0.0, platform: str | None = None, window=None, softcap=None, sinks=None
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
    if sinks is not None:
        return "jax.nn.dot_product_attention has no attention sinks (sinks)"
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
    implementation, q, k, mask, bias, window, dropout_rate, platform, softcap=None, sinks=None
) -> str | None:
    """Why `implementation` cannot run this call on `platform`, or None when it can."""
    if implementation == "cudnn":
        return cudnn_unsupported_reason(q, k, dropout_rate, platform, window, softcap, sinks)
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
    sinks=None,
) -> str:
    """The implementation `implementation=None` runs, for the target platform (the one place
    where that is decided): cuDNN on GPUs where it applies; from SPLASH_MIN_LENGTH keys the
    splash kernel on TPUs where it applies; from CHUNKED_MIN_LENGTH keys "chunked"; else "xla".
    """
    platform = platform or target_platform()
    return _choose(q, k, mask, bias, window, dropout_rate, platform, softcap, sinks)


def _choose(q, k, mask, bias, window, dropout_rate, platform, softcap, sinks) -> str:
    """choose_implementation with every argument given (the target `platform` too)."""
    args = (q, k, mask, bias, window, dropout_rate, platform, softcap, sinks)
    s = k.shape[1]
    if platform == "gpu" and _unavailable_reason("cudnn", *args) is None:
        return "cudnn"
    if (
        platform == "tpu"
        and s >= SPLASH_MIN_LENGTH
        and _unavailable_reason("splash", *args) is None
    ):
        return "splash"
    return _unfused(s)


def _sharded_alike(q, k, v, sharding):
    """q, k and v with one layout, batch and heads split as `sharding` (the activations' [B, T,
    N, H] PartitionSpec) says: cuDNN's partitioner refuses others (a decode step's cached keys
    otherwise keep the cache's layout); kv heads repeated when they do not split like the query
    heads. As they are without a sharding."""
    if sharding is None:
        return q, k, v
    k, v = splash.split_like_query_heads(k, v, q.shape[2], 2, sharding[2])
    return tuple(jax.lax.with_sharding_constraint(x, sharding) for x in (q, k, v))


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def _cudnn_attention(q, k, v, p: Pattern, requested: bool, sharding):
    """cuDNN's fused attention; None when it fails and was not `requested` by name (then a
    slower path runs)."""
    mask = p.mask
    if p.segment_ids is not None:  # it takes a dense [B, 1, T, S] mask
        mask = masks.combine_masks(mask, masks.segment_mask(p.segment_ids, p.kv_segment_ids))
    try:
        q, k, v = _sharded_alike(q, k, v, sharding)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=p.bias,
            mask=mask,
            scale=p.scale,
            is_causal=p.is_causal,
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
    sinks=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    implementation: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    sharding=None,
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
      sinks: None, or [N] floats, one logit per query head that joins each of its rows' softmax
        denominators without a value (GPT-OSS's attention sinks; neither scaled nor capped):
        out = sum_s exp(l_s) v_s / (exp(sink) + sum_s exp(l_s)). cuDNN does not take them.
      dropout_rate: dropout on the attention weights (needs dropout_rng).
      implementation: "xla", "cudnn", "splash", "chunked" or None (`choose_implementation`).
      chunk_size: key chunk length C of the "chunked" path.
      sharding: how the mesh in context splits [B, T, N, H] activations, a PartitionSpec (the
        splash and cuDNN kernels run per shard of batch and heads); None: unsplit.
        tfjax.nn.dot_product_attention fills it from the logical axis rules in context.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    p = Pattern(mask, bias, segment_ids, kv_segment_ids, is_causal, window, scale, softcap, sinks)
    _check_inputs(q, k, v, p, implementation, dropout_rate, dropout_rng)
    p = p._replace(
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids,
        sinks=None if sinks is None else sinks.astype(jnp.promote_types(sinks.dtype, jnp.float32)),
    )
    # Only the kernels that depend on it ask for the target: an explicit "xla" or "chunked"
    # traces without starting a backend (the run's pre-start check builds the model so).
    platform = target_platform() if implementation in (None, "cudnn", "splash") else None
    args = (q, k, mask, bias, window, dropout_rate, platform, softcap, p.sinks)
    requested = implementation is not None
    if implementation is None:
        implementation = _choose(*args)
    elif reason := _unavailable_reason(implementation, *args):
        raise ValueError(f'implementation="{implementation}" is not available: {reason}')
    if implementation == "splash":
        return splash.splash_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            kv_segment_ids=p.kv_segment_ids,
            is_causal=is_causal,
            scale=p.scale,
            sinks=p.sinks,
            interpret=platform != "tpu",
            sharding=sharding,
        )
    if implementation == "cudnn":
        out = _cudnn_attention(q, k, v, p, requested, sharding)
        if out is not None:
            return out
        implementation = _unfused(k.shape[1])
    if implementation == "chunked":
        return _chunked_attention(q, k, v, p, dropout_rate, dropout_rng, chunk_size)
    return _xla_attention(q, k, v, p, dropout_rate, dropout_rng)
