"""A Vision Transformer's maths around its blocks: patches embedded, the token sequence
assembled (mask token, class token, position embeddings, registers) and pooled.

Letters: B batch, H, W image height and width, C channels, p the patch size, X, Y the patch
grid's rows and columns (H/p, W/p), I, J a pixel's row and column within its patch, P = X Y
patches, R registers, D model width.
"""

import jax.numpy as jnp

from tfjax.ops.position import sincos_2d


def crop_to_patches(images, patch_size: int, *, drop_remainder: bool):
    """images [B, H, W, C] floats, checked, without the rows and columns past the last whole
    patch (drop_remainder, as a stride-p convolution drops them; refused otherwise)."""
    if images.ndim != 4 or not jnp.issubdtype(images.dtype, jnp.floating):
        raise ValueError(
            f"images must be [B, H, W, C] floats, got shape {images.shape} {images.dtype}"
        )
    _, height, width, _ = images.shape
    p = patch_size
    if (height % p or width % p) and not drop_remainder:
        raise ValueError(
            f"image size {height}x{width} is not divisible by patch_size={p} (set "
            "drop_remainder=True to drop the last rows and columns)"
        )
    return images[:, : height - height % p, : width - width % p]


def patch_embed(images, kernel, bias=None):
    """images [B, H, W, C] -> [B, X, Y, D]: the p x p convolution of stride p by kernel
    [p, p, C, D] (and bias [D]), as a matmul: patches do not overlap, so each grid position's
    output is its p x p x C patch, flattened, times the kernel flattened to [p p C, D]."""
    p = kernel.shape[0]
    b, h, w, c = images.shape
    # [B, X, I, Y, J, C]: patch (x, y) of the grid, its pixel row i and column j
    patches = images.reshape(b, h // p, p, w // p, p, c)
    # [B, X, Y, D]
    out = jnp.einsum("bxiyjc,ijcd->bxyd", patches, kernel)
    return out if bias is None else out + bias


def tokens(x, grid, *, mask=None, mask_token=None, cls=None, pos_embed=None, registers=None):
    """The blocks' input from the patch embeddings x [B, P, D] of a `grid` (X, Y):

    mask [B, P] booleans, True where the patch is replaced by mask_token [D]; then the class
    token cls [1, 1, D] in front; position embeddings pos_embed [1, n, D] (learned, one per
    token, the class token's included) or, when None, the fixed 2-D sin-cos ones (none for the
    class token, as in MoCo v3); then the registers [1, R, D] after the class token, without
    position embeddings. -> [B, 1 + R + P, D] (no 1 without cls, no R without registers).
    """
    b, p, d = x.shape
    if mask is not None:
        if mask_token is None:
            raise ValueError("a mask needs a model with mask_token=True")
        if mask.shape != (b, p):
            raise ValueError(f"mask must be [B, P] = {(b, p)}, got {mask.shape}")
        x = jnp.where(mask[..., None], mask_token.astype(x.dtype), x)
    if cls is not None:
        # [B, 1 + P, D]
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)
    n_cls = x.shape[1] - p
    if pos_embed is None:
        pos_embed = jnp.pad(sincos_2d(*grid, d), ((n_cls, 0), (0, 0)))[None]
    x = x + pos_embed.astype(x.dtype)
    if registers is not None:
        r = registers.shape[1]
        registers = jnp.broadcast_to(registers.astype(x.dtype), (b, r, d))
        # [B, 1 + R + P, D]
        x = jnp.concatenate([x[:, :n_cls], registers, x[:, n_cls:]], axis=1)
    return x


def pool(x, kind: str, num_registers: int = 0):
    """The blocks' output x [B, 1 + R + P, D] -> [B, D] pooled by `kind`: "cls" the class
    token, "gap" the patch tokens' mean (the registers' excluded; x has no class token), or
    "cls_gap" both concatenated [B, 2 D] (Hugging Face's Dinov2ForImageClassification)."""
    if kind == "cls":
        return x[:, 0]
    if kind == "gap":
        return x[:, num_registers:].mean(axis=1)
    if kind == "cls_gap":
        patches = x[:, 1 + num_registers :]
        return jnp.concatenate([x[:, 0], patches.mean(axis=1)], axis=-1)
    raise ValueError(f"pool={kind!r}: pool() takes 'cls', 'gap' or 'cls_gap' ('map' is a head)")
