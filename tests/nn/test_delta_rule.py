"""tfjax.ops.delta_rule: the gated delta rule's chunked form against its recurrent form and
against transformers' Qwen3.5 references; segments, padding, decoding; the causal convolution."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from tfjax.ops import delta_rule as dr

recurrent = jax.jit(dr.gated_delta_rule_recurrent, static_argnames=("normalize_qk", "scale"))
chunked = jax.jit(
    dr.gated_delta_rule_chunked, static_argnames=("normalize_qk", "scale", "chunk_size")
)
entry = jax.jit(dr.gated_delta_rule, static_argnames=("implementation", "chunk_size"))
conv = jax.jit(dr.causal_conv1d)


def inputs(b=2, t=13, kh=2, n=4, hk=8, hv=6, seed=0, dtype=np.float32):
    """q, k, v, g (<= 0), beta (in (0, 1)) and an initial state, as numpy arrays."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, kh, hk)) for _ in range(2))
    v = rng.standard_normal((b, t, n, hv))
    g = -np.abs(rng.standard_normal((b, t, n)))
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, n))))
    state = rng.standard_normal((b, n, hk, hv))
    return [x.astype(dtype) for x in (q, k, v, g, beta, state)]


def close(got, want, tol=1e-5):
    """Max |got - want| relative to max |want| within tol."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("chunk_size", [4, 5, 64])  # divides T = 12, does not, longer than T
def test_chunked_equals_recurrent(chunk_size):
    q, k, v, g, beta, s0 = inputs(t=12)
    for state in (None, s0):
        want = recurrent(q, k, v, g, beta, initial_state=state)
        got = chunked(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
        close(got[0], want[0])
        close(got[1], want[1])


@pytest.mark.parametrize(
    ("chunk_size", "segment_ids"), [(3, None), (4, None), (3, [[1, 1, 1, 2, 2, 0, 3, 3]])]
)
def test_gradients_of_both_forms_agree(chunk_size, segment_ids):
    q, k, v, g, beta, s0 = inputs(t=8, b=1, seed=1)
    rng = np.random.default_rng(2)
    cot_out = rng.standard_normal(v.shape).astype(np.float32)
    cot_state = rng.standard_normal(s0.shape).astype(np.float32)
    ids = None if segment_ids is None else np.array(segment_ids)

    def loss(fn, *args):
        out, state = fn(*args[:5], initial_state=args[5], segment_ids=ids)
        return jnp.sum(out * cot_out) + jnp.sum(state * cot_state)

    args = (q, k, v, g, beta, s0)
    want = jax.grad(functools.partial(loss, recurrent), argnums=range(6))(*args)
    chunk = functools.partial(chunked, chunk_size=chunk_size)
    got = jax.grad(functools.partial(loss, chunk), argnums=range(6))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want, strict=True):
        assert np.all(np.isfinite(a)), name
        close(a, b)


@pytest.mark.parametrize("c", [1, 5, 16])  # powers of two and not
def test_unit_lower_inverse(c):
    strict = np.tril(np.random.default_rng(c).standard_normal((2, 3, c, c)), -1)
    with jax.enable_x64(True):
        got = jax.jit(dr.unit_lower_inverse)(jnp.asarray(strict))
    close(got, np.linalg.inv(np.eye(c) + strict), tol=1e-12)


@pytest.mark.parametrize("normalize_qk", [True, False])
def test_both_forms_match_transformers_in_float64(normalize_qk):
    # Grouped heads (K = 2 serve N = 4), an initial state, a length no chunk divides.
    q, k, v, g, beta, s0 = inputs(t=11, seed=3, dtype=np.float64)
    if not normalize_qk:  # keys of norm <= 1 keep the unnormalised rule stable
        q, k = q / 4, k / 4
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta, s0)]
    kw = dict(initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=normalize_qk)
    references = (
        hf.torch_recurrent_gated_delta_rule(*t[:5], **kw),
        hf.torch_chunk_gated_delta_rule(*t[:5], chunk_size=4, **kw),
    )
    with jax.enable_x64(True):
        args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
        ours = (
            dr.gated_delta_rule_recurrent(*args, initial_state=s0, normalize_qk=normalize_qk),
            dr.gated_delta_rule_chunked(
                *args, initial_state=s0, normalize_qk=normalize_qk, chunk_size=4
            ),
        )
        assert ours[0][0].dtype == ours[1][1].dtype == jnp.float64
    for want in references:
        for got in ours:
            close(got[0], want[0].numpy())
            close(got[1], want[1].numpy())


def test_padding_leaves_the_state_and_outputs_zero():
    # Right padding: outputs there are zero, the final state is the last real token's; the
    # chunked form pads its last chunk the same way (T = 10 in chunks of 4).
    q, k, v, g, beta, _ = inputs(b=1, t=10, seed=4)
    ids = np.array([[1] * 7 + [0] * 3])
    prefix = recurrent(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7])
    for fn in (recurrent, functools.partial(chunked, chunk_size=4)):
        out, state = fn(q, k, v, g, beta, segment_ids=ids)
        assert not np.any(np.asarray(out[:, 7:]))
        close(out[:, :7], prefix[0])
        close(state, prefix[1])
    # Unmarked, the padded tokens would have changed the state.
    assert np.abs(np.asarray(recurrent(q, k, v, g, beta)[1] - prefix[1])).max() > 1e-3


@pytest.mark.parametrize("chunk_size", [3, 16])
def test_packed_segments_restart_the_state(chunk_size):
    # Segments 1, 2, 3 with padding between 2 and 3 and at the end; starts fall mid-chunk.
    ids = np.array([[1, 1, 1, 1, 2, 2, 0, 0, 3, 3, 3, 3, 3, 0], [1] * 5 + [2] * 9])
    q, k, v, g, beta, s0 = inputs(t=14, seed=5)
    for state in (None, s0):
        want_out = np.zeros(v.shape, np.float32)
        want_state = np.zeros(s0.shape, np.float32)
        for row in range(2):
            for seg in np.unique(ids[row][ids[row] > 0]):
                cols = np.flatnonzero(ids[row] == seg)
                first = state is not None and seg == 1
                out, last = recurrent(
                    *(x[row : row + 1, cols] for x in (q, k, v, g, beta)),
                    initial_state=state[row : row + 1] if first else None,
                )
                want_out[row, cols] = out[0]
                want_state[row] = last[0]  # the row's last segment's
        for fn in (recurrent, functools.partial(chunked, chunk_size=chunk_size)):
            out, last = fn(q, k, v, g, beta, initial_state=state, segment_ids=ids)
            close(out, want_out)
            close(last, want_state)


def test_chunked_prefill_then_token_by_token_decoding():
    q, k, v, g, beta, _ = inputs(t=12, seed=6)
    full, full_state = entry(q, k, v, g, beta, chunk_size=4)
    _, state = entry(*(x[:, :7] for x in (q, k, v, g, beta)), chunk_size=4)
    outs = []
    for t in range(7, 12):  # T = 1: the recurrent form
        out, state = entry(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=state)
        outs.append(out)
    close(jnp.concatenate(outs, 1), full[:, 7:])
    close(state, full_state)


@pytest.mark.parametrize(
    ("name", "shapes"),
    [
        ("q", dict(q=(2, 5, 8))),
        ("k", dict(k=(2, 5, 2, 7))),
        ("v", dict(v=(2, 5, 3, 6))),
        ("g", dict(g=(2, 5, 2))),
        ("beta", dict(beta=(2, 4, 4))),
        ("initial_state", dict(initial_state=(2, 4, 6, 8))),
        ("segment_ids", dict(segment_ids=(2, 4))),
    ],
)
def test_wrong_shapes_name_the_argument(name, shapes):
    full = dict(q=(2, 5, 2, 8), k=(2, 5, 2, 8), v=(2, 5, 4, 6), g=(2, 5, 4), beta=(2, 5, 4))
    full = {**full, **shapes}
    args = {a: jnp.zeros(s) for a, s in full.items()}
    with pytest.raises(ValueError, match=f"^{name}: shape"):
        dr.gated_delta_rule(**args)
    with pytest.raises(ValueError, match="^implementation: 'splash'"):
        dr.gated_delta_rule(*inputs()[:5], implementation="splash")
    with pytest.raises(ValueError, match="^chunk_size: 0"):
        dr.gated_delta_rule(*inputs()[:5], chunk_size=0)


def test_the_ops_make_transformers_gated_deltanet_layer():
    """Qwen3.5's linear-attention layer from its parameters: projections (numpy), the
    convolution and the rule from tfjax.ops (q, k as convolved: the op normalises and scales),
    the gated RMSNorm and the output projection (numpy)."""
    kh, n, hk, hv, d = 2, 4, 8, 6, 16
    config = Qwen3_5TextConfig(
        hidden_size=d,
        linear_num_key_heads=kh,
        linear_num_value_heads=n,
        linear_key_head_dim=hk,
        linear_value_head_dim=hv,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        layer.norm.weight.normal_()
        x = torch.randn(2, 11, d)
        want = layer(x).numpy()
    p = {name: w.detach().numpy() for name, w in layer.named_parameters()}
    x = x.numpy()
    b, t = x.shape[:2]
    mixed, _ = dr.causal_conv1d(x @ p["in_proj_qkv.weight"].T, p["conv1d.weight"][:, 0, :].T)
    q, k, v = np.split(np.asarray(mixed), [kh * hk, 2 * kh * hk], axis=-1)
    q, k, v = q.reshape(b, t, kh, hk), k.reshape(b, t, kh, hk), v.reshape(b, t, n, hv)
    beta = 1 / (1 + np.exp(-x @ p["in_proj_b.weight"].T))
    g = -np.exp(p["A_log"]) * np.logaddexp(0, x @ p["in_proj_a.weight"].T + p["dt_bias"])
    out, _ = entry(q, k, v, g, beta, chunk_size=4)
    out = np.asarray(out)
    z = (x @ p["in_proj_z.weight"].T).reshape(b, t, n, hv)
    out = out / np.sqrt(np.mean(out**2, -1, keepdims=True) + config.rms_norm_eps)
    out = out * p["norm.weight"] * z / (1 + np.exp(-z))
    close(out.reshape(b, t, n * hv) @ p["out_proj.weight"].T, want, tol=1e-5)


def conv_case(b=2, t=9, c=5, w=4, seed=7):
    rng = np.random.default_rng(seed)
    conv1d = torch.nn.Conv1d(c, c, w, groups=c, padding=w - 1, bias=False)
    with torch.no_grad():
        conv1d.weight.copy_(torch.from_numpy(rng.standard_normal((c, 1, w)).astype(np.float32)))
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    return conv1d, x, conv1d.weight.detach().numpy()[:, 0, :].T  # kernel [W, C]


def test_causal_conv1d_matches_transformers_module_and_decodes_step_by_step():
    conv1d, x, kernel = conv_case()
    xt = torch.from_numpy(x).transpose(1, 2)
    with torch.no_grad():
        want = torch.nn.functional.silu(conv1d(xt)[..., : x.shape[1]]).transpose(1, 2).numpy()
        also = hf.causal_conv1d_fn(xt, conv1d.weight.squeeze(1), activation="silu")
    close(also.transpose(1, 2).numpy(), want)
    out, state = conv(x, kernel)
    close(out, want)
    np.testing.assert_array_equal(state, x[:, -3:])
    # Decoding: a prefix, then one token at a time, then two, carrying the state; transformers'
    # single-token update agrees on each step.
    out, state = conv(x[:, :4], kernel)
    outs, hf_state = [out], torch.from_numpy(np.array(state)).transpose(1, 2).contiguous()
    for t in range(4, 7):
        out, state = conv(x[:, t : t + 1], kernel, state=state)
        with torch.no_grad():
            hf_out = hf.causal_conv1d_update(
                xt[..., t : t + 1], hf_state, conv1d.weight.squeeze(1), activation="silu"
            )
        close(out, hf_out.transpose(1, 2).numpy())
        outs.append(out)
    out, state = conv(x[:, 7:], kernel, state=state)
    close(jnp.concatenate([*outs, out], 1), want)
    np.testing.assert_array_equal(state, x[:, -3:])


def test_causal_conv1d_keeps_segments_apart():
    _, x, kernel = conv_case(b=1, t=10)
    ids = np.array([[1, 1, 1, 1, 1, 2, 2, 0, 2, 0]])
    out, state = conv(x, kernel, segment_ids=ids)
    first, _ = conv(x[:, :5], kernel)
    # Segment 2 alone; its padding at column 7 is a zero input.
    second, _ = conv(x[:, 5:9] * np.array([1, 1, 0, 1])[None, :, None], kernel)
    close(out[:, :5], first)
    close(out[:, [5, 6, 8]], second[:, [0, 1, 3]])
    assert not np.any(np.asarray(out[:, [7, 9]]))
    # The state: the last W - 1 inputs, padding zeroed, none from before segment 2's start.
    np.testing.assert_array_equal(state, x[:, 7:] * np.array([0, 1, 0])[None, :, None])
    with pytest.raises(ValueError, match="^kernel: shape"):
        dr.causal_conv1d(x, kernel[:, :3])
    with pytest.raises(ValueError, match="^state: shape"):
        dr.causal_conv1d(x, kernel, state=jnp.zeros((1, 4, 5)))
