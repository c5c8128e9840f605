"""What the vision towers share (DINOv2, CLIP, SigLIP; `tfjax.models.vit` without a
classification head): loading at another image size and saving with the image size the
position embeddings were made for.

A `Tower` is a family and where its position embeddings are. `load` resamples them to the
requested image size with the bicubic resize the Hugging Face model uses at that size
(`core.posemb`), so the model equals the reference's `interpolate_pos_encoding`, after checking
that the config's image_size gives the checkpoint's number of them; `save` writes the export's
image_size (a square size: config.json has one number, so a non-square grid is refused) and
num_channels from the weights.
"""

import dataclasses
import math

import jax.numpy as jnp

from tfjax.interop.core import convert, files, tables
from tfjax.interop.core.posemb import image_size_pair, resample_posemb

# Hugging Face hidden_act -> tfjax activation (the tanh GELU has two names there).
ACTIVATIONS = {
    "gelu": "gelu",
    "quick_gelu": "quick_gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}
HEADLESS = {"num_classes": None, "posemb": "learned"}  # what every tower fixes


@dataclasses.dataclass(frozen=True)
class Tower:
    """A vision tower's family and its position embeddings' layout (keys after the prefix)."""

    family: tables.Family
    posemb: str  # the position embeddings' key
    patch_kernel: str  # the patch embedding's kernel (its input channels: num_channels)
    prefix_tokens: int  # position embeddings before the patches' (the class token's)
    antialias: bool = False  # resampled as torch's antialiased bicubic (DINOv2 with registers)
    nested: bool = False  # image_size and num_channels in config.json's vision_config


def load(tower: Tower, source, config, image_size, overrides):
    """(tfjax ViT, params) from a directory or (state dict, config); image_size: int or (H, W)
    the model will see (the position embeddings resampled from the config's image_size)."""
    state, c = files.load_source(source, config)
    model = tables.build(tower.family, c, **overrides)
    return model, import_params(tower, model, state, c, image_size)


def import_params(tower: Tower, model, state, c: dict, image_size):
    """`model`'s params from the state dict of a checkpoint with config dict `c`, its position
    embeddings resampled to `image_size` (int or (H, W); None: the config's image_size)."""
    family = tower.family
    what = family.architecture
    vision = (c.get("vision_config") or {}) if tower.nested else c
    size_key = "vision_config.image_size" if tower.nested else "image_size"
    key = convert.key_prefix(family, state) + tower.posemb
    p = model.patch_size
    trained = image_size_pair(vision.get("image_size") or 224)
    size = image_size_pair(image_size) if image_size else trained
    if min(size) < p:
        raise ValueError(f"{what}: image size {size} is smaller than patch {p}")
    if key in state:
        table = state[key]
        grid = (trained[0] // p, trained[1] // p)
        given = vision.get("image_size")
        said_size = f"{size_key}={given}" if given else f"no {size_key} (224)"
        if table.shape[-2] - tower.prefix_tokens != grid[0] * grid[1]:
            raise ValueError(
                f"{what}: {said_size} means {grid[0]}x{grid[1]} "
                f"patches of {p} px ({grid[0] * grid[1] + tower.prefix_tokens} position "
                f"embeddings), but {key!r} in {state.where(key)} holds {table.shape[-2]}; do the "
                "config and the weights belong together?"
            )
        resampled = resample_posemb(
            table.reshape(1, -1, table.shape[-1]),
            (size[0] // p, size[1] // p),
            num_prefix_tokens=tower.prefix_tokens,
            antialias=tower.antialias,
        )
        state = files.StateDict(state, state.files, state.origin)
        state[key] = resampled.reshape(*table.shape[:-2], -1, table.shape[-1])
    images = jnp.zeros((1, *size, vision.get("num_channels") or 3), jnp.float32)
    return convert.import_params(family, model, state, inputs=(images,))


def save(tower: Tower, model, params):
    """({Hugging Face key: numpy array}, config dict), the config's image_size and num_channels
    from the position embeddings and the patch kernel."""
    family = tower.family
    state, config = convert.to_hf(family, model, params)
    posemb = state[family.prefix + tower.posemb]
    kernel = state[family.prefix + tower.patch_kernel]
    patches = posemb.shape[-2] - tower.prefix_tokens
    side = math.isqrt(patches)
    if side * side != patches:
        raise ValueError(
            f"{family.architecture}: the position embeddings hold {patches} patches, no square "
            "grid, and config.json's image_size is one number; load at a square image_size"
        )
    config |= {"image_size": side * model.patch_size, "num_channels": kernel.shape[1]}
    return state, config
