"""Gated DeltaNet linear attention (tfjax.ops.linear_attention, its NNX and Linen modules, the
weight conversion in tfjax.interop.core.linear_attention): against transformers' Qwen3.5 layer,
Linen against NNX, decoding through the RecurrentState, packed rows; the gated attention's
output gate and partial RoPE against transformers' Qwen3.5 attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from tfjax.interop.core import linear_attention as convert
from tfjax.nn.linear_attention import GatedDeltaNet as LinenGatedDeltaNet
from tfjax.nnx.linear_attention import GatedDeltaNet
from tfjax.ops import axes
from tfjax.ops import linear_attention as la
from tfjax.ops.attention import dot_product_attention

D = 16
CONFIG = la.LinearAttentionConfig(
    num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=4
)


def close(got, want, tol=1e-5):
    """Max |got - want| relative to max |want| within tol."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-30)


def transformers_layer(seed=0):
    """transformers' Qwen3.5 linear-attention layer of CONFIG's sizes, random weights (its
    norm's scale too, which starts at ones)."""
    config = Qwen3_5TextConfig(
        hidden_size=D,
        linear_num_key_heads=CONFIG.num_key_heads,
        linear_num_value_heads=CONFIG.num_value_heads,
        linear_key_head_dim=CONFIG.key_head_dim,
        linear_value_head_dim=CONFIG.value_head_dim,
        linear_conv_kernel_dim=CONFIG.conv_kernel_size,
        rms_norm_eps=CONFIG.norm_eps,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(seed)
    layer = hf.Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.norm.weight.normal_()
    return layer


def nnx_layer(params, config=CONFIG):
    """The NNX module with `params` {name: array} put in."""
    model = GatedDeltaNet(config, D, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, {k: jnp.asarray(v) for k, v in params.items()})
    nnx.update(model, state)
    return model


@nnx.jit
def call(model, x, segment_ids=None, cache=None):
    """The NNX module's call, compiled (eagerly, its scans compile op by op)."""
    return model(x, segment_ids=segment_ids, cache=cache)


@jax.jit
def linen_call(params, x, segment_ids=None, cache=None):
    lm = LinenGatedDeltaNet(CONFIG)
    return lm.apply({"params": params}, x, segment_ids=segment_ids, cache=cache)


def linen_params(seed=0):
    lm = LinenGatedDeltaNet(CONFIG)
    return lm, jax.jit(lm.init)(jax.random.key(seed), jnp.zeros((1, 3, D)))["params"]


def rows(b=2, t=11, seed=1):
    return np.random.default_rng(seed).standard_normal((b, t, D)).astype(np.float32)


@pytest.mark.parametrize("implementation", [None, "recurrent"])
def test_modules_match_transformers_layer(implementation):
    layer = transformers_layer()
    x = rows()
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    state = {k: w.detach().numpy() for k, w in layer.state_dict().items()}
    params = convert.from_transformers(state, CONFIG)
    config = la.LinearAttentionConfig(**{**CONFIG.__dict__, "implementation": implementation})
    got, cache = call(nnx_layer(params, config), jnp.asarray(x))
    assert cache is None
    close(got, want)
    got, _ = jax.jit(LinenGatedDeltaNet(config).apply)({"params": params}, jnp.asarray(x))
    close(got, want)
    # Left padding: transformers zeroes the padded inputs (its attention_mask); tfjax's
    # segment_ids keep them out of the convolution and the state. The same outputs.
    mask = np.ones(x.shape[:2], np.int64)
    mask[1, :3] = 0
    with torch.no_grad():
        want = layer(torch.from_numpy(x), attention_mask=torch.from_numpy(mask)).numpy()
    got, _ = call(nnx_layer(params, config), jnp.asarray(x), segment_ids=jnp.asarray(mask))
    close(got, want)


def test_weight_conversion_round_trips_bitwise():
    state = {k: w.detach().numpy() for k, w in transformers_layer(seed=3).state_dict().items()}
    params = convert.from_transformers(state, CONFIG)
    for name, (shape, _, _) in la.parameter_shapes(CONFIG, D).items():
        assert params[name].shape == shape, name
    back = convert.to_transformers(params, CONFIG)
    assert set(back) == set(state)
    for key in state:
        assert back[key].shape == state[key].shape, key
        np.testing.assert_array_equal(back[key], state[key])
    with pytest.raises(ValueError, match="^state: keys"):
        convert.from_transformers({k: v for k, v in state.items() if k != "A_log"}, CONFIG)


def test_linen_and_nnx_share_the_tree_and_the_function():
    lm, boxed = linen_params()
    model = GatedDeltaNet(CONFIG, D, rngs=nnx.Rngs(0))
    nnx_state = nnx.state(model, nnx.Param)
    layout = {k: v.shape for k, v in flatten_dict(nn.meta.unbox(boxed)).items()}
    assert layout == {k: v.shape for k, v in flatten_dict(nnx.to_pure_dict(nnx_state)).items()}
    linen_names = flatten_dict(nn.get_partition_spec(boxed))
    nnx_names = flatten_dict(nnx.to_pure_dict(nnx.get_partition_spec(nnx_state)))
    assert nnx_names == linen_names
    known = {v for k, v in vars(axes).items() if k.isupper() and isinstance(v, str)}
    for (name,), spec in linen_names.items():
        assert len(spec) == len(layout[(name,)]), name
        assert any(spec) and set(spec) <= known | {None}, (name, spec)
    params = nn.meta.unbox(boxed)
    x = jnp.asarray(rows(seed=2))
    ids = jnp.asarray([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2])
    model = nnx_layer(params)
    for segment_ids in (None, ids):
        got, _ = call(model, x, segment_ids=segment_ids)
        want, _ = linen_call(params, x, segment_ids=segment_ids)
        close(got, want, tol=1e-6)
    # Every parameter reaches the output.
    grads = jax.jit(jax.grad(lambda p: jnp.sum(linen_call(p, x)[0] ** 2)))(params)
    for name, g in grads.items():
        assert np.abs(np.asarray(g)).max() > 0, name


def test_prefill_then_decoding_equals_the_full_pass():
    params = nn.meta.unbox(linen_params(seed=4)[1])
    model = nnx_layer(params)
    x = jnp.asarray(rows(t=12, seed=5))
    empty = la.init_recurrent_state(CONFIG, 2)
    full, full_cache = call(model, x, cache=empty)
    assert int(full_cache.index) == 12
    outs, caches = [], [empty]
    for lo, hi in ((0, 8), (8, 9), (9, 10), (10, 12)):  # prefill, then 1, 1, 2 tokens
        out, cache = call(model, x[:, lo:hi], cache=caches[-1])
        outs.append(out)
        caches.append(cache)
    close(jnp.concatenate(outs, axis=1), full)
    close(cache.state, full_cache.state)
    close(cache.conv, full_cache.conv)
    assert int(cache.index) == 12
    # Linen decodes the same from the NNX module's state.
    out, linen_cache = linen_call(params, x[:, 10:], cache=caches[3])
    close(out, full[:, 10:])
    close(linen_cache.state, full_cache.state)
    assert int(linen_cache.index) == 12


def test_packed_segments_equal_separate_rows():
    model = nnx_layer(nn.meta.unbox(linen_params(seed=6)[1]))
    x = jnp.asarray(rows(b=1, t=13, seed=7))
    # Three segments of 4 tokens, padding between the second and third.
    ids = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 0, 3, 3, 3, 3]])
    cols = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [9, 10, 11, 12]])
    out, cache = call(model, x, segment_ids=ids, cache=la.init_recurrent_state(CONFIG, 1))
    alone, alone_cache = call(model, x[0, cols], cache=la.init_recurrent_state(CONFIG, 3))
    close(out[0, cols], alone)
    close(cache.state, alone_cache.state[2:])  # the row's last segment's state
    close(cache.conv, alone_cache.conv[2:])
    assert not np.any(np.asarray(out[:, 8]))  # padding's output


def test_the_state_does_not_grow_with_the_context():
    params = nn.meta.unbox(linen_params()[1])
    empty = la.init_recurrent_state(CONFIG, 2)
    shapes = {}
    for t in (3, 4096):  # shapes only (jax.eval_shape): nothing runs
        x = jax.ShapeDtypeStruct((2, t, D), jnp.float32)
        _, cache = jax.eval_shape(lambda x: la.gated_deltanet(x, params, CONFIG, cache=empty), x)
        shapes[t] = [(a.shape, a.dtype) for a in cache]
    assert shapes[3] == shapes[4096] == [(a.shape, a.dtype) for a in empty]
    # bfloat16 compute: the output in it, the state kept in the cache's dtypes.
    half = {name: w.astype(jnp.bfloat16) for name, w in params.items()}
    x = jax.ShapeDtypeStruct((2, 5, D), jnp.bfloat16)
    y, cache = jax.eval_shape(lambda x: la.gated_deltanet(x, half, CONFIG, cache=empty), x)
    assert y.dtype == jnp.bfloat16 and [a.dtype for a in cache] == [a.dtype for a in empty]
    w, c = CONFIG.conv_kernel_size, CONFIG.conv_channels
    assert empty.conv.shape == (2, w - 1, c) and empty.state.shape == (2, 4, 8, 6)
    # A stack's: unrolled (a tuple of layers) or scanned (a leading layer axis).
    stack = la.init_recurrent_state(CONFIG, 2, num_layers=3)
    assert len(stack) == 3 and all(isinstance(s, la.RecurrentState) for s in stack)
    scanned = la.init_recurrent_state(CONFIG, 2, num_layers=3, scanned=True, dtype=jnp.bfloat16)
    assert scanned.conv.shape == (3, 2, w - 1, c) and scanned.conv.dtype == jnp.bfloat16
    assert scanned.state.shape == (3, 2, 4, 8, 6) and scanned.state.dtype == jnp.float32
    assert scanned.index.shape == (3,)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_key_heads", 0),
        ("num_value_heads", 3),
        ("key_head_dim", 2.0),
        ("conv_kernel_size", True),
        ("norm_eps", 0.0),
        ("implementation", "splash"),
        ("chunk_size", 0),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LinearAttentionConfig: {field}"):
        la.LinearAttentionConfig(**{**CONFIG.__dict__, field: value})


def test_gated_attention_pieces_match_transformers_attention():
    """Qwen3.5's gated full attention rebuilt from its parameters: the query / gate split of
    q_proj per head, the (1 + w) q and k norms, partial RoPE, tfjax.ops' attention, the gate."""
    n, kv, h = 4, 2, 8
    config = Qwen3_5TextConfig(
        hidden_size=D,
        num_attention_heads=n,
        num_key_value_heads=kv,
        head_dim=h,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(8)
    layer = hf.Qwen3_5Attention(config, 0).eval()
    rotary = hf.Qwen3_5TextRotaryEmbedding(config)
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_()
        x = torch.randn(1, 7, D)
        pos = torch.arange(7)[None]
        mask = torch.full((7, 7), -torch.inf).triu(1)[None, None]
        want, _ = layer(x, rotary(x, pos), mask)
    p = {k: w.detach().numpy() for k, w in layer.state_dict().items()}
    x = x.numpy()[0]
    query_kernel, gate_kernel = convert.gated_query_from_transformers(p["q_proj.weight"], n, h)
    back = convert.gated_query_to_transformers(query_kernel, gate_kernel)
    np.testing.assert_array_equal(back, p["q_proj.weight"])
    query, gate = (np.einsum("td,dnh->tnh", x, w) for w in (query_kernel, gate_kernel))

    def norm(y, w):
        return y / np.sqrt(np.mean(y**2, -1, keepdims=True) + config.rms_norm_eps) * (1 + w)

    q = norm(query, p["q_norm.weight"])[None]
    k = norm((x @ p["k_proj.weight"].T).reshape(7, kv, h), p["k_norm.weight"])[None]
    v = (x @ p["v_proj.weight"].T).reshape(1, 7, kv, h)
    rotary_dim = int(h * 0.25)
    q, k = (la.partial_rope(jnp.asarray(a), jnp.arange(7), rotary_dim) for a in (q, k))
    out = dot_product_attention(q, k, jnp.asarray(v), is_causal=True)
    out = la.gate_output(out, jnp.asarray(gate[None]))
    got = np.asarray(out).reshape(7, n * h) @ p["o_proj.weight"].T
    close(got[None], want.numpy())
    with pytest.raises(ValueError, match="^rotary_dim"):
        la.partial_rope(q, jnp.arange(7), 3)
    bias = np.arange(n * 2 * h, dtype=np.float32)  # the same layout as the weight's rows
    q_bias, gate_bias = convert.gated_query_from_transformers(bias, n, h)
    assert q_bias.shape == (n, h) and q_bias[1, 0] == 2 * h and gate_bias[0, 0] == h
    np.testing.assert_array_equal(convert.gated_query_to_transformers(q_bias, gate_bias), bias)
