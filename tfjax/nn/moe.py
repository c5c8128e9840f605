"""The mixture-of-experts FFN (a MoeConfig): a router, stacked expert MLPs, shared experts.

Letters: B batch, T length, N = B T tokens, D model width, F expert width, E experts.

    mlp = MoeMlp(MoeConfig(num_experts=8, top_k=2, hidden_dim=F))
    y = mlp.apply(variables, x)                                       # [B, T, D] -> [B, T, D]
    y, state = mlp.apply(variables, x, mutable=[AUX_LOSSES])          # and its losses

Parameters: "router" (kernel [D, E], bias [E] with router_bias), with score_bias
"router_score_bias" [E] (float32, not trained: DeepSeek-V3's correction), "experts" ("wi_0", "wi_1"
[E, D, F] for gated activations, else "wi"; "wo" [E, F, D]; with use_bias "<name>_bias"
[E, F] / [E, D]), and with shared experts "shared" (a tfjax.nn Mlp / GatedMlp) and
"shared_gate" (kernel [D, 1]). The expert kernels' leading axis is named `experts`: the
sharding rules split it over a mesh axis for expert parallelism (tfjax.ops.moe: how the tokens
travel to their experts).

Each call that may write the AUX_LOSSES collection (`mutable=[AUX_LOSSES]`, as the runner's
train step does) stores the layer's "load_balance" and "router_z" losses (tfjax.ops.moe; means
over the N tokens) and "loss", their weighted sum by the config's weights, which the runner
adds to the task's loss (tfjax.runner.steps). Decoding and evaluation compute neither.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfjax.nn import axes
from tfjax.nn.ffn import default_kernel_init, dense, make_mlp
from tfjax.ops import moe
from tfjax.ops.config import MoeConfig
from tfjax.ops.moe import (  # noqa: F401 (re-exported: the names both module systems use)
    AUX_LOSSES,
    EXPERTS,
    expert_names,
    expert_sharding,
    stacked_init,
)


class Experts(nn.Module):
    """E expert MLPs, stacked: tokens with their routes -> the weighted sum of their experts."""

    config: MoeConfig
    kernel_init: Callable = default_kernel_init  # of one expert's kernel
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    @nn.compact
    def __call__(self, x, weights, experts):
        """x [N, D], weights [N, k], experts [N, k] -> [N, D]."""
        c, d = self.config, x.shape[-1]
        names = expert_names(c)
        shapes = {"wo": (c.num_experts, c.hidden_dim, d)}
        kernels, biases = {}, {}
        for name in ("wi_0", "wi_1") if c.gated else ("wi",):
            shapes[name] = (c.num_experts, d, c.hidden_dim)
        for name in (*shapes,):
            init = nn.with_logical_partitioning(stacked_init(self.kernel_init), names[name])
            kernels[name] = self.param(name, init, shapes[name], self.param_dtype)
            if c.use_bias:
                bias_names = names[f"{name}_bias"]
                zeros = nn.with_logical_partitioning(nn.initializers.zeros, bias_names)
                shape = (c.num_experts, shapes[name][-1])
                biases[name] = self.param(f"{name}_bias", zeros, shape, self.param_dtype)
        dtype = self.dtype or x.dtype
        return moe.sharded_experts_ffn(
            x.astype(dtype),
            weights,
            experts,
            kernels,
            biases or None,
            activation=c.activation_fn(),
            num_experts=c.num_experts,
            weigh_inputs=c.weigh_inputs,
            sharding=expert_sharding(names),
        )


class MoeMlp(nn.Module):
    """A mixture-of-experts FFN: router, experts (dropless), optional shared experts."""

    config: MoeConfig  # what it computes
    kernel_init: Callable = default_kernel_init  # the router's, each expert's, the shared ones'
    dtype: Any = None  # compute dtype of the experts; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        """x: [B, T, D] -> [B, T, D]; `train` is accepted as Mlp's (no dropout here)."""
        c = self.config
        b, t, d = x.shape
        # [N, D]
        tokens = x.reshape(b * t, d)
        # The router in float32 or wider (ST-MoE's selective precision: a bfloat16 router
        # routes unstably); [N, E]
        router_dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        logits = dense(
            c.num_experts,
            (axes.EMBED, None),
            name="router",
            use_bias=c.router_bias,
            kernel_init=self.kernel_init,
            dtype=router_dtype,
            param_dtype=self.param_dtype,
        )(tokens.astype(router_dtype))
        score_bias = None
        if c.score_bias:  # not trained: route stops its gradient
            init = nn.with_logical_partitioning(nn.initializers.zeros, (axes.ROUTER,))
            score_bias = self.param("router_score_bias", init, (c.num_experts,), jnp.float32)
        weights, experts, scores = moe.route(
            logits, c.top_k, score_bias=score_bias, **c.route_options()
        )
        if self.is_mutable_collection(AUX_LOSSES):
            for name, value in moe.aux_losses(logits, scores, experts, c).items():
                self.sow(AUX_LOSSES, name, value)
        kwargs = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        y = Experts(c, self.kernel_init, **kwargs, name=EXPERTS)(tokens, weights, experts)
        y = y.reshape(b, t, d)
        if c.shared_dim:
            shared = make_mlp(c.shared(), kernel_init=self.kernel_init, **kwargs, name="shared")
            s = shared(x, train=train)
            if c.shared_gate:
                gate = dense(
                    1,
                    (axes.EMBED, None),
                    name="shared_gate",
                    use_bias=False,
                    kernel_init=self.kernel_init,
                    **kwargs,
                )(x)
                s = jax.nn.sigmoid(gate) * s
            y = y + s.astype(y.dtype)
        return y


def active_parameters(params, top_k: int, num_experts: int) -> float:
    """The parameters one token uses: every one, but of the expert kernels and biases (those
    below an "experts" module) top_k / num_experts."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = {getattr(k, "key", None) for k in path}
        share = top_k / num_experts if EXPERTS in keys else 1.0
        total += share * int(np.prod(np.shape(leaf)))
    return total
