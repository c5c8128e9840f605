"""Hugging Face / PyTorch checkpoints <-> tfjax models and parameter trees.

    from tfjax import interop
    model, params = interop.load("path/to/checkpoint")   # config.json + safetensors / .bin
    logits, aux = model.apply({"params": params}, tokens)
    interop.save(model, params, "path/to/out")           # model.safetensors + config.json

    model = interop.load("path/to/checkpoint", nnx=True)  # a Flax NNX model (tfjax.nnx)
    interop.save(model, "path/to/out")                   # its nnx.Param state is the params

What converts is the table `supported()` gives (docs/interop.md shows it): one row per source,
declared by its family module (`families/`) with the loaders of the architectures it names;
`load` picks the loader from config.json's "architectures" (the keys of ARCHITECTURES) and
`export` the one exporter that takes the model (`core.registry`). Each family's `from_*` /
`to_*` converters are also here, for a state dict plus a config (`from_gpt2(state, config)`).
Every converter checks every key and shape before returning: nothing is loaded half-way.
Needs `safetensors` (and `torch` only for pytorch_model.bin files); never `transformers`.
"""

import logging
import os

from flax import nnx as _nnx

from tfjax.interop import core, families, pretrained
from tfjax.interop.core.files import CONFIG, read_config, read_state_dict, write_safetensors
from tfjax.interop.core.posemb import resample_posemb
from tfjax.interop.families import REGISTRY
from tfjax.interop.families.bert import *  # noqa: F403 (each family's __all__: its converters)
from tfjax.interop.families.clip import *  # noqa: F403
from tfjax.interop.families.deepseek import *  # noqa: F403
from tfjax.interop.families.dinov2 import *  # noqa: F403
from tfjax.interop.families.gemma import *  # noqa: F403
from tfjax.interop.families.gpt2 import *  # noqa: F403
from tfjax.interop.families.llama import *  # noqa: F403
from tfjax.interop.families.llama4 import *  # noqa: F403
from tfjax.interop.families.marian import *  # noqa: F403
from tfjax.interop.families.moe import *  # noqa: F403
from tfjax.interop.families.qwen3_5 import *  # noqa: F403
from tfjax.interop.families.t5 import *  # noqa: F403
from tfjax.interop.families.torch_nn import *  # noqa: F403
from tfjax.interop.families.vit import *  # noqa: F403
from tfjax.interop.nnx import as_nnx, example_images, linen_of

ARCHITECTURES = REGISTRY.loaders  # Hugging Face architecture -> loader(directory, config, **kw)


def supported() -> list[core.registry.Row]:
    """The table of what converts, row by row, as docs/interop.md shows it (`Row.cells`:
    architectures, source, converters, tfjax model); rows without architectures (torch.nn
    modules) convert with their functions only, not `load`."""
    return list(REGISTRY.rows)


def load(directory, *, nnx: bool = False, rngs: _nnx.Rngs | None = None, **overrides):
    """(model, params) from a local Hugging Face checkpoint directory (no hub access).

    `overrides` go to the converter (e.g. scan_layers=True, dtype, image_size for ViT).

    nnx=True: the Flax NNX model instead (`tfjax.nnx.models.from_linen` of the same model,
    which holds the params as its nnx.Param state; see `as_nnx`); `rngs` seeds its own
    streams (dropout when training), nnx.Rngs(0) when None.
    """
    if rngs is not None and not nnx:
        raise ValueError("load: rngs= is for the NNX model (nnx=True)")
    config = read_config(directory)
    where = os.path.join(os.fspath(directory), CONFIG)
    model, params = REGISTRY.loader(config, where)(directory, config, **overrides)
    if not nnx:
        return model, params
    return as_nnx(model, params, *example_images(model, config, overrides), rngs=rngs)


def export(model, params=None):
    """({Hugging Face key: numpy array}, config dict) for a tfjax model: a Linen model and its
    params, or a tfjax.nnx model alone (its params are its nnx.Param state).

    A model loaded from a multimodal checkpoint (Gemma3ForConditionalGeneration) is its text
    model: the export is the text architecture (config["architectures"]), and a log line says
    it is text only."""
    model, params = linen_of(model, params)
    state, config = REGISTRY.exporter(model).export(model, params)
    for architecture in config.get("architectures", ()):
        wrappers = core.multimodal.text_only(architecture)
        if wrappers:
            logging.getLogger(__name__).info(
                "export: %s, a text-only model (no vision tower: what a model loaded from %s "
                "keeps)",
                architecture,
                " or ".join(wrappers),
            )
    return state, config


def save(model, *args) -> str:
    """save(model, params, directory) for a Linen model, save(model, directory) for a
    tfjax.nnx model: writes model.safetensors and config.json (Hugging Face layout); returns
    the weights path.

    `load(directory)` (`nnx=True`) gives the same params back bit for bit, and transformers'
    `from_pretrained(directory)` reads it.
    """
    nnx = isinstance(model, _nnx.Module)
    if len(args) != (1 if nnx else 2):
        raise TypeError(
            "save takes (model, directory) for an NNX model, (model, params, directory) for a "
            f"Linen one; got {1 + len(args)} arguments for a {type(model).__name__}"
        )
    state, config = export(model, *args[:-1])
    return write_safetensors(state, args[-1], config)


__all__ = [
    "ARCHITECTURES",
    "REGISTRY",
    "as_nnx",
    "core",
    "export",
    "families",
    "load",
    "pretrained",
    "read_config",
    "read_state_dict",
    "resample_posemb",
    "save",
    "supported",
    "write_safetensors",
]
for _family in families.ALL:  # each family's converters, from_* / to_*
    __all__ += _family.__all__
