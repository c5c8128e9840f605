"""The mixture-of-experts FFN (tfjax.nn.MoeMlp, tfjax.ops.moe) against a float64 reference that
computes every expert on every token (no sorting, no grouped matmul): routing, dispatch,
combine, both auxiliary losses, their gradients; no token dropped; expert parallelism on 8
CPU devices equal to one device."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax import sharding
from tfjax.models import decoder
from tfjax.nn import moe
from tfjax.ops.config import MlpConfig, MoeConfig

CASES = {  # (config, [B, T, D]): each option of the router, the experts and the shared experts
    "softmax-swiglu": (MoeConfig(4, 2, 8), (2, 5, 6)),
    "sigmoid-top1-biases-shared": (
        MoeConfig(
            5,
            1,
            8,
            activation="gelu",
            use_bias=True,
            router_score="sigmoid",
            renormalize=False,
            router_bias=True,
            shared_dim=6,
        ),
        (3, 4, 6),
    ),
    "gpt-oss-all-experts-shared-gate": (
        MoeConfig(
            4,
            4,
            8,
            activation="swiglu_clamped",
            swiglu_alpha=1.5,  # not GPT-OSS's 1.702 and 7.0: the config's values are used
            swiglu_limit=3.0,
            use_bias=True,
            renormalize=False,
            router_bias=True,
            shared_dim=8,
            shared_gate=True,
        ),
        (2, 3, 6),
    ),
}
WEIGHTS = dict(load_balance_weight=0.3, router_z_weight=0.07)


def erf(xp, x):
    return jax.scipy.special.erf(x) if xp is jnp else np.vectorize(math.erf)(x)


def activation(xp, c: MoeConfig, x, up=None):
    silu = x / (1 + xp.exp(-x))
    gelu = 0.5 * x * (1 + erf(xp, x / math.sqrt(2)))
    if c.activation == "swiglu_clamped":
        limit = c.swiglu_limit
        gate, up = xp.minimum(x, limit), xp.clip(up, -limit, limit)
        return (up + 1) * gate / (1 + xp.exp(-c.swiglu_alpha * gate))
    act = {"swiglu": silu, "gelu": gelu}[c.activation]
    return act if up is None else act * up


def mlp(xp, p, x, c: MoeConfig, gated, bias):
    """Dense MLP of x [..., D] with the kernels p["wi_0"], ... of one expert (or the shared),
    the activation of config `c`."""

    def proj(h, key):
        k = p[key]
        return h @ k["kernel"] + (k["bias"] if bias else 0)

    if gated:
        h = activation(xp, c, proj(x, "wi_0"), proj(x, "wi_1"))
    else:
        h = activation(xp, c, proj(x, "wi"))
    return proj(h, "wo")


def reference(xp, params, x, c: MoeConfig):
    """(y [B, T, D], load-balance loss, router z-loss) by the formulas, every expert computed
    on every token and the outputs combined by a [N, E] matrix of the chosen weights; xp is
    numpy (float64 forward) or jax.numpy (its gradients)."""
    b, t, d = x.shape
    xs = x.reshape(b * t, d)
    logits = xs @ params["router"]["kernel"]
    if c.router_bias:
        logits = logits + params["router"]["bias"]
    if c.router_score == "softmax":
        e = xp.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + xp.exp(-logits))
    if xp is np:
        chosen = np.argsort(-scores, axis=-1, kind="stable")[:, : c.top_k]
    else:
        chosen = jax.lax.top_k(jax.lax.stop_gradient(scores), c.top_k)[1]
    weights = xp.take_along_axis(scores, chosen, axis=-1)
    if c.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    one_hot = (chosen[..., None] == np.arange(c.num_experts)).astype(xs.dtype)  # [N, k, E]
    combine = (one_hot * weights[..., None]).sum(1)  # [N, E]
    experts = params["experts"]
    out = 0
    for e in range(c.num_experts):
        per_expert = {
            k: {"kernel": experts[k][e], "bias": experts.get(f"{k}_bias", [0] * (e + 1))[e]}
            for k in ("wi_0", "wi_1", "wi", "wo")
            if k in experts
        }
        y = mlp(xp, per_expert, xs, c, c.gated, c.use_bias)
        out = out + combine[:, e : e + 1] * y
    if c.shared_dim:
        s = mlp(xp, params["shared"], xs, c, c.gated, c.use_bias)
        if c.shared_gate:
            s = s / (1 + xp.exp(-(xs @ params["shared_gate"]["kernel"])))
        out = out + s
    fraction = one_hot.sum((0, 1)) / xs.shape[0]
    probs = scores / scores.sum(-1, keepdims=True)
    load_balance = c.num_experts * (fraction * probs.mean(0)).sum()
    top = logits.max(-1)
    log_z = top + xp.log(xp.exp(logits - top[:, None]).sum(-1))
    return out.reshape(b, t, d), load_balance, (log_z**2).mean()


def random_params(module, x, seed=1, scale=0.7):
    """Every parameter random (biases too, which init to zeros), of the shapes init gives."""
    shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(scale * rng.normal(size=a.shape), a.dtype), shapes)


def apply(module, params, x):
    """(y, {"load_balance", "router_z", "loss"}) of the module, its losses as written."""
    y, state = module.apply({"params": params}, x, mutable=[moe.AUX_LOSSES])
    return y, {k: v[0] for k, v in state[moe.AUX_LOSSES].items()}


@pytest.mark.parametrize("case", CASES)
def test_moe_matches_the_float64_reference_with_its_gradients(case):
    config, shape = CASES[case]
    config = MoeConfig(**{**config.__dict__, **WEIGHTS})
    with jax.enable_x64(True):
        module = moe.MoeMlp(config, param_dtype=jnp.float64)
        x = jax.random.normal(jax.random.key(2), shape, jnp.float64)
        params = random_params(module, x, scale=2.0 if "gpt-oss" in case else 0.7)
        y, losses = jax.jit(lambda p, x: apply(module, p, x))(params, x)
        want, load_balance, router_z = reference(
            np, jax.tree.map(np.asarray, params), np.asarray(x), config
        )
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        assert float(losses["load_balance"]) == pytest.approx(load_balance, rel=1e-12)
        assert float(losses["router_z"]) == pytest.approx(router_z, rel=1e-12)
        weighted = WEIGHTS["load_balance_weight"] * load_balance
        weighted += WEIGHTS["router_z_weight"] * router_z
        assert float(losses["loss"]) == pytest.approx(weighted, rel=1e-12)
        if config.activation == "swiglu_clamped":  # the clamps were reached
            gate = x.reshape(-1, shape[-1]) @ params["experts"]["wi_0"][0]
            assert (gate > config.swiglu_limit).any()

        # Gradients of a loss through the output and both auxiliary losses, of every parameter
        # and of the input, against the reference's (autodiff of einsums, no sort or gather).
        r = jax.random.normal(jax.random.key(3), shape, jnp.float64)

        def objective(params, x):
            y, losses = apply(module, params, x)
            return jnp.sum(y * r) + losses["loss"]

        def objective_reference(params, x):
            y, load_balance, router_z = reference(jnp, params, x, config)
            aux = WEIGHTS["load_balance_weight"] * load_balance
            return jnp.sum(y * r) + aux + WEIGHTS["router_z_weight"] * router_z

        got = jax.jit(jax.grad(objective, argnums=(0, 1)))(params, x)
        expected = jax.jit(jax.grad(objective_reference, argnums=(0, 1)))(params, x)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), got, expected
        )


def imbalanced(params):
    """The router sends every token to experts 0 and 1 (8x their fair share of 8 experts)."""
    router = dict(params["router"], kernel=jnp.zeros_like(params["router"]["kernel"]))
    router["bias"] = jnp.zeros_like(router["bias"]).at[0].set(5.0).at[1].set(4.0)
    return dict(params, router=router)


def test_no_token_is_dropped_when_all_go_to_one_expert():
    """Dropless: every token's pair with an overloaded expert is computed (a capacity of 1.25
    times the fair share, 2.5 rows of expert 0 here, would drop 17 of 20 tokens)."""
    config = MoeConfig(8, 2, 8, router_bias=True)
    module = moe.MoeMlp(config)
    x = jax.random.normal(jax.random.key(2), (4, 5, 6))
    params = imbalanced(random_params(module, x))
    y, losses = jax.jit(lambda p, x: apply(module, p, x))(params, x)
    want, load_balance, _ = reference(np, jax.tree.map(np.asarray, params), np.asarray(x), config)
    per_token = np.abs(np.asarray(y) - want).max(-1) <= 1e-5 * np.abs(want).max(-1)
    computed = np.abs(np.asarray(y)).max(-1) > 0
    assert int((per_token & computed).sum()) == 20  # every token counted
    assert float(losses["load_balance"]) == pytest.approx(load_balance, rel=1e-5)
    assert load_balance > 7.0  # E * (1 * P_0 + 1 * P_1) with P_0 + P_1 near 1: 8 at worst


def test_expert_parallel_equals_one_device():
    """On 8 CPU devices, data parallel over 2, the experts on the fsdp axis (2 shards of 4
    experts), their F over tensor (2): outputs and gradients (through the losses too) equal one
    device's; also when the router sends every token to the experts of one shard, and for 3
    tokens, fewer than the devices (decoding), which the compiler partitions. No expert kernel
    is ever gathered whole: the tokens travel, the experts stay. The other rules give the same
    numbers: the experts whole with their D over fsdp (FSDP: gathered per layer), and split over
    (fsdp, tensor), where tensor does not split the tokens (outputs summed over it)."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    config = MoeConfig(8, 2, 16, use_bias=True, router_bias=True, shared_dim=8, **WEIGHTS)
    module = moe.MoeMlp(config)
    x = jax.random.normal(jax.random.key(2), (8, 6, 12))
    params = random_params(module, x)
    r = jax.random.normal(jax.random.key(3), x.shape)
    abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), x))["params"]
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def objective(params, x, r):
        y, losses = apply(module, params, x)
        return jnp.sum(y * r) + losses["loss"], y

    def step_on_mesh(rules):
        """The jitted step under `rules` and the parameters' shardings."""

        def on_mesh(params, x, r):
            with sharding.logical_context(mesh, rules):
                return jax.value_and_grad(objective, has_aux=True)(params, x, r)

        return jax.jit(on_mesh), sharding.logical_shardings(abstract, mesh, rules)

    def check(step, shardings, p, inputs, name):
        (want_loss, want_y), want_grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(
            p, *inputs
        )
        placed = [jax.device_put(a, rows) if a.shape[0] % 8 == 0 else a for a in inputs]
        (loss, y), grad = step(jax.device_put(p, shardings), *placed)
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5, err_msg=name)
        # a sum of 576 products whose rounding differs by reduction order (tensor-split F)
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-4), name
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)

    step, shardings = step_on_mesh(sharding.expert_parallel(sharding.DEFAULT_RULES, "fsdp"))
    assert shardings["experts"]["wo"].spec == P("fsdp", "tensor", None)
    compiled = step.lower(jax.device_put(params, shardings), x, r).compile().as_text()
    whole = "f32[8,12,16]"  # an expert kernel [E, D, F] gathered whole
    assert not [line for line in compiled.splitlines() if "all-gather" in line and whole in line]
    assert "reduce-scatter" in compiled  # the tokens' outputs go back to their devices
    check(step, shardings, params, (x, r), "balanced")
    check(step, shardings, imbalanced(params), (x, r), "to one shard")
    check(step, shardings, params, (x[:1, :3], r[:1, :3]), "3 tokens")

    for rules, spec in [
        (sharding.DEFAULT_RULES, P(None, "fsdp", "tensor")),
        (
            sharding.expert_parallel(sharding.DEFAULT_RULES, ("fsdp", "tensor")),
            P(("fsdp", "tensor"), None, None),
        ),
    ]:
        step, shardings = step_on_mesh(rules)
        assert shardings["experts"]["wi_0"].spec == spec
        check(step, shardings, params, (x, r), str(spec))


def test_active_parameters_count_top_k_of_the_experts():
    module = moe.MoeMlp(MoeConfig(8, 2, 16, use_bias=True, router_bias=True, shared_dim=4))
    params = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.ones((1, 2, 12))))
    router, shared = 12 * 8 + 8, 3 * (12 * 4 + 4) - 4 + 12  # wi_0, wi_1 [12, 4], wo [4, 12]
    experts = 8 * (2 * (12 * 16 + 16) + 16 * 12 + 12)
    assert moe.active_parameters(params["params"], 2, 8) == router + shared + experts * 2 / 8


def test_swiglu_gain_and_clamp_are_refused_for_other_activations():
    """swiglu_alpha / swiglu_limit set with an activation that has none are errors naming both
    fields, as are values that are not positive numbers."""
    with pytest.raises(ValueError, match=r"MoeConfig: swiglu_alpha=1.702, swiglu_limit=5.0 "):
        MoeConfig(4, 2, 8, activation="swiglu", swiglu_limit=5.0)
    with pytest.raises(ValueError, match=r"apply to activation='swiglu_clamped', not 'gelu'"):
        MlpConfig(8, "gelu", swiglu_alpha=1.0)
    with pytest.raises(ValueError, match=r"MoeConfig: swiglu_limit must be a positive number"):
        MoeConfig(4, 2, 8, activation="swiglu_clamped", swiglu_limit=0.0)
    with pytest.raises(ValueError, match=r"Decoder.swiglu_alpha"):
        decoder.Model(variant="moe-tiny", vocab_size=8, swiglu_alpha=-1.0)
