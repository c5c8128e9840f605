"""RoPE scaling (linear, dynamic NTK, Llama 3.1, YaRN) against transformers' own rotary layer."""

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
