"""tfjax.nn options used by converted checkpoints: the "silu" Mlp and Stack.final_norm."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import nn as tnn


def test_mlp_silu_formula():
    mlp = tnn.Mlp(tnn.MlpConfig(12, "silu"))
    x = jax.random.normal(jax.random.key(0), (2, 3, 5))
    p = jax.tree.map(np.asarray, nn.unbox(mlp.init(jax.random.key(1), x))["params"])
    h = x @ p["wi"]["kernel"] + p["wi"]["bias"]
    want = (h / (1 + np.exp(-h))) @ p["wo"]["kernel"] + p["wo"]["bias"]  # x * sigmoid(x)
    np.testing.assert_allclose(mlp.apply({"params": p}, x), want, atol=1e-5)


@pytest.mark.parametrize(
    ("norm_position", "final_norm", "has_norm"),
    [("pre", None, True), ("post", None, False), ("post", True, True), ("pre", False, False)],
)
def test_stack_final_norm(norm_position, final_norm, has_norm):
    blk = tnn.BlockConfig(tnn.AttentionConfig(4), tnn.MlpConfig(32), norm_position=norm_position)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    stack = tnn.Stack(blk, 2, final_norm=final_norm)
    params = nn.unbox(stack.init(jax.random.key(1), x))["params"]
    assert ("final_norm" in params) == has_norm
    if not has_norm:
        return
    # The final norm is a LayerNorm of the last layer's output (with scale and bias that show).
    k1, k2 = jax.random.split(jax.random.key(2))
    params["final_norm"] = {
        "scale": 1 + 0.3 * jax.random.normal(k1, (16,)),
        "bias": 0.3 * jax.random.normal(k2, (16,)),
    }
    without = {k: v for k, v in params.items() if k != "final_norm"}
    y = tnn.Stack(blk, 2, final_norm=False).apply({"params": without}, x)
    mean, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
    want = (y - mean) / jnp.sqrt(var + blk.norm_eps)
    want = want * params["final_norm"]["scale"] + params["final_norm"]["bias"]
    np.testing.assert_allclose(stack.apply({"params": params}, x), want, atol=1e-5)
