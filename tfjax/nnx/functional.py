"""An NNX family model behind Linen's functional API (`init` / `apply`), so that the runner's
steps, its ahead-of-time compiles and `tfjax.decode` run an NNX model on the code path they
run a Linen model on, with the same parameter trees and checkpoints:

    from tfjax.specs import decoder
    from tfjax.nnx.functional import Functional
    model = Functional(decoder.Model("tiny", vocab_size=256))  # the NNX decoder, as a function
    params = model.init(key, tokens)["params"]                  # Linen's tree and names
    logits, aux = model.apply({"params": params}, tokens)       # computed by the NNX model

`apply` is pure: each call merges the NNX model's structure (its graphdef, made once,
abstractly) with the given parameters and calls it, so it traces inside the caller's `jax.jit`
(split and merge inside one jit, not `nnx.jit`'s graph walk per call). `init` makes the NNX
model under the key and returns its parameters as Linen's `init` does: the same tree, shapes,
dtypes and logical-axis boxes (nn.LogicallyPartitioned), with values of its own drawing.
Fields and the explicit cache (`vocab_size`, `scan_layers`, `init_cache`, ...) are read off
`spec`: the family spec (tfjax.specs) or Linen model it was made of.

`split(model)` turns an NNX model (`tfjax.nnx.models`) into (Functional, params), as
`tfjax.decode.generate` does with one it is given.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.nnx import blocks, models
from tfjax.ops.moe import AUX_LOSSES

# What `apply(mutable=...)` may ask for: the auxiliary losses the layers sow (tfjax.nnx.blocks
# AuxLoss). Linen's other collections have no NNX counterpart here: the KV cache is explicit
# (`cache=`), and NNX layers sow no intermediates.
MUTABLE = (AUX_LOSSES,)


class Functional:
    """The NNX model of the family spec `spec` (tfjax.specs, or an unbound Linen family model),
    as `init` and `apply`; `example_args` / `options` size what the fields do not (a ViT's
    images: see tfjax.nnx.models.from_linen). Equal (and hashing equal) when the specs and the
    NNX models' structures are: a static argument of jitted functions. `adapt(model, rngs)`:
    the NNX model as it runs, from the one made of `spec` (e.g. with tfjax.lora's adapters:
    `init` makes them, `apply` runs them); a function, so tfjax.nnx needs no tfjax.lora."""

    def __init__(self, spec, *example_args, adapt=None, **options):
        def build(rngs):
            model = models.from_linen(spec, *example_args, rngs=rngs, **options)
            return model if adapt is None else adapt(model, rngs)

        # The structure only: nnx.eval_shape makes no parameter.
        self._set(spec, nnx.eval_shape(lambda: build(nnx.Rngs(0))), build)

    def _set(self, spec, abstract_model, build):
        self.spec = spec
        self._build = build  # rngs -> the NNX model
        self._graphdef, self._params, self._rest = nnx.split(abstract_model, nnx.Param, ...)

    @classmethod
    def of(cls, model: nnx.Module) -> Functional:
        """The Functional of an NNX family model (its structure; `init` makes another of its
        spec and options, a ViT's image size)."""
        if type(model).__name__ not in models.FAMILIES or not hasattr(model, "spec"):
            raise TypeError(
                f"{type(model).__name__} is not a tfjax.nnx.models family model (one built from "
                "a family spec, its .spec)"
            )
        spec, options = model.spec, dict(getattr(model, "options", {}))

        def build(rngs):
            return models.from_spec(spec, rngs=rngs, **options)

        fn = cls.__new__(cls)
        fn._set(spec, nnx.eval_shape(lambda: model), build)
        return fn

    def __eq__(self, other):  # by the family spec: a Linen model's equals its dataclass's
        return (
            type(other) is type(self)
            and models.family_spec(other.spec) == models.family_spec(self.spec)
            and other._graphdef == self._graphdef
        )

    def __hash__(self):
        return hash((type(self), models.family_spec(self.spec), self._graphdef))

    def __repr__(self):
        return f"Functional({self.spec!r})"

    def __getattr__(self, name):
        # Called for what the class lacks: the Linen model's fields and its own methods
        # (init_cache). Linen's machinery (bind, clone, init_with_output, ...) would run the
        # Linen model, not this one: refused.
        if name.startswith("_") or hasattr(nn.Module, name):
            raise AttributeError(
                f"Functional has no {name!r}: it runs the NNX model through init and apply; "
                "its family spec is its .spec"
            )
        return getattr(self.spec, name)

    def init(self, rngs, *args, **kwargs):
        """Linen's `init`, by the NNX model: {"params": the parameters of the NNX model made
        under `rngs` (a key, or {"params": key, ...})}, each boxed with its logical axis names
        (nn.LogicallyPartitioned), as Linen's init gives the same tree. `args` and `kwargs`
        (Linen's example inputs) are not read: the spec and the options given when this was
        made size the model."""
        del args, kwargs
        key = rngs["params"] if isinstance(rngs, dict) else rngs
        return {"params": boxed_params(self._build(nnx.Rngs(key)))}

    def model(self, params) -> nnx.Module:
        """The NNX model holding `params` (a Linen params tree, boxed or not); inside a trace,
        the NNX model of traced parameters."""
        state = jax.tree.map(lambda v: v, self._params)  # a copy: filled in place below
        nnx.replace_by_pure_dict(state, nn.meta.unbox(params))
        # The model's own RNG streams: placeholders, never drawn from (a training call must
        # pass `rngs`, see apply).
        rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._rest)
        return nnx.merge(self._graphdef, state, rest)

    def apply(self, variables, *args, method=None, mutable=False, rngs=None, **kwargs):
        """Linen's `apply`, computed by the NNX model: `variables` {"params": ...}; `method` a
        name (or a Linen method, by its name) of the NNX model, its call by default; `rngs`
        {"dropout": key} (or a key) for a training call; `mutable` only the auxiliary losses
        (then (out, {"aux_losses": ...}), {} when no layer sowed any). `decode` is the Linen
        flag of the KV cache: the explicit one (`cache=`) only."""
        extra = sorted(set(variables) - {"params"})
        if extra:
            raise ValueError(
                f"variables hold {extra}; the NNX model takes only 'params' (its KV cache is "
                "explicit: cache=model.init_cache(...))"
            )
        collections = _collections(mutable)
        if kwargs.pop("decode", False) and kwargs.get("cache") is None:
            raise ValueError(
                "decode=True without cache=: the NNX model has no 'cache' collection; pass the "
                "explicit cache (cache=model.init_cache(batch, length))"
            )
        if kwargs.get("train") and rngs is None:
            raise ValueError(
                "a training call (train=True) needs rngs={'dropout': key}: the NNX model's "
                "dropout keys come from it"
            )
        model = self.model(variables["params"])
        name = method if isinstance(method, str) or method is None else method.__name__
        fn = model if name in (None, "__call__") else getattr(model, name)
        if rngs is not None and "rngs" in inspect.signature(fn).parameters:
            kwargs["rngs"] = nnx.Rngs(**rngs) if isinstance(rngs, dict) else nnx.Rngs(rngs)
        out = fn(*args, **kwargs)
        if not collections:
            return out
        sown = nnx.to_pure_dict(nnx.pop(model, blocks.AuxLoss))
        return out, ({AUX_LOSSES: sown} if sown else {})


def _collections(mutable) -> tuple:
    """Linen's `mutable` (False, a name, a list of names, True) as a tuple of collections,
    refused unless MUTABLE allows each."""
    if mutable is False or mutable is None:
        return ()
    names = (mutable,) if isinstance(mutable, str) else mutable
    if names is True or any(n not in MUTABLE for n in names):
        raise ValueError(
            f"mutable={mutable!r}: an NNX model's apply can return only {MUTABLE} (its KV "
            "cache is explicit, cache=; it sows no intermediates)"
        )
    return tuple(names)


def boxed_params(model: nnx.Module) -> dict:
    """The nnx.Param state of `model` as Linen's params tree: each parameter with logical axis
    names (its `out_sharding`, tfjax.nnx.blocks.metadata) boxed in nn.LogicallyPartitioned."""
    tree = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        names = variable.get_metadata().get("out_sharding")
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value if names is None else nn.LogicallyPartitioned(value, tuple(names))
    return tree


def split(model: nnx.Module) -> tuple[Functional, dict]:
    """(Functional, params) of an NNX family model (tfjax.nnx.models): its function and its
    parameters as the Linen params tree (plain arrays)."""
    return Functional.of(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
