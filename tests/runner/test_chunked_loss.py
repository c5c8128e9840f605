"""The chunked loss (config.loss.chunks): logits and cross-entropy in slices of T.

Numbers (float32, CPU): the chunked sums and every parameter's gradient equal those of the
full [B, T, V] logits, for tied and untied heads, the masked-LM head with its bias and the
encoder-decoder's head with a logits bias, with label smoothing, z-loss and packed rows; a
sharded train step (8 CPU devices) gives the same update. Programs: the chunked train step
compiles for a TPU v5e:2x2 slice and needs less memory there than the full logits. Config:
bad values are refused naming loss.chunks and what is allowed, before any work.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import set_fields

from tfjax import sharding, tasks
from tfjax.models import decoder, encoder, transformer
from tfjax.runner import aot, checks, setup, steps
from tfjax.tasks import losses

B, T, V = 4, 16, 97
TOL = 1e-6  # float32: relative to a tensor's largest value, rounding of sums taken in slices
# A tree's leaves are compared at no less than this fraction of its largest value: TOL x FLOOR is
# about float32's epsilon (1.2e-7): the rounding noise in a small leaf, or one that vanishes in
# exact arithmetic, is a fraction of it. (At 1e-2, XLA:CPU of jaxlib 0.12 left 1.1e-8 and 1.3e-8
# of the largest value in two such leaves, past that bound though within float32's rounding.)
FLOOR = 1e-1


def assert_close(got, want, what, *, scale=0.0):
    """|got - want| <= TOL x (want's largest magnitude, or `scale` if larger).

    Elementwise relative error means nothing for entries that are sums cancelling to ~0.
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), scale, 1e-30)
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL * scale, f"{what}: max |diff| {err:.3g} > {TOL} x {scale:.3g}"


def assert_trees_close(got, want, what):
    """Leaf by leaf, each at its own scale but no less than FLOOR of the tree's largest value:
    some gradients vanish in exact arithmetic (attention's key biases: softmax ignores a shift
    shared by every key) and hold only float32 rounding noise (about 1e-8 of the largest
    value) on either side."""
    top = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g in zip(flat, jax.tree.leaves(got), strict=True):
        assert_close(g, w, f"{what} {jax.tree_util.keystr(path)}", scale=FLOOR * top)


def _lm_batch(rng, packed):
    tokens = rng.integers(1, V, (B, T)).astype(np.int32)
    if not packed:
        tokens[1, 11:] = 0  # a padded row
        return {"tokens": tokens, "weights": (tokens != 0).astype(np.float32)}
    # two examples per row (6 and 7 tokens), then padding
    seg = np.repeat(np.array([[1] * 6 + [2] * 7 + [0] * 3], np.int32), B, 0)
    pos = np.repeat(np.concatenate([np.arange(6), np.arange(7), np.zeros(3)])[None], B, 0)
    tokens[seg == 0] = 0
    return {
        "tokens": tokens,
        "weights": (seg > 0).astype(np.float32),
        "tokens_segment_ids": seg,
        "tokens_positions": pos.astype(np.int32),
    }


def _case(name):
    rng = np.random.default_rng(0)
    if name.startswith("decoder"):
        variant = "tiny" if "tied" in name.split("-") else "modern-tiny"
        return decoder.Model(variant, vocab_size=V), "lm", _lm_batch(rng, "packed" in name)
    if name == "encoder-mlm":
        batch = {
            "tokens": rng.integers(1, V, (B, T)).astype(np.int32),
            "targets": rng.integers(1, V, (B, T)).astype(np.int32),
            "weights": (rng.random((B, T)) > 0.5).astype(np.float32),
        }
        model = encoder.Model("tiny", vocab_size=V, dropout_rate=0.0, attention_dropout_rate=0.0)
        return model, "mlm", batch
    targets = rng.integers(1, V, (B, T)).astype(np.int32)
    targets[:, 11:] = 0
    batch = {"inputs": rng.integers(1, V, (B, 12)).astype(np.int32), "targets": targets}
    shared = name == "transformer-shared"
    model = transformer.Model("tiny", vocab_size=V, share_embeddings=shared, logits_bias=not shared)
    return model, "translation", batch


CASES = [
    "decoder-tied",
    "decoder-untied-packed",
    "decoder-tied-packed",
    "encoder-mlm",
    "transformer-shared",
    "transformer-untied-bias",
]


@pytest.mark.parametrize("name", CASES)
def test_chunked_loss_and_gradients_equal_the_full_logits(name):
    model, task_name, batch = _case(name)
    task = tasks.get(task_name)
    args, kwargs = task.model_inputs(batch)
    params = nn.unbox(model.init(jax.random.key(0), *args, **kwargs)["params"])
    # Non-zero biases and a not-yet-trained head, so that every term has a gradient.
    params = jax.tree.map(
        lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params
    )

    @functools.partial(jax.jit, static_argnums=1)
    def value_and_grad(params, chunks):
        def f(p):
            loss, stats = steps.loss_and_stats(
                model,
                task,
                p,
                batch,
                train=False,
                loss_chunks=chunks,
                label_smoothing=0.1,
                z_loss=1e-2,
            )
            return loss / stats["weight"], stats

        return jax.value_and_grad(f, has_aux=True)(params)

    (_, full), full_grads = value_and_grad(params, 1)
    assert float(full["weight"]) > 0 and float(full["correct"]) >= 0
    for chunks in (4, T):  # T: one position per slice
        (_, got), grads = value_and_grad(params, chunks)
        assert set(got) == set(full) == set(losses.SUMS)
        for k in losses.SUMS:
            assert_close(got[k], full[k], f"{name} chunks={chunks} {k}")
        assert_trees_close(grads, full_grads, f"{name} chunks={chunks} grad")
    # The head's parameters do get a gradient through the slices.
    head = (
        full_grads["embed"]["embedding"]
        if "output_proj" not in full_grads
        else (full_grads["output_proj"]["kernel"])
    )
    assert float(jnp.max(jnp.abs(head))) > 0


@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_chunked_sums_match_cross_entropy_sums(eps, z):
    """The loss function alone, with a plain untied head closed over its kernel: sums, and the
    gradients of the kernel and of the hidden states."""
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(3, 12, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 11)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 11, (3, 12)))
    weights = jnp.asarray(rng.random((3, 12)) > 0.3)

    def full(h, w):
        return losses.cross_entropy_sums(h @ w, labels, weights, label_smoothing=eps, z_loss=z)

    def chunked(h, w, *, chunks):
        return losses.chunked_cross_entropy_sums(
            lambda x: x @ w, h, labels, weights, chunks=chunks, label_smoothing=eps, z_loss=z
        )

    def chunked_loss(h, w, chunks):
        return chunked(h, w, chunks=chunks)["loss"]

    want = full(hidden, kernel)
    want_grads = jax.grad(lambda h, w: full(h, w)["loss"], argnums=(0, 1))(hidden, kernel)
    for c in (1, 3, 4, 12):
        got = chunked(hidden, kernel, chunks=c)
        for k in losses.SUMS:
            assert_close(got[k], want[k], f"chunks={c} {k}")
        grads = jax.grad(chunked_loss, argnums=(0, 1))(hidden, kernel, c)
        assert_close(grads[0], want_grads[0], f"chunks={c} d hidden")
        assert_close(grads[1], want_grads[1], f"chunks={c} d kernel")
    with pytest.raises(ValueError, match="chunks=5 must be >= 1 and divide the length T=12"):
        chunked(hidden, kernel, chunks=5)


def test_heads_apart_from_the_model_give_the_same_logits():
    for name in CASES:
        model, task_name, batch = _case(name)
        args, kwargs = tasks.get(task_name).model_inputs(batch)
        variables = model.init(jax.random.key(0), *args, **kwargs)
        logits, aux = model.apply(variables, *args, **kwargs)
        hidden, _ = model.apply(variables, *args, **kwargs, apply_head=False)
        assert hidden.shape == (B, T, model.width), name
        np.testing.assert_array_equal(model.apply(variables, hidden, method="logits"), logits)
    classifier = encoder.Model("tiny", vocab_size=V, head="classifier", num_classes=3)
    tokens = jnp.ones((2, 8), jnp.int32)
    variables = classifier.init(jax.random.key(0), tokens)
    with pytest.raises(ValueError, match="apply_head=False is for head='mlm'"):
        classifier.apply(variables, tokens, apply_head=False)


def _config(spec, **overrides):
    config = setup.load_config(f"configs/{spec}")
    with config.unlocked():
        return set_fields(config, overrides)


MESH_2X2X2 = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
# SGD: the update is linear in the gradient (Adam's first step is ~lr * sign(g), which turns
# rounding-level differences of near-zero gradients into lr-sized ones).
SGD = {"optim.name": "sgd", "optim.b1": 0.0, "optim.weight_decay": 0.0, "optim.grad_clip_norm": 0.0}


def test_sharded_train_step_with_chunks_equals_full_logits():
    """Through setup.set_up on a (data 2, fsdp 2, tensor 2) mesh of 8 CPU devices: one SGD
    step (its update is linear in the gradient) from the same state, chunks 1 and 4."""
    devices = jax.devices()[:8]
    results, initial = {}, None
    for chunks in (1, 4):
        config = _config(
            "lm.py:tiny",
            **MESH_2X2X2,
            **SGD,
            **{"loss.chunks": chunks, "loss.label_smoothing": 0.1},
        )
        mesh = sharding.make_mesh(config.mesh, devices)
        exp = setup.set_up(config, mesh, inputs=setup.planned_inputs(config))
        spec = exp.train_batch
        rng = np.random.default_rng(0)
        batch = {k: rng.integers(1, 64, s.shape).astype(s.dtype) for k, s in spec.items()}
        batch["tokens_segment_ids"] = np.repeat(
            np.array([[1] * 20 + [2] * 12], np.int32), spec["tokens"].shape[0], 0
        )
        batch = sharding.shard_batch(batch, mesh, exp.rules)
        if initial is None:  # the chunks do not change the state: one initialisation for both
            initial = jax.device_get(exp.init(jax.random.key(0)))
        state = jax.device_put(initial, exp.state_shardings)  # (each step donates its own)
        state, stats = exp.train_step(state, batch, jax.random.key(1))
        evals = exp.eval_step(state.params, batch)
        results[chunks] = jax.device_get((state.params, stats, evals))
    (p1, s1, e1), (p4, s4, e4) = results[1], results[4]
    for k in losses.SUMS:
        assert_close(s4[k], s1[k], f"train {k}")
        assert_close(e4[k], e1[k], f"eval {k}")
    assert_trees_close(p4, p1, "params")


@pytest.mark.parametrize(
    "spec, overrides, message",
    [
        ("lm.py:tiny", {"loss.chunks": 0}, "loss.chunks must be an integer >= 1, got 0"),
        (
            "lm.py:tiny",
            {"loss.chunks": 3},
            r"loss.chunks=3 does not divide the sequence length 32 \(dataset.seq_len\); "
            "allowed: 1, 2, 4, 8, 16, 32",
        ),
        ("translate.py:tiny", {"loss.chunks": 64}, "loss.chunks=64 does not divide"),
        (
            "mlm.py:tiny",
            {"loss.chunks": 2, "task": "classification"},
            r"loss.chunks=2 applies to the tasks with a vocabulary head \('lm', 'mlm', "
            r"'translation'\); task='classification' allows only 1",
        ),
    ],
)
def test_bad_chunks_are_refused_naming_the_field(spec, overrides, message):
    config = _config(spec, **overrides)
    with pytest.raises(ValueError, match=message):
        checks.check_config(config)


def test_set_up_checks_chunks_against_the_batches_it_is_given():
    config = _config("lm.py:tiny", **{"loss.chunks": 4})
    planned = setup.planned_inputs(config)
    odd = {
        "tokens": jax.ShapeDtypeStruct((16, 30), np.int32),
        "weights": jax.ShapeDtypeStruct((16, 30), np.float32),
    }
    inputs = setup.Inputs(train=odd, eval=odd, vocab_size=planned.vocab_size)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    message = (
        r"loss.chunks=4 does not divide the sequence length 30 \(the train batches' "
        r"labels\); allowed: 1, 2, 3, 5, 6, 10, 15, 30"
    )
    with pytest.raises(ValueError, match=message):
        setup.set_up(config, mesh, inputs=inputs)


def test_vit_configs_have_no_chunks_and_need_none():
    config = _config("vit.py:tiny")
    assert "chunks" not in config.loss and checks.loss_chunks(config) == 1
    checks.check_config(config)


def test_chunked_train_step_compiles_for_v5e_and_needs_less_memory(v5e):
    """The tiny LM with Llama 3's vocabulary (128,256) at T=256, on a (fsdp 2, tensor 2) v5e:2x2
    mesh: with 8 slices the train step compiles, fits, and its peak memory per device is lower
    than with the full logits (which dominate it at this size; at T=128 they no longer do since
    the loss keeps no float32 copy of them: 0.55 there)."""
    peaks = {}
    for chunks in (1, 8):
        config = _config(
            "lm.py:tiny",
            **{
                "mesh.data": 1,
                "mesh.fsdp": 2,
                "mesh.tensor": 2,
                "dtype": "bfloat16",
                "model.scan_layers": True,
                "model.vocab_size": 128256,
                "dataset.seq_len": 256,
                "loss.chunks": chunks,
            },
        )
        report = aot.compile_experiment(config, v5e, steps=("train", "eval"))
        assert report.fits, report.steps
        peaks[chunks] = {s.name: s.peak_bytes for s in report.steps}
    assert peaks[8]["train"] < 0.5 * peaks[1]["train"], peaks  # 0.27 when measured
    assert peaks[8]["eval"] < peaks[1]["eval"], peaks
