"""Positional information as pure functions: sinusoidal, 2-D sin-cos, RoPE (and its scalings),
ALiBi and T5's relative position buckets.

Letters: B batch, T length, N heads, H head dim, D model width.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a RoPE model stretches its frequencies past its training length.

    Every kind works on the inverse frequencies base^(-2i/H), i < H/2 (H the rotated width):
      "linear":  all divided by `factor` (position interpolation, Chen et al., 2023).
      "dynamic": NTK-aware: the base grows with the longest position L seen in the call once L
                 passes `original_length` (O): base * (factor L / O - factor + 1)^(H / (H - 2)).
      "llama3":  Llama 3.1's split by wavelength w = 2 pi / f: w below original_length /
                 high_freq_factor kept, above original_length / low_freq_factor divided by
                 `factor`, blended linearly in between.
      "yarn":    YaRN (Peng et al., 2023): frequencies that turn fewer than `beta_slow` times in
                 `original_length` divided by `factor`, more than `beta_fast` kept, a linear ramp
                 over the dimensions between; cos and sin scaled by `attention_factor`.
    """

    kind: str  # one of SCALING_KINDS
    factor: float  # how many times longer than original_length the model is meant to read
    original_length: int  # the pretraining length the scaling starts from
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by factor
    attention_factor: float | None = None  # yarn: cos/sin scale; None: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    mscale_all_dim: float | None = None  # yarn, read by multi-head latent attention only
    # (DeepSeek): its logits also times (0.1 mscale_all_dim ln(factor) + 1)^2 (tfjax.ops.mla)

    def __post_init__(self):
        if self.kind not in SCALING_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}; supported: {SCALING_KINDS}")
        if not self.factor > 0 or self.original_length < 1:
            raise ValueError(
                f"RopeScaling needs factor > 0 and original_length >= 1; got factor={self.factor}, "
                f"original_length={self.original_length}"
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling(kind='llama3') needs high_freq_factor > low_freq_factor; got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


SCALING_KINDS = ("linear", "dynamic", "llama3", "yarn")


def rope_frequencies(width: int, base: float, scaling: RopeScaling | None = None, *, length=None):
    """Inverse frequencies [width/2] (float32) and the cos/sin scale of RoPE.

    Args:
      width: rotated channels per head (H), even.
      base: wavelength base (rope_theta).
      scaling: None for the plain frequencies base^(-2i/H), else how they are stretched.
      length: "dynamic" only: the longest position + 1 in this call (a traced scalar is fine).
    Returns:
      (inv_freq [width/2], scale): the angle of channel pair i at position p is p * inv_freq[i];
      cos and sin are multiplied by `scale` (1.0 except for yarn).
    """
    if scaling is None:
        return base ** (-jnp.arange(0, width, 2, dtype=jnp.float32) / width), 1.0
    # The scaled kinds are computed once, in float64, from the static fields (dynamic: below).
    exponents = np.arange(0, width, 2, dtype=np.float64) / width  # [H/2]
    plain = 1.0 / float(base) ** exponents
    factor, original = scaling.factor, scaling.original_length
    if scaling.kind == "linear":
        return jnp.asarray(plain / factor, jnp.float32), 1.0
    if scaling.kind == "dynamic":
        if length is None:
            raise ValueError(
                "rope_frequencies: RopeScaling(kind='dynamic') needs the call's length"
            )
        length = jnp.maximum(jnp.asarray(length, jnp.float32), original)
        grown = base * (factor * length / original - (factor - 1)) ** (width / (width - 2))
        return 1.0 / grown ** jnp.asarray(exponents, jnp.float32), 1.0
    if scaling.kind == "llama3":
        wavelength = 2 * math.pi / plain
        short = original / scaling.high_freq_factor  # wavelengths below: kept
        long = original / scaling.low_freq_factor  # wavelengths above: divided by factor
        blend = (original / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - blend) * plain / factor + blend * plain
        out = np.where(
            wavelength > long, plain / factor, np.where(wavelength < short, plain, blended)
        )
        return jnp.asarray(out.astype(np.float32)), 1.0

    # yarn: the dimension d at which a frequency turns r times in `original` positions.
    def dimension(rotations):
        return width * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    high = high + 0.001 if high == low else high  # a ramp of zero width would divide by zero
    ramp = np.clip((np.arange(width // 2) - low) / (high - low), 0, 1)
    out = (plain / factor) * ramp + plain * (1 - ramp)
    scale = scaling.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return jnp.asarray(out.astype(np.float32)), float(scale)


def rope(x, positions, *, base: float = 10_000.0, scaling: RopeScaling | None = None):
    """Rotary position embedding (Su et al., 2021), rotate-half layout (GPT-NeoX, Llama).

    Args:
      x: [B, T, N, H] queries or keys, H even.
      positions: [B, T] or [T] int positions.
      base: wavelength base (rope_theta).
      scaling: None, or how frequencies are stretched past the training length (RopeScaling).
    Returns:
      [B, T, N, H] with channel pairs (i, i + H/2) rotated by angle pos * inv_freq[i]
      (inv_freq = base^(-2i/H) unscaled; rope_frequencies).
    """
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"rope: head_dim must be even, got {h}")
    positions = jnp.asarray(positions)
    length = jnp.max(positions) + 1 if scaling is not None and scaling.kind == "dynamic" else None
    inv_freq, scale = rope_frequencies(h, base, scaling, length=length)  # [H/2]
    positions = positions.astype(jnp.float32)
    if positions.ndim == 1:
        positions = positions[None]
    # [B, T, 1, H/2]
    angles = (positions[..., None] * inv_freq)[:, :, None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
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


def relative_position_bucket(
    relative_position, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
):
    """T5's bucket of each key - query offset (Raffel et al., 2020, section 2.1).

    Half the buckets (all of them when causal, where only offsets <= 0 occur) hold exact
    distances 0 .. n/2 - 1; the rest cover n/2 .. max_distance on a log scale, and every
    farther distance shares the last bucket. Bidirectional buckets give keys after the query
    their own half.

    Args:
      relative_position: int array of key position - query position (any shape).
    Returns:
      int32 buckets in [0, num_buckets), same shape.
    """
    relative_position = jnp.asarray(relative_position, jnp.int32)
    bucket = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    exact = num_buckets // 2
    # log-spaced beyond `exact`; the max() keeps the log finite where the exact branch is taken
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(
        max_distance / exact
    )
    far = jnp.minimum(
        exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32), num_buckets - 1
    )
    return bucket + jnp.where(distance < exact, distance, far)


def relative_position_bias(
    table,
    query_positions,
    key_positions,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
):
    """T5's learned attention bias: the table's [num_buckets, N] scalar of each (key - query
    offset's bucket, head).

    Args:
      query_positions: [T] or [B, T] ints; key_positions: [S] or [B, S] ints.
    Returns:
      [B|1, N, T, S] float32, added to the attention logits.
    """
    q = jnp.atleast_2d(query_positions)[:, :, None]
    k = jnp.atleast_2d(key_positions)[:, None, :]
    # [B|1, T, S]
    buckets = relative_position_bucket(
        k - q, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    # [B|1, T, S, N] -> [B|1, N, T, S]
    return jnp.take(table, buckets, axis=0).astype(jnp.float32).transpose(0, 3, 1, 2)


def attention_temperature(positions, floor: int, scale: float):
    """The query scale of attention temperature tuning at `positions` (any shape, ints):
    1 + scale * log(1 + floor((p + 1) / floor)), float32 (Llama 4's NoPE layers: floor_scale,
    attn_scale; arXiv 2501.19399): 1 for the first floor - 1 positions,
    then growing with the log of the length."""
    p = jnp.asarray(positions, jnp.float32)
    return 1.0 + scale * jnp.log1p(jnp.floor((p + 1.0) / floor))
