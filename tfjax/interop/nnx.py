"""Converted checkpoints as Flax NNX models (tfjax.nnx), and NNX models back to what
`interop.export` writes: a tfjax.nnx family model is its `spec` (a family spec or a Linen model)
holding the Linen params tree as its nnx.Param state.

    model = interop.as_nnx(linen_model, params)     # what interop.load(..., nnx=True) gives
    spec, params = linen_of(model, None)            # what interop.save(model, directory) writes
"""

import flax
import jax
import numpy as np
from flax import nnx

from tfjax.interop.core.posemb import image_size_pair
from tfjax.models import common
from tfjax.nnx import models as nnx_models


def as_nnx(model, params, *example_args, rngs: nnx.Rngs | None = None):
    """The Flax NNX model (tfjax.nnx) of the Linen `model` (its `spec`) holding `params` (that
    model's params tree, boxed or not), built without drawing its parameters at random: its
    layout comes from `nnx.eval_shape`, and only its non-parameter state (RNG streams, from
    `rngs`, nnx.Rngs(0) when None) is computed. Any family `tfjax.nnx.models.FAMILIES` has;
    `example_args`: inputs as the model will take them, for a family that is sized by its
    inputs (a ViT's images, [B, H, W, C] arrays or shapes; else its default size)."""
    rngs = nnx.Rngs(0) if rngs is None else rngs

    def build(rngs):
        return nnx_models.from_linen(model, *example_args, rngs=rngs)

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, layout, _ = nnx.split(abstract, nnx.Param, ...)

    # The parameter initialisers are traced but not run: XLA drops what is not returned.
    @nnx.jit
    def rest(rngs):
        return nnx.state(build(rngs), nnx.Not(nnx.Param))

    def describe(x):
        return "none" if x is None else f"{x.dtype}{list(x.shape)}"

    example_hint = not example_args and hasattr(abstract, "num_patches")  # a ViT's size
    want = flax.traverse_util.flatten_dict(nnx.to_pure_dict(layout), sep="/")
    got = flax.traverse_util.flatten_dict(flax.linen.meta.unbox(params), sep="/")
    for path in sorted(want.keys() | got.keys()):
        w, g = want.get(path), got.get(path)
        if w is None or g is None or (w.shape, w.dtype) != (g.shape, g.dtype):
            raise ValueError(
                f"as_nnx: params[{path!r}] is {describe(g)}; the NNX {type(abstract).__name__} "
                f"has {describe(w)}"
                + (" (pass example images of the checkpoint's size)" if example_hint else "")
            )
    out = nnx.merge(graphdef, layout, rest(rngs))
    nnx_models.load_params(out, params)
    return out


def example_images(model, config, overrides) -> tuple:
    """A vision tower's example images (their shape, [1, H, W, C]) at the size its params are
    for (image_size= when resampled, else the checkpoint's), which size its NNX model; () for
    any other model."""
    if type(model).__name__ != "VisionTransformer":
        return ()
    vision = config.get("vision_config", config)
    height, width = image_size_pair(overrides.get("image_size") or vision.get("image_size", 224))
    channels = vision.get("num_channels", 3)
    return (jax.ShapeDtypeStruct((1, height, width, channels), np.float32),)


def linen_of(model, params):
    """(Linen model, params) of the arguments of export/save: an NNX model gives its `spec`
    and its nnx.Param state (the Linen params tree); its `spec` (a family spec or a Linen model)
    as the Linen model."""
    if not isinstance(model, nnx.Module):
        if params is None:
            raise TypeError(f"a Linen {type(model).__name__} needs its params")
        return model, params
    if params is not None:
        raise TypeError(f"an NNX {type(model).__name__} holds its params; pass none")
    if nnx.state(model, nnx.LoRAParam):
        raise ValueError(
            f"the NNX {type(model).__name__} holds LoRA adapters (nnx.LoRAParam); export the "
            "merged params: lora.merge(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config) "
            "with the model's `spec`"
        )
    spec = getattr(model, "spec", None)
    if type(spec).__name__ not in nnx_models.FAMILIES:
        raise TypeError(
            f"{type(model).__name__} is not a tfjax.nnx family model (no family `spec`: one of "
            f"{', '.join(sorted(nnx_models.FAMILIES))})"
        )
    return common.linen_of(spec), nnx.to_pure_dict(nnx.state(model, nnx.Param))
