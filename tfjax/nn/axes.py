"""Logical axis names: tfjax.ops.axes (framework-free, shared with tfjax.nnx and tfjax.specs),
re-exported here where Linen code and users have always imported them."""

from tfjax.ops.axes import (  # noqa: F401 (re-exported)
    ACT_EMBED,
    ACT_HEADS,
    ACT_MLP,
    ACT_VOCAB,
    BATCH,
    EMBED,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LATENT,
    LAYERS,
    LENGTH,
    MLP,
    NORM,
    ROUTER,
    VOCAB,
    attention_sharding,
    shards,
)
