"""A run's parameters as a Hugging Face checkpoint directory (`experiments/export.py`).

    from tfjax.runner import export
    export.export_run("/tmp/ft", "/tmp/ft_hf")          # the newest checkpoint; step=N for another

writes what `transformers`' `from_pretrained` and `generate` read: config.json (the family's,
with the special token ids), generation_config.json, the weights (model.safetensors, or shards
with an index above 5 GB; LoRA adapters merged into their kernels) and the tokenizer files of
the checkpoint the run started from (`workdir/pretrained`, see `tfjax.runner.pretrained`). A
run trained from scratch gets the ids of tfjax's own tokenizers and no tokenizer files. A
vision run's export holds its head's class names as id2label / label2id and the checkpoint's
preprocessor_config.json, and no generation_config.json; a model Hugging Face has no class for
(a CLIP or SigLIP tower with a linear head) is refused, naming what each class needs.
Everything is written into a temporary directory beside `output` and renamed at the end: an
existing `output` is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import numpy as np

from tfjax.runner import pretrained, workdirs

GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_run(workdir: str, output: str, *, step: int | None = None) -> str:
    """Writes the run's parameters (newest checkpoint, or `step`) to `output` as a Hugging Face
    checkpoint directory; returns `output`. Refuses an existing `output` before any work."""
    from tfjax import interop
    from tfjax.runner import train

    output = os.path.abspath(os.path.expanduser(output))
    if os.path.lexists(output):
        raise FileExistsError(f"--output={output!r} exists; give a new directory")
    config = workdirs.read_config(workdir)
    model, params, tokenizer = train.restore_model(
        config, workdir, step=step, devices=jax.devices()[:1], merge_lora=True
    )
    state, hf_config = interop.export(model, jax.device_get(params))
    kept = os.path.join(workdir, pretrained.KEPT)
    ids = _special_ids(kept, tokenizer)
    hf_config.update({k: v for k, v in ids.items() if v is not None})
    classes = os.path.join(workdir, pretrained.CLASSES)
    if os.path.isfile(classes):  # the head's labels by name
        with open(classes) as f:
            names = json.load(f)
        hf_config["id2label"] = {str(i): name for i, name in enumerate(names)}
        hf_config["label2id"] = {name: i for i, name in enumerate(names)}
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}-", dir=parent)
    try:
        interop.write_safetensors(state, tmp, hf_config)
        for name in pretrained.SMALL_FILES:
            path = os.path.join(kept, name)
            if name != "config.json" and os.path.isfile(path):
                shutil.copy2(path, os.path.join(tmp, name))
        if tokenizer is not None and not os.path.exists(os.path.join(tmp, GENERATION_CONFIG)):
            with open(os.path.join(tmp, GENERATION_CONFIG), "w") as f:
                json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _special_ids(kept: str, tokenizer) -> dict:
    """bos / eos / pad ids: the starting checkpoint's (its generation_config.json, then its
    config.json), else the run's tokenizer's."""
    ids = {}
    for name in (GENERATION_CONFIG, "config.json"):
        path = os.path.join(kept, name)
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f)
            for key in SPECIAL_IDS:
                ids.setdefault(key, found.get(key))
    if tokenizer is not None:
        for key, attr in zip(SPECIAL_IDS, ("bos_id", "eos_ids", "pad_id"), strict=True):
            value = getattr(tokenizer, attr, None)
            if attr == "eos_ids" and value is None:
                value = getattr(tokenizer, "eos_id", None)
            if isinstance(value, tuple | list):
                value = list(value) if len(value) > 1 else value[0]
            if ids.get(key) is None and value is not None:
                ids[key] = int(value) if np.isscalar(value) else value
    return ids
