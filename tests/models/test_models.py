"""The four model families: parameter counts, causality, caches, layouts, learning, errors."""

import dataclasses
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tfjax import nn as tnn
from tfjax.models import common, decoder, encoder, transformer, vit
from tfjax.ops.cache import next_position

V = 61


def jit_apply(model):
    """model.apply compiled once (eager Flax re-traces every scan and is slow on 2 cores)."""
    return jax.jit(model.apply, static_argnames=("decode", "method", "mutable", "train"))


def count(model, *inputs):
    shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes["params"])))


def tokens(shape, seed=0, low=1):
    return jax.random.randint(jax.random.key(seed), shape, low, V)


# Closed forms: attention 4(d^2 + d), FFN 2 d f + f + d, LayerNorm 2 d.
def attn(d):
    return 4 * (d * d + d)


def ffn(d, f):
    return 2 * d * f + f + d


def count_transformer(v, d, f, n):
    enc = attn(d) + ffn(d, f) + 2 * 2 * d
    dec = 2 * attn(d) + ffn(d, f) + 3 * 2 * d
    return v * d + n * (enc + dec)


def count_bert(v, d, n, f, classes, max_len=512, types=2):
    emb = v * d + max_len * d + types * d + 2 * d
    return emb + n * (attn(d) + ffn(d, f) + 4 * d) + (d * d + d) + (d * classes + classes)


def count_gpt2(v, d, n, ctx=1024):
    return v * d + ctx * d + n * (attn(d) + ffn(d, 4 * d) + 4 * d) + 2 * d


def count_vit(p, d, n, f, classes, patches, channels=3):
    stem = p * p * channels * d + d + d + (patches + 1) * d
    return stem + n * (attn(d) + ffn(d, f) + 4 * d) + 2 * d + d * classes + classes


TOK = jnp.ones((1, 8), jnp.int32)


@pytest.mark.parametrize(
    "name,model,inputs,closed_form,published,tolerance",
    [
        (
            "transformer base",
            transformer.Model(variant="base", vocab_size=37000),
            (TOK, TOK),
            count_transformer(37000, 512, 2048, 6),
            65e6,
            0.05,
        ),
        (
            "transformer big",
            transformer.Model(variant="big", vocab_size=37000),
            (TOK, TOK),
            count_transformer(37000, 1024, 4096, 6),
            213e6,
            0.01,
        ),
        (
            "bert-base",
            encoder.Model(variant="bert-base", vocab_size=30522, head="classifier"),
            (TOK,),
            count_bert(30522, 768, 12, 3072, 2),
            110e6,
            0.01,
        ),
        (
            "gpt2-small",
            decoder.Model(variant="gpt2-small", vocab_size=50257),
            (TOK,),
            count_gpt2(50257, 768, 12),
            124e6,
            0.01,
        ),
        (
            "vit B/16",
            vit.Model(variant="B/16", num_classes=1000),
            (jnp.ones((1, 224, 224, 3)),),
            count_vit(16, 768, 12, 3072, 1000, 196),
            86e6,
            0.01,
        ),
    ],
)
def test_parameter_counts(name, model, inputs, closed_form, published, tolerance):
    n = count(model, *inputs)
    assert n == closed_form, name
    assert abs(n - published) / published <= tolerance, (name, n)


def test_modern_decoder_count():
    m = decoder.Model(variant="modern-tiny", vocab_size=V)  # d 32, 4 heads of 8, 2 kv heads, f 96
    d, f, n, kv = 32, 96, 2, 2 * 8
    layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d  # no biases; two RMSNorm scales
    assert count(m, TOK) == V * d + n * layer + d + d * V


# ----------------------------------------------------------------------------------------------
# Causality, padding, caches.

FAMILIES = {
    "decoder": lambda **kw: decoder.Model(variant="tiny", vocab_size=V, **kw),
    "modern": lambda **kw: decoder.Model(variant="modern-tiny", vocab_size=V, **kw),
    "alibi": lambda **kw: decoder.Model(variant="tiny", vocab_size=V, position="alibi", **kw),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_is_causal(family):
    m = FAMILIES[family]()
    x = tokens((2, 10))
    v = m.init(jax.random.key(0), x)
    y, _ = jit_apply(m)(v, x)
    x2 = x.at[:, 6:].set(tokens((2, 4), seed=5))
    y2, _ = jit_apply(m)(v, x2)
    np.testing.assert_allclose(y[:, :6], y2[:, :6], atol=1e-5)
    assert not np.allclose(y[:, 6:], y2[:, 6:], atol=1e-3)


def test_transformer_decoder_is_causal_and_ignores_source_padding():
    m = transformer.Model(variant="tiny", vocab_size=V)
    src, tgt = tokens((2, 9)), tokens((2, 8), seed=1)
    v = m.init(jax.random.key(0), src, tgt)
    y, _ = jit_apply(m)(v, src, tgt)
    # targets[t] enters the decoder at t + 1: logits up to t do not depend on it.
    tgt2 = tgt.at[:, 5:].set(tokens((2, 3), seed=7))
    y2, _ = jit_apply(m)(v, src, tgt2)
    np.testing.assert_allclose(y[:, :6], y2[:, :6], atol=1e-5)
    assert not np.allclose(y[:, 6:], y2[:, 6:], atol=1e-3)
    # Appending padding to the source changes nothing.
    src_padded = jnp.pad(src, ((0, 0), (0, 4)))
    y3, _ = jit_apply(m)(v, src_padded, tgt)
    np.testing.assert_allclose(y, y3, atol=1e-5)


def test_encoder_ignores_padded_keys():
    m = encoder.Model(variant="tiny", vocab_size=V)
    x = tokens((2, 6))
    v = m.init(jax.random.key(0), x)
    y, _ = jit_apply(m)(v, x)
    y2, _ = jit_apply(m)(v, jnp.pad(x, ((0, 0), (0, 5))))
    np.testing.assert_allclose(y, y2[:, :6], atol=1e-5)


def test_encoder_without_positions_is_permutation_equivariant():
    """Self-attention alone is permutation-equivariant; the learned positions break it."""
    m = encoder.Model(variant="tiny", vocab_size=V, type_vocab_size=0)
    x = tokens((1, 8))
    v = nn.unbox(m.init(jax.random.key(0), x))
    perm = np.array([3, 1, 7, 0, 5, 2, 6, 4])
    y, _ = jit_apply(m)(v, x)
    yp, _ = jit_apply(m)(v, x[:, perm])
    assert not np.allclose(y[:, perm], yp, atol=1e-3)
    flat = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.zeros_like(a) if "pos_embed" in str(p) else a, v
    )
    y, _ = jit_apply(m)(flat, x)
    yp, _ = jit_apply(m)(flat, x[:, perm])
    np.testing.assert_allclose(y[:, perm], yp, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scan", [False, True])
def test_decoder_kv_cache_matches_full_forward(family, scan):
    m = FAMILIES[family](scan_layers=scan)
    x = tokens((2, 9))
    params = m.init(jax.random.key(0), x)["params"]
    apply = jit_apply(m)
    full, _ = apply({"params": params}, x)
    cache = m.init(jax.random.key(0), x, decode=True)["cache"]
    steps = []
    for lo, hi in [(0, 4)] + [(i, i + 1) for i in range(4, 9)]:  # a prompt, then single tokens
        (logits, _), mut = apply(
            {"params": params, "cache": cache}, x[:, lo:hi], decode=True, mutable=("cache",)
        )
        cache = mut["cache"]
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-4)


def test_transformer_kv_cache_matches_full_forward():
    m = transformer.Model(variant="tiny", vocab_size=V)
    src, tgt = tokens((2, 7)), tokens((2, 6), seed=1)
    params = m.init(jax.random.key(0), src, tgt)["params"]
    apply = jit_apply(m)
    full, _ = apply({"params": params}, src, tgt)
    encoded = apply({"params": params}, src, method="encode")
    dec_in = jnp.pad(tgt, ((0, 0), (1, 0)))[:, :-1]
    cache = m.init(jax.random.key(0), encoded, src, dec_in, decode=True, method="decode")["cache"]
    steps = []
    for t in range(6):
        (logits, _), mut = apply(
            {"params": params, "cache": cache},
            encoded,
            src,
            dec_in[:, t : t + 1],
            decode=True,
            method="decode",
            mutable=("cache",),
        )
        cache = mut["cache"]
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-4)


SMALL = dict(vocab_size=V, width=32, num_heads=4, head_dim=8, mlp_dim=48)  # for large presets
EXPLICIT = {
    "modern": FAMILIES["modern"],
    "alibi": FAMILIES["alibi"],
    "gemma": lambda **kw: decoder.Model(  # local and global layers
        "gemma-3-1b", num_layers=7, sliding_window=3, **SMALL, **kw
    ),
    # a dense layer, then one with a mixture of experts: two stacks, a cache for each
    "moe": lambda **kw: decoder.Model("moe-tiny", vocab_size=V, first_dense_layers=1, **kw),
}


def _cached_keys(explicit, collection, scan):
    """Every layer's cached keys: (the explicit cache's, the collection's), the stacks in order
    (a scanned model with two stacks has an explicit cache for each)."""
    stacks = [name for name in ("dense_decoder", "decoder") if name in collection]
    if scan:
        explicit = explicit if len(stacks) > 1 else (explicit,)
        return (
            jnp.concatenate([c.keys for c in explicit]),
            jnp.concatenate(
                [collection[s]["layers"]["self_attention"]["cached_key"] for s in stacks]
            ),
        )
    layers = [collection[s][f"layers_{i}"] for s in stacks for i in range(len(collection[s]))]
    return (
        jnp.stack([c.keys for c in explicit]),
        jnp.stack([layer["self_attention"]["cached_key"] for layer in layers]),
    )


@pytest.mark.parametrize("family", EXPLICIT)
@pytest.mark.parametrize("scan", [False, True])
def test_decoder_explicit_cache_equals_the_collection(family, scan):
    """A cache the caller holds (init_cache, passed and returned) gives the "cache"
    collection's logits and keys to the bit, a prompt and then single tokens."""
    m = EXPLICIT[family](scan_layers=scan)
    x = tokens((2, 9))
    params = m.init(jax.random.key(0), x)["params"]
    apply = jit_apply(m)
    collection = m.init(jax.random.key(0), x, decode=True)["cache"]
    explicit = m.init_cache(2, 9)
    for lo, hi in [(0, 4)] + [(i, i + 1) for i in range(4, 9)]:
        (want, _), mut = apply(
            {"params": params, "cache": collection}, x[:, lo:hi], decode=True, mutable=("cache",)
        )
        collection = mut["cache"]
        (got, _), explicit = apply({"params": params}, x[:, lo:hi], decode=True, cache=explicit)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(*_cached_keys(explicit, collection, scan))
    assert int(next_position(explicit)) == 9


@pytest.mark.parametrize("scan", [False, True])
def test_t5_explicit_cache_equals_the_collection(scan):
    """T5's relative bias reads the cache's length from the explicit cache (the collection
    keeps it as a zero vector of that length)."""
    m = transformer.Model("flan-t5-small", num_layers=2, scan_layers=scan, **SMALL)
    src, tgt = tokens((2, 7)), tokens((2, 6), seed=1)
    params = m.init(jax.random.key(0), src, tgt)["params"]
    apply = jit_apply(m)
    encoded = apply({"params": params}, src, method="encode")
    dec_in = jnp.pad(tgt, ((0, 0), (1, 0)))[:, :-1]
    collection = m.init(jax.random.key(0), encoded, src, dec_in, decode=True, method="decode")
    collection = collection["cache"]
    explicit = m.init_cache(2, 6)
    for t in range(6):
        step = (encoded, src, dec_in[:, t : t + 1])
        (want, _), mut = apply(
            {"params": params, "cache": collection},
            *step,
            decode=True,
            method="decode",
            mutable=("cache",),
        )
        collection = mut["cache"]
        (got, _), explicit = apply(
            {"params": params}, *step, decode=True, method="decode", cache=explicit
        )
        np.testing.assert_array_equal(got, want)
    assert "key_slots" in collection["decoder_position_bias"]
    np.testing.assert_array_equal(*_cached_keys(explicit, collection, scan))


def test_init_cache_takes_a_dtype_and_a_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = tokens((8, 3))
    for scan, spec in ((False, ("data",)), (True, (None, "data"))):
        m = decoder.Model(variant="modern-tiny", vocab_size=V, scan_layers=scan)
        cache = m.init_cache(8, 16, dtype=jnp.bfloat16, sharding=rows)
        keys = cache.keys if scan else cache[0].keys
        assert keys.dtype == jnp.bfloat16 and keys.shape[-4:] == (8, 16, 2, 8)
        assert tuple(keys.sharding.spec) == spec
        params = m.init(jax.random.key(0), x)["params"]
        (logits, _), cache = jit_apply(m)({"params": params}, x, decode=True, cache=cache)
        assert logits.shape == (8, 3, V) and int(next_position(cache)) == 3


def test_packed_rows_equal_separate_examples():
    """Two examples packed in one row with segment ids give each example's own logits."""
    m = decoder.Model(variant="modern-tiny", vocab_size=V)
    a, b = tokens((1, 5), seed=1), tokens((1, 4), seed=2)
    v = m.init(jax.random.key(0), a)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], 1)
    segs = jnp.array([[1] * 5 + [2] * 4 + [0] * 3])
    pos = jnp.array([list(range(5)) + list(range(4)) + [0] * 3])
    y, _ = jit_apply(m)(v, packed, segment_ids=segs, positions=pos)
    np.testing.assert_allclose(y[:, :5], jit_apply(m)(v, a)[0], atol=1e-5)
    np.testing.assert_allclose(y[:, 5:9], jit_apply(m)(v, b)[0], atol=1e-5)


@pytest.mark.parametrize(
    "make,inputs",
    [
        (lambda **kw: vit.Model(variant="tiny/4", num_classes=5, **kw), (jnp.ones((2, 8, 8, 3)),)),
        (lambda **kw: encoder.Model(variant="tiny", vocab_size=V, **kw), (tokens((2, 6)),)),
        (
            lambda **kw: transformer.Model(variant="tiny", vocab_size=V, **kw),
            (tokens((2, 6)), tokens((2, 5), seed=3)),
        ),
        (EXPLICIT["moe"], (tokens((2, 6)),)),
    ],
    ids=["vit", "encoder", "transformer", "moe-decoder"],
)
def test_scanned_and_unrolled_models_agree(make, inputs):
    scanned, unrolled = make(scan_layers=True), make()
    p = nn.unbox(scanned.init(jax.random.key(0), *inputs)["params"])
    if isinstance(scanned, vit.VisionTransformer):  # a zero head would hide differences
        p["head"]["kernel"] = jax.random.normal(jax.random.key(1), p["head"]["kernel"].shape)
    a, _ = jit_apply(scanned)({"params": p}, *inputs)
    b, _ = jit_apply(unrolled)({"params": tnn.scanned_to_unrolled(p)}, *inputs)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_bf16_compute_with_fp32_params():
    m32 = decoder.Model(variant="modern-tiny", vocab_size=V)
    m16 = decoder.Model(variant="modern-tiny", vocab_size=V, dtype=jnp.bfloat16)
    x = tokens((2, 8))
    v = m32.init(jax.random.key(0), x)
    assert all(
        a.dtype == jnp.float32 for a in jax.tree.leaves(nn.unbox(m16.init(jax.random.key(0), x)))
    )
    y32, _ = jit_apply(m32)(v, x)
    y16, _ = jit_apply(m16)(v, x)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1)


def test_vit_aux_and_pooling():
    for pool, posemb in (("cls", "learned"), ("gap", "sincos2d")):
        m = vit.Model(variant="tiny/4", num_classes=None, pool=pool, posemb=posemb)
        x = jnp.ones((2, 8, 12, 1))
        out, aux = m.apply(m.init(jax.random.key(0), x), x)
        assert out.shape == (2, 32) and aux["encoded"].shape == (2, 6 + (pool == "cls"), 32)


def test_vit_takes_images_of_its_image_size_and_channels_when_set():
    """image_size and channels unset: any images (as always); set: others refused by name."""
    m = vit.Model(variant="tiny/4", num_classes=None, image_size=8, channels=1)
    x = jnp.ones((2, 8, 8, 1))
    assert m.apply(m.init(jax.random.key(0), x), x)[0].shape == (2, 32)
    with pytest.raises(ValueError, match=r"images are 8x12; VisionTransformer.image_size=8"):
        m.init(jax.random.key(0), jnp.ones((2, 8, 12, 1)))
    with pytest.raises(ValueError, match=r"images have 3 channels; VisionTransformer.channels=1"):
        m.init(jax.random.key(0), jnp.ones((2, 8, 8, 3)))


def test_patch_embed_is_the_strided_convolution():
    """Same parameters, initial values, outputs and gradients as nn.Conv with stride p."""
    x = jax.random.normal(jax.random.key(0), (2, 32, 48, 3))
    pe = vit.PatchEmbed(8, 16)
    conv = nn.Conv(8, (16, 16), strides=(16, 16), padding="VALID")
    params = nn.unbox(pe.init(jax.random.key(1), x))
    conv_params = conv.init(jax.random.key(1), x)
    assert jax.tree.structure(params) == jax.tree.structure(conv_params)
    jax.tree.map(np.testing.assert_array_equal, params, conv_params)
    params = jax.tree.map(lambda a: a + 0.1, params)  # a non-zero bias too
    np.testing.assert_allclose(pe.apply(params, x), conv.apply(params, x), atol=1e-5)
    loss = lambda m: lambda p: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
    g_pe, g_conv = jax.grad(loss(pe))(params), jax.grad(loss(conv))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), g_pe, g_conv)


# ----------------------------------------------------------------------------------------------
# Learning: a few Adam steps on one fixed batch drive the loss down.


def _fit(model, inputs, loss_fn, steps=30):
    params = model.init(jax.random.key(0), *inputs)["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, *inputs)[0]))(
            params
        )
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return losses


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize(
    "family", ["transformer", "encoder", "classifier", "decoder", "modern", "vit"]
)
def test_few_steps_drive_the_loss_down(family):
    x = tokens((4, 8))
    if family == "transformer":
        m, inputs = transformer.Model(variant="tiny", vocab_size=V), (x, tokens((4, 7), seed=2))
        loss = lambda lg: xent(lg, inputs[1])  # noqa: E731
    elif family == "encoder":
        m, inputs = encoder.Model(variant="tiny", vocab_size=V, dropout_rate=0.0), (x,)
        loss = lambda lg: xent(lg, x)  # noqa: E731
    elif family == "classifier":
        m = encoder.Model(variant="tiny", vocab_size=V, head="classifier", num_classes=3)
        inputs = (x,)
        loss = lambda lg: xent(lg, jnp.array([0, 1, 2, 1]))  # noqa: E731
    elif family in ("decoder", "modern"):
        m = decoder.Model(variant="tiny" if family == "decoder" else "modern-tiny", vocab_size=V)
        inputs = (x,)
        loss = lambda lg: xent(lg[:, :-1], x[:, 1:])  # noqa: E731
    else:
        m = vit.Model(variant="tiny/4", num_classes=3)
        inputs = (jax.random.normal(jax.random.key(1), (4, 8, 8, 3)),)
        loss = lambda lg: xent(lg, jnp.array([0, 1, 2, 1]))  # noqa: E731
    losses = _fit(m, inputs, loss)
    assert losses[-1] < 0.5 * losses[0], losses


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="variant='gpt5'.*allowed: tiny, demo, gpt2-small"):
        decoder.Model(variant="gpt5", vocab_size=10)
    with pytest.raises(ValueError, match="variant='Z/16'.*B/16"):
        vit.Model(variant="Z/16")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_layer'\]"):
        encoder.Model(variant="tiny", vocab_size=10, num_layer=3)
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['vocab_size'\]"):
        transformer.Model(variant="base")


def test_bad_inputs_raise_value_errors():
    d = decoder.Model(variant="tiny", vocab_size=V)
    v = d.init(jax.random.key(0), TOK)
    with pytest.raises(ValueError, match="tokens must be \\[B, T\\] integer"):
        d.apply(v, TOK.astype(jnp.float32))
    with pytest.raises(ValueError, match="tokens must be \\[B, T\\] integer"):
        d.apply(v, TOK[0])
    with pytest.raises(ValueError, match="max_len=256"):
        d.apply(v, jnp.ones((1, 300), jnp.int32))
    m = vit.Model(variant="tiny/4", num_classes=3)
    with pytest.raises(ValueError, match="images must be \\[B, H, W, C\\] floats"):
        m.init(jax.random.key(0), jnp.ones((2, 8, 8), jnp.float32))
    with pytest.raises(ValueError, match="not divisible by patch_size=4"):
        m.init(jax.random.key(0), jnp.ones((2, 9, 8, 3)))
    # The fields are checked when the model is made, naming the family's field.
    with pytest.raises(ValueError, match=r"^Decoder.num_heads=5 must divide Decoder.width=32"):
        decoder.Model(variant="tiny", vocab_size=V, num_heads=5)
    with pytest.raises(ValueError, match="^Decoder.num_kv_heads=3 must divide Decoder.num_heads=4"):
        decoder.Model(variant="tiny", vocab_size=V, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"^Decoder.implementation must be one of .* got 'fast'"):
        decoder.Model(variant="tiny", vocab_size=V, implementation="fast")
    with pytest.raises(ValueError, match=r"^Encoder.head must be one of .* got 'pool'"):
        encoder.Model(variant="tiny", vocab_size=V, head="pool")
    with pytest.raises(ValueError, match=r"^Decoder.position must be one of .* got 't5'"):
        decoder.Model(variant="tiny", vocab_size=V, position="t5")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(experts_per_token=9), r"top_k=9 must be in \[1, num_experts=8\]"),
        (dict(first_dense_layers=2), r"first_dense_layers=2 must be in \[0, num_layers=2\)"),
        (dict(router_score="relu"), r"Decoder.router_score must be one of \('softmax', "),
        (dict(shared_expert_gate=True), "shared_gate=True needs shared experts"),
        (
            dict(load_balance_loss_weight=-1.0),
            "Decoder.load_balance_loss_weight must be a finite number >= 0, got -1.0",
        ),
        (
            dict(num_experts=0, router_bias=True, first_dense_layers=1),
            "router_bias, first_dense_layers set, but num_experts=0: they apply to mixture-of",
        ),
    ],
)
def test_mixture_of_experts_fields_are_checked_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        decoder.Model(variant="moe-tiny", vocab_size=V, **fields)


# ----------------------------------------------------------------------------------------------
# Packaging and sharding metadata.


def test_import_needs_no_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys, tfjax, tfjax.nn\n"
        "from tfjax.models import transformer, encoder, decoder, vit\n"
        "tf = ('tensorflow', 'tensorflow_datasets')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in tf]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "model,inputs",
    [
        (transformer.Model(variant="tiny", vocab_size=V, share_embeddings=False), (TOK, TOK)),
        (
            transformer.Model(variant="tiny", vocab_size=V, logits_bias=True, final_norm=True),
            (TOK, TOK),
        ),
        (encoder.Model(variant="tiny", vocab_size=V), (TOK,)),
        (encoder.Model(variant="tiny", vocab_size=V, head="classifier"), (TOK,)),
        (decoder.Model(variant="modern-tiny", vocab_size=V, scan_layers=True), (TOK,)),
        (
            decoder.Model(  # every option with parameters of its own
                variant="moe-tiny",
                vocab_size=V,
                scan_layers=True,
                first_dense_layers=1,
                use_bias=True,
                router_bias=True,
                shared_expert_dim=8,
                shared_expert_gate=True,
            ),
            (TOK,),
        ),
        (vit.Model(variant="tiny/4", num_classes=3), (jnp.ones((1, 8, 8, 3)),)),
    ],
    ids=["transformer", "transformer_options", "encoder", "classifier", "decoder", "moe", "vit"],
)
def test_every_parameter_has_logical_axis_names(model, inputs):
    shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)["params"]
    boxed = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert boxed and all(isinstance(b, nn.LogicallyPartitioned) for b in boxed)
    for b in boxed:
        assert len(b.names) == len(b.value.shape), b


def test_transformer_logits_bias_and_final_norm():
    """Converter options (Marian's output bias, nn.Transformer's final norms); off by default."""
    base = transformer.Model(variant="tiny", vocab_size=V)
    assert not base.logits_bias and not base.final_norm
    d = base.width
    m = transformer.Model(variant="tiny", vocab_size=V, logits_bias=True, final_norm=True)
    assert count(m, TOK, TOK) == count(base, TOK, TOK) + V + 2 * (2 * d)
    params = nn.unbox(m.init(jax.random.key(0), TOK, TOK))["params"]
    assert params["output_bias"].shape == (V,)
    assert "final_norm" in params["encoder"] and "final_norm" in params["decoder"]
    x, y = tokens((2, 6), seed=1), tokens((2, 5), seed=2)
    bias = jax.random.normal(jax.random.key(3), (V,))
    zero = jit_apply(m)({"params": {**params, "output_bias": jnp.zeros(V)}}, x, y)[0]
    biased = jit_apply(m)({"params": {**params, "output_bias": bias}}, x, y)[0]
    np.testing.assert_allclose(biased, zero + bias, atol=1e-5)


@pytest.mark.parametrize(
    "family", [vit.VisionTransformer, decoder.Decoder, encoder.Encoder, transformer.Transformer]
)
def test_every_numeric_field_declares_its_range(family):
    """A family's fields are checked on construction against their type and, for numbers,
    their range (tfjax.models.common.ALLOWED): width=0 or a NaN rate is an error naming the
    field, not a shape error later. A numeric field added without a range fails here."""
    numeric = [
        f.name
        for f in dataclasses.fields(family)
        if f.init and {int, float} & set(typing.get_args(f.type) or (f.type,))
    ]
    assert numeric and not set(numeric) - set(common.ALLOWED), set(numeric) - set(common.ALLOWED)
    vocab = {} if family is vit.VisionTransformer else {"vocab_size": V}
    with pytest.raises(ValueError, match=f"^{family.__name__}.dropout_rate must be a number in"):
        family(**vocab, dropout_rate=float("nan"))
    with pytest.raises(ValueError, match=f"^{family.__name__}.width must be an integer >= 1"):
        family(**vocab, width=0)
