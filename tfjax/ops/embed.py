"""Token embeddings: the lookup (with the optional sqrt(D) scale) and the output projection that
shares the table.

Letters: B batch, T length, D model width, V vocab.
"""

import jax.numpy as jnp

from tfjax.ops import head


def lookup(table, ids, *, dtype=None, scale_by_sqrt_width: bool = False, scale_dtype=None):
    """table [V, D] rows at ids [B, T] (or positions [T]) -> [B, T, D] in `dtype` (float32 when
    None).

    scale_by_sqrt_width: times sqrt(D) (Vaswani et al., 2017), rounded first to `scale_dtype`
    (as transformers' Gemma: a float32 sqrt(D) cast to the table's dtype, so a bfloat16 Gemma
    multiplies by sqrt(3072) = 55.5, not 55.43), or computed in the vectors' dtype when None.
    """
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"Embed: token ids must be integers, got dtype {ids.dtype}")
    x = jnp.take(table, ids, axis=0).astype(dtype or jnp.float32)
    if scale_by_sqrt_width:
        width = table.shape[-1]
        if scale_dtype is None:
            scale = jnp.sqrt(jnp.asarray(width, x.dtype))
        else:
            scale = jnp.asarray(width**0.5, jnp.float32).astype(scale_dtype)
        x = x * scale.astype(x.dtype)
    return x


def attend(x, table):
    """x [B, T, D] -> [B, T, V] logits against the table [V, D] (both in the promoted dtype);
    the gradients of x and the table made together (`head.matmul`)."""
    # [B, T, V]
    return head.matmul(x, table.T)
