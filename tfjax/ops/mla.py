"""Multi-head latent attention (MLA; DeepSeek-V2 / V3) for an AttentionConfig with `latent` (a
LatentAttention), given its parameters; a module system holds them (tfjax.nn.mla in Linen,
tfjax.nnx.mla in NNX), by the names below.

Letters: B batch, T query length, S key length, D width, N heads, Hn each query and key head's
unrotated part (the config's head_dim), Hr the rotated part shared by the keys (rope_dim), Hv
each value head (value_dim), R the keys' and values' latent (kv_rank), Rq the queries' (q_rank).

    queries   q = x Wq                     or  q = rms(x Wq_down) Wq_up        [B, T, N, Hn + Hr]
    latents   [c | k_r] = x Wkv_down;  c = rms(c)                      [B, T, R], [B, T, Hr]
    keys      k_n = c Wk_up [B, S, N, Hn];  k = [k_n | rope(k_r), the same for every head]
    values    v = c Wv_up [B, S, N, Hv];   out = attention(q, k, v) Wo         [B, T, D]

Two forms compute it. Expanded (training, prefill without a cache): keys and values per head,
then tfjax.ops.multihead.attend with every backend and mask it takes. Absorbed (decoding with a
tfjax.ops.LatentCache, which holds only c and rope(k_r) per token): Wk_up folds into the
queries, q_n Wk_up^T . c = q_n . k_n, so the logits come from the latent directly, the
weighted sum stays in the latent, and Wv_up maps it out per head; the same numbers.

The logit scale: the config's, else (Hn + Hr)^-1/2 times, for YaRN with mscale_all_dim,
(0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek's softmax_scale; transformers'
yarn_apply_mscale). DeepSeek's checkpoints rotate interleaved pairs; tfjax's RoPE rotates halves,
and the converters permute the rotated rows of the query and latent projections to it.

Parameters (shapes; logical axes in tfjax.ops.axes):
  query_kernel [D, N, Hn + Hr]                  (without q_rank)
  query_down_kernel [D, Rq], query_latent_norm [Rq], query_up_kernel [Rq, N, Hn + Hr]
  kv_down_kernel [D, R + Hr], kv_latent_norm [R]
  key_up_kernel [R, N, Hn], value_up_kernel [R, N, Hv], out_kernel [N, Hv, D]
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from tfjax.ops import axes, masks, multihead, position
from tfjax.ops.cache import LatentCache, write_latent
from tfjax.ops.norms import rms_norm


def initializers(kernel_init) -> dict:
    """{kind: init(key, shape, dtype)} of `parameter_shapes`' kinds: the projections'
    `kernel_init`, ones for the norm scales."""
    return {"kernel": kernel_init, "ones": jax.nn.initializers.ones}


def parameter_shapes(config, width: int) -> dict:
    """{name: (shape, logical axes, initializer kind)} of a latent attention's parameters on
    inputs of `width`; kind "kernel" (the projections' initializer) or "ones" (norm scales)."""
    lat, n, hn = config.latent, config.num_heads, config.head_width(width)
    hq, hv = hn + lat.rope_dim, lat.value_dim or hn
    heads = (axes.HEADS, axes.HEAD_DIM)
    shapes = {}
    if lat.q_rank is None:
        shapes["query_kernel"] = ((width, n, hq), (axes.EMBED, *heads), "kernel")
    else:
        shapes["query_down_kernel"] = ((width, lat.q_rank), (axes.EMBED, axes.LATENT), "kernel")
        shapes["query_latent_norm"] = ((lat.q_rank,), (axes.LATENT,), "ones")
        shapes["query_up_kernel"] = ((lat.q_rank, n, hq), (axes.LATENT, *heads), "kernel")
    r = lat.kv_rank
    shapes["kv_down_kernel"] = ((width, r + lat.rope_dim), (axes.EMBED, axes.LATENT), "kernel")
    shapes["kv_latent_norm"] = ((r,), (axes.LATENT,), "ones")
    shapes["key_up_kernel"] = ((r, n, hn), (axes.LATENT, *heads), "kernel")
    shapes["value_up_kernel"] = ((r, n, hv), (axes.LATENT, *heads), "kernel")
    shapes["out_kernel"] = ((n, hv, width), (*heads, axes.EMBED), "kernel")
    return shapes


def logit_scale(config) -> float:
    """The attention logits' scale (see the module docstring)."""
    if config.scale is not None:
        return config.scale
    scale = (config.head_dim + config.latent.rope_dim) ** -0.5
    scaling = config.variants[0].rope_scaling
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        if scaling.factor > 1:
            scale *= (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2
    return scale


def queries(x, p: dict, config):
    """[B, T, D] -> q [B, T, N, Hn + Hr] (not yet rotated)."""
    n, hq = config.num_heads, config.head_dim + config.latent.rope_dim
    if "query_kernel" in p:
        return multihead.project(x, p["query_kernel"], n, hq)
    # [B, T, Rq]
    a = jnp.einsum("btd,dr->btr", x, p["query_down_kernel"])
    a = rms_norm(a, p["query_latent_norm"], eps=config.latent.norm_eps)
    return multihead.project(a, p["query_up_kernel"], n, hq)


def latents(x, p: dict, config):
    """[B, T, D] -> (the normed latent c [B, T, R], the shared key part k_r [B, T, Hr], not
    yet rotated)."""
    r = config.latent.kv_rank
    # [B, T, R + Hr]
    both = jnp.einsum("btd,de->bte", x, p["kv_down_kernel"])
    c = rms_norm(both[..., :r], p["kv_latent_norm"], eps=config.latent.norm_eps)
    return c, both[..., r:]


def rotate(q, k_r, positions, config):
    """RoPE on the queries' last Hr channels [B, T, N, Hn + Hr] and the shared key part
    [B, T, Hr], at `positions` ([B, T] or [T]), with the config's base and scaling."""
    choice = config.variants[0]
    opts = dict(base=choice.rope_base, scaling=choice.rope_scaling)
    hn = config.head_dim
    q = jnp.concatenate([q[..., :hn], position.rope(q[..., hn:], positions, **opts)], axis=-1)
    k_r = position.rope(k_r[:, :, None], positions, **opts)[:, :, 0]
    return q, k_r


def expand(c, k_r, p: dict):
    """The latent c [B, S, R] and rotated k_r [B, S, Hr] as per-head keys [B, S, N, Hn + Hr]
    and values [B, S, N, Hv]."""
    # [B, S, N, Hn]
    k_n = jnp.einsum("bsr,rnh->bsnh", c, p["key_up_kernel"])
    k_r = jnp.broadcast_to(k_r[:, :, None], (*k_n.shape[:3], k_r.shape[-1]))
    v = jnp.einsum("bsr,rnh->bsnh", c, p["value_up_kernel"])
    return jnp.concatenate([k_n, k_r.astype(k_n.dtype)], axis=-1), v


def expanded_attention(q, c, k_r, p: dict, config, *, positions, **options):
    """The attention output [B, T, N, Hv] of q [B, T, N, Hn + Hr] (rotated) on the keys and
    values expanded from c and rotated k_r (`expand`), by tfjax.ops.multihead.attend (its
    `options`: mask, segment_ids, is_causal, dropout, sharding, ...). q, k and v are padded
    with zero channels to one width, as attention's backends take (zeros change no logit and
    no output channel of interest)."""
    k, v = expand(c, k_r, p)
    hq, hv = q.shape[-1], v.shape[-1]
    h = max(hq, hv)

    def pad(y):
        return jnp.pad(y, ((0, 0),) * 3 + ((0, h - y.shape[-1]),))

    fixed = dataclasses.replace(config, scale=logit_scale(config))
    out, _ = multihead.attend(pad(q), pad(k), pad(v), fixed, positions=positions, **options)
    return out[..., :hv]


def absorbed_attention(q, c, k_r, p: dict, config, *, offset, mask=None):
    """The attention output [B, T, N, Hv] of q [B, T, N, Hn + Hr] (rotated; at positions
    offset..) on a whole cache's latents c [B, S, R] and rotated k_r [B, S, Hr] at 0..S-1,
    causally (and by `mask`, broadcastable to [B, N, T, S]), in the absorbed form."""
    hn = config.head_dim
    f32 = jnp.float32
    # [B, T, N, R]: the unrotated queries through the keys' up projection
    q_c = jnp.einsum("btnh,rnh->btnr", q[..., :hn], p["key_up_kernel"])
    # [B, N, T, S]
    logits = jnp.einsum("btnr,bsr->bnts", q_c, c, preferred_element_type=f32)
    logits += jnp.einsum("btnh,bsh->bnts", q[..., hn:], k_r, preferred_element_type=f32)
    logits *= logit_scale(config)
    t, s = q.shape[1], c.shape[1]
    causal = masks.block_mask(offset + jnp.arange(t), jnp.arange(s), is_causal=True)
    weights = jax.nn.softmax(masks.masked_logits(logits, masks.combine_masks(mask, causal)))
    # [B, T, N, R] -> [B, T, N, Hv]
    out_c = jnp.einsum("bnts,bsr->btnr", weights.astype(c.dtype), c)
    return jnp.einsum("btnr,rnh->btnh", out_c, p["value_up_kernel"]).astype(q.dtype)


def latent_attention(
    x,
    p: dict,
    config,
    *,
    positions=None,
    cache: LatentCache | None = None,
    mask=None,
    segment_ids=None,
    is_causal: bool = False,
    **options,
):
    """Self-attention of x [B, T, D] -> [B, T, D] by the parameters `p` (already in the
    compute dtype); with `cache` (decoding: this call's latents written at its index, the
    absorbed form over all it holds) -> ([B, T, D], the updated cache). `options`: the expanded
    form's multihead.attend options (dropout, sharding)."""
    offset = cache.index if cache is not None else 0
    if positions is None:
        positions = offset + jnp.arange(x.shape[1])
    q, (c, k_r) = queries(x, p, config), latents(x, p, config)
    q, k_r = rotate(q, k_r, positions, config)
    if cache is None:
        out = expanded_attention(
            q,
            c,
            k_r,
            p,
            config,
            positions=positions,
            mask=mask,
            segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            is_causal=is_causal,
            **options,
        )
    else:
        if segment_ids is not None:
            raise ValueError("latent attention: decoding takes a mask, not segment_ids")
        cache = write_latent(cache, c, k_r)
        out = absorbed_attention(
            q, cache.latent, cache.rope_keys, p, config, offset=offset, mask=mask
        )
    out = multihead.project_out(out, p["out_kernel"], p["out_kernel"].shape[-1])
    return out if cache is None else (out, cache)
