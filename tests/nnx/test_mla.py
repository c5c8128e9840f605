"""Multi-head latent attention (tfjax.ops.mla; DeepSeek) in the decoder: Linen and NNX from the
same parameters (logits and gradients), the absorbed form equal to the expanded one, decoding
with the latent cache equal to the whole forward pass, the logit scale of YaRN's
mscale_all_dim, and the refusals."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_checks import assert_same_packed_logits_and_gradients, assert_same_tree, close

from tfjax.models import decoder as linen
from tfjax.nnx import models
from tfjax.nnx.models import decoder
from tfjax.ops import LatentCache, mla
from tfjax.ops.config import AttentionConfig, LatentAttention, LayerAttention
from tfjax.ops.position import RopeScaling

VOCAB = 37


def _fields(case, **more):
    fields = dict(vocab_size=VOCAB, **more)
    if case == "q-direct":  # a dense model: no experts' fields
        return dict(
            fields,
            width=32,
            num_layers=2,
            num_heads=4,
            head_dim=8,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            v_head_dim=16,
            mlp_dim=64,
            position="rope",
            norm="rms",
            activation="swiglu",
            use_bias=False,
            tie_embeddings=False,
            dropout_rate=0.0,
        )
    return dict(fields, variant="deepseek-tiny")


def _models(case, scan_layers, **more):
    fields = _fields(case, scan_layers=scan_layers, **more)
    variant = fields.pop("variant", None)
    return linen.Model(variant, **fields), decoder.Model(variant, rngs=nnx.Rngs(1), **fields)


def _tokens(batch=2, length=9, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, VOCAB, (batch, length)))


def _params(lm, tokens):
    return lm.init(jax.random.key(0), tokens)["params"]


# the preset scanned (its dense layer and its experts' layers: two scanned stacks), queries
# straight from the input unrolled
@pytest.mark.parametrize(("case", "scan_layers"), [("q-latent", True), ("q-direct", False)])
def test_linen_and_nnx_give_the_same_logits_and_gradients(case, scan_layers):
    lm, model = _models(case, scan_layers)
    tokens = _tokens()
    boxed = _params(lm, tokens)
    assert_same_tree(boxed, model)
    _, grads, _ = assert_same_packed_logits_and_gradients(
        lm, model, nn.meta.unbox(boxed), tokens, VOCAB
    )
    for path in grads:
        if path[-1] == "router_score_bias":  # not trained
            assert not np.abs(grads[path]).max() > 0
        else:
            assert np.abs(grads[path]).max() > 0, path


def _config(**latent):
    lat = LatentAttention(**{**dict(kv_rank=16, rope_dim=4, value_dim=6), **latent})
    return AttentionConfig(4, head_dim=8, use_bias=False, position="rope", latent=lat)


def _random_params(config, width, seed=0):
    rng = np.random.RandomState(seed)
    return {
        name: jnp.asarray(rng.randn(*shape) * (0.3 if kind == "kernel" else 1.0), jnp.float32)
        + (1.0 if kind == "ones" else 0.0)
        for name, (shape, _, kind) in mla.parameter_shapes(config, width).items()
    }


@pytest.mark.parametrize("q_rank", [None, 12])
def test_absorbed_form_equals_the_expanded_form(q_rank):
    """The same attention output from the whole latent cache, with and without a mask."""
    config, width = _config(q_rank=q_rank), 32
    p = _random_params(config, width)
    x = jnp.asarray(np.random.RandomState(1).randn(2, 7, width), jnp.float32)
    positions = jnp.arange(7)
    q, (c, k_r) = mla.queries(x, p, config), mla.latents(x, p, config)
    q, k_r = mla.rotate(q, k_r, positions, config)
    want = mla.expanded_attention(q, c, k_r, p, config, positions=positions, is_causal=True)
    got = mla.absorbed_attention(q, c, k_r, p, config, offset=0)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)).max() > 0.1
    # the last three queries against the first six keys of a longer cache, a key masked out
    mask = jnp.ones((2, 1, 3, 7), bool).at[0, :, :, 2].set(False)
    got = mla.absorbed_attention(q[:, 3:6], c, k_r, p, config, offset=3, mask=mask)
    pattern = jnp.ones((2, 1, 7, 7), bool).at[0, :, :, 2].set(False)
    want = mla.expanded_attention(
        q, c, k_r, p, config, positions=positions, is_causal=True, mask=pattern
    )
    np.testing.assert_allclose(got, want[:, 3:6], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_with_the_latent_cache_matches_the_forward_pass(scan_layers):
    """The cache holds each token's latent and rotated key part only; a prompt then single
    tokens give the whole sequence's logits, in Linen and NNX alike."""
    lm, model = _models("q-direct", scan_layers, q_lora_rank=12)  # dense: quick op by op
    tokens = _tokens(length=7)
    params = nn.meta.unbox(_params(lm, tokens))
    models.load_params(model, params)
    want_cache, cache = lm.init_cache(2, 8), model.init_cache(2, 8)
    layers = jax.tree.leaves(want_cache, is_leaf=lambda x: isinstance(x, LatentCache))
    assert all(isinstance(c, LatentCache) for c in layers)
    # per layer [B, S, R] and [B, S, Hr]; scanned, one per stack with its layers leading
    leads = [(2,)] if scan_layers else [()] * 2
    assert [(c.latent.shape, c.rope_keys.shape) for c in layers] == [
        ((*lead, 2, 8, 16), (*lead, 2, 8, 4)) for lead in leads
    ]
    full = lm.apply({"params": params}, tokens)[0]
    for start, stop in ((0, 4), (4, 5), (5, 7)):
        step = tokens[:, start:stop]
        (want, _), want_cache = lm.apply({"params": params}, step, decode=True, cache=want_cache)
        (got, _), cache = model(step, cache=cache)
        close(got, want)
        np.testing.assert_allclose(want, full[:, start:stop], atol=1e-5, rtol=1e-5)
    jax.tree.map(close, cache, want_cache)


def test_yarn_mscale_all_dim_scales_the_logits():
    yarn = RopeScaling("yarn", 40.0, 4096, mscale_all_dim=1.0)
    config = AttentionConfig(
        4,
        head_dim=8,
        use_bias=False,
        position="rope",
        variants=(LayerAttention(rope_scaling=yarn),),
        latent=LatentAttention(16, 4),
    )
    want = 12**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
    assert math.isclose(mla.logit_scale(config), want, rel_tol=1e-12)
    assert mla.logit_scale(_config()) == 12**-0.5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_kv_heads=2), r"latent attention does not take num_kv_heads=2 \(needs 4\)"),
        (dict(position="learned"), r"position=None \(needs 'rope'\)"),
        (dict(qk_norm=True), r"qk_norm=True \(needs False\)"),
        (dict(kv_lora_rank=None), r"q_lora_rank, qk_rope_head_dim, v_head_dim set, but kv_lora"),
        (dict(qk_rope_head_dim=None), r"kv_lora_rank needs qk_rope_head_dim"),
        (dict(qk_rope_head_dim=5), r"rope_dim=5 must be even"),
    ],
)
def test_what_latent_attention_cannot_take_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        linen.Model("deepseek-tiny", vocab_size=VOCAB, **fields)


def test_linen_decoding_needs_the_explicit_cache():
    lm, _ = _models("q-direct", False)
    tokens = _tokens(length=3)
    params = _params(lm, tokens)
    with pytest.raises(ValueError, match="decode=True needs an explicit cache"):
        lm.apply({"params": params}, tokens, decode=True, mutable=["cache"])
