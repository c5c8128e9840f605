"""Position-wise feed-forward networks.

Letters: B batch, T length, D model width, F mlp width.
Mlp:      wo(act(wi(x)))              relu (Vaswani et al.), gelu (BERT, ViT), gelu_tanh (GPT-2),
                                      silu (Marian), quick_gelu (CLIP)
GatedMlp: wo(act(wi_0(x)) * wi_1(x))  swiglu (Llama), geglu (Shazeer, 2020), geglu_tanh (Gemma)
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfjax.nn import axes


def gelu(x):
    """Exact (erf) GELU, x * Phi(x), written as PyTorch writes it: 0.5 * x * (1 + erf(x / sqrt 2)).

    The same function as jax.nn.gelu(approximate=False), which writes the normal CDF through
    erfc: Phi(x) = (1 + erf(x / sqrt 2)) / 2 = erfc(-x / sqrt 2) / 2. The two forms round
    differently, by at most 5e-7 for standard-normal inputs (their step times: README, "What
    changed the CPU step").
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(2**-0.5, x.dtype)))


def quick_gelu(x):
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU (Hendrycks and Gimpel, 2016) that
    CLIP was trained with; a different function from gelu, not a faster form of it."""
    return x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x)


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,  # a.k.a. swish (Marian / Opus-MT)
    "quick_gelu": quick_gelu,  # CLIP
}
GATED_ACTIVATIONS = {
    "swiglu": jax.nn.silu,
    "geglu": gelu,
    "geglu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # Gemma's gelu_pytorch_tanh gate
}
ALL_ACTIVATIONS = (*ACTIVATIONS, *GATED_ACTIVATIONS)

default_kernel_init = nn.initializers.xavier_uniform()


def dense(features, names, *, name, use_bias, kernel_init, dtype, param_dtype):
    """nn.Dense whose kernel [in, out] and bias [out] carry the logical axis `names`."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        kernel_init=nn.with_logical_partitioning(kernel_init, names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
    )


class Mlp(nn.Module):
    """Two projections with an activation between: max(0, x W1 + b1) W2 + b2 for relu."""

    mlp_dim: int  # F
    activation: str = "relu"  # "relu", "gelu" (exact erf), "gelu_tanh", "silu" or "quick_gelu"
    dropout_rate: float = 0.0  # on the hidden activations; 0 in Vaswani et al.
    use_bias: bool = True  # biases on both projections
    kernel_init: Callable = default_kernel_init  # both projections
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"Mlp: activation={self.activation!r} is unknown; allowed: {tuple(ACTIVATIONS)} "
                f"(gated: {tuple(GATED_ACTIVATIONS)} with GatedMlp)"
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        """x: [B, T, D] -> [B, T, D]."""
        kw = dict(
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        # [B, T, F]
        h = ACTIVATIONS[self.activation](
            dense(self.mlp_dim, (axes.EMBED, axes.MLP), name="wi", **kw)(x)
        )
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
        # [B, T, D]
        return dense(x.shape[-1], (axes.MLP, axes.EMBED), name="wo", **kw)(h)


class GatedMlp(nn.Module):
    """Gated linear unit FFN: (act(x W_0) * x W_1) W_o (Shazeer, 2020)."""

    mlp_dim: int  # F
    activation: str = "swiglu"  # "swiglu", "geglu" or "geglu_tanh"
    dropout_rate: float = 0.0  # on the hidden activations
    use_bias: bool = False  # Llama has none
    kernel_init: Callable = default_kernel_init  # all three projections
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        if self.activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"GatedMlp: activation={self.activation!r} is unknown; allowed: "
                f"{tuple(GATED_ACTIVATIONS)}"
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        """x: [B, T, D] -> [B, T, D]."""
        kw = dict(
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        # [B, T, F]
        gate = dense(self.mlp_dim, (axes.EMBED, axes.MLP), name="wi_0", **kw)(x)
        up = dense(self.mlp_dim, (axes.EMBED, axes.MLP), name="wi_1", **kw)(x)
        h = GATED_ACTIVATIONS[self.activation](gate) * up
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
        # [B, T, D]
        return dense(x.shape[-1], (axes.MLP, axes.EMBED), name="wo", **kw)(h)


def make_mlp(activation: str, **kwargs) -> nn.Module:
    """Mlp or GatedMlp, chosen by the activation's name."""
    if activation in GATED_ACTIVATIONS:
        return GatedMlp(activation=activation, **kwargs)
    return Mlp(activation=activation, **kwargs)
