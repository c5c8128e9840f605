"""Positional information: sinusoidal, learned, 2-D sin-cos, RoPE and ALiBi.

Letters: B batch, T length, N heads, H head dim, D model width.
"""

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tfjax.nn import axes


def sinusoidal(positions, width: int, *, max_timescale: float = 10_000.0, dtype=jnp.float32):
    """Sinusoidal encodings of Vaswani et al. (2017), section 3.5, interleaved exactly as written.

    PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

    Args:
      positions: int array of any shape [...], e.g. [T] or [B, T].
      width: d_model; must be even.
    Returns:
      [..., width] encodings.
    """
    if width % 2:
        raise ValueError(f"sinusoidal: width must be even, got {width}")
    # [D/2]
    inv_freq = max_timescale ** (-np.arange(0, width, 2, dtype=np.float64) / width)
    # [..., D/2]
    angles = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    # [..., D/2, 2] -> [..., D]: sin at even, cos at odd indices.
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(*pe.shape[:-2], width).astype(dtype)


def sincos_2d(
    height: int, width: int, dim: int, *, temperature: float = 10_000.0, dtype=jnp.float32
):
    """2-D sin-cos embeddings for a [height, width] grid of image patches.

    The channels are [sin(y), cos(y), sin(x), cos(x)], each dim/4 wide (as in MoCo v3 and
    big_vision's ViT). Returns [height * width, dim], row-major over the grid.
    """
    if dim % 4:
        raise ValueError(f"sincos_2d: dim must be divisible by 4, got {dim}")
    y, x = np.mgrid[:height, :width]
    omega = 1.0 / temperature ** (np.arange(dim // 4) / (dim // 4 - 1 if dim > 4 else 1))
    # [HW, dim/4] each
    y = y.reshape(-1, 1) * omega[None]
    x = x.reshape(-1, 1) * omega[None]
    pe = np.concatenate([np.sin(y), np.cos(y), np.sin(x), np.cos(x)], axis=1)
    return jnp.asarray(pe, dtype)


class LearnedPositions(nn.Module):
    """A learned [max_len, D] table, looked up at the given positions."""

    max_len: int  # the longest sequence the table covers
    width: int  # D
    init_stddev: float = 0.02  # BERT and GPT-2 use 0.02
    param_dtype: jnp.dtype = jnp.float32  # storage dtype
    dtype: jnp.dtype | None = None  # compute dtype of the output (param_dtype when None)

    @nn.compact
    def __call__(self, positions):
        """positions: [T] or [B, T] ints -> [T, D] or [B, T, D] in `dtype`."""
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.init_stddev), (None, axes.EMBED)
            ),
            (self.max_len, self.width),
            self.param_dtype,
        )
        # Cast after the lookup: a bfloat16 model's residual stream stays bfloat16 (a float32
        # table added to it would promote the whole stream to float32).
        return jnp.take(table, positions, axis=0).astype(self.dtype or self.param_dtype)


def rope(x, positions, *, base: float = 10_000.0):
    """Rotary position embedding (Su et al., 2021), rotate-half layout (GPT-NeoX, Llama).

    Args:
      x: [B, T, N, H] queries or keys, H even.
      positions: [B, T] or [T] int positions.
    Returns:
      [B, T, N, H] with channel pairs (i, i + H/2) rotated by angle pos * base^(-2i/H).
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"rope: head_dim must be even, got {h}")
    inv_freq = base ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    positions = jnp.asarray(positions, jnp.float32)
    if positions.ndim == 1:
        positions = positions[None]
    # [B, T, 1, H/2]
    angles = (positions[..., None] * inv_freq)[:, :, None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Head slopes of ALiBi (Press et al., 2022): a geometric sequence starting at 2^(-8/n).

    For a head count that is not a power of two, the paper's recipe: the slopes of the nearest
    lower power of two, then every other slope of the next power of two.
    """

    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start**i for i in range(1, n + 1)]

    if math.log2(num_heads).is_integer():
        return np.asarray(pow2(num_heads), np.float32)
    lower = 2 ** math.floor(math.log2(num_heads))
    extra = pow2(2 * lower)[0::2][: num_heads - lower]
    return np.asarray(pow2(lower) + extra, np.float32)


def alibi_bias(num_heads: int, query_positions, key_positions):
    """[B, N, T, S] additive ALiBi bias: -slope_n * |t - s|.

    Args:
      query_positions: [B, T] or [T] ints; key_positions: [B, S] or [S] ints.
    """
    q = jnp.atleast_2d(query_positions)[:, None, :, None]
    k = jnp.atleast_2d(key_positions)[:, None, None, :]
    slopes = jnp.asarray(alibi_slopes(num_heads))[None, :, None, None]
    return -slopes * jnp.abs(q - k).astype(jnp.float32)


class DecodePositions(nn.Module):
    """Positions [T] of this call's tokens when decoding with a cache.

    Keeps a counter in the "cache" collection: 0.. at initialisation (which only sizes the
    caches), then continuing after the tokens already decoded.
    """

    @nn.compact
    def __call__(self, length: int):
        initialized = self.has_variable("cache", "position_index")
        index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
        start = index.value
        if initialized:
            index.value = start + length
        return start + jnp.arange(length)
