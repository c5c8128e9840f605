"""Position-wise feed-forward networks, configured by an MlpConfig.

Letters: B batch, T length, D model width, F mlp width.
Mlp:      wo(act(wi(x)))              relu (Vaswani et al.), gelu (BERT, ViT), gelu_tanh (GPT-2),
                                      silu (Marian), quick_gelu (CLIP)
GatedMlp: wo(act(wi_0(x)) * wi_1(x))  swiglu (Llama), geglu (Shazeer, 2020), geglu_tanh (Gemma);
                                      swiglu_clamped (GPT-OSS) clamps both first
The activations: tfjax.ops.activations.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax.nn import axes
from tfjax.ops.activations import (  # noqa: F401 (re-exported)
    ACTIVATIONS,
    ALL_ACTIVATIONS,
    GATED_ACTIVATIONS,
    gelu,
    quick_gelu,
)
from tfjax.ops.config import (
    MlpConfig,
    default_kernel_init,  # noqa: F401 (re-exported)
)


def dense(features, names, *, name, use_bias, kernel_init, dtype, param_dtype, **dense_kwargs):
    """nn.Dense whose kernel [in, out] and bias [out] carry the logical axis `names`;
    `dense_kwargs` go to nn.Dense (a vocabulary head's `dot_general`: tfjax.ops.head)."""
    return nn.Dense(
        features,
        **dense_kwargs,
        use_bias=use_bias,
        kernel_init=nn.with_logical_partitioning(kernel_init, names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
    )


class Mlp(nn.Module):
    """Two projections with an activation between: max(0, x W1 + b1) W2 + b2 for relu."""

    config: MlpConfig  # the width, activation (one of `activations`), dropout and biases
    kernel_init: Callable = default_kernel_init  # every projection
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype
    activations = ACTIVATIONS  # what config.activation may name

    def __post_init__(self):
        if self.config.activation not in self.activations:
            raise ValueError(
                f"{type(self).__name__}: activation={self.config.activation!r} is unknown; "
                f"allowed: {tuple(self.activations)} (make_mlp picks Mlp or GatedMlp by it)"
            )
        super().__post_init__()

    def _dense(self, features, names, name):
        return dense(
            features,
            names,
            name=name,
            use_bias=self.config.use_bias,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )

    def _hidden(self, x):
        """[B, T, D] -> [B, T, F]: the activated projection."""
        return self.config.activation_fn()(
            self._dense(self.config.hidden_dim, (axes.EMBED, axes.MLP), "wi")(x)
        )

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        """x: [B, T, D] -> [B, T, D]."""
        # [B, T, F]
        h = nn.with_logical_constraint(self._hidden(x), (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        h = nn.Dropout(self.config.dropout_rate)(h, deterministic=not train)
        # [B, T, D]
        return self._dense(x.shape[-1], (axes.MLP, axes.EMBED), "wo")(h)


class GatedMlp(Mlp):
    """Gated linear unit FFN: (act(x W_0) * x W_1) W_o (Shazeer, 2020)."""

    activations = GATED_ACTIVATIONS

    def _hidden(self, x):
        """[B, T, D] -> [B, T, F]: the gate's activation times the second projection."""
        f, names = self.config.hidden_dim, (axes.EMBED, axes.MLP)
        gate, up = self._dense(f, names, "wi_0")(x), self._dense(f, names, "wi_1")(x)
        return self.config.activation_fn()(gate, up)


def make_mlp(config: MlpConfig, **kwargs) -> nn.Module:
    """Mlp or GatedMlp, chosen by the config's activation; `kwargs`: the module's others."""
    return (GatedMlp if config.gated else Mlp)(config, **kwargs)
