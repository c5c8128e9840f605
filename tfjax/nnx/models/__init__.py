"""The model families as Flax NNX modules, one file per family as in tfjax.models (decoder,
encoder, transformer, vit).

Each NNX family model is built from its family's spec (tfjax.specs.<family>, its `spec`),
which holds, checks and translates the fields, or from a Linen model of the family, whose
fields and methods are its spec's; so one place builds the NNX model of any spec or Linen
family model, and one loads a Linen `params` tree into it:

    from tfjax.specs import decoder
    from tfjax.nnx import models
    model = models.from_spec(decoder.Model("gpt2-small", vocab_size=50257), rngs=nnx.Rngs(0))
    models.load_params(model, params)  # a Linen model's (or checkpoint's) params
"""

import importlib

import flax.linen as nn
from flax import nnx

# A family spec's (and its Linen model's) class name -> the module here that has its NNX model.
FAMILIES = {
    "Decoder": "decoder",
    "Encoder": "encoder",
    "Transformer": "transformer",
    "VisionTransformer": "vit",
}


def from_spec(spec, *example_args, rngs: nnx.Rngs, **options) -> nnx.Module:
    """The NNX model of the family spec `spec` (tfjax.specs), or of an (unbound) Linen family
    model's same family and fields.

    `options`: what the NNX model needs besides (a ViT's image_size and channels), or
    `example_args`, inputs as the model will take them (arrays or their shapes and dtypes), from
    which a family that sizes parameters by its inputs reads those options (a ViT's images), as
    Linen's `init` does."""
    name = type(spec).__name__
    if name not in FAMILIES:
        raise NotImplementedError(
            f"tfjax.nnx has no NNX model for {name} yet; it has: {', '.join(sorted(FAMILIES))}"
        )
    family = importlib.import_module(f"{__name__}.{FAMILIES[name]}")
    if example_args and hasattr(family, "input_sizes"):
        options = family.input_sizes(*example_args) | options
    return getattr(family, name)(spec, rngs=rngs, **options)


def family_spec(spec):
    """The family spec (tfjax.specs) of `spec`: itself, or a Linen family model's `.spec` (the
    dataclass its fields come from). The NNX models hold the spec, whose methods they call."""
    return getattr(spec, "spec", spec)


def load_params(model: nnx.Module, params) -> None:
    """Puts a Linen model's `params` tree (the same layout; boxed with logical names, as `init`
    returns it, or not) into the NNX `model`, in place."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, nn.meta.unbox(params))
    nnx.update(model, state)


from_linen = from_spec  # its name when the NNX models were built from Linen models only
