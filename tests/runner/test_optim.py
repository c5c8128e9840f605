"""tfjax.runner.optim: schedules against their formulas, decay mask, clipping. What each field
allows is checked by tfjax.runner.checks.check_config (tests/runner/test_validation.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tfjax.models import decoder, vit
from tfjax.runner import optim


def config(**overrides):
    c = ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=1.0,
            schedule="rsqrt",
            warmup_steps=4000,
            end_learning_rate_fraction=0.1,
            b1=0.9,
            b2=0.98,
            eps=1e-9,
            weight_decay=0.0,
            grad_clip_norm=0.0,
            ema_decay=0.0,
        )
    )
    c.update(overrides)
    return c


def test_rsqrt_is_the_papers_formula():
    schedule = optim.make_schedule(config(), d_model=512, num_train_steps=100_000)
    for step in (1, 100, 3999, 4000, 4001, 50_000):  # the paper's step numbers, from 1
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        np.testing.assert_allclose(float(schedule(step - 1)), expected, rtol=1e-6)
    # peak at the end of warmup: d^-0.5 * warmup^-0.5
    np.testing.assert_allclose(float(schedule(3999)), (512 * 4000) ** -0.5, rtol=1e-6)


def test_warmup_cosine_and_constant():
    c = config(schedule="warmup_cosine", learning_rate=1e-3, warmup_steps=10)
    s = optim.make_schedule(c, d_model=8, num_train_steps=110)
    np.testing.assert_allclose([float(s(0)), float(s(5)), float(s(10))], [0, 5e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), 1e-4 + (1e-3 - 1e-4) * 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(s(110)), 1e-4, rtol=1e-5)
    s = optim.make_schedule(
        config(schedule="constant", learning_rate=0.5, warmup_steps=0), d_model=8, num_train_steps=5
    )
    assert float(s(0)) == float(s(4)) == 0.5
    with pytest.raises(ValueError, match="num_train_steps \\(10\\) > optim.warmup_steps \\(10\\)"):
        optim.make_schedule(c, d_model=8, num_train_steps=10)
    with pytest.raises(ValueError, match="optim.schedule='linear' is unknown"):
        optim.make_schedule(config(schedule="linear"), d_model=8, num_train_steps=10)


def _params(model, *inputs):
    # boxed: nn.LogicallyPartitioned leaves
    return jax.jit(model.init)(jax.random.key(0), *inputs)["params"]


def test_decay_mask_spares_biases_norms_and_tokens():
    params = _params(vit.Model("tiny/4", num_classes=3), jnp.zeros((1, 8, 8, 1)))
    mask = optim.decay_mask(nn.unbox(params))
    flat = {
        "/".join(str(k.key) for k in path): m
        for path, m in jax.tree_util.tree_flatten_with_path(mask)[0]
    }
    boxed = jax.tree.leaves(optim.decay_mask(params))  # boxed parameters give the same mask
    assert boxed == jax.tree.leaves(mask)
    assert flat["encoder/layers_0/mlp/wi/kernel"]
    assert flat["encoder/layers_0/self_attention/query_kernel"]
    assert flat["patch_embed/kernel"]
    assert not flat["encoder/layers_0/mlp/wi/bias"]
    assert not flat["encoder/layers_0/self_attention/query_bias"]  # 2-D, still a bias
    assert not flat["encoder/layers_0/mlp_norm/scale"]
    assert not flat["cls"] and not flat["pos_embed"]


def test_adamw_decays_only_masked_parameters():
    params = nn.unbox(_params(decoder.Model("tiny", vocab_size=16), jnp.zeros((1, 4), jnp.int32)))
    tx = optim.make_optimizer(
        config(schedule="constant", learning_rate=0.1, warmup_steps=0, weight_decay=0.5),
        d_model=32,
        num_train_steps=1,
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = jax.jit(lambda p: optax.apply_updates(p, tx.update(zeros, tx.init(p), p)[0]))(params)
    kernel = params["decoder"]["layers_0"]["mlp"]["wi"]["kernel"]
    np.testing.assert_allclose(
        new["decoder"]["layers_0"]["mlp"]["wi"]["kernel"], kernel * (1 - 0.1 * 0.5), rtol=1e-6
    )
    scale = params["decoder"]["final_norm"]["scale"]
    np.testing.assert_array_equal(new["decoder"]["final_norm"]["scale"], scale)


def test_clipping_bounds_the_gradient_norm():
    params = {"w": jnp.zeros(4)}
    tx = optim.make_optimizer(
        config(
            name="sgd",
            schedule="constant",
            learning_rate=1.0,
            warmup_steps=0,
            b1=0.0,
            grad_clip_norm=2.0,
        ),
        d_model=8,
        num_train_steps=1,
    )
    updates, _ = tx.update({"w": jnp.full(4, 10.0)}, tx.init(params), params)
    np.testing.assert_allclose(optax.tree.norm(updates), 2.0, rtol=1e-6)


def test_a_zero_rate_is_allowed_and_sgd_ignores_adams_fields():
    params = {"kernel": jnp.ones((2, 2))}
    for c in (config(), config(name="sgd", b2=2.0, eps=-1.0)):  # b2, eps: Adam's only
        c.update(schedule="constant", learning_rate=0.0, warmup_steps=0, weight_decay=0.1)
        tx = optim.make_optimizer(c, d_model=8, num_train_steps=10)
        updates, _ = tx.update(params, tx.init(params), params)
        assert not np.any(updates["kernel"])  # a run that only evaluates
