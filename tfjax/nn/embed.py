"""Token embeddings, with the output projection that shares their matrix.

Letters: B batch, T length, D model width, V vocab.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.ops import head


class Embed(nn.Module):
    """A [V, D] table: `embed(ids)` looks tokens up, `embed.attend(x)` gives logits x E^T.

    Vaswani et al. (2017) share this matrix between both embeddings and the pre-softmax
    projection and multiply the looked-up embeddings by sqrt(d_model).
    """

    vocab_size: int  # V
    width: int  # D
    scale_by_sqrt_width: bool = False  # multiply looked-up vectors by sqrt(D) (the paper)
    scale_dtype: Any = None  # sqrt(D) is rounded to this dtype first; the vectors' when None
    # (Gemma: the table's, so a bfloat16 Gemma multiplies by sqrt(3072) = 55.5, not 55.43)
    init_stddev: float | None = None  # D**-0.5 when None (unit variance after the sqrt(D) scale)
    dtype: Any = None  # compute dtype; float32 when None
    param_dtype: Any = jnp.float32  # storage dtype

    def setup(self):
        std = self.width**-0.5 if self.init_stddev is None else self.init_stddev
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(std), (axes.VOCAB, axes.EMBED)),
            (self.vocab_size, self.width),
            self.param_dtype,
        )

    def __call__(self, ids):
        """ids: [B, T] ints -> [B, T, D]."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"Embed: token ids must be integers, got dtype {ids.dtype}")
        x = jnp.take(self.embedding, ids, axis=0).astype(self.dtype or jnp.float32)
        if self.scale_by_sqrt_width:
            if self.scale_dtype is None:
                scale = jnp.sqrt(jnp.asarray(self.width, x.dtype))
            else:  # as transformers' Gemma: a float32 sqrt(D) cast to the table's dtype
                scale = jnp.asarray(self.width**0.5, jnp.float32).astype(self.scale_dtype)
            x = x * scale.astype(x.dtype)
        return x

    def attend(self, x):
        """x: [B, T, D] -> [B, T, V] logits against the (shared) embedding matrix."""
        x, table = nn.dtypes.promote_dtype(x, self.embedding, dtype=self.dtype)
        # [B, T, V], the gradients of x and the table made together (tfjax.ops.head)
        return head.matmul(x, table.T)
