"""tfjax.lora: LoRA and QLoRA adapters through Qwix on tfjax's decoders.

What it must keep: the base params (paths, shapes, values), the base model's logits while B is
zero, the merged model's logits (and generated tokens) after training, the logical names and
so the shardings, every way the decoders are called (unrolled or scanned, remat, the logits
method, the explicit KV cache), in and out of jit.
"""

import dataclasses
import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GEMMA2_TINY, with_random_lora_b
from jax.sharding import PartitionSpec as P
from qwix._src.providers import ptq

from tfjax import decode, lora, sharding
from tfjax import nn as tnn
from tfjax.models import decoder

V = 64
TOKENS = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10]], jnp.int32)
CONFIG = lora.LoraConfig(rank=2, alpha=4.0)
# Llama-shaped: RMSNorm, SwiGLU (wi_0, wi_1, wo), RoPE, grouped-query attention, no biases.
MODERN = dict(variant="modern-tiny", vocab_size=V)
GEMMA = GEMMA2_TINY  # conftest: Gemma-2-shaped, V = 64
KERNELS = ("query_kernel", "key_kernel", "value_kernel", "out_kernel")
MLP = ("wi_0", "wi_1", "wo")


def _flat(tree):
    return flax.traverse_util.flatten_dict(
        tree, is_leaf=lambda _, x: isinstance(x, ptq.WithAux), sep="/"
    )


@functools.cache
def _base(scan: bool):
    """(the base model, its params, the LoRA model, its params from the same init key)."""
    model = decoder.Model(**MODERN, scan_layers=scan)
    lora_model = lora.apply_lora(model, CONFIG)
    base = model.init(jax.random.key(0), TOKENS)["params"]
    return model, base, lora_model, lora_model.init(jax.random.key(0), TOKENS)["params"]


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def llama(request):
    """(base model, its params, the LoRA model, its params with random B)."""
    model, base, lora_model, params = _base(request.param)
    return model, base, lora_model, with_random_lora_b(params)


@pytest.fixture(scope="module")
def scanned():
    """llama's scanned layout (nn.scan over the layers: what large runs use)."""
    model, base, lora_model, params = _base(True)
    return model, base, lora_model, with_random_lora_b(params)


def test_fresh_lora_is_the_base_model(llama):
    model, base, lora_model, _ = llama
    params = _base(model.scan_layers)[3]  # as initialised: B = 0
    layer = "decoder/layers" if model.scan_layers else "decoder/layers_0"
    adapters = _flat(lora.split(params)[1])
    expected = [f"{layer}/self_attention/{k}" for k in KERNELS] + [
        f"{layer}/mlp/{m}/kernel" for m in MLP
    ]
    per_layer = sorted(k for k in adapters if k.startswith(layer + "/"))
    assert per_layer == sorted(e + s for e in expected for s in lora.ADAPTER_SUFFIXES)
    assert len(adapters) == 2 * len(expected) * (1 if model.scan_layers else model.num_layers)
    # One init key gives the base model's params (paths, shapes, values), adapters beside them,
    # and the base model's logits, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, lora.split(params)[0], base)
    logits, _ = model.apply({"params": base}, TOKENS)
    np.testing.assert_array_equal(lora_model.apply({"params": params}, TOKENS)[0], logits)
    # Adapters for given base params (a loaded checkpoint's): boxed as the base is.
    added = lora.init_params(lora_model, base, jax.random.key(3), TOKENS)
    assert _flat(added).keys() == _flat(params).keys()
    jax.tree.map(np.testing.assert_array_equal, lora.split(added)[0], base)
    assert all(isinstance(v, nn.Partitioned) for v in _flat(added).values())
    assert all(not v.value.any() for k, v in _flat(added).items() if k.endswith("_lora_b"))
    np.testing.assert_array_equal(lora_model.apply({"params": added}, TOKENS)[0], logits)


def test_lora_equals_the_merged_model(llama):
    model, base, lora_model, params = llama
    merged = lora.merge(params, CONFIG)
    expected, _ = model.apply({"params": merged}, TOKENS)
    logits, _ = lora_model.apply({"params": params}, TOKENS)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    if not model.scan_layers:  # jitted too (nn.scan's body is traced either way)
        jitted, _ = jax.jit(lambda p: lora_model.apply({"params": p}, TOKENS))(params)
        np.testing.assert_allclose(jitted, expected, atol=1e-5, rtol=0)
    assert float(jnp.abs(logits - model.apply({"params": base}, TOKENS)[0]).max()) > 0.05
    # merge changes the targeted kernels only; every other parameter is bit-identical
    flat_base, flat_merged = _flat(nn.unbox(base)), _flat(merged)
    assert flat_merged.keys() == flat_base.keys()
    changed = {k for k in flat_base if not np.array_equal(flat_base[k], flat_merged[k])}
    assert changed == {k[: -len("_lora_a")] for k in _flat(params) if k.endswith("_lora_a")}


def test_the_other_call_paths(scanned):
    """apply_head=False + method="logits" (the chunked loss), remat, and generation."""
    model, _, lora_model, params = scanned
    logits, aux = lora_model.apply({"params": params}, TOKENS)
    hidden, _ = lora_model.apply({"params": params}, TOKENS, apply_head=False)
    np.testing.assert_array_equal(hidden, aux["pre_logits"])
    np.testing.assert_array_equal(
        lora_model.apply({"params": params}, hidden, method="logits"), logits
    )
    remat = lora.apply_lora(model.clone(remat_policy="full"), CONFIG)
    np.testing.assert_allclose(remat.apply({"params": params}, TOKENS)[0], logits, atol=1e-6)
    # Generation through the explicit KV cache: the merged model's tokens.
    prompts = jnp.array([[5, 6, 7, 0], [9, 10, 11, 12]])
    tokens, scores = decode.generate(lora_model, params, prompts, max_new_tokens=5, eos_id=3)
    merged = lora.merge(params, CONFIG)
    expected, expected_scores = decode.generate(model, merged, prompts, max_new_tokens=5, eos_id=3)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-5)


def test_gradients_reach_the_adapters_only(scanned):
    _, _, lora_model, params = scanned
    base, adapters = lora.split(params)

    def loss(adapters):
        logits, _ = lora_model.apply({"params": lora.combine(base, adapters)}, TOKENS)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 5])

    grads = _flat(jax.jit(jax.grad(loss))(adapters))
    assert grads.keys() == _flat(adapters).keys()
    assert all(np.isfinite(g).all() for g in grads.values())
    assert all(np.abs(g).max() > 0 for k, g in grads.items() if k.endswith("_lora_b"))
    mask = _flat(lora.adapter_mask(params))
    assert {k for k, v in mask.items() if v} == set(grads)


def test_adapters_carry_logical_names_and_shard(scanned):
    model, _, lora_model, params = scanned
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.DEFAULT_RULES
    tokens = jnp.tile(TOKENS, (2, 1))  # the batch splits over data x fsdp

    def init(rng):
        with sharding.logical_context(mesh, rules):
            return lora_model.init(rng, tokens)["params"]

    boxed = jax.eval_shape(init, jax.random.key(0))
    names = {k: v.names for k, v in _flat(boxed).items() if lora.is_adapter(k)}
    layer, stacked = "decoder/layers/", ("layers",)
    attention = layer + "self_attention/"
    assert names[attention + "query_kernel_lora_a"] == (*stacked, "embed", None)  # [D, r]
    assert names[attention + "query_kernel_lora_b"] == (*stacked, None, "heads")  # [r, N H]
    assert names[attention + "key_kernel_lora_b"] == (*stacked, None, "kv_heads")  # [r, K H]
    assert names[attention + "out_kernel_lora_a"] == (*stacked, "heads", None)  # [N H, r]
    assert names[attention + "out_kernel_lora_b"] == (*stacked, None, "embed")  # [r, D]
    assert names[layer + "mlp/wi_0/kernel_lora_b"] == (*stacked, None, "mlp")  # [r, F]
    assert names[layer + "mlp/wo/kernel_lora_a"] == (*stacked, "mlp", None)  # [F, r]
    shardings = sharding.logical_shardings(boxed, mesh, rules)
    specs = {k: s.spec for k, s in _flat(shardings).items()}
    lead = (None,) * len(stacked)
    assert specs[attention + "query_kernel_lora_a"] == P(*lead, "fsdp", None)
    assert specs[attention + "query_kernel_lora_b"] == P(*lead, None, "tensor")
    assert specs[attention + "out_kernel_lora_b"] == P(*lead, None, "fsdp")
    sharded = jax.device_put(params, shardings)
    assert _flat(sharded)[attention + "query_kernel_lora_a"].sharding.spec == P(*lead, "fsdp", None)

    @jax.jit
    def forward(params, tokens):
        with sharding.logical_context(mesh, rules):
            return lora_model.apply({"params": params}, tokens)[0]

    expected, _ = lora_model.apply({"params": params}, tokens)
    np.testing.assert_allclose(forward(sharded, tokens), expected, atol=2e-6)


def test_gemma_shaped_scanned_with_remat():
    model = decoder.Model(**GEMMA, scan_layers=True, remat_policy="dots_no_batch")
    lora_model = lora.apply_lora(model, CONFIG)
    params = with_random_lora_b(jax.jit(lora_model.init)(jax.random.key(0), TOKENS)["params"])
    logits = jax.jit(lambda p: lora_model.apply({"params": p}, TOKENS)[0])(params)
    expected, _ = model.apply({"params": lora.merge(params, CONFIG)}, TOKENS)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def test_targets_choose_the_kernels():
    config = lora.LoraConfig(rank=2, alpha=4.0, targets=r".*/self_attention/(query|value)_kernel")
    lora_model = lora.apply_lora(decoder.Model(**MODERN), config)
    params = jax.eval_shape(lora_model.init, jax.random.key(0), TOKENS)["params"]
    adapters = sorted(k for k in _flat(params) if lora.is_adapter(k))
    assert adapters == sorted(
        f"decoder/layers_{i}/self_attention/{k}_kernel{s}"
        for i in range(2)
        for k in ("query", "value")
        for s in lora.ADAPTER_SUFFIXES
    )


def test_targets_that_match_nothing_name_themselves():
    config = lora.LoraConfig(targets=r".*/attention/q_proj")
    lora_model = lora.apply_lora(decoder.Model(**MODERN), config)
    with pytest.raises(ValueError, match=r"targets='\.\*/attention/q_proj' matches none") as e:
        jax.eval_shape(lora_model.init, jax.random.key(0), TOKENS)
    assert "'decoder/layers_0/self_attention/query_kernel'" in str(e.value)
    assert "'decoder/layers_0/mlp/wi_0/kernel'" in str(e.value)


def test_a_mixture_of_experts_adapts_attention_and_dense_layers_not_experts():
    """A mixture of experts (a dense first layer, scanned): the default targets adapt every
    attention projection and the dense layer's MLP; the experts' stacked kernels, multiplied by
    a grouped matmul that takes no adapters, are refused by name when a target matches them."""
    model = decoder.Model(variant="moe-tiny", vocab_size=V, first_dense_layers=1, scan_layers=True)
    params = jax.eval_shape(lora.apply_lora(model, CONFIG).init, jax.random.key(0), TOKENS)
    adapters = {k for k in _flat(params["params"]) if lora.is_adapter(k)}
    assert adapters == {
        f"{stack}/layers/{kernel}{s}"
        for stack in ("decoder", "dense_decoder")
        for kernel in [f"self_attention/{k}" for k in KERNELS]
        + [f"mlp/{k}/kernel" for k in MLP if stack == "dense_decoder"]
        for s in lora.ADAPTER_SUFFIXES
    }
    config = lora.LoraConfig(rank=2, targets=r".*/experts/wi_.")
    with pytest.raises(
        ValueError,
        match=r"^LoraConfig.targets='\.\*/experts/wi_\.' matches decoder/layers/mlp/experts/"
        r"wi_0, a mixture of experts' stacked expert kernel: .* leave \.\*/mlp/experts/ out",
    ):
        jax.eval_shape(lora.apply_lora(model, config).init, jax.random.key(0), TOKENS)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", 0, "rank must be a positive int"),
        ("alpha", 0.0, "alpha must be a positive number"),
        ("dropout", 1.0, r"dropout must be in \[0, 1\)"),
        ("targets", "(", "targets='\\(' is not a regex"),
        ("base_dtype", "int4", "base_dtype='int4' is unknown"),
        ("tile_size", -1, r"tile_size must be an int >= 0 \(0: one scale per output channel\)"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraConfig(**{field: value})


@pytest.mark.parametrize(
    "base_dtype, tile_size, block",
    [
        ("nf4", None, 64),  # QLoRA's NF4 blocks: one scale per 64 inputs, the default
        ("nf4", 32, 32),
        ("nf4", 0, None),  # one scale per output channel
        ("int8", None, None),
        ("int8", 64, 64),
    ],
)
def test_quantized_kernels_are_scaled_in_blocks_of_tile_size(base_dtype, tile_size, block):
    """A Dense kernel [128 inputs, 3 outputs] quantized: nf4 by default in QLoRA's blocks of 64
    inputs per output channel, int8 by default per output channel; tile_size chooses."""
    config = lora.LoraConfig(rank=2, base_dtype=base_dtype, tile_size=tile_size, targets="kernel")
    assert config.block_size == block
    x = jnp.ones((2, 128))
    float_base = nn.Dense(3).init(jax.random.key(0), x)["params"]
    params = lora.init_params(
        lora.apply_lora(nn.Dense(3), config), float_base, jax.random.key(1), x
    )
    assert params["kernel"].array.scale.shape == (128 // block if block else 1, 3)


@pytest.mark.parametrize("base_dtype, tile_size", [("int8", None), ("nf4", 16)])
def test_qlora_trains_adapters_on_a_quantized_base(base_dtype, tile_size):
    config = lora.LoraConfig(rank=2, alpha=4.0, base_dtype=base_dtype, tile_size=tile_size)
    model, float_base = _base(True)[:2]
    lora_model = lora.apply_lora(model, config)
    params = jax.jit(lambda b: lora.init_params(lora_model, b, jax.random.key(1), TOKENS))(
        float_base
    )
    base, adapters = lora.split(nn.unbox(params))
    kernel = nn.unbox(_flat(base)["decoder/layers/self_attention/query_kernel"])
    assert isinstance(kernel, ptq.WithAux)
    assert kernel.array.qvalue.dtype == {"int8": jnp.int8, "nf4": jnp.uint4}[base_dtype]
    assert kernel.shape == (2, 32, 32)  # [L, D, N H]: the matmul's layout
    assert not isinstance(_flat(base)["embed/embedding"], ptq.WithAux)  # not a target
    # Fresh adapters: the quantized base model, close to the float one.
    logits = jax.jit(lambda p: lora_model.apply({"params": p}, TOKENS)[0])(params)
    expected, _ = model.apply({"params": float_base}, TOKENS)
    tolerance = {"int8": 0.01, "nf4": 0.1}[base_dtype]
    np.testing.assert_allclose(logits, expected, atol=tolerance)

    def loss(adapters):
        logits, _ = lora_model.apply({"params": lora.combine(base, adapters)}, TOKENS)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 5])

    grads = _flat(jax.jit(jax.grad(loss))(adapters))
    assert all(np.isfinite(g).all() for g in grads.values())
    assert all(np.abs(g).max() > 0 for k, g in grads.items() if k.endswith("_lora_b"))
    # The trained adapters merge into the float base (not into the quantized one).
    merged = lora.merge(lora.combine(float_base, with_random_lora_b(adapters)), config)
    assert _flat(merged).keys() == _flat(float_base).keys()
    with pytest.raises(ValueError, match="is quantized"):
        lora.merge(params, config)
    with pytest.raises(ValueError, match="holds float values"):
        lora_model.apply({"params": lora.combine(float_base, adapters)}, TOKENS)


def test_a_tile_size_that_does_not_divide_a_kernels_inputs_is_one_error_naming_them():
    """modern-tiny's adapted kernels take 32 inputs (D; N H) but mlp/wo 96 (F). A tile_size
    that divides not every one is one line naming the field, each kernel with its width, and
    the sizes that fit: before any work from the float LoRA params' shapes (check_tile_size,
    which the runner calls), and at quantization (init_params) for the kernel it meets first."""
    params = _base(True)[3]  # the LoRA params' adapters A [L, in, r] give the widths
    attention = "decoder/layers/self_attention"
    with pytest.raises(ValueError) as e:
        lora.check_tile_size(lora.LoraConfig(base_dtype="nf4", tile_size=48), params, "lora")
    message = str(e.value)
    assert message.startswith("lora.tile_size=48: 6 adapted kernel(s) of base_dtype='nf4' ")
    assert f"{attention}/key_kernel (32), {attention}/out_kernel (32)" in message
    assert "and 2 more; set lora.tile_size to 0 (one scale per output channel) or to a " in message
    assert "divisor of 32, what every adapted kernel's inputs divide by (32, 16, 8, 4, ...)" in (
        message
    )
    assert "mlp/wo/kernel" not in message  # 96 = 2 x 48
    with pytest.raises(ValueError, match=r"^LoraConfig.tile_size unset \(nf4's default: 64, "):
        lora.check_tile_size(lora.LoraConfig(base_dtype="nf4"), params)
    for fits in (
        lora.LoraConfig(base_dtype="nf4", tile_size=32),
        lora.LoraConfig(base_dtype="int8"),  # per channel
        lora.LoraConfig(tile_size=48),  # no base_dtype: nothing quantized
    ):
        lora.check_tile_size(fits, params)
    # Quantizing on its own (no check first): Qwix's "(32, 32) cannot be tiled as {0: 64}"
    # was all it said; now the kernel and the field.
    model, base = _base(True)[:2]
    qlora = lora.apply_lora(model, lora.LoraConfig(base_dtype="nf4"))
    with pytest.raises(ValueError, match=r"^LoraConfig.tile_size unset .*: decoder/layers/"):
        jax.eval_shape(lambda b: lora.init_params(qlora, b, jax.random.key(1), TOKENS), base)


def test_a_resumed_or_decoded_qlora_run_must_quantize_its_base_as_it_was_trained():
    """A workdir from before nf4's default became QLoRA's blocks of 64 recorded tile_size 0
    (per channel): resuming it with the default (None: 64 now) is refused naming the fields
    and the flags that give its base back; the same quantization however spelled passes."""
    recorded = lora.LoraConfig(base_dtype="nf4", tile_size=0)
    with pytest.raises(ValueError) as e:
        lora.check_quantization_kept(recorded, lora.LoraConfig(base_dtype="nf4"), "W/config.json")
    assert str(e.value) == (
        "lora.base_dtype / lora.tile_size: this run's adapters were trained on its base "
        "quantized as nf4 with one scale per output channel (lora.base_dtype='nf4', "
        "lora.tile_size 0) (W/config.json), but this config makes it quantized as nf4 in "
        "blocks of 64 inputs (lora.base_dtype='nf4', lora.tile_size unset); give "
        "--config.lora.base_dtype=nf4 --config.lora.tile_size=0, the base the adapters belong to"
    )
    with pytest.raises(ValueError, match="trained on its base float .* makes it quantized as"):
        lora.check_quantization_kept(lora.LoraConfig(), lora.LoraConfig(base_dtype="int8"), "")
    same = [
        (lora.LoraConfig(base_dtype="nf4", tile_size=64), lora.LoraConfig(base_dtype="nf4")),
        (lora.LoraConfig(base_dtype="int8"), lora.LoraConfig(base_dtype="int8", tile_size=0)),
        (lora.LoraConfig(tile_size=0), lora.LoraConfig(tile_size=32)),  # no quantization
        (None, lora.LoraConfig(base_dtype="nf4")),  # not a LoRA run before: other checks'
    ]
    for trained, now in same:
        lora.check_quantization_kept(trained, now, "W/config.json")


def test_eager_bfloat16_attention_finds_every_kernel():
    """Outside jit, on kernels cast to bfloat16 and reshaped (key and value of one shape),
    where Qwix's own lookup finds none of them: each gets its adapters, and the maths holds."""
    attention = tnn.MultiHeadAttention(
        tnn.AttentionConfig(num_heads=4, num_kv_heads=2), dtype=jnp.bfloat16
    )
    lora_attention = lora.apply_lora(attention, lora.LoraConfig(rank=2, alpha=4.0, targets=".*"))
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    params = lora_attention.init(jax.random.key(1), x)["params"]
    assert sorted(k for k in params if lora.is_adapter((k,))) == sorted(
        k + s for k in KERNELS for s in lora.ADAPTER_SUFFIXES
    )
    params = with_random_lora_b(params)
    y = lora_attention.apply({"params": params}, x)
    assert y.dtype == jnp.bfloat16
    # The maths: the merged model's output computed in float32. bfloat16 rounding (of the base
    # matmul and of the adapters' (x A) B, added in bfloat16) stays under 0.1 (0.03 with jax
    # 0.10, 0.08 with jax 0.12, whose eager path rounds more), while an adapter left out moves
    # the output by more than 0.2: the check tells the two apart.
    f32 = dataclasses.replace(attention, dtype=jnp.float32)
    expected = f32.apply({"params": lora.merge(params, CONFIG)}, x)
    np.testing.assert_allclose(y.astype(np.float32), expected, atol=0.1)
    for kernel in KERNELS:
        without = dict(params, **{kernel + "_lora_b": jnp.zeros_like(params[kernel + "_lora_b"])})
        moved = f32.apply({"params": lora.merge(without, CONFIG)}, x) - expected
        assert float(jnp.abs(moved).max()) > 0.2, kernel


def test_convolution_kernels():
    class Convolution(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.Conv(8, (3, 3))(x))

    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3))
    config = lora.LoraConfig(rank=2, alpha=4.0, targets=r"Conv_0/kernel")
    model = lora.apply_lora(Convolution(), config)
    params = model.init(jax.random.key(1), x)["params"]
    assert params["Conv_0"]["kernel_lora_a"].shape == (3, 3, 3, 2)  # [I, J, C, r]
    assert params["Conv_0"]["kernel_lora_b"].shape == (2, 8)  # [r, D]
    assert set(params["Dense_0"]) == {"kernel", "bias"}
    params = with_random_lora_b(params)
    expected = Convolution().apply({"params": lora.merge(params, config)}, x)
    np.testing.assert_allclose(model.apply({"params": params}, x), expected, atol=1e-5)


class _GatedLinear(nn.Module):
    """A kernel multiplied by an einsum and one used elementwise (no matmul Qwix intercepts)."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.ones, (x.shape[-1], 3))
        gate = self.param("gate_kernel", nn.initializers.ones, (3,))
        x, kernel, gate = nn.dtypes.promote_dtype(x, kernel, gate, dtype=None)
        return jnp.einsum("bd,de->be", x, kernel) * gate


def test_a_target_kernel_no_matmul_multiplies_is_refused_by_name():
    """A targeted kernel that the model reads but no intercepted matmul multiplies would get no
    adapters: refused at init, named; the einsum's kernel alone is adapted."""
    x = jnp.ones((2, 4))
    model = lora.apply_lora(_GatedLinear(), lora.LoraConfig(rank=2, targets=".*kernel"))
    with pytest.raises(
        ValueError, match=r"targets='\.\*kernel' matches gate_kernel: kernel\(s\) the model reads"
    ):
        model.init(jax.random.key(0), x)
    model = lora.apply_lora(_GatedLinear(), lora.LoraConfig(rank=2, targets="kernel"))
    params = model.init(jax.random.key(0), x)["params"]
    assert sorted(params) == ["gate_kernel", "kernel", "kernel_lora_a", "kernel_lora_b"]
