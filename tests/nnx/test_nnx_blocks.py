"""tfjax.nnx.blocks against tfjax.nn (Linen), module by module where the families do not reach
an option: cross-attention over a context of another width and with a mask, a mixture of
experts with biases, a shared gated expert and its sown losses, split over a mesh, and T5's
relative position bias."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from nnx_checks import assert_same_tree, close, flat

from tfjax import nn as tnn
from tfjax import sharding
from tfjax.nn.moe import AUX_LOSSES
from tfjax.nnx import blocks, models
from tfjax.ops.config import AttentionConfig, BlockConfig, MlpConfig, MoeConfig


def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def _same(linen_module, nnx_module, *args, mutable=False, **kwargs):
    """Linen `linen_module` initialised on `args`, its parameters in `nnx_module`: the same
    tree, and the same outputs and gradients (of their sum of squares, and of any sown
    losses); returns the NNX module's sown AuxLoss tree and Linen's collection."""
    variables = linen_module.init(jax.random.key(0), *args, **kwargs)
    assert_same_tree(variables["params"], nnx_module)
    params = nn.meta.unbox(variables["params"])
    models.load_params(nnx_module, params)

    def total(out, aux):
        return jnp.sum(out**2) + sum(jnp.sum(x) for x in jax.tree.leaves(aux))

    def linen_loss(p):
        if mutable:
            out, state = linen_module.apply({"params": p}, *args, mutable=[AUX_LOSSES], **kwargs)
            aux = state[AUX_LOSSES]
        else:
            out, aux = linen_module.apply({"params": p}, *args, **kwargs), {}
        return total(out, aux), (out, aux)

    def nnx_loss(m):
        out = m(*args, **kwargs)
        aux = nnx.to_pure_dict(nnx.pop(m, blocks.AuxLoss))
        return total(out, aux), (out, aux)

    (_, (want, want_aux)), want_grads = jax.value_and_grad(linen_loss, has_aux=True)(params)
    (_, (got, aux)), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(nnx_module)
    close(got, want)
    assert flat(aux).keys() == flat(want_aux).keys()
    jax.tree.map(close, aux, want_aux)
    grads, want_grads = flat(nnx.to_pure_dict(grads)), flat(want_grads)
    assert grads.keys() == want_grads.keys()
    for path in grads:
        close(grads[path], want_grads[path])
    return aux, want_aux


ATTENTION = AttentionConfig(num_heads=4, num_kv_heads=2, position="rope")


def test_block_with_cross_attention_over_a_wider_context():
    """Cross-attention's own parameters (its key and value kernels [D', K, H], norms, layer
    scale) and inputs (the context, its segment ids and mask) as Linen's Block takes them; the
    families' stacks (test_nnx_transformer) cover the rest."""
    config = BlockConfig(
        ATTENTION,
        MlpConfig(48, activation="geglu"),
        norm="rms",
        norm_position="sandwich",
        causal=True,
        cross_attention=True,
        layer_scale=0.5,
    )
    x, context = _x((2, 5, 32)), _x((2, 7, 24), seed=1)
    ids = jnp.asarray([[1, 1, 1, 2, 2], [1, 1, 1, 1, 1]])
    context_ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 0], [1] * 7])
    # the second row's queries see only the first 4 context tokens
    context_mask = jnp.arange(7)[None, None, None, :] < jnp.asarray([7, 4])[:, None, None, None]
    block = blocks.Block(config, 32, context_width=24, rngs=nnx.Rngs(1))
    _same(
        tnn.Block(config),
        block,
        x,
        context,
        segment_ids=ids,
        context_segment_ids=context_ids,
        context_mask=context_mask,
        positions=jnp.arange(5)[None],
    )
    assert block.cross_attention.key_kernel[...].shape == (24, 2, 8)
    assert hasattr(block, "cross_attention_post_norm")
    with pytest.raises(ValueError, match="cross_attention=True needs the encoder output"):
        block(x)


def test_mixture_of_experts_with_biases_and_a_shared_gated_expert():
    config = MoeConfig(
        num_experts=4,
        top_k=2,
        hidden_dim=16,
        activation="gelu",
        use_bias=True,
        router_bias=True,
        shared_dim=24,
        shared_gate=True,
        router_z_weight=0.1,
    )
    mlp = blocks.MoeMlp(config, 32, rngs=nnx.Rngs(1))
    aux, _ = _same(tnn.MoeMlp(config), mlp, _x((2, 5, 32)), mutable=True)
    assert set(aux) == {"load_balance", "router_z", "loss"}
    assert aux["loss"][0].shape == ()


def test_relative_position_bias_as_t5s():
    for bidirectional in (True, False):
        bias = blocks.RelativePositionBias(
            4, bidirectional=bidirectional, num_buckets=8, max_distance=16, rngs=nnx.Rngs(1)
        )
        linen_bias = tnn.position.RelativePositionBias(
            4, bidirectional=bidirectional, num_buckets=8, max_distance=16
        )
        params = linen_bias.init(jax.random.key(0), jnp.arange(6))["params"]
        assert_same_tree(params, bias)
        models.load_params(bias, params)
        q, k = jnp.arange(3) + 4, jnp.arange(9)
        close(bias(q, k), linen_bias.apply({"params": params}, q, k))
        assert bias(q, k).shape == (1, 4, 3, 9)


def test_experts_created_split_over_the_mesh_compute_one_devices_numbers():
    """Created under a mesh and the expert-parallel rules, the expert kernels lie where the
    rules put Linen's (E over fsdp, F over tensor; not D too, which NNX's own eager sharding
    would claim); run in the logical context (the tokens travel to their experts,
    tfjax.ops.moe), the outputs and losses are one device's."""
    assert len(jax.devices()) >= 8, f"needs 8 devices, has {len(jax.devices())}"
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.expert_parallel(sharding.DEFAULT_RULES, "fsdp")
    config = MoeConfig(num_experts=4, top_k=2, hidden_dim=16, shared_dim=8)
    x = _x((8, 3, 32))
    abstract = jax.eval_shape(lambda: tnn.MoeMlp(config).init(jax.random.key(0), x))["params"]
    want_shardings = flat(sharding.logical_shardings(abstract, mesh, rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        mlp = blocks.MoeMlp(config, 32, rngs=nnx.Rngs(1))
    params = flat(nnx.to_pure_dict(nnx.state(mlp, nnx.Param)))
    for path, p in params.items():
        assert p.sharding.is_equivalent_to(want_shardings[path], p.ndim), path
    wo = params["experts", "wo"]  # [E, F, D]
    assert wo.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tensor")), 3)
    reference = blocks.MoeMlp(config, 32, rngs=nnx.Rngs(1))  # same seed, no mesh
    want = reference(x)
    want_aux = nnx.to_pure_dict(nnx.pop(reference, blocks.AuxLoss))

    @nnx.jit
    def run(m, x):
        with sharding.logical_context(mesh, rules):
            y = m(x)
        return y, nnx.to_pure_dict(nnx.pop(m, blocks.AuxLoss))

    got, aux = run(mlp, jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")))))
    close(got, want)
    jax.tree.map(close, aux, want_aux)
    # Under a mesh of Explicit axes too (jax.sharding.reshard places them).
    explicit = jax.make_mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3
    )
    with jax.set_mesh(explicit), nn.logical_axis_rules(rules):
        mlp = blocks.MoeMlp(config, 32, rngs=nnx.Rngs(1))
    assert mlp.experts.wo[...].sharding.spec == P("fsdp", "tensor", None)
    close(mlp.experts.wo[...], reference.experts.wo[...])
