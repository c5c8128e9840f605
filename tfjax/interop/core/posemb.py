"""Position embeddings resampled to another image size, as PyTorch's bicubic resize does it.

`resample_posemb` interpolates the patch grid bicubically exactly as
`torch.nn.functional.interpolate(mode="bicubic", align_corners=False)` does (Keys' kernel with
a = -0.75, clamped borders), which is what Hugging Face's `interpolate_pos_encoding=True`
uses, or with `antialias=True` as torch's antialiased resize (timm's `resample_abs_pos_embed`,
DINOv2 with registers); the class token's embedding is kept as it is.
"""

import math

import numpy as np

_A = -0.75  # PyTorch's bicubic kernel parameter


def _cubic(x):
    """Keys' cubic convolution kernel with a = -0.75, for |x| < 2."""
    x = np.abs(x)
    near = ((_A + 2) * x - (_A + 3)) * x * x + 1
    far = ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _cubic_aa(x):
    """Keys' cubic convolution kernel with a = -0.5 (PIL's; torch's antialiased bicubic)."""
    x = np.abs(x)
    near = (1.5 * x - 2.5) * x * x + 1
    far = ((-0.5 * x + 2.5) * x - 4) * x + 2
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _bicubic_aa_matrix(size_in: int, size_out: int) -> np.ndarray:
    """torch's bicubic resize with antialias=True (align_corners=False): the kernel widened by
    the scale when shrinking, taps outside the image left out, each row's weights normalised."""
    m = np.zeros((size_out, size_in), np.float64)
    scale = size_in / size_out
    support = 2.0 * max(scale, 1.0)
    inv = 1.0 / max(scale, 1.0)
    for i in range(size_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        j = np.arange(lo, hi)
        w = _cubic_aa((j - center + 0.5) * inv)
        m[i, lo:hi] = w / w.sum()
    return m


def bicubic_matrix(size_in: int, size_out: int, *, antialias: bool = False) -> np.ndarray:
    """[size_out, size_in] weights of torch's bicubic resize (align_corners=False) on one axis;
    `antialias` as torch's interpolate (DINOv2 with registers resamples with it)."""
    if antialias:
        return _bicubic_aa_matrix(size_in, size_out)
    m = np.zeros((size_out, size_in), np.float64)
    scale = size_in / size_out
    for i in range(size_out):
        src = scale * (i + 0.5) - 0.5
        base = math.floor(src)
        t = src - base
        for offset in (-1, 0, 1, 2):
            w = _cubic(np.float64(t - offset))
            m[i, min(max(base + offset, 0), size_in - 1)] += w
    return m


def resample_posemb(
    posemb,
    new_grid: tuple[int, int],
    *,
    num_prefix_tokens: int = 1,
    antialias: bool = False,
    grid: tuple[int, int] | None = None,
):
    """Position embeddings [1, prefix + h * w, D] of an (h, w) grid -> [1, prefix + H * W, D].

    Args:
      posemb: learned embeddings; the first `num_prefix_tokens` (the class token) are kept.
      new_grid: (H, W) patches of the new image size.
      antialias: torch's antialiased bicubic (a = -0.5, normalised taps) instead of the plain one.
      grid: (h, w) the embeddings were made for, row-major; a square one when None.
    """
    posemb = np.asarray(posemb)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"resample_posemb: posemb must be [1, N, D], got {posemb.shape}")
    prefix, table = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    if grid is None:
        side = math.isqrt(table.shape[0])
        if side * side != table.shape[0]:
            raise ValueError(
                f"resample_posemb: {table.shape[0]} patch embeddings do not form a square grid"
            )
        grid = (side, side)
    if grid[0] * grid[1] != table.shape[0]:
        raise ValueError(
            f"resample_posemb: {table.shape[0]} patch embeddings are no {grid[0]}x{grid[1]} grid"
        )
    h, w = new_grid
    if (h, w) == tuple(grid):
        return posemb
    d = table.shape[-1]
    # [h, w, D] -> [H, W, D]
    table = table.reshape(*grid, d).astype(np.float64)
    rows, cols = (
        bicubic_matrix(n_in, n, antialias=antialias) for n_in, n in zip(grid, (h, w), strict=True)
    )
    # [H, W, D]
    out = np.einsum("Hh,hwd,Ww->HWd", rows, table, cols)
    out = out.reshape(1, h * w, d).astype(posemb.dtype)
    return np.concatenate([prefix, out], axis=1)


def image_size_pair(value) -> tuple[int, int]:
    if isinstance(value, int | np.integer):
        return int(value), int(value)
    h, w = value
    return int(h), int(w)
