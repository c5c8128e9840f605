"""A run that starts from a Hugging Face checkpoint directory (config.init_from).

config.init_from names either another run's workdir (its newest parameters) or a Hugging Face
checkpoint directory (config.json and safetensors, single or sharded with an index), told apart
by content: a workdir holds checkpoints/, a checkpoint directory config.json and weight files.

From a checkpoint directory the model is the checkpoint's: its family and every field that
changes the maths come from config.json through the converters' tables (`tfjax.interop`).
config.model may set only what does not change the maths (SAME_MATHS: scan_layers, remat,
attention backend, dropout); a size it sets must equal the checkpoint's (an error names both).

A vision checkpoint (DINOv2, CLIP, SigLIP; `tfjax.interop.pretrained.family_of` gives its bare
tower) gets a new head for the run's classes (`with_head`): the class folders of
dataset.train_files (`tfjax.data.image_folders`), kept in the workdir's classes.json. Its
images are made as its preprocessor_config.json says, at the image size it gives, to which the
tower's position embeddings are resampled when loaded.

The run keeps what it needs of the checkpoint in its workdir (`pretrained/`: config.json, the
tokenizer, generation and image processor files), so resuming, decoding and exporting need only
the workdir, even after the checkpoint directory is gone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from absl import logging
from flax import traverse_util

from tfjax.runner import checkpoint, defaults

KEPT = "pretrained"  # the workdir's copy of the checkpoint's small files
CLASSES = "classes.json"  # in the workdir: the class names of a run's head, in label order
# The pooling of a vision checkpoint's new head, by model_type: what Hugging Face's classifier
# of that tower reads, so that the fine-tuned model exports as it (DINOv2:
# Dinov2ForImageClassification's class token and mean of the patch tokens). The others keep the
# tower's own pooling (CLIP: the normed class token, SigLIP: its attention pooling head); no
# Hugging Face class holds those with a linear head, so their export is refused.
HEAD_POOLS = {"dinov2": "cls_gap", "dinov2_with_registers": "cls_gap"}
# Model fields a run may set on a loaded checkpoint: none changes what the weights compute.
SAME_MATHS = (
    "scan_layers",
    "remat_policy",
    "implementation",
    "dropout_rate",
    "attention_dropout_rate",
)
# The files a run keeps from the checkpoint (all that exist): the model config, the tokenizer
# (tokenizers' JSON, SentencePiece, or GPT-2's vocab + merges) and generation's defaults.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
)


def is_checkpoint_dir(path: str) -> bool:
    """A Hugging Face checkpoint directory: config.json and weights."""
    from tfjax.interop.core import files

    return os.path.isfile(os.path.join(path, files.CONFIG)) and any(
        os.path.isfile(os.path.join(path, name)) for name in files.WEIGHT_FILES
    )


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The checkpoint a run starts from.

    config_dir: where its config.json (and tokenizer files) are read: the checkpoint itself,
      or the workdir's copy once the run has started.
    weights_dir: the checkpoint directory with the weights (None: not needed, the run resumes
      or restores from its own checkpoints).
    model_name: the tfjax.models module of its family ("decoder").
    fields: the model fields its config.json means.
    architecture: config.json's architecture, for messages.
    model_type: config.json's model_type ("dinov2").
    """

    config_dir: str
    weights_dir: str | None
    model_name: str
    fields: dict
    architecture: str
    model_type: str

    @property
    def vision(self) -> bool:
        """A vision tower (a ViT): its images are made as its preprocessor_config.json says."""
        return self.model_name == "vit"

    @classmethod
    def read(cls, config_dir: str, weights_dir: str | None) -> Pretrained:
        from tfjax.interop.pretrained import family_of, pretrained_model

        family, _ = family_of(config_dir)
        model = pretrained_model(config_dir)
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
        fields = {k: v for k, v in fields.items() if k not in ("parent", "name")}
        module = family.model.__module__  # tfjax.models.<name>
        return cls(
            config_dir=config_dir,
            weights_dir=weights_dir,
            model_name=module.rsplit(".", 1)[-1],
            fields=fields,
            architecture=family.architecture,
            model_type=family.model_type,
        )


def _kept_dir(workdir: str | None) -> str | None:
    """The workdir's copy of the checkpoint's small files once the run has started (the workdir
    holds a checkpoint): a start that failed before its first checkpoint left a copy that the
    next start replaces (`keep`) and never reads: the user may have fixed the checkpoint."""
    kept = os.path.join(workdir, KEPT) if workdir else None
    if kept and os.path.isfile(os.path.join(kept, "config.json")):
        return kept if checkpoint.has_checkpoint(workdir) else None
    return None


def find(config, workdir: str | None) -> Pretrained | None:
    """The checkpoint `config` starts from, None when it starts from scratch or a workdir.

    A workdir that holds the kept copy and a checkpoint takes the model from it (the run
    resumes: the checkpoint directory may be gone); otherwise an init_from that is a checkpoint
    directory.
    """
    init_from = config.get("init_from") or ""
    kept = _kept_dir(workdir)
    source = init_from if init_from and is_checkpoint_dir(init_from) else None
    if kept:
        return Pretrained.read(kept, source)
    if source:
        return Pretrained.read(os.path.abspath(os.path.expanduser(source)), source)
    return None


def _checkpoint_dir(config, workdir: str | None, what: str) -> str:
    """Where the run reads the checkpoint's small files: the workdir's copy once the run keeps
    one (`keep`), else config.init_from; a ValueError says `what` needs them otherwise."""
    kept = _kept_dir(workdir)
    init_from = os.path.expanduser(config.get("init_from") or "")
    if kept:
        return kept
    if init_from and is_checkpoint_dir(init_from):
        return os.path.abspath(init_from)
    raise ValueError(what)


def dataset_spec(config, workdir: str | None):
    """The run's dataset (`tfjax.data.dataset_spec(config)`) with what the checkpoint gives it
    (its copy in `workdir` once the run keeps one, `keep`, else config.init_from's):
    the "files" dataset's tokenizer when dataset.tokenizer is unset (a loader's saved position
    knows the tokenizer by its files' bytes, so both are the same to it); the "image_folders"
    dataset's preprocessor, its image size and the number of classes (`classes`)."""
    from tfjax.data import catalog

    data = catalog.dataset_spec(config)
    if catalog.is_image_folders(data.name):
        from tfjax.data import image_folders

        if not data.preprocessor:
            data = dataclasses.replace(
                data,
                preprocessor=_checkpoint_dir(
                    config,
                    workdir,
                    "dataset.preprocessor is unset and config.init_from is not a Hugging Face "
                    "checkpoint directory: give the directory of the checkpoint's "
                    "preprocessor_config.json as dataset.preprocessor",
                ),
            )
        size = image_folders.Preprocessor.read(data.preprocessor).image_size
        given = config.dataset.get("image_size")
        if given is not None and given != size:
            raise ValueError(
                f"dataset.image_size={given}, but the checkpoint's image processor makes "
                f"{size} px images ({data.preprocessor}/{image_folders.PREPROCESSOR}); leave "
                "dataset.image_size unset"
            )
        return dataclasses.replace(data, image_size=size, num_classes=len(classes(data, workdir)))
    if not catalog.is_files(data.name):
        return data
    if not data.tokenizer:
        directory = _checkpoint_dir(
            config,
            workdir,
            "dataset.tokenizer is unset and config.init_from is not a Hugging Face "
            "checkpoint directory: give the directory of the tokenizer files "
            "(tokenizer.json or tokenizer.model) as dataset.tokenizer",
        )
        data = dataclasses.replace(data, tokenizer=directory)
    return data


def classes(data, workdir: str | None) -> list[str]:
    """The class names of an "image_folders" run, in label order: the class folders of
    dataset.train_files, which must be those of workdir/classes.json once the run keeps it
    (`keep_classes`); the kept ones alone when train_files is gone (exporting a workdir)."""
    from tfjax.data import image_folders

    path = os.path.join(workdir, CLASSES) if workdir else None
    kept = None
    if path and os.path.isfile(path):
        with open(path) as f:
            kept = json.load(f)
        if not os.path.isdir(os.path.expanduser(data.train_files or "")):
            return kept
    found = image_folders.class_names(data)
    if kept is not None and kept != found:
        raise ValueError(
            f"dataset.train_files={data.train_files!r} has the class folders {found}, but the "
            f"run in {workdir} trained its head on {kept} ({path}): a label would mean another "
            "class; give the folders it was trained on or use a new workdir"
        )
    return found


def keep_classes(data, workdir: str) -> None:
    """Writes the class names of an "image_folders" run to workdir/classes.json (process 0,
    once, atomically); nothing for other datasets."""
    from tfjax.data import catalog

    path = os.path.join(workdir, CLASSES)
    if not catalog.is_image_folders(data.name) or os.path.isfile(path) or jax.process_index() != 0:
        return
    names = classes(data, workdir)
    fd, tmp = tempfile.mkstemp(prefix=f".{CLASSES}-", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump(names, f, indent=1)
    os.replace(tmp, path)


def with_head(pretrained: Pretrained, fields: dict, num_classes: int | None) -> dict:
    """The fields of a vision checkpoint's model with a new head of `num_classes` (the run's
    classes), pooled as HEAD_POOLS says; `fields` as they are for other checkpoints."""
    if not pretrained.vision or num_classes is None:
        return fields
    pool = HEAD_POOLS.get(pretrained.model_type, fields["pool"])
    return {**fields, "num_classes": num_classes, "pool": pool}


def model_fields(pretrained: Pretrained, config_model) -> dict:
    """The fields of the run's model: the checkpoint's, with the SAME_MATHS fields config.model
    sets. A name or size config.model sets that differs from the checkpoint's is a ValueError
    naming both values."""
    given = {k: v for k, v in dict(config_model).items() if v is not None}
    given.pop("api", None)  # which API runs the model, not a field of it
    name = given.pop("name", pretrained.model_name)
    if name != pretrained.model_name:
        raise ValueError(
            f"model.name={name!r}, but config.init_from={pretrained.config_dir!r} is a "
            f"{pretrained.architecture} (tfjax.models.{pretrained.model_name}); set "
            f"model.name={pretrained.model_name!r} or leave it unset"
        )
    set_here = set(given)
    variant = given.pop("variant", None)
    if variant is not None:  # a preset's sizes: each must be the checkpoint's
        given = {**defaults.model_module(name).VARIANTS[variant], **given}
    fields = dict(pretrained.fields)
    for key, value in given.items():
        if key in SAME_MATHS:
            fields[key] = value
        elif key not in fields:
            raise ValueError(
                f"model.{key}={value!r}: {pretrained.architecture} models have no field {key!r}"
            )
        elif fields[key] != value:
            what = f"model.{key}={value!r}"
            if key not in set_here:
                what = f"model.variant={variant!r} has {key}={value!r}, which"
            raise ValueError(
                f"{what} differs from the checkpoint's {key}={fields[key]!r} "
                f"(config.init_from={pretrained.config_dir!r}); a run from a checkpoint keeps "
                f"its sizes: leave model.{key} unset (a run may set {', '.join(SAME_MATHS)})"
            )
    return fields


def keep(pretrained: Pretrained, workdir: str, content: str | None = None) -> None:
    """Copies the checkpoint's small files (SMALL_FILES) into workdir/pretrained, with BASE_FILE
    naming the checkpoint's weights (a LoRA run's checkpoints hold only its adapters:
    `check_base`): their path, header fingerprint and `content` digest (`ContentDigest`, taken
    while they were loaded). Written to a temporary directory and renamed, so a crash leaves no
    half copy; once per run (a copy left by a start that failed before its first checkpoint is
    replaced, see `_kept_dir`)."""
    kept = os.path.join(workdir, KEPT)
    if _kept_dir(workdir) or jax.process_index() != 0:
        return
    tmp = tempfile.mkdtemp(prefix=f".{KEPT}-", dir=workdir)
    for name in SMALL_FILES:
        path = os.path.join(pretrained.config_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(tmp, name))
    if pretrained.weights_dir:
        base = os.path.abspath(os.path.expanduser(pretrained.weights_dir))
        record = {"init_from": base, "weights": weights_fingerprint(base), "content": content}
        with open(os.path.join(tmp, BASE_FILE), "w") as f:
            json.dump(record, f, indent=1)
    if os.path.isdir(kept):  # a failed start's copy
        shutil.rmtree(kept)
    os.replace(tmp, kept)


BASE_FILE = "base.json"  # in workdir/pretrained: the checkpoint's path and weights' identity


def weights_fingerprint(directory: str) -> str:
    """A short name of a checkpoint's weight files: each file's name, size and (safetensors)
    header, which lists every tensor's name, dtype, shape and offsets: read in milliseconds,
    so a base re-saved with other sizes is refused before anything is loaded. Two checkpoints
    of one architecture have the same; `ContentDigest` tells them apart."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith((".safetensors", ".bin")) or not os.path.isfile(path):
            continue
        digest.update(f"{name}:{os.path.getsize(path)}:".encode())
        if name.endswith(".safetensors"):
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                digest.update(f.read(size))
    return digest.hexdigest()[:16]


def recorded_base(workdir: str) -> tuple[str, dict]:
    """(the path of a workdir's BASE_FILE, what it records)."""
    recorded = os.path.join(workdir, KEPT, BASE_FILE)
    with open(recorded) as f:
        return recorded, json.load(f)


def check_base(pretrained: Pretrained | None, workdir: str, config) -> None:
    """A LoRA run's checkpoints hold only its adapters: their base must be the checkpoint the
    run started from (BASE_FILE), still at config.init_from. Checked before loading by the
    weight files' headers (`weights_fingerprint`), and after by their content
    (`check_base_content`). A CheckpointMismatchError (one line: the runner's scripts print it
    alone) says which."""
    recorded, base = recorded_base(workdir)
    init_from = config.get("init_from") or ""
    if not init_from and is_checkpoint_dir(base["init_from"]):  # not moved: only not given
        raise checkpoint.CheckpointMismatchError(
            "config.init_from is unset, and this LoRA run's checkpoints hold only its "
            f"adapters: give their base as --config.init_from={base['init_from']} ({recorded})"
        )
    if pretrained is None or not pretrained.weights_dir:
        raise checkpoint.CheckpointMismatchError(
            f"config.init_from={init_from!r} holds no Hugging Face checkpoint, and this LoRA "
            f"run's checkpoints hold only its adapters: their base was {base['init_from']} "
            f"({recorded}); put it back, or give its new place as --config.init_from"
        )
    found = weights_fingerprint(os.path.abspath(os.path.expanduser(pretrained.weights_dir)))
    if found != base["weights"]:
        raise checkpoint.CheckpointMismatchError(
            f"config.init_from={init_from!r}: its weights are not the base this LoRA run's "
            f"adapters were trained on ({base['init_from']}, fingerprint {base['weights']} in "
            f"{recorded}; found {found})"
        )


def check_base_content(workdir: str, config, content: str) -> None:
    """The base's weights as loaded (`content`: their `ContentDigest`) must be those the LoRA
    run's adapters were trained on; else a CheckpointMismatchError naming the path and both
    digests. A workdir recorded before content digests is checked by its headers only."""
    recorded, base = recorded_base(workdir)
    if not base.get("content"):
        logging.info(
            "%s has no content digest (an older run): the base is checked by headers", recorded
        )
        return
    if content != base["content"]:
        init_from = config.get("init_from") or base["init_from"]
        raise checkpoint.CheckpointMismatchError(
            f"config.init_from={init_from!r}: its weights are not the base this LoRA run's "
            f"adapters were trained on (content digest {content}; {recorded} records "
            f"{base['content']} of {base['init_from']}): the checkpoint there was replaced. "
            "Put the original base back, or give its place as --config.init_from"
        )


def load_params(pretrained: Pretrained, model, abstract_params, digest=None):
    """The checkpoint's weights as (the base of) `model`'s params, placed on the shardings of
    `abstract_params` (ShapeDtypeStructs with shardings; it may hold more than the checkpoint,
    e.g. LoRA adapters or a vision tower's new head, which come back as None); `digest` (a
    `tfjax.interop.core.files.ContentDigest`) is given each tensor as it is read. Streamed: the
    weights are read tensor by tensor and each parameter placed as soon as it is converted
    (stacked layer by layer when scanned), so the host holds the placed shards plus one
    parameter, never a second copy of the model (benchmarks/load_memory.py). Each process
    builds only the shards its devices hold."""
    from tfjax.interop.pretrained import pretrained_model, stream_pretrained_params

    # The checkpoint's own model in the run's layout (stacked when scanned): `model` may hold
    # more (LoRA adapters) than the converter fills.
    layout = pretrained_model(
        pretrained.config_dir, scan_layers=getattr(model, "scan_layers", False)
    )
    image_size = None
    if pretrained.vision:  # the tower's position embeddings resampled to the run's images
        from tfjax.data import image_folders

        image_size = image_folders.Preprocessor.read(pretrained.config_dir).image_size
    target = traverse_util.flatten_dict(abstract_params)
    placed = dict.fromkeys(target)
    streamed = stream_pretrained_params(
        pretrained.weights_dir, layout, image_size=image_size, digest=digest
    )
    for path, array in streamed:
        abstract = target.get(path)
        if abstract is None:  # a converter and the run's model disagree: a bug, still named
            raise ValueError(f"the checkpoint's param {'/'.join(path)} is not in the run's model")
        if array.shape != abstract.shape:
            raise ValueError(
                f"checkpoint array {'/'.join(path)} {array.shape} != the model's {abstract.shape}"
            )
        array = array.astype(abstract.dtype, copy=False)
        placed[path] = jax.make_array_from_callback(
            abstract.shape, abstract.sharding, lambda index, a=array: a[index]
        )
    _check_finite(pretrained, placed)
    return traverse_util.unflatten_dict(placed)


def _check_finite(pretrained: Pretrained, placed: dict) -> None:
    """Weights holding NaN or Inf would make step 1's loss non-finite, which the run would blame
    on the learning rate: refused here, naming them. One jitted reduction over the placed
    arrays where they lie, one host sync."""
    floats = {
        "/".join(path): a
        for path, a in placed.items()
        if a is not None and jnp.issubdtype(a.dtype, jnp.floating)
    }
    finite = jax.device_get(
        jax.jit(lambda t: {k: jnp.isfinite(x).all() for k, x in t.items()})(floats)
    )
    bad = sorted(k for k, ok in finite.items() if not ok)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise checkpoint.DamagedWeightsError(
            f"config.init_from={pretrained.weights_dir!r}: the checkpoint's weights hold NaN or "
            f"Inf values (in the model's {', '.join(bad[:3])}{more}): the checkpoint is damaged "
            "or was saved from a diverged run; download or export it again"
        )
