"""Gated DeltaNet linear attention (Qwen3.5's linear layers) in NNX: the parameters of
tfjax.ops.linear_attention (names, shapes and logical axes from its `parameter_shapes`, as
Linen's tfjax.nn.linear_attention.GatedDeltaNet), its maths that module's."""

from tfjax.nnx.params import ParamTable
from tfjax.ops import linear_attention as la


class GatedDeltaNet(ParamTable):
    """A Gated DeltaNet layer (tfjax.ops.linear_attention.gated_deltanet) on inputs of `width`
    (the config's, or given)."""

    OPS = la  # config: a LinearAttentionConfig

    def __call__(self, x, *, segment_ids=None, cache: la.RecurrentState | None = None):
        """x [B, T, D] -> (y [B, T, D], the RecurrentState after x, or None without `cache`)."""
        x, p = self.promoted(x)
        return la.gated_deltanet(x, p, self.config, segment_ids=segment_ids, cache=cache)
