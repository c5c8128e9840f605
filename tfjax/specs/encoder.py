"""The BERT-like encoder family's spec: its flat fields, their checks and presets, and the
layers' config they make, without a framework; tfjax.models.encoder (Linen) and
tfjax.nnx.models.encoder (NNX) build their modules from it.

    spec = encoder.Model("bert-base", vocab_size=30522)   # a checked, frozen Encoder
    spec.block_config()
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from tfjax.allowed import one_of
from tfjax.ops.config import BlockConfig
from tfjax.specs import common

# Sizes of BERT (Devlin et al.) and its miniatures (Turc et al., 2019); "tiny" for tests.
VARIANTS = {
    "tiny": dict(width=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=128),
    # configs/mlm.py's CPU experiment (pydoc): trains in minutes on two cores
    "demo": dict(width=128, num_layers=4, num_heads=4, mlp_dim=512, max_len=128),
    "bert-mini": dict(width=256, num_layers=4, num_heads=4, mlp_dim=1024),
    "bert-small": dict(width=512, num_layers=4, num_heads=8, mlp_dim=2048),
    "bert-medium": dict(width=512, num_layers=8, num_heads=8, mlp_dim=2048),
    "bert-base": dict(width=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "bert-large": dict(width=1024, num_layers=24, num_heads=16, mlp_dim=4096),
}
HEADS = ("mlm", "classifier")


@dataclasses.dataclass(**common.SPEC_OPTIONS)
class Encoder(common.FamilySpec):
    """The BERT-like encoder's fields (letters as in tfjax.models.encoder)."""

    CHOICES = dict(head=one_of(*HEADS))

    vocab_size: int  # V
    width: int = 768  # D
    num_layers: int = 12  # L
    num_heads: int = 12  # A
    mlp_dim: int = 3072  # 4 D in BERT
    max_len: int = 512  # learned position table size
    type_vocab_size: int = 2  # sentence A / B embeddings; 0 for none
    head: str = "mlm"  # "mlm" (masked-LM logits) or "classifier" (pooled sequence logits)
    num_classes: int = 2  # C, with head="classifier"
    dropout_rate: float = 0.1  # embeddings, residual sub-layers and the classifier input
    attention_dropout_rate: float = 0.1  # on attention weights (BERT: 0.1)
    activation: str = "gelu"  # exact GELU as in BERT
    norm_position: str = "post"  # BERT is post-LN
    norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    init_stddev: float = 0.02  # truncated-normal-like init scale of BERT
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.ops.remat.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def block_config(self) -> BlockConfig:
        """Every layer's config: the flat fields translated (common.block_config)."""
        return common.block_config(self)

    def check_call(self, length: int, *, apply_head: bool = True) -> None:
        """Refuses tokens `length` long past the learned position table, and apply_head=False
        (the masked-LM head's hidden states) with another head."""
        if length > self.max_len:
            raise ValueError(f"tokens are {length} long; max_len={self.max_len}")
        if not apply_head and self.head != "mlm":
            raise ValueError(f"apply_head=False is for head='mlm'; this head={self.head!r}")

    def check_logits(self) -> None:
        """Refuses `logits` (the masked-LM projection) with another head."""
        if self.head != "mlm":
            raise ValueError(f"logits is the projection of head='mlm'; this head={self.head!r}")


def Model(variant: str | None = None, **overrides) -> Encoder:  # noqa: N802 (a factory)
    """Encoder(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return common.from_variant(Encoder, VARIANTS, variant, overrides)
