"""The checks of a run's config and paths, made before any data, model or workdir work starts
(`tfjax.runner.setup.resolve` calls them once; `setup.check_run` adds the model's).

ml_collections' locking already rejects unknown keys and most wrong types; these are the checks
it cannot make: every field against what it allows (declared beside the field, `tfjax.allowed`),
and the paths. Each error names the field (or flag) and what is allowed.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import ml_collections

from tfjax import allowed, sharding, tasks
from tfjax import lora as lora_lib
from tfjax.runner import (
    checkpoint,
    defaults,
    executables,
    optim,
    pretrained,
    profiling,
    workdirs,
)

COMPUTE_DTYPES = {name: getattr(jnp, name) for name in defaults.COMPUTE_DTYPES}


class ConfigError(ValueError):
    """A config field the devices cannot honour (the mesh's sizes, a batch that does not
    split), found once JAX has started, still before any data, model or workdir work
    (`tfjax.runner.setup.prepare`): experiments/run.py reports it as the checks before."""


def check_config(config) -> tuple:
    """Every field of every section against what it allows (`tfjax.runner.defaults.ALLOWED`:
    types, finite numbers, ranges, choices), then what relates fields to each other; each error
    names the field. ml_collections' locking already rejects unknown keys and most wrong types.
    The model's and the dataset's own fields are checked where they are resolved
    (`tfjax.runner.setup.check_run`). Returns config.logical_axis_rules, checked."""
    for section, rules in defaults.ALLOWED.items():
        values = config.get(section) if section else config
        if values is not None:
            allowed.check(values, rules, owner=f"{section}." if section else "")
    rules = sharding.check_rules(config.logical_axis_rules)
    free = [axis for axis in sharding.MESH_AXES if config.mesh.get(axis, 1) == -1]
    if len(free) > 1:
        raise ValueError(
            f"mesh.{free[0]} and mesh.{free[1]} are both -1; at most one axis takes the devices "
            "the others leave"
        )
    d = config.get("decode")
    if d is not None and d.method == "beam" and d.beam_size < 1:
        raise ValueError(f"decode.beam_size must be at least 1 for beam search, got {d.beam_size}")
    check_loss_chunks(config)
    _check_lora_fields(config)
    checkpoint.check_options(config.checkpoint)
    checkpoint.check_best_metric(config)
    profiling.check_profile(config)
    module = defaults.model_module(config.model.name)
    variant = config.model.get("variant")
    if variant is not None and variant not in module.VARIANTS:
        raise ValueError(
            f"model.variant={variant!r} is unknown for model.name={config.model.name!r}; "
            f"allowed: {', '.join(module.VARIANTS)}"
        )
    # Builds the optimizer and its schedule (nothing is allocated) for their errors; d_model
    # only scales the values of the "rsqrt" schedule.
    optim.make_optimizer(config.optim, d_model=1, num_train_steps=config.num_train_steps)
    return rules


def loss_chunks(config) -> int:
    """config.loss.chunks: slices of T for the logits and the loss (1 where the config has none,
    as classification configs)."""
    return config.loss.get("chunks", 1)


def check_loss_chunks(config, lengths=None) -> None:
    """loss.chunks is >= 1, used by a task with a vocabulary head only, and divides the
    sequence lengths: `lengths` {what: T}, by default dataset.seq_len (resolved)."""
    chunks = loss_chunks(config)
    if chunks == 1:
        return
    if config.task not in tasks.TOKEN_TASKS:
        raise ValueError(
            f"loss.chunks={chunks} applies to the tasks with a vocabulary head "
            f"{tasks.TOKEN_TASKS}; task={config.task!r} allows only 1"
        )
    if lengths is None:
        from tfjax.data import catalog  # here, as in check_paths: only runs need tfjax.data

        lengths = {"dataset.seq_len": catalog.dataset_spec(config).seq_len}
    for what, length in lengths.items():
        if length % chunks:
            divisors = [str(d) for d in range(1, length + 1) if length % d == 0]
            raise ValueError(
                f"loss.chunks={chunks} does not divide the sequence length {length} ({what}); "
                f"allowed: {', '.join(divisors)}"
            )


def _check_lora_fields(config) -> None:
    """config.lora's fields act only with adapters (lora.rank > 0), and lora.tile_size only on
    a quantized base: set without them, each would be ignored, and is refused by name."""
    c = config.get("lora")
    if c is None:
        return
    if not c.rank:
        unset = {"alpha": 16.0, "dropout": 0.0, "targets": "", "base_dtype": ""}
        given = [f"lora.{k}={c[k]!r}" for k, v in unset.items() if c.get(k, v) != v]
        given += [f"lora.tile_size={c.tile_size}"] if c.get("tile_size") else []
        if given:
            raise ValueError(
                f"{given[0]} acts only on LoRA adapters, and lora.rank=0 trains every "
                "parameter without them: set --config.lora.rank (the lora preset's is 16), or "
                f"leave lora.{given[0][5:].split('=')[0]} unset"
            )
    elif c.get("tile_size") and not c.base_dtype:
        raise ValueError(
            f"lora.tile_size={c.tile_size} is QLoRA's block size and acts only on a quantized "
            "base: set lora.base_dtype ('int8' or 'nf4'), or leave lora.tile_size unset"
        )


def check_batch(name, size, mesh, rules, num_microbatches=1) -> None:
    """`size` rows must split evenly over the data-parallel devices (and microbatches)."""
    dp = sharding.data_parallel_size(mesh, rules)
    if size % (dp * num_microbatches):
        what = f"{dp} (the data-parallel size: mesh {dict(mesh.shape)} under the 'batch' rule)"
        if num_microbatches > 1:
            what += f" x num_microbatches={num_microbatches}"
        raise ValueError(f"{name}={size} is not divisible by {what}")


def check_paths(config, workdir: str, *, restore: bool = False, files: bool = True) -> None:
    """--workdir, config.data_dir and config.init_from must be usable directories, and the
    dataset's own files (config.dataset.train_files, eval_files, tokenizer) must exist: checked
    before any data work, and nothing is created.

    workdir may be missing (training creates it) but then must be creatable; with restore=True
    (decoding) it must hold a checkpoint and init_from is not used. files=False leaves the
    dataset's own files to the caller's `check_data` (which has the dataset resolved).
    """
    if not workdir:
        raise ValueError("--workdir is empty; give the directory of the run")
    _check_dir(f"--workdir={workdir!r}", workdir, must_exist=restore, writable=not restore)
    if not restore:
        _check_is_workdir(workdir)
    if restore and not checkpoint.has_checkpoint(workdir):
        if pretrained.is_checkpoint_dir(os.path.expanduser(workdir)):
            raise FileNotFoundError(
                f"--workdir={workdir!r} is a Hugging Face checkpoint, not a run's workdir (it "
                "has no checkpoints/): decode a run's, e.g. one started from it with "
                f"--config.init_from={workdir}"
            )
        raise FileNotFoundError(f"--workdir={workdir!r} holds no checkpoint to restore")
    # Missing is fine: embedded datasets are prepared there and others say how to prepare.
    if config.data_dir:
        _check_dir(f"config.data_dir={config.data_dir!r}", config.data_dir)
    else:
        from tfjax.data import catalog  # here, as in planned_inputs: only runs need tfjax.data

        data_dir = catalog.default_data_dir()
        _check_dir(
            f"the data directory {data_dir!r} (config.data_dir is '': $TFJAX_DATA_DIR, "
            "$TFDS_DATA_DIR or ~/tensorflow_datasets)",
            data_dir,
        )
    # init_from is read only when the run starts, not when it resumes (its source may be gone).
    if config.get("init_from") and not restore and not checkpoint.has_checkpoint(workdir):
        _check_dir(f"config.init_from={config.init_from!r}", config.init_from, must_exist=True)
        init_from = os.path.expanduser(config.init_from)
        if pretrained.is_checkpoint_dir(init_from):  # its architecture and the sizes set
            pretrained.model_fields(pretrained.Pretrained.read(init_from, init_from), config.model)
            _check_safetensors_headers(init_from)
        elif _adapters_only_workdir(init_from):
            raise ValueError(
                f"config.init_from={config.init_from!r} is a LoRA run's workdir: its checkpoints "
                "hold only the adapters, not a model to start from; start from its export: "
                f"python experiments/export.py --workdir={config.init_from} --output=DIR, then "
                "--config.init_from=DIR"
            )
        elif os.path.isfile(os.path.join(init_from, pretrained.KEPT, "config.json")):
            raise ValueError(
                f"config.init_from={config.init_from!r} is the workdir of a run from a Hugging "
                f"Face checkpoint, whose model is that checkpoint's ({pretrained.KEPT}/): start "
                f"from its export: python experiments/export.py --workdir={config.init_from} "
                "--output=DIR, then --config.init_from=DIR"
            )
        elif not checkpoint.has_checkpoint(init_from):
            raise FileNotFoundError(
                f"config.init_from={config.init_from!r} holds no checkpoint: neither a run's "
                "workdir (a step directory in it or its checkpoints/) nor a Hugging Face "
                "checkpoint directory (config.json and model.safetensors, its index or "
                "pytorch_model.bin)"
            )
    _check_as_recorded(config, workdir)
    if not restore:  # the step to restore, the user's own files and its tokenizer directory
        checkpoint.check_restore_step(config, workdir)
        if config.get("compiled_dir"):  # the saved programs: present, whole and unaltered
            executables.check_dir(config.compiled_dir)
        if files:
            check_data(config, pretrained.dataset_spec(config, workdir))


def check_data(config, data) -> None:
    """The dataset's own files, before any data work: every image folder and file of an
    "image_folders" dataset listed (none decoded); the user's text files and their tokenizer
    (`tfjax.data.files.check`). `data`: the run's DatasetSpec (`setup.Run.data`)."""
    from tfjax.data import catalog  # here, as in planned_inputs: only runs need tfjax.data

    if catalog.is_image_folders(data.name):  # every folder and file listed, none decoded
        from tfjax.data import image_folders

        for split in ("train", "eval"):
            image_folders.open_split(data, split)
    if catalog.is_files(data.name):
        from tfjax.data import files

        if not data.eval_files.strip():  # decoding and exporting need no files
            raise ValueError(
                "dataset.eval_files is empty: a run evaluates the held-out loss (the first "
                "time before training); give held-out files as a path, a glob or a "
                "comma-separated list"
            )
        files.check(data, files.tokenizer_field(config))


def _check_is_workdir(workdir: str) -> None:
    """A run writes into --workdir (config.json, metrics, checkpoints): a directory that holds
    other files and no run's (its lock, its checkpoints) is refused, so that a checkpoint's or
    a data folder's files are never overwritten or read back as rows."""
    path = os.path.expanduser(workdir)
    if not os.path.isdir(path):
        return
    names = os.listdir(path)
    if not names or workdirs.LOCK_FILE in names or "checkpoints" in names:
        return
    kind = (
        "a Hugging Face checkpoint" if pretrained.is_checkpoint_dir(path) else "not a run's workdir"
    )
    raise ValueError(
        f"--workdir={workdir!r} holds other files ({', '.join(sorted(names)[:3])}"
        f"{', ...' if len(names) > 3 else ''}) and is {kind}: a run would write its own "
        "config.json, metrics and checkpoints there; give a new or empty directory"
    )


def _check_as_recorded(config, workdir: str) -> None:
    """What a started workdir's parameters were trained as, from the config it recorded
    (config.json): the LoRA adapters' scale (lora.alpha) and their base's quantization
    (`tfjax.lora.check_quantization_kept`) on resume and decode, and for a run that trained
    every parameter, the checkpoint it started from: it resumes from its own checkpoints and
    never reads config.init_from again, so another checkpoint named there would be ignored."""
    if not os.path.isdir(workdir) or not checkpoint.has_checkpoint(workdir):
        return
    stored = workdirs.previous_config(workdir)
    if stored is None:
        return
    where = os.path.join(workdir, workdirs.CONFIG_FILE)
    trained = optim.lora_config(ml_collections.ConfigDict(stored))
    now = optim.lora_config(config)
    if trained is not None and now is not None and trained.alpha != now.alpha:
        raise ValueError(
            f"lora.alpha={now.alpha:g}: this workdir's adapters were trained at lora.alpha="
            f"{trained.alpha:g} ({where}), and alpha / rank scales what they add; give "
            f"--config.lora.alpha={trained.alpha:g}"
        )
    lora_lib.check_quantization_kept(trained, now, where)
    init_from = os.path.expanduser(config.get("init_from") or "")
    has_base = os.path.isfile(os.path.join(workdir, pretrained.KEPT, pretrained.BASE_FILE))
    if trained is None and has_base and pretrained.is_checkpoint_dir(init_from):
        base, recorded = pretrained.recorded_base(workdir)
        if pretrained.weights_fingerprint(init_from) != recorded.get("weights"):
            raise ValueError(
                f"config.init_from={config.init_from!r} is another checkpoint than the one "
                f"this workdir's run started from ({recorded.get('init_from')}, {base}): a run "
                "resumes from its own checkpoints and would never read it; give the original "
                "(or leave config.init_from as the workdir's config.json has it), or use a new "
                "--workdir to start from this one"
            )


def _check_dir(what: str, path: str, *, must_exist: bool = False, writable: bool = False):
    """`path` is a directory, or can be made one (below a directory, writable if asked)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.lexists(path):
        if not os.path.isdir(path):
            kind = "a file" if os.path.isfile(path) else "not a directory"
            raise NotADirectoryError(f"{what} is {kind}; a directory is needed")
        nearest = path
    elif must_exist:
        raise FileNotFoundError(f"{what}: no such directory")
    else:  # it will be created below its nearest existing ancestor
        nearest = os.path.dirname(path)
        while not os.path.lexists(nearest):
            nearest = os.path.dirname(nearest)
        if not os.path.isdir(nearest):
            raise NotADirectoryError(f"{what} cannot be created: {nearest} is not a directory")
    if writable and not os.access(nearest, os.W_OK | os.X_OK):
        raise PermissionError(f"{what}: {nearest} is not writable")


def _check_safetensors_headers(directory: str) -> None:
    """Opens every safetensors file of a Hugging Face checkpoint (headers only, milliseconds):
    a truncated or damaged one, or a tensor whose shape is not what config.json's sizes make
    (`tfjax.interop.pretrained.check_pretrained`), is named before any work. Torch files have
    no such cheap read."""
    from tfjax.interop.core import files
    from tfjax.interop.pretrained import check_pretrained

    names = os.listdir(directory)
    if files.SAFETENSORS in names or files.SAFETENSORS_INDEX in names:
        check_pretrained(directory)


def _adapters_only_workdir(path: str) -> bool:
    """A LoRA run from a Hugging Face checkpoint: its checkpoints hold only the adapters (see
    tfjax.runner.train's Saver)."""
    base = os.path.join(path, pretrained.KEPT, pretrained.BASE_FILE)
    if not (os.path.isfile(base) and os.path.isfile(os.path.join(path, workdirs.CONFIG_FILE))):
        return False
    lora = workdirs.read_config(path).get("lora")
    return bool(lora and lora.get("rank"))
