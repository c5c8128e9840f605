"""tfjax.lora on the Flax NNX models (tfjax.nnx), through Qwix's NNX provider: the adapters
(nnx.LoRAParam) have the Linen LoRA model's parameter tree and logical names, and from the same
params the same logits and adapter gradients; a fresh LoRA model computes the base model; an
optimizer over nnx.LoRAParam trains the adapters alone; one submodule can be wrapped; unrolled
and scanned stacks alike; adapter dropout in training calls; QLoRA's quantized base, bit for bit
Linen's, with Linen's logits, gradients and merged weights."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import GEMMA2_TINY, with_random_lora_b
from flax import nnx
from qwix._src.providers import ptq

from tfjax import interop, lora, sharding
from tfjax.models import decoder as linen
from tfjax.nnx.models import decoder, load_params

V = 64
TOKENS = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10]], jnp.int32)
CONFIG = lora.LoraConfig(rank=2, alpha=4.0)
# Llama-shaped (RMSNorm, SwiGLU, RoPE, grouped-query attention), untied head
MODERN = dict(variant="modern-tiny", vocab_size=V, tie_embeddings=False)
GEMMA = GEMMA2_TINY  # conftest: Gemma-2-shaped, V = 64
FIELDS = {"modern": MODERN, "gemma": GEMMA}


def _flat(tree):
    return flax.traverse_util.flatten_dict(
        nn.meta.unbox(tree), is_leaf=lambda _, x: isinstance(x, ptq.WithAux), sep="/"
    )


def _params(model):
    """The NNX model's params (base and adapters): the Linen params tree."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _linen(fields, scan, config=CONFIG):
    """(Linen LoRA model, its params with random B: boxed, with the logical names)."""
    model = linen.Model(**fields, scan_layers=scan)
    lora_model = lora.apply_lora(model, config)
    return lora_model, lora_model.init(jax.random.key(0), TOKENS)["params"]


def _nnx(fields, scan, config=CONFIG):
    """(NNX base model, the NNX LoRA model made from it)."""
    model = decoder.Model(**fields, scan_layers=scan, rngs=nnx.Rngs(0))
    return model, lora.apply_lora(model, config, TOKENS, rngs=nnx.Rngs(1))


def _jit_logits(model, tokens=TOKENS):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s: nnx.merge(graphdef, s)(tokens)[0])(state)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", FIELDS)
def test_fresh_lora_is_the_base_model_with_linens_adapter_tree(name, scan):
    base, model = _nnx(FIELDS[name], scan)
    # a copy: the base model has no adapters; the copy has the base's params, bit for bit
    assert not nnx.state(base, nnx.LoRAParam)
    got_base, adapters = lora.split(_params(model))
    jax.tree.map(np.testing.assert_array_equal, got_base, _params(base))
    # B = 0: the base model's logits, bit for bit, eagerly and under jit
    np.testing.assert_array_equal(model(TOKENS)[0], base(TOKENS)[0])
    np.testing.assert_array_equal(_jit_logits(model), _jit_logits(base))
    # the Linen LoRA model's tree (paths, shapes, dtypes) and logical names
    _, linen_params = _linen(FIELDS[name], scan)
    layout = {k: (v.shape, v.dtype) for k, v in _flat(_params(model)).items()}
    assert layout == {k: (v.shape, v.dtype) for k, v in _flat(linen_params).items()}
    names = _flat(nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.LoRAParam))))
    want_names = _flat(nn.get_partition_spec(lora.split(linen_params)[1]))
    assert names == want_names
    layer = "decoder/layers" if scan else "decoder/layers_0"
    assert names[f"{layer}/self_attention/out_kernel_lora_b"][-1] == "embed"
    assert all(not v.any() for k, v in _flat(adapters).items() if k.endswith("_lora_b"))
    assert all(v.std() > 0 for k, v in _flat(adapters).items() if k.endswith("_lora_a"))
    if scan:  # one A per layer, as nn.scan makes them
        a = _flat(adapters)["decoder/layers/mlp/wo/kernel_lora_a"]
        assert not np.array_equal(a[0], a[1])


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", FIELDS)
def test_same_logits_and_adapter_gradients_as_linen(name, scan):
    """The Linen LoRA params (random B) put into the NNX LoRA model: the same logits and the
    same gradients of a loss with respect to the adapters, and the merged model's logits."""
    linen_model, boxed = _linen(FIELDS[name], scan)
    params = with_random_lora_b(boxed)
    _, model = _nnx(FIELDS[name], scan)
    # the NNX model's Param state (nnx.LoRAParam is an nnx.Param) takes the Linen tree
    load_params(model, params)
    want = jax.jit(linen_model.apply)({"params": params}, TOKENS)[0]  # compiled, as _jit_logits
    np.testing.assert_allclose(_jit_logits(model), want, atol=1e-6, rtol=0)
    # held as numpy arrays (jax.device_get's), called eagerly: the kernels are still found
    numpy_model = _nnx(FIELDS[name], scan)[1]
    load_params(numpy_model, jax.device_get(params))
    eager = linen_model.apply({"params": params}, TOKENS)[0]  # op by op, as the NNX call
    np.testing.assert_allclose(numpy_model(TOKENS)[0], eager, atol=1e-6, rtol=0)

    def loss(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS).mean()

    base, adapters = lora.split(params)
    want_grads = jax.grad(
        lambda a: loss(linen_model.apply({"params": lora.combine(base, a)}, TOKENS)[0])
    )(adapters)
    grads = nnx.grad(lambda m: loss(m(TOKENS)[0]), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    got, want_flat = _flat(nnx.to_pure_dict(grads)), _flat(want_grads)
    assert got.keys() == want_flat.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want_flat[k], atol=1e-6, rtol=0, err_msg=k)
    # merged into the base kernels, as an NNX model without adapters: the same logits up to
    # float32 rounding (x (W + A B) against x W + (x A) B; Gemma's soft caps and sandwich
    # norms reach 1.6e-5)
    merged = interop.as_nnx(model.spec, lora.merge(_params(model), CONFIG))
    assert not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(_jit_logits(merged), want, atol=5e-5, rtol=0)
    assert float(jnp.abs(want - linen_model.apply({"params": boxed}, TOKENS)[0]).max()) > 0.05


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_training_moves_the_adapters_only(scan):
    """nnx.Optimizer over nnx.LoRAParam, a jitted step (split / merge inside): the loss falls,
    every base parameter stays bit for bit, every adapter moves."""
    _, model = _nnx(MODERN, scan)
    before = _flat(_params(model))
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.LoRAParam)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits, _ = m(TOKENS[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    losses = []
    for _ in range(6):
        loss, state = step(state)
        losses.append(float(loss))
    nnx.update((model, optimizer), state)
    assert losses[-1] < losses[0] - 0.1, losses
    after = _flat(_params(model))
    assert after.keys() == before.keys()
    for k in before:  # the base bit for bit; every adapter (A too, after B left zero) moved
        assert np.array_equal(after[k], before[k]) != lora.is_adapter(k), k


def _one_attention(scan):
    """(config adapting one attention's query and value, Linen LoRA model, its params with
    random B, its logits)."""
    layer = "layers" if scan else "layers_1"
    targets = f"decoder/{layer}/self_attention/(query|value)_kernel"
    config = lora.LoraConfig(rank=2, alpha=4.0, targets=targets)
    linen_model, boxed = _linen(MODERN, scan, config)
    params = with_random_lora_b(boxed)
    assert len(_flat(lora.split(params)[1])) == 4
    return config, params, linen_model.apply({"params": params}, TOKENS)[0]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_one_attention_by_targets(scan):
    """A targets regex naming one attention module's kernels (a scanned stack's: every layer's):
    Linen's adapters, and from the same params Linen's logits."""
    config, params, want = _one_attention(scan)
    _, model = _nnx(MODERN, scan, config)
    assert sorted(_flat(lora.split(_params(model))[1])) == sorted(_flat(lora.split(params)[1]))
    load_params(model, params)
    np.testing.assert_allclose(_jit_logits(model), want, atol=1e-6, rtol=0)


def test_one_attention_wrapped():
    """`model.decoder.layers_1.self_attention` replaced by its LoRA copy (targets: the module's
    own paths, "query_kernel"): the same adapters, at the same paths in the model, as Linen's
    with the regex naming them, and the same logits from the same params."""
    _, params, want = _one_attention(False)
    model = decoder.Model(**MODERN, rngs=nnx.Rngs(0))
    config = lora.LoraConfig(rank=2, alpha=4.0, targets="(query|value)_kernel")
    x = jnp.zeros((1, 4, 32))
    attention = model.decoder.layers_1.self_attention
    model.decoder.layers_1.self_attention = lora.apply_lora(attention, config, x, rngs=nnx.Rngs(2))
    assert sorted(_flat(lora.split(_params(model))[1])) == sorted(_flat(lora.split(params)[1]))
    load_params(model, params)
    np.testing.assert_allclose(_jit_logits(model), want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(model(TOKENS)[0], want, atol=1e-6, rtol=0)


def test_a_scanned_layers_module_is_refused_by_name():
    """A module inside a scanned stack holds every layer's parameters [L, ...] and runs only
    inside the stack's scan: wrapping it is refused, naming the targets way."""
    model = decoder.Model(**MODERN, scan_layers=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"scanned stack.*targets"):
        lora.apply_lora(
            model.decoder.layers.self_attention, CONFIG, jnp.zeros((1, 4, 32)), rngs=nnx.Rngs(0)
        )


def test_the_other_call_paths():
    """The head alone (apply_head=False, then `logits`: the chunked loss) with the head
    adapted too, and decoding with the explicit KV cache (prefill then one token)."""
    config = lora.LoraConfig(
        rank=2, alpha=4.0, targets=lora.DEFAULT_TARGETS + "|output_proj/kernel"
    )
    _, model = _nnx(MODERN, False, config)
    assert "output_proj/kernel_lora_a" in _flat(_params(model))
    load_params(model, with_random_lora_b(_params(model)))
    logits, aux = model(TOKENS)
    hidden, _ = model(TOKENS, apply_head=False)
    np.testing.assert_array_equal(hidden, aux["pre_logits"])
    np.testing.assert_allclose(model.logits(hidden), logits, atol=1e-6, rtol=0)
    # without the adapters' head: another result (the head's adapters act in `logits`)
    plain = model.output_proj(hidden)
    assert float(jnp.abs(plain - logits).max()) > 1e-3
    cache = model.init_cache(2, 16)
    (prefill, _), cache = model(TOKENS[:, :5], cache=cache)
    (step, _), cache = model(TOKENS[:, 5:6], cache=cache)
    np.testing.assert_allclose(prefill, logits[:, :5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(step[:, 0], logits[:, 5], atol=1e-5, rtol=0)


def test_refusals():
    model = decoder.Model(**MODERN, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"matches none of the model's kernels.*query_kernel"):
        lora.apply_lora(model, lora.LoraConfig(targets="nothing"), TOKENS, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"needs rngs=nnx.Rngs"):
        lora.apply_lora(model, CONFIG, TOKENS)
    with pytest.raises(TypeError, match="needs example inputs"):
        lora.apply_lora(model, CONFIG, rngs=nnx.Rngs(0))
    adapted = lora.apply_lora(model, CONFIG, TOKENS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="has adapters already"):
        lora.apply_lora(adapted, CONFIG, TOKENS, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="example inputs and rngs are for an NNX model"):
        lora.apply_lora(linen.Model(**MODERN), CONFIG, TOKENS)
    with pytest.raises(TypeError, match="flax.linen or flax.nnx Module"):
        lora.apply_lora(object(), CONFIG)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_adapters_created_sharded_under_a_mesh(scan):
    """Under a mesh and the runner's logical rules each adapter is created where the rules put
    the Linen LoRA model's, and the sharded LoRA model computes the unsharded one's logits."""
    assert len(jax.devices()) >= 4, f"needs 4 devices, has {len(jax.devices())}"
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, jax.devices()[:4])
    rules = sharding.DEFAULT_RULES
    linen_model = lora.apply_lora(linen.Model(**MODERN, scan_layers=scan), CONFIG)
    abstract = jax.eval_shape(lambda: linen_model.init(jax.random.key(0), TOKENS))["params"]
    want = _flat(sharding.logical_shardings(lora.split(abstract)[1], mesh, rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        base, model = _nnx(MODERN, scan)
    adapters = _flat(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))
    assert adapters.keys() == want.keys()
    for path, x in adapters.items():
        assert x.sharding.is_equivalent_to(want[path], x.ndim), path
    layer = "decoder/layers" if scan else "decoder/layers_0"
    b = adapters[f"{layer}/mlp/wi_0/kernel_lora_b"]  # [(L,) r, F]: F over tensor
    assert b.sharding.spec[-1] == "tensor"
    load_params(model, with_random_lora_b(_params(model)))
    reference = _nnx(MODERN, scan)[1]  # the same seeds, no mesh
    load_params(reference, jax.device_get(_params(model)))
    with sharding.logical_context(mesh, rules):
        got = nnx.jit(lambda m, t: m(t)[0])(model, TOKENS)
    np.testing.assert_allclose(got, reference(TOKENS)[0], atol=1e-5, rtol=0)


class _Projection(nnx.Module):
    """x [B, 256] -> [B, 4] by one kernel, a call that trains with train=True and rngs."""

    def __init__(self, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (256, 4)))

    def __call__(self, x, *, train=False, rngs=None):
        return jnp.einsum("bd,df->bf", x, self.kernel[...])


def test_adapter_dropout_drops_the_adapters_inputs_in_training_calls_only():
    """y = x W + (dropout(x) A) B alpha / r: the gradient of sum(y) with respect to x, less W's
    part, is each input's kept (1 / (1 - rate)) or dropped (0) share of A B's, in a training
    call only; the same key drops the same inputs, another key others."""
    rate = 0.25
    config = lora.LoraConfig(rank=2, alpha=4.0, targets="kernel", dropout=rate)
    x = jnp.ones((1, 256))
    model = lora.apply_lora(_Projection(nnx.Rngs(0)), config, x, rngs=nnx.Rngs(1))
    model.kernel_lora_b[...] = jax.random.normal(jax.random.key(2), (2, 4))
    through_adapters = (model.kernel_lora_a[...] @ model.kernel_lora_b[...]).sum(1) * 2.0
    kernel = model.kernel[...]

    def dropped(**kwargs):  # which inputs the adapters' part of the gradient drops
        grad = jax.grad(lambda x: model(x, **kwargs).sum())(x)[0] - kernel.sum(1)
        scaled = through_adapters / (1 - rate) if kwargs.get("train") else through_adapters
        out = np.abs(grad) < np.abs(grad - scaled)
        np.testing.assert_allclose(grad, np.where(out, 0.0, scaled), atol=1e-5, rtol=0)
        return out

    assert not dropped().any()  # not training: no dropout
    assert not dropped(train=False, rngs=nnx.Rngs(dropout=3)).any()
    drawn = dropped(train=True, rngs=nnx.Rngs(dropout=3))
    assert 0.15 < drawn.mean() < 0.35, drawn.mean()
    np.testing.assert_array_equal(dropped(train=True, rngs=nnx.Rngs(dropout=3)), drawn)
    assert (dropped(train=True, rngs=nnx.Rngs(dropout=4)) != drawn).any()
    with pytest.raises(ValueError, match=r"LoraConfig.dropout=0.25: .* needs rngs=nnx.Rngs"):
        model(x, train=True)  # no rngs given, and the module has none


def _stacked(params, num_layers):
    """An unrolled decoder's params as the scanned one's: decoder/layers_i/... stacked [L]."""
    flat = _flat(params)
    out = {k: v for k, v in flat.items() if "/layers_" not in k}
    for k in flat:
        if "/layers_0/" in k:
            layers = [flat[k.replace("/layers_0/", f"/layers_{i}/")] for i in range(num_layers)]
            out[k.replace("/layers_0/", "/layers/")] = jnp.stack(layers)
    return flax.traverse_util.unflatten_dict(out, sep="/")


def test_adapter_dropout_in_a_decoders_training_call():
    """A decoder (with dropout of its own) called with train=True: a fresh LoRA model is the
    base model (B = 0; the model draws its own keys as without LoRA); with B trained, dropout
    on the adapters' inputs, per the call's key, the same compiled and eager, and the same
    draws per layer in a scanned stack as in the unrolled one (each layer its own)."""
    fields = dict(MODERN, dropout_rate=0.1)
    config = lora.LoraConfig(rank=2, alpha=4.0, dropout=0.5)
    models = {}
    for scan in (False, True):
        base = decoder.Model(**fields, scan_layers=scan, rngs=nnx.Rngs(0))
        models[scan] = model = lora.apply_lora(base, config, TOKENS, rngs=nnx.Rngs(1))
        got = model(TOKENS, train=True, rngs=nnx.Rngs(dropout=3))[0]
        want = base(TOKENS, train=True, rngs=nnx.Rngs(dropout=3))[0]
        np.testing.assert_array_equal(got, want)
    unrolled, scanned = models[False], models[True]
    params = with_random_lora_b(_params(unrolled))
    load_params(unrolled, params)
    load_params(scanned, _stacked(params, unrolled.spec.num_layers))
    train = unrolled(TOKENS, train=True, rngs=nnx.Rngs(dropout=3))[0]
    np.testing.assert_allclose(
        scanned(TOKENS, train=True, rngs=nnx.Rngs(dropout=3))[0], train, atol=1e-5, rtol=0
    )
    graphdef, state = nnx.split(unrolled)
    compiled = jax.jit(
        lambda s, k: nnx.merge(graphdef, s)(TOKENS, train=True, rngs=nnx.Rngs(dropout=k))[0]
    )(state, jax.random.key(3))
    np.testing.assert_allclose(compiled, train, atol=1e-5, rtol=0)
    # the base's dropout alone (B = 0 above) against the adapters' too
    base = decoder.Model(**fields, rngs=nnx.Rngs(0))
    load_params(base, lora.split(params)[0])
    assert not np.allclose(train, base(TOKENS, train=True, rngs=nnx.Rngs(dropout=3))[0])
    assert not np.allclose(train, unrolled(TOKENS, train=True, rngs=nnx.Rngs(dropout=4))[0])
    evaluated = unrolled(TOKENS)[0]
    assert not np.allclose(train, evaluated)
    load_params(base, lora.merge(params, config))  # not training: the merged model
    np.testing.assert_allclose(evaluated, base(TOKENS)[0], atol=5e-5, rtol=0)


QLORA = {"int8": lora.LoraConfig(rank=2, alpha=4.0, base_dtype="int8")}
QLORA["nf4"] = lora.LoraConfig(rank=2, alpha=4.0, base_dtype="nf4", tile_size=16)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("base_dtype", QLORA)
def test_qlora_is_linens(base_dtype, scan):
    """apply_lora with base_dtype quantizes the NNX model's targeted kernels as Linen's
    init_params does from the same float base (bit for bit, Linen's params tree: WithAux in the
    matmul's layout); from the same params the same logits and adapter gradients; a jitted
    step trains the adapters on the quantized base; merged into the dequantized base, Linen's
    merged weights, and the plain NNX model of them computes the QLoRA model."""
    config = QLORA[base_dtype]
    base, model = _nnx(MODERN, scan, config)
    float_base = _params(base)
    linen_model = lora.apply_lora(linen.Model(**MODERN, scan_layers=scan), config)
    linen_params = nn.unbox(lora.init_params(linen_model, float_base, jax.random.key(1), TOKENS))
    got, want = _flat(_params(model)), _flat(linen_params)
    assert got.keys() == want.keys()
    layer = "decoder/layers" if scan else "decoder/layers_0"
    query = got[f"{layer}/self_attention/query_kernel"]
    assert type(query) is ptq.WithAux and query.shape == ((2,) if scan else ()) + (32, 32)
    for k in got:
        assert jax.tree.structure(got[k]) == jax.tree.structure(want[k]), k
        if not lora.is_adapter(k):
            jax.tree.map(np.testing.assert_array_equal, got[k], want[k])
    params = with_random_lora_b(linen_params)
    load_params(model, params)
    logits = jax.jit(linen_model.apply)({"params": params}, TOKENS)[0]
    np.testing.assert_allclose(_jit_logits(model), logits, atol=1e-6, rtol=0)
    # held as numpy arrays (jax.device_get's), called eagerly: the kernels are still found
    numpy_model = _nnx(MODERN, scan, config)[1]
    load_params(numpy_model, jax.device_get(params))
    eager = linen_model.apply({"params": params}, TOKENS)[0]
    np.testing.assert_allclose(numpy_model(TOKENS)[0], eager, atol=1e-6, rtol=0)

    def loss(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS).mean()

    quantized, adapters = lora.split(params)
    want_grads = jax.grad(
        lambda a: loss(linen_model.apply({"params": lora.combine(quantized, a)}, TOKENS)[0])
    )(adapters)
    grads = nnx.grad(lambda m: loss(m(TOKENS)[0]), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    got_grads, want_flat = _flat(nnx.to_pure_dict(grads)), _flat(want_grads)
    assert got_grads.keys() == want_flat.keys()
    for k in got_grads:
        np.testing.assert_allclose(got_grads[k], want_flat[k], atol=1e-6, rtol=0, err_msg=k)
    # merged into the dequantized base: Linen's weights; as a plain NNX model, the QLoRA logits
    merged = lora.merge(lora.dequantized(_params(model), float_base), config)
    want_merged = lora.merge(lora.dequantized(params, float_base), config)
    jax.tree.map(np.testing.assert_array_equal, merged, want_merged)
    plain = interop.as_nnx(model.spec, merged)
    np.testing.assert_allclose(_jit_logits(plain), logits, atol=1e-4, rtol=0)
    # a jitted step: the adapters move, the quantized base stays bit for bit
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.LoRAParam)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: loss(m(TOKENS)[0]), argnums=nnx.DiffState(0, nnx.LoRAParam))
        optimizer.update(model, grads(model))
        return nnx.state((model, optimizer))

    nnx.update((model, optimizer), step(state))
    after = _flat(_params(model))
    for k, v in _flat(params).items():
        same = all(jax.tree.leaves(jax.tree.map(np.array_equal, after[k], v)))
        assert same != lora.is_adapter(k), k
    # float kernels loaded into it are refused by name, not quantized on the way
    load_params(model, lora.combine(float_base, adapters))
    with pytest.raises(ValueError, match=r"base_dtype=.* the kernel .*_kernel holds float"):
        model(TOKENS)


class _GatedLinear(nnx.Module):
    """A kernel multiplied by an einsum and one used elementwise (no matmul Qwix intercepts)."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.ones((4, 3)))
        self.gate_kernel = nnx.Param(jnp.ones((3,)))

    def __call__(self, x):
        x, kernel, gate = nnx.nn.dtypes.promote_dtype(
            (x, self.kernel[...], self.gate_kernel[...]), dtype=None
        )
        return jnp.einsum("bd,de->be", x, kernel) * gate


def test_a_target_kernel_no_matmul_multiplies_is_refused_by_name():
    x = jnp.ones((2, 4))
    config = lora.LoraConfig(rank=2, targets=".*kernel")
    with pytest.raises(
        ValueError, match=r"targets='\.\*kernel' matches gate_kernel: kernel\(s\) the model reads"
    ):
        lora.apply_lora(_GatedLinear(), config, x, rngs=nnx.Rngs(0))
    config = lora.LoraConfig(rank=2, targets="kernel")
    adapted = lora.apply_lora(_GatedLinear(), config, x, rngs=nnx.Rngs(0))
    assert sorted(nnx.to_pure_dict(nnx.state(adapted, nnx.LoRAParam))) == [
        "kernel_lora_a",
        "kernel_lora_b",
    ]


def test_latent_attention_adapters_decode_as_the_forward_pass_in_linen_and_nnx():
    """DeepSeek-shaped (deepseek-tiny): the default targets adapt the latent attention's six
    projections and the dense and shared MLPs; with B drawn at random NNX gives Linen's logits,
    and decoding through the latent cache (the absorbed form, which takes key_up and value_up
    with their adapters merged) gives the forward pass's, in both."""
    fields = dict(variant="deepseek-tiny", vocab_size=V)
    lm = lora.apply_lora(linen.Model(**fields), CONFIG)
    params = with_random_lora_b(nn.unbox(lm.init(jax.random.key(0), TOKENS)["params"]))
    kernels = {k.rsplit("_lora_", 1)[0] for k in _flat(params) if lora.is_adapter(k)}
    attention = {k.rsplit("/", 1)[1] for k in kernels if "/self_attention/" in k}
    assert attention == {
        f"{n}_kernel" for n in ("query_down", "query_up", "kv_down", "key_up", "value_up", "out")
    }
    assert any("/mlp/shared/wi_0/" in k for k in kernels)
    assert not any("/experts/" in k for k in kernels)
    model = lora.apply_lora(
        decoder.Model(**fields, rngs=nnx.Rngs(0)), CONFIG, TOKENS, rngs=nnx.Rngs(1)
    )
    load_params(model, params)
    full = lm.apply({"params": params}, TOKENS)[0]
    np.testing.assert_allclose(model(TOKENS)[0], full, atol=1e-5, rtol=0)
    want_cache, cache = lm.init_cache(2, 16), model.init_cache(2, 16)
    for start, stop in ((0, 5), (5, 6)):
        step = TOKENS[:, start:stop]
        (want, _), want_cache = lm.apply({"params": params}, step, decode=True, cache=want_cache)
        (got, _), cache = model(step, cache=cache)
        np.testing.assert_allclose(want, full[:, start:stop], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
