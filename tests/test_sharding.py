"""tfjax.sharding: meshes from configs, rules, parameter and batch shardings."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tfjax import sharding
from tfjax.models import transformer


def test_make_mesh_fills_the_free_axis():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.make_mesh({"fsdp": -1}).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    one = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    assert one.devices.size == 1


@pytest.mark.parametrize(
    "mesh, message",
    [
        ({"data": 3, "fsdp": 1, "tensor": 1}, "has 3 devices but there are 8"),
        ({"data": -1, "fsdp": 3}, "does not divide the 8 devices"),
        ({"data": -1, "fsdp": -1}, "at most one -1"),
        ({"data": 0}, "sizes must be positive"),
        ({"model": 8}, "unknown axis"),
    ],
)
def test_make_mesh_errors_name_the_cause(mesh, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(mesh)


def test_check_rules():
    rules = sharding.check_rules([["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["norm", None]])
    assert rules == (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("norm", None))
    with pytest.raises(ValueError, match="names mesh axis 'model'"):
        sharding.check_rules([("embed", "model")])
    with pytest.raises(ValueError, match="not a \\(name, mesh axes\\) pair"):
        sharding.check_rules([("embed",)])


def _param_shardings(mesh, rules=sharding.DEFAULT_RULES):
    model = transformer.Model("tiny", vocab_size=64)
    tokens = jnp.zeros((8, 4), jnp.int32)
    with sharding.logical_context(mesh, rules):
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]
    return sharding.logical_shardings(boxed, mesh, rules)


def test_parameter_specs_follow_the_rules():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    s = _param_shardings(mesh)
    layer = s["encoder"]["layers_0"]
    assert s["embed"]["embedding"].spec == P("tensor", "fsdp")  # [vocab, embed]
    assert layer["mlp"]["wi"]["kernel"].spec == P("fsdp", "tensor")  # [embed, mlp]
    assert layer["mlp"]["wo"]["kernel"].spec == P("tensor", "fsdp")  # [mlp, embed]
    assert layer["self_attention"]["query_kernel"].spec == P("fsdp", "tensor", None)
    assert layer["self_attention"]["out_kernel"].spec == P("tensor", None, "fsdp")
    assert layer["mlp_norm"]["scale"].spec == P(None)
    # Pure data parallelism is a rule change: nothing is sharded.
    dp_rules = tuple(
        (name, None if name != "batch" else ("data", "fsdp")) for name, _ in sharding.DEFAULT_RULES
    )
    s = _param_shardings(mesh, dp_rules)
    assert all(x.is_fully_replicated for x in jax.tree.leaves(s))


def test_check_divisible_names_the_parameter():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 2})
    model = transformer.Model("tiny", vocab_size=61)  # 61 does not split 2 ways
    tokens = jnp.zeros((8, 4), jnp.int32)
    with sharding.logical_context(mesh, sharding.DEFAULT_RULES):
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]
    shardings = sharding.logical_shardings(boxed, mesh, sharding.DEFAULT_RULES)
    with pytest.raises(ValueError, match=r"'embed/embedding' of shape \(61, 32\).*by 2"):
        sharding.check_divisible(nn.unbox(boxed), shardings)


def test_batches_are_split_over_data_and_fsdp():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.DEFAULT_RULES
    assert sharding.data_parallel_size(mesh, rules) == 4
    assert sharding.data_shard(mesh, rules) == (0, 1)
    local = {"tokens": np.arange(8 * 3).reshape(8, 3), "label": np.arange(8)}
    batch = sharding.shard_batch(local, mesh, rules)
    assert batch["tokens"].sharding.spec == P(("data", "fsdp"), None)
    assert {s.data.shape for s in batch["tokens"].addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(batch["tokens"], local["tokens"])
    np.testing.assert_array_equal(batch["label"], local["label"])
