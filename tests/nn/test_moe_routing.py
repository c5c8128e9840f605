"""DeepSeek-V3's router (tfjax.ops.moe.route with score_bias, groups, groups_kept, scale)
against transformers' DeepseekV3TopkRouter on random logits, the spec fields that set it, and
their refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.models import decoder
from tfjax.ops import moe
from tfjax.ops.config import MoeConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402

CASES = {  # (E, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    "groups-kept-renormalised-scaled": (16, 4, 4, 2, True, 2.5),
    "one-group-not-renormalised": (8, 2, 1, 1, False, 1.0),
    "groups-all-kept": (12, 3, 3, 3, True, 1.5),
    "one-group-kept-of-four": (8, 2, 4, 1, True, 2.0),
}


def _torch_router(e, k, groups, kept, renormalize, scale, d, seed):
    config = transformers.DeepseekV3Config(
        hidden_size=d,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=kept,
        norm_topk_prob=renormalize,
        routed_scaling_factor=scale,
    )
    router = ds.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, d, generator=gen))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(e, generator=gen))
    return router


@pytest.mark.parametrize("case", CASES)
def test_route_matches_deepseek_v3_topk_router(case):
    e, k, groups, kept, renormalize, scale = CASES[case]
    d, n = 6, 40
    router = _torch_router(e, k, groups, kept, renormalize, scale, d, seed=len(case))
    x = np.random.RandomState(0).randn(n, d).astype(np.float32)
    with torch.no_grad():
        logits, want_w, want_e = router(torch.tensor(x))
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    config = MoeConfig(
        e,
        k,
        4,
        router_score="sigmoid",
        renormalize=renormalize,
        score_bias=True,
        groups=groups,
        groups_kept=kept,
        scale=scale,
    )
    weights, experts, scores = moe.route(
        jnp.asarray(logits.numpy()), k, score_bias=bias, **config.route_options()
    )
    # the same experts (transformers' order is unsorted), with the same weights
    order_want = np.argsort(want_e.numpy(), axis=-1)
    order_got = np.argsort(np.asarray(experts), axis=-1)
    want_e_sorted = np.take_along_axis(want_e.numpy(), order_want, axis=-1)
    got_e_sorted = np.take_along_axis(np.asarray(experts), order_got, axis=-1)
    np.testing.assert_array_equal(got_e_sorted, want_e_sorted)
    got_w = np.take_along_axis(np.asarray(weights), order_got, axis=-1)
    want_w_sorted = np.take_along_axis(want_w.numpy(), order_want, axis=-1)
    np.testing.assert_allclose(got_w, want_w_sorted, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(scores), torch.sigmoid(logits).numpy(), rtol=1e-6)


def test_the_bias_and_the_groups_change_the_choice_and_not_the_weights():
    """The correction bias and group limits act on the choice only: the chosen weights are the
    un-biased scores, and without them the choice is plain top-k."""
    logits = jnp.asarray(np.random.RandomState(1).randn(30, 8), jnp.float32)
    bias = jnp.asarray(np.random.RandomState(2).randn(8), jnp.float32)
    plain_w, plain_e, scores = moe.route(logits, 2, score="sigmoid", renormalize=False)
    w, e, _ = moe.route(logits, 2, score="sigmoid", renormalize=False, score_bias=bias)
    assert not np.array_equal(np.asarray(e), np.asarray(plain_e))
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(np.asarray(scores), e, -1))
    _, grouped, _ = moe.route(logits, 2, score="sigmoid", groups=4, groups_kept=1)
    assert (np.asarray(grouped) // 2 == np.asarray(grouped)[:, :1] // 2).all()  # one group
    # the default options are today's routing: the top-k of the softmax, renormalised
    w0, e0, _ = moe.route(logits, 2)
    top, idx = jax.lax.top_k(jax.nn.softmax(logits), 2)
    np.testing.assert_array_equal(np.asarray(e0), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(w0), np.asarray(top / top.sum(-1, keepdims=True)))


def test_no_gradient_reaches_the_score_bias():
    logits = jnp.asarray(np.random.RandomState(3).randn(10, 8), jnp.float32)

    def loss(bias):
        w, _, _ = moe.route(logits, 2, score="sigmoid", score_bias=bias, scale=2.5)
        return jnp.sum(w)

    grad = jax.grad(loss)(jnp.ones(8))
    np.testing.assert_array_equal(np.asarray(grad), np.zeros(8))


def test_decoder_fields_build_the_router_and_its_parameter():
    spec = decoder.Model(
        "moe-tiny",
        vocab_size=11,
        router_score="sigmoid",
        router_score_bias=True,
        router_groups=4,
        router_groups_kept=2,
        router_scale=2.5,
    )
    moe_config = spec.block_config().mlp
    assert (moe_config.score_bias, moe_config.groups, moe_config.groups_kept) == (True, 4, 2)
    assert moe_config.scale == 2.5
    variables = jax.eval_shape(lambda: spec.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32)))
    bias = variables["params"]["decoder"]["layers_0"]["mlp"]["router_score_bias"]
    assert bias.value.shape == (8,) and bias.names == ("router",)
    assert decoder.Model("moe-tiny", vocab_size=11).block_config().mlp.route_options() == dict(
        score="softmax", renormalize=True, groups=1, groups_kept=None, scale=1.0
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(router_groups=3), r"groups=3 must divide num_experts=8"),
        (dict(router_groups=4, router_groups_kept=5), r"groups_kept=5 must be in \[1, groups=4\]"),
        (dict(router_groups=8, router_groups_kept=2), r"groups=8 of 8 experts leaves groups"),
        (
            dict(router_groups=4, router_groups_kept=1, experts_per_token=3),
            r"top_k=3 exceeds the 2 experts of the groups_kept=1 groups",
        ),
        (dict(router_scale=0.0), r"router_scale"),
    ],
)
def test_inconsistent_router_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        decoder.Model("moe-tiny", vocab_size=11, **fields)


def test_router_fields_without_experts_are_refused():
    with pytest.raises(ValueError, match="router_groups, router_scale set, but num_experts=0"):
        decoder.Model("tiny", vocab_size=11, router_groups=2, router_scale=2.0)
