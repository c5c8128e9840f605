"""The grouped matmul of the MoE dispatch: each target's kernel computes ragged_dot's numbers,
and ops.moe.grouped_matmul chooses it where it should (Megablox for a TPU chip, XLA where the
compiler partitions the call, on the CPU, and for dims under a TPU tile)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax.ops import moe
from tfjax.runner import aot


def test_megablox_equals_ragged_dot_with_its_gradients():
    """Megablox (interpreted on this CPU) against XLA's ragged_dot, float32: outputs and the
    gradients of rows and kernels, with an empty group, rows of no group (sum(sizes) < R) and
    R = 37, no multiple of a tile (padded inside)."""
    rows = jax.random.normal(jax.random.key(0), (37, 128))
    kernel = jax.random.normal(jax.random.key(1), (4, 128, 256)) / 16
    sizes = jnp.array([10, 0, 20, 5], jnp.int32)  # 35 of 37 rows
    defined = (jnp.arange(37) < 35)[:, None]
    cotangent = jax.random.normal(jax.random.key(2), (37, 256)) * defined

    def objective(implementation):
        def f(rows, kernel):
            out = moe.grouped_matmul(rows, kernel, sizes, implementation=implementation)
            return jnp.sum(jnp.where(defined, out, 0) * cotangent), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    (_, want), want_grads = objective("xla")(rows, kernel)
    (_, got), got_grads = objective("megablox")(rows, kernel)
    np.testing.assert_allclose(got[:35], want[:35], rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got_grads[1][1]).max()) == 0.0  # the empty group's kernel: no gradient


def choice(mesh, kernel_shape=(8, 256, 512), manual=()):
    """The implementation grouped_matmul picks when traced under `mesh` (axes in `manual` made
    manual by shard_map), read off the compiled program's custom calls."""

    def f(rows, kernel, sizes):
        return moe.grouped_matmul(rows, kernel, sizes)

    if manual:
        f = jax.shard_map(
            f, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=set(manual), check_vma=False
        )  # as ops.moe's expert-parallel path makes it
    whole = NamedSharding(mesh, P())
    args = (
        jax.ShapeDtypeStruct((256, kernel_shape[1]), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct(kernel_shape, jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((kernel_shape[0],), jnp.int32, sharding=whole),
    )
    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(*args).as_text()
    return "megablox" if "tpu_custom_call" in text else "xla"


def test_each_target_gets_its_grouped_matmul():
    tpu = np.array(aot.topology_devices("v5p:2x2x1"))
    assert choice(Mesh(tpu[:1], ("data",))) == "megablox"  # one chip
    # Two chips split by the compiler: a Pallas kernel is one device's program.
    assert choice(Mesh(tpu[:2], ("data",))) == "xla"
    # ... unless shard_map makes every split axis manual (the expert-parallel path).
    pair = Mesh(tpu[:4].reshape(2, 2), ("data", "tensor"))
    assert choice(pair, manual=("data", "tensor")) == "megablox"
    assert choice(pair, manual=("data",)) == "xla"
    # Mosaic wants every axis manual in shard_map, even one of size 1.
    assert choice(Mesh(tpu[:2].reshape(2, 1), ("data", "tensor")), manual=("data",)) == "xla"
    assert choice(Mesh(tpu[:1], ("data",)), kernel_shape=(8, 64, 512)) == "xla"  # under a tile
    assert choice(Mesh(np.array(jax.devices("cpu")[:1]), ("data",))) == "xla"


def test_an_unknown_implementation_is_refused_by_name():
    with pytest.raises(ValueError, match="implementation 'cutlass' is not one of"):
        moe.grouped_matmul(
            jnp.ones((2, 4)), jnp.ones((1, 4, 4)), jnp.array([2]), implementation="cutlass"
        )


def test_megablox_in_the_expert_parallel_path_equals_one_device(monkeypatch):
    """The kernel where the TPU runs it in training: inside the expert-parallel shard_map (8 CPU
    devices, tokens over data x fsdp, 4 shards of 2 experts over fsdp), Megablox (interpreted)
    forced: outputs and gradients equal one device's XLA ones, the pairs routed to other
    shards (rows of no local group) adding nothing, NaN nowhere."""
    from tfjax import sharding
    from tfjax.nn import moe as nn_moe
    from tfjax.ops.config import MoeConfig

    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    module = nn_moe.MoeMlp(MoeConfig(8, 2, 128, use_bias=True, router_bias=True))
    x = jax.random.normal(jax.random.key(2), (8, 4, 128))
    r = jax.random.normal(jax.random.key(3), x.shape)
    params = nn.unbox(module.init(jax.random.key(0), x)["params"])
    params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(4), a.shape), params)
    rules = sharding.expert_parallel(sharding.DEFAULT_RULES, "fsdp")

    def objective(params, x):
        y, state = module.apply({"params": params}, x, mutable=[nn_moe.AUX_LOSSES])
        return jnp.sum(y * r) + state[nn_moe.AUX_LOSSES]["loss"][0], y

    def on_mesh(params, x):
        with sharding.logical_context(mesh, rules):
            return jax.value_and_grad(objective, has_aux=True)(params, x)

    (want_loss, want_y), want_grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, x)
    monkeypatch.setattr(moe, "_grouped_matmul_implementation", lambda: "megablox")
    abstract = jax.eval_shape(lambda: params)
    placed = jax.device_put(params, sharding.logical_shardings(abstract, mesh, rules))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    (loss, y), grad = jax.jit(on_mesh)(placed, jax.device_put(x, rows))
    # outputs up to ~70, sums of 2 x 128 products each, rounded in another order
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-4)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    # gradients up to ~700, summed over shards in another order: rounding scales with the array
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
