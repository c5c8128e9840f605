"""The model side of generation: a step function mapping the tokens at one position to
next-token logits.

With `use_cache=True` each step feeds one token through the model's KV cache: the explicit cache
of tfjax's models (`model.init_cache`, a pytree the loop carries), or the "cache" collection of a
model without one (`use_cache="collection"` takes the collection always; both give the same
tokens); `use_cache=False` recomputes the whole prefix every step (the reference the tests
compare against, and the benchmark's baseline).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax


def is_encoder_decoder(model) -> bool:
    """A transformer (source -> target: `encode`, then `decode`), not a decoder."""
    return hasattr(model, "encode")


class Stepper:
    """Wraps a model into init_state(batch) and step(state, tokens [B, T], i) -> logits.

    With the cache the state is the model's explicit KV cache (a model with `init_cache`, unless
    use_cache="collection") or its "cache" collection; without it the state is unused and
    `step` reruns the model on the whole buffer (given as `buffer`) and reads position i.
    """

    def __init__(self, model, params, length, use_cache, inputs=None, encoded=None):
        self.model, self.params, self.length, self.use_cache = model, params, length, use_cache
        explicit = use_cache and use_cache != "collection"
        self.explicit = explicit and hasattr(model, "init_cache")
        self.enc_dec = is_encoder_decoder(model)
        self.inputs = inputs  # [B, S] source ids (encoder-decoder only)
        self.encoded = encoded  # [B, S, D] encoder output, computed once
        if self.enc_dec and encoded is None:
            self.encoded = model.apply({"params": params}, inputs, method="encode")

    def repeat(self, k):
        """The same stepper for K beams per row (source and encoder output repeated)."""
        if not self.enc_dec:
            return self
        rep = functools.partial(jnp.repeat, repeats=k, axis=0)
        return Stepper(
            self.model,
            self.params,
            self.length,
            self.use_cache,
            rep(self.inputs),
            rep(self.encoded),
        )

    def _call(self, variables, tokens, decode, **kwargs):
        if self.enc_dec:
            args, kwargs = (self.encoded, self.inputs, tokens), dict(kwargs, method="decode")
        else:
            args = (tokens,)
        return self.model.apply(variables, *args, decode=decode, **kwargs)

    def init_state(self, batch):
        if not self.use_cache:
            return jnp.zeros((), jnp.int32)
        if self.explicit:
            return self.model.init_cache(batch, self.length)
        tokens = jnp.zeros((batch, self.length), jnp.int32)
        shapes = jax.eval_shape(
            lambda: self._call({"params": self.params}, tokens, True, mutable=["cache"])[1]
        )
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def prefill(self, state, tokens):
        """Feeds a prompt's first tokens [B, T] into the cache (nothing to do without one)."""
        if not self.use_cache or tokens.shape[1] == 0:
            return state
        return self.step(state, tokens, 0, None)[1]

    def step(self, state, tokens, i, buffer):
        """Logits [B, T, V] for `tokens` at positions i.. (cached) or for buffer[:, i]."""
        if self.explicit:
            (logits, _), state = self._call({"params": self.params}, tokens, True, cache=state)
            return logits, state
        if self.use_cache:
            (logits, _), mut = self._call(
                {"params": self.params, "cache": state}, tokens, True, mutable=["cache"]
            )
            return logits, mut["cache"]
        logits, _ = self._call({"params": self.params}, buffer, False)
        return lax.dynamic_slice_in_dim(logits, i, tokens.shape[1], axis=1), state

    def batch_axis(self, path) -> int:
        """The batch axis of the state's leaf at `path`: 1 behind a scanned stack's layer axis
        (the explicit cache's leaves, the collection's under "layers"), else 0."""
        if not getattr(self.model, "scan_layers", False):
            return 0
        return 1 if self.explicit or any(getattr(p, "key", None) == "layers" for p in path) else 0
