"""tfjax.decode with an NNX model (tfjax.nnx.models): `generate(model, prompts, ...)` runs it
through tfjax.nnx.functional on the Linen path's code and explicit KV cache, and gives the
Linen model's tokens and scores from the same parameters: greedy (left-padded prompts),
sampling with a fixed key, beam search. (The runner's evaluation decodes with model.api="nnx"
in tests/nnx/test_nnx_runner.py.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfjax import decode
from tfjax.models import decoder as linen
from tfjax.nnx import models

VOCAB = 64
FIELDS = dict(vocab_size=VOCAB, num_layers=2, num_kv_heads=2, scan_layers=True, qk_norm=True)


@pytest.fixture(scope="module")
def pair():
    """(Linen model, its params, the NNX model holding them, prompts [3, 6], left-padded mask)."""
    lm = linen.Model("modern-tiny", **FIELDS)
    prompts = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (3, 6)))
    params = nn.unbox(lm.init(jax.random.key(0), prompts)["params"])
    model = models.from_linen(lm, rngs=nnx.Rngs(1))
    models.load_params(model, params)
    mask = jnp.asarray([[1] * 6, [0, 0] + [1] * 4, [0] * 5 + [1]], bool)
    return lm, params, model, prompts, mask


CASES = {
    "greedy": dict(method="greedy", masked=True),
    "sample": dict(method="sample", rng=jax.random.key(3), temperature=1.5, top_k=20, top_p=0.9),
    "beam": dict(method="beam", beam_size=3, alpha=0.6),
}


@pytest.mark.parametrize("case", CASES)
def test_nnx_model_decodes_the_linen_models_tokens(pair, case):
    lm, params, model, prompts, mask = pair
    options = dict(CASES[case])
    if options.pop("masked", False):
        options["mask"] = mask
    options.update(max_new_tokens=7, eos_id=(1, 2))
    want, want_scores = decode.generate(lm, params, prompts, **options)
    got, scores = decode.generate(model, prompts, **options)
    assert got.shape == (3, 7)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6)
    assert len(set(map(tuple, np.asarray(got).tolist()))) > 1  # the rows decode differently


def test_nnx_model_arguments_are_checked(pair):
    _, params, model, prompts, _ = pair
    with pytest.raises(TypeError, match="an NNX model holds its parameters"):
        decode.generate(model, params, prompts, max_new_tokens=2, eos_id=1)
    with pytest.raises(ValueError, match=r"mutable=\['cache'\]: an NNX model's apply can"):
        decode.generate(model, prompts, max_new_tokens=2, eos_id=1, use_cache="collection")
    with pytest.raises(ValueError, match="inputs hold token id 64, outside the vocabulary"):
        decode.generate(model, prompts.at[0, 0].set(VOCAB), max_new_tokens=2, eos_id=1)
