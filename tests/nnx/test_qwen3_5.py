"""Qwen3.5's decoder (linear-attention and gated full-attention layers by layer_types): Linen ==
NNX from the same parameters (logits and gradients), scanned == unrolled, decoding through the
mixed recurrent states and KV caches == the forward pass, tfjax.decode's greedy, sampling and
beam search with the cache == without it, and the spec's refusals by name."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from nnx_checks import assert_same_packed_logits_and_gradients, assert_same_tree, close

from tfjax import decode
from tfjax.models import decoder
from tfjax.nnx import models
from tfjax.nnx.models import decoder as nnx_decoder
from tfjax.ops import KVCache
from tfjax.ops.cache import max_length, next_position
from tfjax.ops.linear_attention import RecurrentState
from tfjax.specs import decoder as spec

VOCAB = 48


def _models(scan_layers, **overrides):
    fields = dict(vocab_size=VOCAB, scan_layers=scan_layers, **overrides)
    lm = decoder.Model("qwen3.5-tiny", **fields)
    return lm, nnx_decoder.Model("qwen3.5-tiny", rngs=nnx.Rngs(0), **fields)


def _tokens(batch=2, length=9, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, VOCAB, (batch, length)))


def _params(lm, tokens):
    """Linen's init with the (1 + w) norms' offsets made random, so each shows."""
    boxed = lm.init(jax.random.key(0), tokens)["params"]
    params = nn.meta.unbox(boxed)
    rng = np.random.RandomState(1)
    flat = flatten_dict(params)
    for path, x in flat.items():
        if "norm" in path[-2]:
            flat[path] = x + jnp.asarray(0.3 * rng.randn(*x.shape), x.dtype)
    return boxed, unflatten_dict(flat)


def test_linen_and_nnx_give_the_same_logits_and_gradients():
    lm, model = _models(True)  # scanned: the runs' stacked parameters (unrolled: the next test)
    tokens = _tokens()
    boxed, params = _params(lm, tokens)
    assert_same_tree(boxed, model)
    want, grads, _ = assert_same_packed_logits_and_gradients(lm, model, params, tokens, VOCAB)
    assert any(p[-1] == "gate_kernel" and "decoder_1" in p for p in grads)  # the gated query's
    for path in grads:
        assert np.abs(grads[path]).max() > 0, path
    # each packed segment as its own row: the recurrent state restarts at a segment
    alone = lm.apply({"params": params}, tokens[:1, 5:])[0]
    np.testing.assert_allclose(want[:1, 5:], alone, atol=1e-5, rtol=1e-5)


def test_scanned_gives_the_unrolled_logits():
    """The runs of one layer type are scanned each: the same parameters stacked, the same
    logits."""
    (unrolled, _), (scanned, _) = _models(False), _models(True)
    tokens = _tokens()
    _, params = _params(unrolled, tokens)
    stacked = {}
    for name, _, _, n in unrolled.stacks():
        layers = [params[name][f"layers_{i}"] for i in range(n)]
        stacked[name] = {"layers": jax.tree.map(lambda *x: jnp.stack(x), *layers)}
        if "final_norm" in params[name]:
            stacked[name]["final_norm"] = params[name]["final_norm"]
    stacked = {**params, **stacked}
    want = unrolled.apply({"params": params}, tokens)[0]
    got = scanned.apply({"params": stacked}, tokens)[0]
    close(got, want)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_through_states_and_caches_matches_the_forward_pass(scan_layers):
    """A prompt then single tokens give the whole sequence's logits, in Linen and NNX alike;
    the cache holds a RecurrentState per linear layer and a KVCache per full one."""
    lm, model = _models(scan_layers)
    tokens = _tokens(length=7)
    _, params = _params(lm, tokens)
    models.load_params(model, params)
    want_cache, cache = lm.init_cache(2, 8), model.init_cache(2, 8)
    kinds = [type(c) for c in want_cache]
    assert kinds == ([RecurrentState, KVCache] if scan_layers else [RecurrentState] * 3 + [KVCache])
    assert int(next_position(want_cache)) == 0 and max_length(want_cache) == 8
    full = lm.apply({"params": params}, tokens)[0]
    # compiled: op by op, the delta rule's steps take longer than compiling them
    linen_step = jax.jit(lambda s, c: lm.apply({"params": params}, s, decode=True, cache=c))
    nnx_step = nnx.jit(lambda m, s, c: m(s, cache=c))
    for start, stop in ((0, 4), (4, 5), (5, 7)):
        step = tokens[:, start:stop]
        (want, _), want_cache = linen_step(step, want_cache)
        (got, _), cache = nnx_step(model, step, cache)
        close(got, want)
        np.testing.assert_allclose(want, full[:, start:stop], atol=1e-5, rtol=1e-5)
        assert int(next_position(cache)) == stop
    jax.tree.map(close, cache, want_cache)


@pytest.mark.parametrize(
    "options",
    [dict(method="greedy"), dict(method="beam", beam_size=3), dict(method="sample", top_k=5)],
)
def test_generation_with_the_cache_matches_recomputing(options):
    """tfjax.decode's greedy, beam and sampled tokens through the recurrent states and KV
    caches are those it gets recomputing the whole prefix each step."""
    lm, _ = _models(False)
    prompts = np.asarray(_tokens(length=4, seed=5))
    _, params = _params(lm, jnp.asarray(prompts))
    run = dict(max_new_tokens=5, eos_id=VOCAB - 1, rng=jax.random.key(2), **options)
    cached, _ = decode.generate(lm, params, prompts, **run)
    again, _ = decode.generate(lm, params, prompts, use_cache=False, **run)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(again))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(layer_types=("linear_attention", "sliding_attention")), r"\['sliding_attention'\]"),
        (dict(layer_types=("full_attention",)), r"one type per layer \(num_layers=2\)"),
        (
            dict(layer_types=("full_attention",) * 2, linear_num_key_heads=2),
            r"linear_num_key_heads set, but layer_types has no linear_attention layer",
        ),
        (
            dict(layer_types=("linear_attention", "full_attention"), linear_num_key_heads=2),
            r"linear_attention layers need linear_num_value_heads, linear_key_head_dim",
        ),
        (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be a number in \(0, 1\]"),
        (
            dict(partial_rotary_factor=0.5, position="learned"),
            r"partial_rotary_factor=0.5 applies to position='rope', not 'learned'",
        ),
    ],
)
def test_what_the_spec_cannot_take_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        spec.Model("modern-tiny", vocab_size=VOCAB, **fields)


def test_linear_layers_do_not_mix_with_attention_patterns():
    with pytest.raises(ValueError, match=r"do not take attention_pattern=\('global',\)"):
        spec.Model("qwen3.5-tiny", vocab_size=VOCAB, attention_pattern=("global",))


def test_linen_decoding_needs_the_explicit_cache():
    """Linear layers keep their state in the explicit cache, not the "cache" collection."""
    lm, _ = _models(False)
    tokens = _tokens(length=3)
    _, params = _params(lm, tokens)
    with pytest.raises(ValueError, match=r"linear attention decodes with the explicit cache"):
        lm.apply({"params": params}, tokens, decode=True, mutable=["cache"])


def test_a_cache_of_linear_layers_only_has_no_length():
    """next_position reads the recurrent states; max_length, which only attention caches have,
    is refused by name."""
    linear_only = spec.Model(
        "qwen3.5-tiny", vocab_size=VOCAB, layer_types=("linear_attention",) * 4
    )
    cache = linear_only.init_cache(2, 8)
    assert len(cache) == 4 and all(isinstance(c, RecurrentState) for c in cache)
    assert int(next_position(cache)) == 0
    with pytest.raises(ValueError, match=r"no attention layer"):
        max_length(cache)
