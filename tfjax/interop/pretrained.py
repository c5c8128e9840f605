"""What a run starts from (`tfjax.runner`'s init_from): a checkpoint directory's model, read from
its config.json alone, and its weights in that model's layout, checked, whole or streamed one
parameter at a time. Unlike `interop.load`, a vision checkpoint gives its bare tower (DINOv2,
CLIP, SigLIP: a run gives it its own head), and only architectures with a config table (a
`core.tables.Family`) or a tower start a run.
"""

import os

import flax
import jax
import numpy as np

from tfjax.interop.core import convert, files, tables, towers
from tfjax.interop.core.files import CONFIG, read_config, read_state_dict
from tfjax.interop.families import REGISTRY


def _run_loader(directory):
    """(family, vision tower or None, config dict) a run starts from: a table-driven family, or
    a vision tower's backbone (the bare tower, without the checkpoint's own head)."""
    config = read_config(directory)
    where = os.path.join(os.fspath(directory), CONFIG)
    loader = REGISTRY.loader(config, where)
    tower = getattr(loader, "backbone", None)
    family = tower.family if tower is not None else getattr(loader, "family", None)
    if family is None:
        raise ValueError(
            f"{where}: {config.get('architectures')} loads with interop.load, but a run cannot "
            "start from it yet; loadable by a run: "
            + ", ".join(a for a, f in REGISTRY.loaders.items() if _runnable(f))
        )
    return family, tower, config


def _runnable(loader) -> bool:
    return hasattr(loader, "family") or hasattr(loader, "backbone")


def family_of(directory):
    """(the `core.tables.Family`, config dict) a checkpoint directory's config.json names (read
    alone, no weights), for starting a run from it: for a vision checkpoint the bare tower's
    (DINOv2, CLIP, SigLIP: a run gives it its own head); a ValueError names an architecture
    that has no converter or that a run cannot start from (ViTForImageClassification)."""
    family, _, config = _run_loader(directory)
    return family, config


def pretrained_model(directory, **overrides):
    """The tfjax model a checkpoint directory's config.json means, without reading weights;
    `overrides` set fields that do not change the maths (scan_layers, dtype, ...)."""
    family, config = family_of(directory)
    return tables.build(family, config, **overrides)


def pretrained_params(directory, model, *, image_size=None):
    """The weights of a checkpoint directory as `model`'s params (its layout: stacked when
    scan_layers), every key and shape checked; `model` as `pretrained_model` gives it (other
    fields that do not change the parameters may differ). A vision tower's position embeddings
    are resampled to `image_size` (int or (H, W); None: the config's image_size)."""
    family, tower, config = _run_loader(directory)
    state = read_state_dict(directory)
    if tower is not None:
        return towers.import_params(tower, model, state, config, image_size)
    return convert.import_params(family, model, state)


def check_pretrained(directory) -> None:
    """Every key and shape of a checkpoint directory's safetensors weights against the model
    its config.json builds (`pretrained_model`), from the files' headers: no tensor is read, no
    device used. A config.json whose sizes are not its weights' is a ValueError naming the key,
    the file and both shapes, before a run does any work. Vision towers (read whole) and torch
    files (no header to read) are checked as they load."""
    family, tower, _ = _run_loader(directory)
    state = read_state_dict(directory, lazy=True)
    if tower is not None or not isinstance(state, files.LazyStateDict):
        return
    model = pretrained_model(directory)
    if hasattr(model, "implementation"):  # the same parameters; its choice needs no device
        model = model.clone(implementation="xla")
    convert.check_params(family, model, state)


def stream_pretrained_params(directory, model, *, image_size=None, digest=None):
    """`pretrained_params` one parameter at a time, for placing each on its devices as it is
    read: (path in `model`'s layout, numpy array), every key and shape checked first, the
    safetensors files read tensor by tensor (memory-mapped); see `convert.stream_params`. A
    vision tower (at most a few GB; its position embeddings resampled as a whole) is read
    whole, then given a parameter at a time. `digest` (a `core.files.ContentDigest`) is given
    each checkpoint tensor as it is read: the weights' identity, at no second read."""
    family, tower, config = _run_loader(directory)
    if tower is not None:
        state = read_state_dict(directory, digest=digest)
        params = towers.import_params(tower, model, state, config, image_size)
        flat = flax.traverse_util.flatten_dict(jax.device_get(params))
        return ((path, np.asarray(array)) for path, array in flat.items())
    return convert.stream_params(
        family, model, read_state_dict(directory, lazy=True, digest=digest)
    )
