"""Positions converted checkpoints need: RoPE scaling (linear, dynamic NTK, Llama 3.1, YaRN) and
T5's relative position buckets, against transformers' own layers."""

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.nn import position

torch = pytest.importorskip("torch")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig  # noqa: E402

# (rope_parameters beyond rope_type and rope_theta, tfjax fields). max_position_embeddings is
# 64 and the head width 32, so every kind acts on positions the test reaches (up to 200).
CASES = {
    "linear": ({"factor": 4.0}, {"factor": 4.0, "original_length": 64}),
    "dynamic": ({"factor": 2.0}, {"factor": 2.0, "original_length": 64}),
    "llama3": (
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"factor": 8.0, "original_length": 32, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ),
    "llama3-uneven": (
        {
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 48,
        },
        {"factor": 32.0, "original_length": 48, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
    ),
    "yarn": (
        {"factor": 4.0, "original_max_position_embeddings": 16},
        {"factor": 4.0, "original_length": 16},
    ),
    "yarn-untruncated": (
        {
            "factor": 3.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.25,
            "truncate": False,
        },
        {
            "factor": 3.0,
            "original_length": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.25,
            "truncate": False,
        },
    ),
}


def _reference(case, q, k, position_ids):
    """transformers' rotary layer applied to q, k [B, T, N, H] (float64)."""
    params, _ = CASES[case]
    kind = case.split("-")[0]
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": kind, "rope_theta": 500.0, **params},
    )
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    # [B, N, T, H] as the reference lays them out.
    tq, tk = (torch.from_numpy(np.swapaxes(a, 1, 2)).double() for a in (q, k))
    cos, sin = rotary(tq, torch.from_numpy(position_ids))
    rq, rk = modeling_llama.apply_rotary_pos_emb(tq, tk, cos.double(), sin.double())
    return (np.swapaxes(a.numpy(), 1, 2) for a in (rq, rk))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("length", [24, 200])
def test_rope_scaling_matches_transformers(case, length):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, length, 2, 32)).astype(np.float32)
    k = rng.standard_normal((2, length, 2, 32)).astype(np.float32)
    position_ids = np.stack([np.arange(length), np.arange(length) + 3])  # [B, T]
    ref_q, ref_k = _reference(case, q, k, position_ids)
    scaling = position.RopeScaling(case.split("-")[0], **CASES[case][1])
    # Both sides form angles p * f in float32: one ulp of f (6e-8 relative) at p = 200 moves the
    # angle by ~1e-5 rad, so the tolerance grows with the length.
    atol = 2e-5 * max(1, length / 40)
    for x, ref in ((q, ref_q), (k, ref_k)):
        out = position.rope(jnp.asarray(x), position_ids, base=500.0, scaling=scaling)
        np.testing.assert_allclose(np.asarray(out), ref, atol=atol, rtol=1e-5)


def test_dynamic_scaling_follows_the_longest_position():
    # Below original_length the frequencies are the plain ones; past it the base grows.
    scaling = position.RopeScaling("dynamic", factor=2.0, original_length=64)
    plain, _ = position.rope_frequencies(32, 500.0)
    short, _ = position.rope_frequencies(32, 500.0, scaling, length=40)
    long, _ = position.rope_frequencies(32, 500.0, scaling, length=200)
    np.testing.assert_allclose(short, plain, rtol=1e-6)
    assert np.all(np.asarray(long)[1:] < np.asarray(plain)[1:])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kind": "longrope", "factor": 2.0, "original_length": 8}, "RopeScaling.kind='longrope'"),
        ({"kind": "linear", "factor": 0.0, "original_length": 8}, "factor > 0"),
        (
            {
                "kind": "llama3",
                "factor": 8.0,
                "original_length": 8,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
            },
            "high_freq_factor > low_freq_factor",
        ),
    ],
)
def test_bad_scaling_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        position.RopeScaling(**fields)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 20), (8, 8)])
def test_relative_position_buckets_match_t5(bidirectional, num_buckets, max_distance):
    modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    offsets = np.arange(-400, 401)
    ref = modeling_t5.T5Attention._relative_position_bucket(
        torch.from_numpy(offsets),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    ).numpy()
    out = position.relative_position_bucket(
        offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    np.testing.assert_array_equal(np.asarray(out), ref)
    # The offsets reach every bucket (bidirectional: but one, "after the query at distance 0").
    assert len(np.unique(ref)) == num_buckets - bidirectional


@pytest.mark.parametrize("is_decoder", [False, True])
def test_relative_position_bias_matches_t5(is_decoder):
    import flax.linen
    import jax
    from transformers import T5Config

    modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    config = T5Config(
        d_model=16,
        d_kv=4,
        num_heads=4,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=24,
        is_decoder=is_decoder,
    )
    attention = modeling_t5.T5Attention(config, has_relative_attention_bias=True)
    bias = position.RelativePositionBias(
        num_heads=4, bidirectional=not is_decoder, num_buckets=16, max_distance=24
    )
    variables = flax.linen.unbox(bias.init(jax.random.key(0), jnp.arange(5), jnp.arange(5)))
    attention.relative_attention_bias.weight.data = torch.from_numpy(
        np.array(variables["params"]["embedding"])
    )
    # A decode step: 3 queries after 30 cached tokens, against all 33 keys.
    ref = attention.compute_bias(3, 33, past_seen_tokens=30).detach().numpy()
    out = bias.apply(variables, 30 + jnp.arange(3), jnp.arange(33))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)
