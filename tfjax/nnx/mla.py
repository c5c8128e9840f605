"""Multi-head latent attention (DeepSeek) in NNX: the parameters of tfjax.ops.mla (their names,
shapes and logical axes from `mla.parameter_shapes`, as Linen's tfjax.nn.mla.LatentAttention),
its maths that module's."""

from tfjax.nnx.params import ParamTable
from tfjax.ops import axes, mla
from tfjax.ops.cache import LatentCache


class LatentAttention(ParamTable):
    """Self-attention with `config.latent` (tfjax.ops.mla): the expanded form without a cache,
    the absorbed form over a tfjax.ops.LatentCache (`cache=`) when decoding."""

    OPS = mla  # config: an AttentionConfig with `latent`

    def __call__(
        self,
        x,
        *,
        mask=None,
        bias=None,
        segment_ids=None,
        is_causal: bool = False,
        positions=None,
        dropout_rng=None,
        variant=None,
        cache: LatentCache | None = None,
    ):
        """tfjax.nnx.Attention's self-attention call (no `bias`: latent attention takes none).
        Returns [B, T, D]; with `cache`, ([B, T, D], the updated cache)."""
        if bias is not None:
            raise ValueError("LatentAttention: takes no additive logit bias")
        x, p = self.promoted(x)
        # The dropout and sharding options are the expanded form's: decoding takes none.
        rate = self.config.dropout_rate if dropout_rng is not None and cache is None else 0.0
        return mla.latent_attention(
            x,
            p,
            self.config,
            positions=positions,
            cache=cache,
            mask=mask,
            segment_ids=segment_ids,
            is_causal=is_causal,
            dropout_rate=rate,
            dropout_rng=dropout_rng if rate > 0.0 else None,
            sharding=axes.attention_sharding(),
        )
