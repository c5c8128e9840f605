"""Logical axis names: the one vocabulary shared by model code and sharding rules.

Parameters and activations are annotated with these names; `tfjax.sharding` maps them to mesh
axes through rules from the config, so data, FSDP and tensor parallelism are rule changes only.
Parameter axes and activation axes have different names because they shard differently under
FSDP: a weight's `embed` axis is split over `fsdp`, an activation's `act_embed` is not.

The names are plain strings, shared by tfjax.specs, tfjax.nn (Linen) and tfjax.nnx; the two
functions read Flax's logical axis rules in context, importing Flax when called (tfjax.ops
imports no Flax).
"""

import jax

# Activations.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

# Parameters.
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"
NORM = "norm"
LAYERS = "layers"  # the stacked axis of scanned layers
EXPERTS = "experts"  # the stacked axis of a mixture's expert kernels (expert parallelism)
ROUTER = "router"  # a router's per-expert vector (DeepSeek-V3's score correction): replicated
LATENT = "latent"  # multi-head latent attention's low ranks (DeepSeek's q and kv latents)


def shards(name: str) -> int:
    """Into how many parts the rules and mesh in context split logical axis `name` (1 outside
    `tfjax.sharding.logical_context`)."""
    import flax.linen as nn

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    (mesh_axes,) = nn.logical_to_mesh_axes((name,))
    if mesh_axes is None:
        return 1
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    size = 1
    for axis in mesh_axes:
        size *= mesh.shape[axis]
    return size


def attention_sharding():
    """The mesh axes (a PartitionSpec) that the rules and mesh in context give attention's
    [B, T, N, H] activations, the layout tfjax.ops' sharded kernels take; None outside
    `tfjax.sharding.logical_context` (no mesh or no rules: nothing is constrained)."""
    import flax.linen as nn

    if jax.sharding.get_abstract_mesh().empty or not nn.get_logical_axis_rules():
        return None
    return nn.logical_to_mesh_axes((BATCH, LENGTH, ACT_HEADS, None))
