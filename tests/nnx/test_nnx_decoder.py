"""tfjax.nnx's decoder against tfjax.models.decoder (Linen): the same parameter tree (paths,
shapes, dtypes, logical names), and from the same parameters the same logits, gradients and
decoding steps, unrolled and scanned, over configs that cover the family's options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from nnx_checks import assert_same_tree

from tfjax import sharding
from tfjax.models import decoder as linen
from tfjax.nn import RopeScaling, scanned_to_unrolled
from tfjax.nnx import blocks, models
from tfjax.nnx.models import decoder

VOCAB = 64
TINY = dict(vocab_size=VOCAB, width=32, num_heads=4, mlp_dim=48, max_len=64, dropout_rate=0.0)
CONFIGS = {
    # GPT-2: learned positions, LayerNorm, biases, tanh-GELU, tied output
    "gpt2": dict(TINY, num_layers=2),
    # Llama 3 / Qwen: GQA, RMSNorm, SwiGLU, RoPE with Llama 3's scaling, qkv biases, q/k norm,
    # a window on every layer, untied output
    "llama": dict(
        TINY,
        variant="modern-tiny",
        num_layers=3,
        num_kv_heads=2,
        rope_scaling=RopeScaling("llama3", 4.0, 16, low_freq_factor=1.0, high_freq_factor=4.0),
        qkv_bias=True,
        qk_norm=True,
        sliding_window=5,
    ),
    # Gemma 2 / 3: sandwich norms of (1 + w), scaled embeddings, GeGLU, soft caps, local and
    # global layers with their own RoPE (linear scaling on the global ones), head_dim and
    # attention_scalar of their own, one kv head
    "gemma": dict(
        TINY,
        num_layers=3,
        num_kv_heads=1,
        position="rope",
        norm="rms_plus_one",
        norm_position="sandwich",
        activation="geglu_tanh",
        use_bias=False,
        scale_embeddings=True,
        head_dim=16,
        attention_scalar=12.0,
        attention_softcap=5.0,
        final_logit_softcap=3.0,
        qk_norm=True,
        sliding_window=3,
        attention_pattern=("local", "local", "global"),
        local_rope_base=100.0,
        rope_scaling=RopeScaling("linear", 2.0, 64),
    ),
    # GPT-OSS (dense): attention sinks, biases, the clamped SwiGLU, YaRN on local and global
    # layers
    "gpt-oss": dict(
        TINY,
        num_layers=2,
        num_kv_heads=2,
        position="rope",
        norm="rms",
        activation="swiglu_clamped",
        attention_sinks=True,
        tie_embeddings=False,
        rope_scaling=RopeScaling("yarn", 4.0, 16, beta_fast=32.0, beta_slow=1.0),
        local_rope_scaling=RopeScaling("yarn", 4.0, 16, beta_fast=32.0, beta_slow=1.0),
        sliding_window=4,
        attention_pattern=("local", "global"),
    ),
    # ALiBi and sinusoidal positions, with remat
    "alibi": dict(TINY, num_layers=2, position="alibi", norm="rms", remat_policy="full"),
    "sinusoidal": dict(TINY, num_layers=2, position="sinusoidal", remat_policy="dots"),
}


# A mixture of experts (DeepSeek-like): a dense first layer, then 8 experts (2 per token) with a
# sigmoid router and a gated shared expert, with remat
MOE = dict(
    TINY,
    variant="moe-tiny",
    num_layers=3,
    first_dense_layers=1,
    router_score="sigmoid",
    shared_expert_dim=16,
    shared_expert_gate=True,
    remat_policy="full",
)


def _models(name, scan_layers, **more):
    fields = dict(CONFIGS[name] if name in CONFIGS else MOE, scan_layers=scan_layers, **more)
    variant = fields.pop("variant", None)
    return (
        linen.Model(variant, **fields),
        decoder.Model(variant, rngs=nnx.Rngs(1), **fields),
    )


def _tokens(batch=2, length=9, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, VOCAB, (batch, length)))


def _linen_params(model, tokens):
    return model.init(jax.random.key(0), tokens)["params"]  # boxed with the logical names


def _flat(tree):
    return flatten_dict(nn.meta.unbox(tree))


def _layout(tree):
    return {path: (x.shape, x.dtype) for path, x in _flat(tree).items()}


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_same_parameter_tree_and_logical_names(name, scan_layers):
    lm, model = _models(name, scan_layers)
    params = _linen_params(lm, _tokens())
    assert_same_tree(params, model)  # Functional.init's boxes too
    names = flatten_dict(nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param))))
    if scan_layers:
        out = P("layers", "heads", "head_dim", "embed")
        assert names["decoder", "layers", "self_attention", "out_kernel"] == out


def test_bfloat16_storage_and_compute_as_linen():
    lm, model = _models("llama", True, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    tokens = _tokens()
    params = _linen_params(lm, tokens)
    assert_same_tree(params, model)  # Functional.init's boxes too
    layout = _layout(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert {dtype for _, dtype in layout.values()} == {jnp.dtype(jnp.bfloat16)}
    models.load_params(model, params)
    got, want = model(tokens)[0], lm.apply({"params": params}, tokens)[0]
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)  # the same operations, so the same roundings


def test_scanned_gradient_step_needs_no_more_memory_than_linens():
    """The scan takes the stacked parameters as its input, never its carry: XLA's compiled
    gradient step needs the Linen one's temporary memory, not a copy of the layers' weights."""
    fields = dict(vocab_size=VOCAB, width=64, num_layers=4, mlp_dim=128, scan_layers=True)
    fields["remat_policy"] = "full"
    lm = linen.Model("modern-tiny", **fields)
    tokens = _tokens(length=32)
    params = nn.meta.unbox(jax.eval_shape(lambda: _linen_params(lm, tokens)))
    model = nnx.eval_shape(lambda: decoder.Model("modern-tiny", rngs=nnx.Rngs(0), **fields))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def linen_loss(p, t):
        return lm.apply({"params": p}, t)[0].mean()

    def nnx_loss(p, t):
        return nnx.merge(graphdef, p, rest)(t)[0].mean()

    def memory(loss, p):
        return jax.jit(jax.grad(loss)).lower(p, tokens).compile().memory_analysis()

    want, got = memory(linen_loss, params), memory(nnx_loss, state)
    assert got.argument_size_in_bytes == want.argument_size_in_bytes
    assert got.temp_size_in_bytes <= want.temp_size_in_bytes


def _loss(logits, pre_logits):
    """A scalar that reaches every parameter: weighted logits and hidden states."""
    w = jax.random.normal(jax.random.key(7), logits.shape)
    return jnp.sum(logits * w) + jnp.sum(pre_logits**2) * 1e-2


def _close(got, want):
    """Equal to 1e-6 of the array's scale: a gradient summed from terms up to ~90 (the loss
    weighs every logit) may round otherwise where XLA fuses the two programs differently (the
    head's optimization barrier: 1.3e-6 on a 0.045 element of GPT-OSS's unrolled gradients)."""
    scale = max(1.0, float(np.abs(np.asarray(want)).max()))
    np.testing.assert_allclose(got, want, atol=1e-6 * scale, rtol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_linen_parameters_give_the_same_logits_and_gradients(name, scan_layers):
    lm, model = _models(name, scan_layers)
    tokens = _tokens()
    segment_ids = jnp.asarray([[1] * 5 + [2] * 4, [1] * 9])
    positions = jnp.asarray([list(range(5)) + list(range(4)), list(range(9))])
    call = dict(segment_ids=segment_ids, positions=positions)
    params = nn.meta.unbox(_linen_params(lm, tokens))
    models.load_params(model, params)

    def linen_loss(p):
        logits, aux = lm.apply({"params": p}, tokens, **call)
        return _loss(logits, aux["pre_logits"]), logits

    def nnx_loss(m):
        logits, aux = m(tokens, **call)
        return _loss(logits, aux["pre_logits"]), logits

    (want_loss, want), want_grads = jax.value_and_grad(linen_loss, has_aux=True)(params)
    (got_loss, got), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(model)
    assert got.shape == (2, 9, VOCAB)
    _close(got, want)
    _close(got_loss, want_loss)
    grads, want_grads = _flat(nnx.to_pure_dict(grads)), _flat(want_grads)
    assert grads.keys() == want_grads.keys()
    for path in grads:
        _close(grads[path], want_grads[path])
    assert all(np.abs(g).max() > 0 for g in grads.values())  # every parameter is reached


def _total(losses):
    return sum(jnp.sum(x) for x in jax.tree.leaves(losses))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_experts_as_linens_and_their_aux_losses(scan_layers):
    """A mixture of experts: the same tree, logits and gradients; the call's routers' losses,
    popped as AuxLoss, are Linen's "aux_losses" collection (stacked [L] when scanned), with the
    same gradients; a second call replaces the first's."""
    lm, model = _models("moe", scan_layers)
    tokens = _tokens()
    boxed = _linen_params(lm, tokens)
    assert_same_tree(boxed, model)  # Functional.init's boxes too
    names = flatten_dict(nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param))))
    layer, lead = (("layers",), ("layers",)) if scan_layers else (("layers_0",), ())
    experts = names[("decoder", *layer, "mlp", "experts", "wo")]
    assert experts == P(*lead, "experts", "mlp", "embed")
    params = nn.meta.unbox(boxed)
    models.load_params(model, params)

    def linen_loss(p):
        (logits, aux), state = lm.apply({"params": p}, tokens, mutable=["aux_losses"])
        losses = state["aux_losses"]
        return _loss(logits, aux["pre_logits"]) + _total(losses), (logits, losses)

    def nnx_loss(m):
        logits, aux = m(tokens)
        losses = nnx.to_pure_dict(nnx.pop(m, blocks.AuxLoss))
        return _loss(logits, aux["pre_logits"]) + _total(losses), (logits, losses)

    (_, (want, want_aux)), want_grads = jax.value_and_grad(linen_loss, has_aux=True)(params)
    (_, (got, aux)), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(model)
    _close(got, want)
    assert _flat(aux).keys() == _flat(want_aux).keys()
    jax.tree.map(_close, aux, want_aux)
    if scan_layers:
        assert aux["decoder"]["layers"]["mlp"]["loss"][0].shape == (2,)
    grads, want_grads = _flat(nnx.to_pure_dict(grads)), _flat(want_grads)
    assert grads.keys() == want_grads.keys()
    for path in grads:
        _close(grads[path], want_grads[path])
    model(tokens)
    model(tokens)
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.pop(model, blocks.AuxLoss)))
    assert shapes == jax.tree.map(jnp.shape, want_aux)


def test_params_go_back_to_linen_and_across_layouts():
    """NNX -> Linen: the NNX model's own (random) parameters in the Linen model; and the
    scanned NNX model's parameters, unrolled, in the unrolled NNX model."""
    tokens = _tokens()
    lm, scanned = _models("gemma", True)
    params = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    want, _ = scanned(tokens)
    _close(lm.apply({"params": params}, tokens)[0], want)
    _, unrolled = _models("gemma", False)
    models.load_params(unrolled, scanned_to_unrolled(params))
    _close(unrolled(tokens)[0], want)


def test_created_without_a_mesh_or_context_manager():
    # Nothing around it: the logical names stay metadata, nothing is placed on a mesh.
    model = decoder.Model("modern-tiny", vocab_size=VOCAB, scan_layers=True, rngs=nnx.Rngs(0))
    kernel = model.decoder.layers.self_attention.query_kernel
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    assert kernel[...].shape == (2, 32, 4, 8)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_created_sharded_under_a_mesh(scan_layers):
    """Under a mesh and logical rules, each parameter is created where the runner's rules put
    the Linen model's, and the sharded model computes the same logits."""
    assert len(jax.devices()) >= 4, f"needs 4 devices, has {len(jax.devices())}"
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    rules = sharding.DEFAULT_RULES
    fields = dict(CONFIGS["llama"], scan_layers=scan_layers)
    variant = fields.pop("variant")
    lm = linen.Model(variant, **fields)
    tokens = _tokens()
    abstract = jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens))["params"]
    want_shardings = _flat(sharding.logical_shardings(abstract, mesh, rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        model = decoder.Model(variant, rngs=nnx.Rngs(1), **fields)
    params = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert params.keys() == want_shardings.keys()
    for path, x in params.items():
        assert x.sharding.is_equivalent_to(want_shardings[path], x.ndim), path
    table = params["embed", "embedding"]  # [V, D]: vocab over tensor, embed over fsdp
    assert table.sharding.is_equivalent_to(NamedSharding(mesh, P("tensor", "fsdp")), 2)
    reference = decoder.Model(variant, rngs=nnx.Rngs(1), **fields)  # same seed, no mesh
    want, _ = reference(tokens)
    with sharding.logical_context(mesh, rules):
        got, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
    _close(got, want)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_with_the_explicit_cache_matches_linen(scan_layers):
    lm, model = _models("gemma", scan_layers)
    tokens = _tokens(length=7)
    params = nn.meta.unbox(_linen_params(lm, tokens))
    models.load_params(model, params)
    want_cache, cache = lm.init_cache(2, 8), model.init_cache(2, 8)
    for step in (tokens[:, :4], tokens[:, 4:5], tokens[:, 5:7]):
        (want, _), want_cache = lm.apply({"params": params}, step, decode=True, cache=want_cache)
        (got, _), cache = model(step, cache=cache)
        _close(got, want)
    # The last step's logits are those of the whole sequence's forward pass.
    _close(got, model(tokens)[0][:, 5:7])
    jax.tree.map(_close, cache, want_cache)


def test_dropout_in_training_only():
    lm, model = _models("gpt2", True, dropout_rate=0.5)
    tokens = _tokens()
    evaluated, _ = model(tokens)
    _close(model(tokens)[0], evaluated)
    first, _ = model(tokens, train=True, rngs=nnx.Rngs(dropout=3))
    again, _ = model(tokens, train=True, rngs=nnx.Rngs(dropout=3))
    other, _ = model(tokens, train=True)  # the model's own stream
    _close(first, again)
    assert not np.allclose(first, evaluated) and not np.allclose(first, other)


def test_same_errors_as_linen():
    with pytest.raises(ValueError, match="Decoder.num_kv_heads=3 must divide"):
        decoder.Model("modern-tiny", vocab_size=VOCAB, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="variant='nope' is unknown"):
        decoder.Model("nope", vocab_size=VOCAB, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("variant", ["qwen3-0.6b", "gemma-3-1b", "gpt-oss-20b"])
def test_published_presets_have_linens_tree(variant):
    """The presets themselves, abstractly (nothing allocated): the Linen model's tree, scanned
    (GPT-OSS's experts included)."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    lm = linen.Model(variant, scan_layers=True)
    model = nnx.eval_shape(lambda: decoder.Model(variant, scan_layers=True, rngs=nnx.Rngs(0)))
    params = jax.eval_shape(lambda: lm.init(jax.random.key(0), tokens))["params"]
    assert _layout(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == _layout(params)


@pytest.mark.parametrize("name", ["moe", "deepseek-tiny", "qwen3.5-tiny"])
def test_graph_definition_hashes(name):
    """nnx.jit and the runner's decoding take the graph definition as a static argument, which
    must hash: every module attribute that is not a Variable must be hashable (an experts'
    dict of logical names was not)."""
    if name == "moe":
        model = _models("moe", False)[1]
    else:
        model = decoder.Model(name, vocab_size=VOCAB, rngs=nnx.Rngs(0))
    graph, _ = nnx.split(model)
    assert hash(graph) == hash(nnx.split(model)[0])
