"""The FFN activations by name.

ACTIVATIONS act on one projection, act(x W1); GATED_ACTIVATIONS combine two, the gate x W0 and
x W1, into the hidden activations: act(x W0) * x W1 (Shazeer, 2020), or GPT-OSS's clamped form,
whose gain and clamp a layer's config may set (`by_name`).
"""

import functools

import jax
import jax.numpy as jnp


def gelu(x):
    """Exact (erf) GELU, x * Phi(x), written as PyTorch writes it: 0.5 * x * (1 + erf(x / sqrt 2)).

    The same function as jax.nn.gelu(approximate=False), which writes the normal CDF through
    erfc: Phi(x) = (1 + erf(x / sqrt 2)) / 2 = erfc(-x / sqrt 2) / 2. The two forms round
    differently, by at most 5e-7 for standard-normal inputs (their step times: README, "What
    changed the CPU step").
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(2**-0.5, x.dtype)))


def softcap(x, cap: float):
    """cap * tanh(x / cap): x squashed smoothly into (-cap, cap) (Gemma 2's soft cap on the
    attention and output logits)."""
    return cap * jnp.tanh(x / cap)


def quick_gelu(x):
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU (Hendrycks and Gimpel, 2016) that
    CLIP was trained with; a different function from gelu, not a faster form of it."""
    return x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x)


def gelu_tanh(x):
    """GELU's tanh approximation (GPT-2; Gemma's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": jax.nn.silu,  # a.k.a. swish (Marian / Opus-MT)
    "quick_gelu": quick_gelu,  # CLIP
}


def _glu(act):
    """The gated linear unit of `act`: (gate, up) -> act(gate) * up."""
    return lambda gate, up: act(gate) * up


SWIGLU_ALPHA = 1.702  # swiglu_clamped's sigmoid gain (GPT-OSS's swiglu_alpha)
SWIGLU_LIMIT = 7.0  # swiglu_clamped's clamp (GPT-OSS's swiglu_limit)


def swiglu_clamped(gate, up, *, alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT):
    """GPT-OSS's gated unit: the gate clamped to at most `limit` and the other projection to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(jnp.asarray(alpha, gate.dtype) * gate)


GATED_ACTIVATIONS = {  # (gate, up) -> the hidden activations
    "swiglu": _glu(jax.nn.silu),
    "geglu": _glu(gelu),
    "geglu_tanh": _glu(gelu_tanh),  # Gemma's gelu_pytorch_tanh gate
    "swiglu_clamped": swiglu_clamped,  # GPT-OSS
}
ALL_ACTIVATIONS = (*ACTIVATIONS, *GATED_ACTIVATIONS)


def by_name(name: str, *, swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT):
    """The activation `name` as a function: of one projection (ACTIVATIONS) or of (gate, up)
    (GATED_ACTIVATIONS), swiglu_clamped with the given gain and clamp."""
    if name == "swiglu_clamped":
        return functools.partial(swiglu_clamped, alpha=swiglu_alpha, limit=swiglu_limit)
    return ACTIVATIONS[name] if name in ACTIVATIONS else GATED_ACTIVATIONS[name]
