"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's
linear layers) and the short causal convolution before it, in JAX alone.

Letters: B batch, T length, N heads (the value heads; the state's), K query/key heads (K divides
N: each serves N/K consecutive value heads, as transformers' repeat_interleave), Hk and Hv the
key and value head dims, W the convolution's width, C its channels, c the chunk length.

Each head keeps a state S [Hk, Hv]. Token t decays it by a_t = exp(g_t) (g <= 0), replaces the
part of it that key k_t reads by the value v_t at rate beta_t, and reads it with its query:

  S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t.

The form a layer calls: q and k arrive as the layer projected and convolved them; by default
(`normalize_qk=True`) the op L2-normalises both in float32, x / sqrt(|x|^2 + 1e-6), as FLA's
kernels and transformers' `use_qk_l2norm_in_kernel=True` (what Qwen3.5 passes) do, then scales
q by `scale` (1/sqrt(Hk) when None). The maths runs in float32 (float64 inputs: float64); the
output has q's dtype, the final state the compute dtype.

Two forms compute the same: `gated_delta_rule_recurrent`, a scan over tokens (the reference,
and single-token decoding), and `gated_delta_rule_chunked`, a scan over chunks of c tokens that
is parallel within a chunk (the WY / UT transform of the DeltaNet papers). Write
gamma_t = a_1 ... a_t within a chunk that the state S_0 enters. Unrolled, S_t = gamma_t S_0 +
sum_{j<=t} (gamma_t / gamma_j) k_j u_j^T, where the "new values" u solve the unit
lower-triangular system

  u_t + beta_t sum_{j<t} (gamma_t / gamma_j) (k_t . k_j) u_j = beta_t (v_t - gamma_t S_0^T k_t),

so u = U - W S_0 with U, W [c, Hv], [c, Hk] from one triangular inverse that needs no S_0, and
o_t = gamma_t S_0^T q_t + sum_{j<=t} (gamma_t / gamma_j) (q_t . k_j) u_j. Everything but the
last two products of u and S_0 is computed for all chunks at once, outside the scan.

Segments (`segment_ids` [B, T], as tfjax.ops.masks: 1..n for the examples packed in a row, 0
for padding): the state restarts from zero at the first token of each segment, except the
row's first segment, which starts from `initial_state` (zero when None); padding neither reads
nor writes the state (its outputs are zero), so a segment continues across it and a
right-padded row's final state is its last token's. The convolution follows the same rule.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

L2_EPS = 1e-6  # FLA's and transformers' l2norm: x / sqrt(|x|^2 + eps)
IMPLEMENTATIONS = ("chunked", "recurrent")
DEFAULT_CHUNK_SIZE = 64


def segment_starts(segment_ids):
    """(valid, starts), both [B, T] bool: valid is False on padding (id 0); starts is True at
    a segment's first token, except the row's first segment's (which `initial_state` and the
    convolution's state enter). Padding between two tokens of one id does not start a segment."""
    valid = segment_ids != 0
    positions = jnp.arange(segment_ids.shape[1])
    # The last valid position at or before each token; -1 where none is.
    last = lax.cummax(jnp.where(valid, positions, -1), axis=1)
    before = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    before_id = jnp.take_along_axis(segment_ids, jnp.maximum(before, 0), axis=1)
    return valid, valid & (before >= 0) & (segment_ids != before_id)


def _l2_normalize(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepare(q, k, v, g, beta, initial_state, segment_ids, normalize_qk, scale):
    """Checks the shapes; returns the float inputs with K heads repeated to N, normalised and
    scaled, padding's g and beta zeroed, and (valid, starts) or None, and the initial state."""
    if q.ndim != 4:
        raise ValueError(f"q: shape {q.shape}, want [B, T, K, Hk]")
    b, t, kh, hk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: shape {k.shape}, want q's {q.shape}")
    if v.ndim != 4 or v.shape[:2] != (b, t) or v.shape[2] % kh:
        raise ValueError(f"v: shape {v.shape}, want [{b}, {t}, N, Hv] with {kh} dividing N")
    n, hv = v.shape[2:]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, n):
            raise ValueError(f"{name}: shape {x.shape}, want [B, T, N] = {(b, t, n)}")
    if initial_state is not None and initial_state.shape != (b, n, hk, hv):
        raise ValueError(
            f"initial_state: shape {initial_state.shape}, want [B, N, Hk, Hv] = {(b, n, hk, hv)}"
        )
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids: shape {segment_ids.shape}, want [B, T] = {(b, t)}")
    dtype = jnp.promote_types(jnp.result_type(q, k, v, g, beta), jnp.float32)
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    if normalize_qk:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * (hk**-0.5 if scale is None else scale)
    if kh != n:
        q, k = jnp.repeat(q, n // kh, axis=2), jnp.repeat(k, n // kh, axis=2)
    segments = None
    if segment_ids is not None:
        segments = segment_starts(segment_ids)
        g = jnp.where(segments[0][..., None], g, 0.0)
        beta = jnp.where(segments[0][..., None], beta, 0.0)
    state = (
        jnp.zeros((b, n, hk, hv), dtype) if initial_state is None else initial_state.astype(dtype)
    )
    return q, k, v, g, beta, segments, state


def _finish(out, segments, dtype):
    """[B, T, N, Hv] outputs with padding's zeroed, in `dtype`."""
    if segments is not None:
        out = jnp.where(segments[0][..., None, None], out, 0.0)
    return out.astype(dtype)


def gated_delta_rule_recurrent(
    q, k, v, g, beta, *, initial_state=None, segment_ids=None, normalize_qk=True, scale=None
):
    """The gated delta rule token by token (a lax.scan over T): the reference, and decoding.

    Args:
      q, k: [B, T, K, Hk] queries and keys (K divides N).
      v: [B, T, N, Hv] values.
      g: [B, T, N] log decays (<= 0): the state is multiplied by exp(g_t) at token t.
      beta: [B, T, N] write rates, usually in (0, 1).
      initial_state: [B, N, Hk, Hv] the state before the first token; zeros when None.
      segment_ids: [B, T] ints for packed or padded rows (see the module docstring).
      normalize_qk: L2-normalise q and k first (Qwen3.5 does); scale: q's factor, 1/sqrt(Hk)
        when None.
    Returns:
      (out [B, T, N, Hv] in q's dtype, final_state [B, N, Hk, Hv] in the compute dtype).
    """
    dtype = q.dtype
    q, k, v, g, beta, segments, state = _prepare(
        q, k, v, g, beta, initial_state, segment_ids, normalize_qk, scale
    )
    starts = jnp.zeros(g.shape[:2], bool) if segments is None else segments[1]

    def step(state, xs):
        q, k, v, g, beta, start = xs  # [B, N, H], [B, N], [B]
        state = jnp.where(start[:, None, None, None], 0.0, state)
        state = state * jnp.exp(g)[..., None, None]
        delta = beta[..., None] * (v - jnp.einsum("bnkv,bnk->bnv", state, k))
        state = state + k[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bnkv,bnk->bnv", state, q)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts)]
    state, out = lax.scan(step, state, time_major)
    return _finish(jnp.moveaxis(out, 0, 1), segments, dtype), state


def gated_delta_rule_chunked(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    segment_ids=None,
    normalize_qk=True,
    scale=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """The gated delta rule in chunks of `chunk_size` tokens: parallel within a chunk (matmuls
    and one triangular inverse), a lax.scan across chunks. Same arguments and results as
    `gated_delta_rule_recurrent`; T need not be a multiple of chunk_size (the last chunk is
    padded with g = beta = 0, which leaves the state as it is)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: {chunk_size!r}, want an int >= 1")
    dtype = q.dtype
    q, k, v, g, beta, segments, state = _prepare(
        q, k, v, g, beta, initial_state, segment_ids, normalize_qk, scale
    )
    b, t, n, _ = q.shape
    c = max(1, min(chunk_size, t))  # T = 0: one empty chunk of 1
    nc = math.ceil(t / c)
    starts = jnp.zeros((b, t), bool) if segments is None else segments[1]

    def chunks(x):
        """[B, T, N, ...] -> [nc, B, N, c, ...], zero-padded to nc * c tokens."""
        x = jnp.pad(x, [(0, 0), (0, nc * c - t)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, nc, c, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    # [nc, B, 1, c] the segment restarts within each chunk: run 0 is the one the state enters.
    run = jnp.cumsum(chunks(starts.astype(jnp.int32)[..., None]), axis=-1)
    within = _within_chunks(q, k, v, g, beta, run)
    out, state = _across_chunks(within, state)
    # [nc, B, N, c, Hv] -> [B, T, N, Hv]
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, nc * c, n, -1)[:, :t]
    return _finish(out, segments, dtype), state


def _within_chunks(q, k, v, g, beta, run):
    """What each chunk needs of the scan but its incoming state, for all chunks at once.

    Args: q, k [nc, B, N, c, Hk], v [nc, B, N, c, Hv], g, beta [nc, B, N, c], run [nc, B, 1, c].
    Returns: (U [.., c, Hv], W [.., c, Hk]) with u = U - W S_0; the queries decayed from the
    chunk's start (q gamma); the intra-chunk weights (q_t . k_j) gamma_t / gamma_j; the keys
    decayed to its end; and the decay of S_0 across the whole chunk [.., 1, 1].
    """
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # log gamma
    causal = jnp.tril(jnp.ones((c, c), bool))
    same = causal & (run[..., :, None] == run[..., None, :])
    # [.., c, c] gamma_t / gamma_j where j <= t in one segment; exp(-inf) = 0 elsewhere (also
    # where t < j, whose positive exponents could overflow).
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    from_start = jnp.exp(cum) * (run == 0)  # gamma_t where S_0 reaches t
    to_end = jnp.exp(cum[..., -1:] - cum) * (run == run[..., -1:])
    across = (jnp.exp(cum[..., -1]) * (run[..., -1] == 0))[..., None, None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    system = beta[..., :, None] * jnp.einsum("...tk,...jk->...tj", k, k) * decay * strict
    rhs = jnp.concatenate([v, k * from_start[..., None]], axis=-1) * beta[..., None]
    solved = unit_lower_inverse(system) @ rhs
    hv = v.shape[-1]
    attn = jnp.einsum("...tk,...jk->...tj", q, k) * decay
    return (
        solved[..., :hv],
        solved[..., hv:],
        q * from_start[..., None],
        attn,
        k * to_end[..., None],
        across,
    )


def unit_lower_inverse(strict):
    """(I + L)^-1 for strictly lower-triangular L [..., c, c], in log2(c) rounds of batched
    matmuls: inverses of diagonal blocks double in size from 1 x 1, as
    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]. (XLA:CPU's triangular solve took
    10 to 300 ms, erratically, for 512 systems of 64 that this inverts in 1 to 10.) c is padded
    to a power of two."""
    c = strict.shape[-1]
    size = 1 << (c - 1).bit_length()
    m = jnp.pad(strict, [(0, 0)] * (strict.ndim - 2) + [(0, size - c)] * 2)
    lead = m.shape[:-2]
    inv = jnp.ones((*lead, size, 1, 1), m.dtype)  # [.., blocks, s, s] the diagonal blocks'
    s = 1
    while s < size:
        p = size // (2 * s)
        # The p diagonal blocks of 2s x 2s [.., p, 2s, 2s]; their lower-left s x s quarter.
        blocks = jnp.diagonal(m.reshape(*lead, p, 2 * s, p, 2 * s), axis1=-4, axis2=-2)
        lower = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]
        a, d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        top = jnp.concatenate([a, jnp.zeros_like(a)], axis=-1)
        bottom = jnp.concatenate([-(d @ lower @ a), d], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :c, :c]


def _across_chunks(within, state):
    """The scan over chunks: returns (out [nc, B, N, c, Hv], final state [B, N, Hk, Hv])."""

    def step(state, xs):
        new_values, reads_state, q_decayed, attn, k_decayed, across = xs
        u = new_values - reads_state @ state
        out = q_decayed @ state + attn @ u
        state = across * state + jnp.swapaxes(k_decayed, -1, -2) @ u
        return state, out

    state, out = lax.scan(step, state, within)
    return out, state


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    segment_ids=None,
    normalize_qk=True,
    scale=None,
    implementation=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """The gated delta rule (see the module docstring), by `implementation`: "chunked",
    "recurrent", or None, which takes the chunked form for T > 1 and the recurrent one for a
    single token (decoding). Arguments and results as `gated_delta_rule_recurrent`."""
    if implementation is None:
        implementation = "chunked" if q.shape[1] > 1 else "recurrent"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: {implementation!r}, want one of {IMPLEMENTATIONS}")
    kwargs = dict(
        initial_state=initial_state,
        segment_ids=segment_ids,
        normalize_qk=normalize_qk,
        scale=scale,
    )
    if implementation == "chunked":
        return gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    return gated_delta_rule_recurrent(q, k, v, g, beta, **kwargs)


def causal_conv1d(x, kernel, *, state=None, segment_ids=None):
    """SiLU of the depthwise causal convolution of `x` (Qwen3.5 convolves its concatenated
    q, k, v projections so before the gated delta rule), and the state that continues it.

    out_t = silu(sum_j kernel[j] * x_{t + j - (W - 1)}): kernel[W - 1] weighs the token itself.
    transformers' depthwise nn.Conv1d weight [C, 1, W] is `weight[:, 0, :].T`.

    Args:
      x: [B, T, C] inputs (T = 1 or a few: decoding).
      kernel: [W, C] one filter per channel.
      state: [B, W - 1, C] the W - 1 inputs before x (a previous call's new state); zeros when
        None.
      segment_ids: [B, T] ints (see the module docstring): a token sees only earlier tokens of
        its segment (and `state` only in the row's first segment); padding is a zero input
        and gives zero outputs.
    Returns:
      (out [B, T, C], new_state [B, W - 1, C]: the last W - 1 inputs, zero before the last
      segment's start), both in x's dtype.
    """
    if x.ndim != 3:
        raise ValueError(f"x: shape {x.shape}, want [B, T, C]")
    b, t, ch = x.shape
    if kernel.ndim != 2 or kernel.shape[1] != ch:
        raise ValueError(f"kernel: shape {kernel.shape}, want [W, C] with C = {ch}")
    w = kernel.shape[0]
    if state is not None and state.shape != (b, w - 1, ch):
        raise ValueError(f"state: shape {state.shape}, want [B, W - 1, C] = {(b, w - 1, ch)}")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids: shape {segment_ids.shape}, want [B, T] = {(b, t)}")
    dtype = jnp.promote_types(jnp.result_type(x, kernel), jnp.float32)
    past = jnp.zeros((b, w - 1, ch), dtype) if state is None else state.astype(dtype)
    xs = jnp.concatenate([past, x.astype(dtype)], axis=1)  # [B, W - 1 + T, C]
    kernel = kernel.astype(dtype)
    if segment_ids is None:
        out = sum(kernel[j] * xs[:, j : j + t] for j in range(w))
        return jax.nn.silu(out).astype(x.dtype), xs[:, t:].astype(x.dtype)
    valid, starts = segment_starts(segment_ids)
    run = jnp.cumsum(starts, axis=1)  # the state's inputs are in run 0
    runs = jnp.pad(run, ((0, 0), (w - 1, 0)))  # [B, W - 1 + T]
    xs = xs * jnp.pad(valid, ((0, 0), (w - 1, 0)), constant_values=True)[..., None]
    out = sum(
        kernel[j] * xs[:, j : j + t] * (runs[:, j : j + t] == run)[..., None] for j in range(w)
    )
    out = jnp.where(valid[..., None], jax.nn.silu(out), 0.0)
    new_state = xs[:, t:] * (runs[:, t:] == run[:, -1:])[..., None]
    return out.astype(x.dtype), new_state.astype(x.dtype)
