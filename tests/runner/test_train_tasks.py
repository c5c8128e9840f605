"""tfjax.tasks: losses against plain numpy formulas, and which tokens count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import tasks
from tfjax.tasks import lm, losses, translation


def reference(logits, labels, weights, eps, z):
    """Plain numpy: smoothed cross-entropy + z * log(Z)^2, weighted sums."""
    logits = np.asarray(logits, np.float64)
    log_z = np.log(np.exp(logits).sum(-1))
    log_p = logits - log_z[..., None]
    v = logits.shape[-1]
    target = np.eye(v)[labels] * (1 - eps) + eps / v
    ce = -(target * log_p).sum(-1) + z * log_z**2
    nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
    return (ce * weights).sum(), (nll * weights).sum()


@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 0.0), (0.1, 1e-2)])
def test_cross_entropy_matches_the_formula(eps, z):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3
    labels = rng.integers(0, 7, size=(3, 5))
    weights = (rng.random((3, 5)) > 0.3).astype(np.float32)
    got = losses.cross_entropy_sums(
        jnp.asarray(logits),
        jnp.asarray(labels),
        jnp.asarray(weights),
        label_smoothing=eps,
        z_loss=z,
    )
    loss, nll = reference(logits, labels, weights, eps, z)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(got["nll"], nll, rtol=1e-5)
    assert float(got["weight"]) == weights.sum()
    correct = ((logits.argmax(-1) == labels) * weights).sum()
    assert float(got["correct"]) == correct


def autodiff_cross_entropy(logits, labels, weights, eps, z):
    """cross_entropy_sums' "loss" + 0.5 "nll" written plainly, for JAX's autodiff to take the
    gradient of (the custom backward pass must give the same)."""
    x = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(x, axis=-1)
    nll = log_z - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    loss = (1 - eps) * nll + eps * (log_z - x.mean(-1)) + z * log_z**2
    return jnp.sum((loss + 0.5 * nll) * weights)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 0.0), (0.1, 1e-2)])
def test_cross_entropy_gradient_is_autodiffs(eps, z, dtype):
    """The written-out backward pass (softmax - target, from the logits as given) gives
    autodiff's gradient, in the logits' dtype, to float32 rounding."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 97)) * 3, dtype)
    labels = jnp.asarray(rng.integers(0, 97, size=(3, 5)))
    weights = jnp.asarray((rng.random((3, 5)) > 0.3).astype(np.float32))

    def sums(x):
        s = losses.cross_entropy_sums(x, labels, weights, label_smoothing=eps, z_loss=z)
        return s["loss"] + 0.5 * s["nll"]

    got = jax.grad(sums)(logits)
    want = jax.grad(autodiff_cross_entropy)(logits, labels, weights, eps, z)
    assert got.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bf16: one rounding of the same float32 gradient; 2 ulp allow a float32 difference to
    # fall on either side of a bf16 rounding boundary
    atol = 2e-6 if dtype == jnp.float32 else 2 * 2.0**-8
    np.testing.assert_allclose(got, want, rtol=0, atol=atol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_label_logits_are_the_labels_logits_exactly(dtype):
    """The masked sum reads each label's logit bit for bit (the other terms are 0), also beside
    -inf and huge logits, which a one-hot product would turn into NaN."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 6, 33)).astype(np.float32) * 5
    logits[0, 0, :] = -np.inf
    logits[1, 2, 5] = 3e38
    labels = rng.integers(0, 33, size=(4, 6))
    labels[0, 0] = 7
    logits[0, 0, 7] = 1.5
    x = jnp.asarray(logits, dtype)
    got = jax.jit(losses.label_logits)(x, jnp.asarray(labels))
    want = np.take_along_axis(np.asarray(x, np.float32), labels[..., None], -1)[..., 0]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)


def test_first_argmax_is_argmax_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(-2, 3, size=(64, 9)).astype(np.float32)  # many ties
    x[0] = 0.0  # all tied (a zero-initialised head): index 0, as argmax
    x[1, :4] = -np.inf
    x[2] = -np.inf
    np.testing.assert_array_equal(losses.first_argmax(jnp.asarray(x)), x.argmax(-1))
    # classes at the label index only count when it is the first maximum
    got = losses.cross_entropy_sums(jnp.zeros((2, 5)), jnp.array([0, 3]), jnp.ones(2))
    assert float(got["correct"]) == 1.0


def test_lm_predicts_next_tokens_within_segments():
    task = tasks.get("lm")
    # two packed examples [1 5 6 2] [1 7 2] then padding
    tokens = jnp.array([[1, 5, 6, 2, 1, 7, 2, 0]])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]])
    weights = (tokens != 0).astype(jnp.float32)
    batch = {
        "tokens": tokens,
        "weights": weights,
        "tokens_segment_ids": seg,
        "tokens_positions": pos,
    }
    args, kwargs = task.model_inputs(batch)
    assert args[0] is tokens and kwargs["segment_ids"] is seg and kwargs["positions"] is pos
    # logits that put all mass on the true next token where it is predicted
    logits = jnp.full((1, 8, 10), -1e4).at[0, jnp.arange(7), tokens[0, 1:]].set(0.0)
    _, stats = task.loss_and_stats(logits, batch)
    # predicted: 5, 6, 2 (first example) and 7, 2 (second); not the 1 after 2, nor padding
    assert float(stats["weight"]) == 5
    assert float(stats["correct"]) == 5 and float(stats["nll"]) < 1e-3
    assert task.summarize(stats)["perplexity"] == pytest.approx(1.0, abs=1e-3)


def test_translation_and_mlm_and_classification_weights():
    t = tasks.get("translation")
    batch = {"inputs": jnp.array([[4, 5, 2, 0]]), "targets": jnp.array([[6, 2, 0, 0]])}
    args, kwargs = t.model_inputs(batch)
    assert len(args) == 2 and kwargs == {}
    _, stats = t.loss_and_stats(jnp.zeros((1, 4, 8)), batch)
    assert float(stats["weight"]) == 2  # 6 and eos
    np.testing.assert_allclose(float(stats["nll"]), 2 * np.log(8), rtol=1e-6)

    m = tasks.get("mlm")
    batch = {
        "tokens": jnp.array([[1, 4, 9, 2]]),
        "targets": jnp.array([[1, 8, 9, 2]]),
        "weights": jnp.array([[0.0, 1.0, 1.0, 0.0]]),
    }
    _, stats = m.loss_and_stats(jnp.zeros((1, 4, 12)), batch)
    assert float(stats["weight"]) == 2

    c = tasks.get("classification")
    batch = {
        "image": jnp.zeros((3, 4, 4, 1)),
        "label": jnp.array([1, 0, 0]),
        "weights": jnp.array([1.0, 1.0, 0.0]),
    }
    logits = jnp.array([[0.0, 5.0], [0.0, 5.0], [5.0, 0.0]])
    _, stats = c.loss_and_stats(logits, batch)
    assert c.summarize(stats)["accuracy"] == 0.5  # the padding row does not count
    assert c.units_per_batch(batch) == 3


def test_unknown_task():
    with pytest.raises(ValueError, match="task='seq2seq' is unknown"):
        tasks.get("seq2seq")


def test_masked_and_causal_lm_feed_the_model_alike():
    assert tasks.get("mlm").model_inputs is tasks.get("lm").model_inputs


def test_a_task_owns_what_its_evaluation_decodes():
    import dataclasses

    import ml_collections

    import tfjax.data
    from tfjax.runner import evaluation

    decode = ml_collections.ConfigDict({"num_samples": 3})

    def config(task, **fields):
        return ml_collections.ConfigDict({"task": task, "seed": 0, **fields})

    bleu = tasks.decode_eval(config("translation", decode=decode))
    assert (type(bleu), bleu.unpacked_eval_rows) == (translation.BleuEval, True)
    samples = tasks.decode_eval(config("lm", decode=decode))
    assert (type(samples), samples.unpacked_eval_rows) == (lm.SamplesEval, False)
    assert tasks.decode_eval(config("lm", decode={"num_samples": 0})) is None
    assert tasks.decode_eval(config("translation")) is None  # no decode section
    assert tasks.decode_eval(config("mlm", decode=decode)) is None  # no hook
    assert tasks.decode_eval(config("classification", decode=decode)) is None

    # BLEU decodes each source alone, so translation evaluates on unpacked rows.
    data = tfjax.data.resolve_config({"name": "numbers_translate", "packing": True})
    run = config("translation", decode=decode)
    assert evaluation.eval_dataset(run, data) == dataclasses.replace(data, packing=False)
    # ... whether or not the config decodes (the same eval rows either way).
    unpacked = evaluation.eval_dataset(config("translation"), data)
    assert unpacked == dataclasses.replace(data, packing=False)
    lm_data = tfjax.data.resolve_config({"name": "pydoc"})
    assert evaluation.eval_dataset(config("lm", decode=decode), lm_data) is lm_data
