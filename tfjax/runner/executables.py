"""Executables saved for launch: the programs a run starts with (the state's initialisation, the
train and eval steps) compiled ahead of time, loaded by the runner at start-up instead of being
traced, lowered and compiled there.

    python experiments/compile.py --config=configs/lm.py:gpt2-small --topology=v5e:4x4 \\
        --save=/ckpt/gpt2-small.v5e-4x4
    python experiments/run.py --config=configs/lm.py:gpt2-small --workdir=... \\
        --config.compiled_dir=/ckpt/gpt2-small.v5e-4x4

DIR holds, per program, `<name>.executable` (a pickle of the program serialized by
`jax.experimental.serialize_executable` with its argument and result pytree definitions) and
`manifest.json`: what they were compiled for (the config's fields that shape the program and
their fingerprint, with the model's fields as built and the bytes of a checkpoint's config and
tokenizer files, which decide the program where the config does not: `experiment_fields`; the
target: platform, device kind and count, processes, the mesh and its device order; the versions
of jax, jaxlib and the platform's compiler plugin) and each file's size, SHA-256 and argument
shapes and shardings.

The runner (config.compiled_dir) checks DIR before any work (`check_dir`: a missing directory
or manifest, a missing, truncated or altered file is an error naming the path), then, once the
steps are set up, uses a saved step when everything it was compiled for matches this run
(`use_saved`); when something differs it logs one line naming it ("compiled_dir=DIR: compiled
for jax 0.10.1, this is 0.10.2; compiling instead") and the step is compiled as usual. What is
compared is what the program depends on; a field such as log_every, eval_every, seed or the
checkpoint section is not part of it (`NOT_IN_PROGRAM`). compile.py plans the batches and the
vocabulary from the config; a run whose differ (a SentencePiece vocabulary smaller than the
dataset's vocab_size: set model.vocab_size to save for it) is told which argument differs.

The initialisation ("init": a new state, random parameters) is what a fresh run compiles
first, and on the CPU its compile takes longer than the train step's; a resumed run, or one
that starts from config.init_from, never calls it. The decode of an evaluation is not saved:
its program is specialised on the prompts' width and the tokenizer's EOS ids, known only once
data is read. `cpu:N` topologies compile for this host's CPU devices (tests, and measuring what
start-up saves: benchmarks/saved_executables.py).
Loading unpickles the files: point compiled_dir only at directories you wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pickle

import jax
from absl import logging

MANIFEST = "manifest.json"
FORMAT = 1
STEPS = ("init", "train", "eval")  # what the runner takes; decode is compiled at eval (above)
SUFFIX = ".executable"
# Config fields (top level or whole sections) that the train and eval programs do not depend on:
# host-side loop settings, where data and checkpoints live, and decode's (not saved).
NOT_IN_PROGRAM = (
    "compiled_dir",
    "seed",  # the dropout key is an argument of the train step
    "data_dir",
    "log_every",
    "eval_every",
    "eval_steps",
    "nonfinite",  # the step always guards; the host decides what a skip does
    "max_nonfinite_skips",
    "checkpoint",
    "profile",
    "decode",
)
# The package whose compiler made the program, beside jax and jaxlib, per platform.
COMPILER_PACKAGES = {"tpu": "libtpu", "cuda": "jax-cuda12-plugin"}


class SavedExecutablesError(ValueError):
    """config.compiled_dir cannot be used: missing, not a save, or a file damaged."""


# ------------------------------------------------------------------------ what they are for
def program_fields(config) -> dict:
    """{"optim.learning_rate": 0.001, ...}: the config's fields the programs depend on (all but
    NOT_IN_PROGRAM), as JSON gives them back."""
    flat = {}

    def walk(prefix, value):
        if hasattr(value, "items"):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    for key, value in config.items():
        if key not in NOT_IN_PROGRAM:
            walk(f"{key}.", value)
    return json.loads(json.dumps(flat, default=repr))


# A checkpoint's files that decide what its model computes and which ids it reads (config.init_from
# or the workdir's copy): the programs of a run from it are compiled for their bytes.
CHECKPOINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def experiment_fields(exp) -> dict:
    """`program_fields(exp.config)` and what decides the programs beyond the config: the model
    as built ("built model.rope_theta": a checkpoint's config.json sets fields the run's config
    never names) and a checkpoint's CHECKPOINT_FILES by their bytes ("checkpoint
    config.json": its SHA-256)."""
    fields = program_fields(exp.config)
    model = exp.base_model if exp.base_model is not None else exp.model
    model = getattr(model, "spec", model)  # an NNX model's Functional: its Linen spec
    for f in dataclasses.fields(model):
        if f.name not in ("parent", "name"):
            fields[f"built model.{f.name}"] = repr(getattr(model, f.name))
    if exp.pretrained is not None:
        for name in CHECKPOINT_FILES:
            path = os.path.join(exp.pretrained.config_dir, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    fields[f"checkpoint {name}"] = hashlib.sha256(f.read()).hexdigest()[:16]
    return fields


def fingerprint(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def target(mesh) -> dict:
    """The devices a program runs on: platform, kind, count, processes, mesh and device order."""
    devices = list(mesh.devices.flat)
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": len({d.process_index for d in devices}),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "device_ids": [int(d.id) for d in devices],
    }


def versions(platform: str) -> dict:
    """The versions of what compiled the program: jax, jaxlib and the platform's plugin."""
    out = {"jax": jax.__version__, "jaxlib": _version("jaxlib")}
    if platform in COMPILER_PACKAGES:
        out[COMPILER_PACKAGES[platform]] = _version(COMPILER_PACKAGES[platform])
    return out


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_arguments(exp) -> dict:
    """{step: its abstract arguments} as the runner calls them (`tfjax.runner.setup`; init as a
    fresh run does, with a key and no known parameters)."""
    return {
        "init": (exp.abstract_rng,),
        "train": (exp.abstract_state, exp.train_batch, exp.abstract_rng),
        "eval": (exp.abstract_state.params, exp.eval_batch),
    }


def signatures(exp) -> dict:
    """{step: one line per array argument, and for init per array of the state it returns (its
    only argument, a key, would not tell another model's state apart)}."""
    out = {step: describe_arguments(args) for step, args in step_arguments(exp).items()}
    out["init"] += [f"returns {line}" for line in describe_arguments(exp.abstract_state)]
    return out


def describe_arguments(args) -> list[str]:
    """One line per array argument: its path, dtype, shape and sharding."""
    lines = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", sharding)
        memory = getattr(sharding, "memory_kind", None)
        where = f" in {memory}" if memory not in (None, "device") else ""
        lines.append(f"{jax.tree_util.keystr(path)} {leaf.dtype}{list(leaf.shape)} {spec}{where}")
    return lines


# --------------------------------------------------------------------------------- saving
@contextlib.contextmanager
def fresh_compiles():
    """JAX's persistent compilation cache off while the block compiles programs to save: a
    program the cache gave back serializes without its machine code on the CPU (jaxlib 0.10:
    the loaded save fails at its first call with "Function slice_add_fusion.13 not found")."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides whether to use the cache once, at a compile
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def check_save_dir(directory: str) -> None:
    """`directory` can take a save: missing, empty, or an earlier save, finished or stopped
    part-way (its files, and the temporaries `_write` left, are replaced); anything else would
    lose files, and is refused before compiling."""
    path = os.path.abspath(os.path.expanduser(directory))
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise SavedExecutablesError(f"--save={directory}: is a file; a directory is needed")
    names = set(os.listdir(path))
    ours = {MANIFEST} | {s + SUFFIX for s in STEPS}
    ours |= {name + TMP for name in ours}
    if names - ours:
        raise SavedExecutablesError(
            f"--save={directory}: holds other files ({', '.join(sorted(names - ours)[:3])}); "
            "give a new directory or an earlier save, whose files are replaced"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise SavedExecutablesError(f"--save={directory}: is not writable")


def save(directory: str, exp, compiled: dict, *, name: str = "") -> list[str]:
    """Writes the train and eval executables of `compiled` ({step: jax.stages.Compiled} of
    `exp`, a tfjax.runner.setup.Experiment), with the state's initialisation beside the train
    step (compiled here: a report has nothing to say of it), and the manifest to `directory`;
    returns the paths. Each file appears whole (written aside, then renamed); the manifest
    comes last, so an interrupted save is no save."""
    from jax.experimental import serialize_executable

    check_save_dir(directory)
    if "train" in compiled and "init" not in compiled:
        compiled = {"init": exp.init.lower(*step_arguments(exp)["init"]).compile(), **compiled}
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest_path):  # an earlier save: it stops being one first
        os.remove(manifest_path)
    manifest = {**describe(exp), "config": name}
    described, paths = signatures(exp), []
    for step in STEPS:
        if step not in compiled:
            continue
        payload, in_tree, out_tree = serialize_executable.serialize(compiled[step])
        data = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
        path = os.path.join(directory, step + SUFFIX)
        _write(path, data)
        manifest["steps"][step] = {
            "file": step + SUFFIX,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "arguments": described[step],
        }
        paths.append(path)
    for step in set(STEPS) - set(compiled):  # an earlier save's program this one does not have
        stale = os.path.join(directory, step + SUFFIX)
        if os.path.exists(stale):
            os.remove(stale)
    for name in os.listdir(directory):  # what a save stopped part-way was writing
        if name.endswith(TMP):
            os.remove(os.path.join(directory, name))
    _write(manifest_path, json.dumps(manifest, indent=1).encode())
    return [*paths, manifest_path]


def describe(exp) -> dict:
    """The manifest of `exp`'s programs without their files: what they are compiled for (the
    fields, target and versions that `mismatch` compares)."""
    where = target(exp.mesh)
    fields = experiment_fields(exp)
    return {
        "format": FORMAT,
        "fingerprint": fingerprint(fields),
        "versions": versions(where["platform"]),
        "target": where,
        "environment": {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "steps": {},
        "fields": fields,
    }


TMP = ".tmp"  # a file being written (`_write`)


def _write(path: str, data: bytes) -> None:
    with open(path + TMP, "wb") as f:
        f.write(data)
    os.replace(path + TMP, path)


# -------------------------------------------------------------------------------- loading
def read_manifest(directory: str) -> dict:
    """The manifest of a save; SavedExecutablesError naming the path when there is none."""
    what = f"config.compiled_dir={directory!r}"
    path = os.path.abspath(os.path.expanduser(directory))
    if not os.path.isdir(path):
        raise SavedExecutablesError(
            f"{what}: no such directory (write one with experiments/compile.py --save=DIR)"
        )
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest["format"] != FORMAT or not isinstance(manifest["steps"], dict):
            raise ValueError(f"format {manifest['format']!r}, this tfjax reads {FORMAT}")
    except FileNotFoundError:
        raise SavedExecutablesError(
            f"{what}: {manifest_path} is missing: not a directory written by "
            "experiments/compile.py --save (or its save did not finish)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise SavedExecutablesError(f"{what}: {manifest_path} cannot be read: {e}") from None
    return manifest


def check_dir(directory: str) -> dict:
    """The manifest of a save (`read_manifest`), every file it lists present, whole and
    unaltered (size and SHA-256); else SavedExecutablesError naming the path. Made before any
    work."""
    manifest = read_manifest(directory)
    for step, entry in manifest["steps"].items():
        _read(directory, step, entry)
    return manifest


def _read(directory: str, step: str, entry: dict) -> bytes:
    """The bytes of a saved program's file, checked against the manifest's size and SHA-256."""
    what = f"config.compiled_dir={directory!r}"
    file = os.path.join(os.path.abspath(os.path.expanduser(directory)), entry["file"])
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SavedExecutablesError(
            f"{what}: the {step} program's {file} cannot be read ({e.strerror})"
        ) from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise SavedExecutablesError(
            f"{what}: {file} is damaged ({len(data)} bytes, {entry['bytes']} written; its "
            "SHA-256 differs from the manifest's): save it again with experiments/compile.py "
            "--save, or leave compiled_dir unset"
        )
    return data


def mismatch(manifest: dict, exp) -> str | None:
    """What differs between what a save was compiled for and this run (None: nothing), as
    "compiled for X, this run has Y"."""
    where = target(exp.mesh)
    t = manifest["target"]
    devices = f"{where['devices']} x {where['device_kind']}"
    if (t["devices"], t["device_kind"], t["platform"]) != (
        where["devices"],
        where["device_kind"],
        where["platform"],
    ):
        return f"compiled for {t['devices']} x {t['device_kind']}, this run has {devices}"
    if t["processes"] != where["processes"]:
        return f"compiled for {t['processes']} processes, this run has {where['processes']}"
    if t["mesh"] != where["mesh"]:
        return f"compiled for mesh {t['mesh']}, this run has {where['mesh']}"
    if t["device_ids"] != where["device_ids"]:
        return f"compiled for the devices {t['device_ids']}, this run has {where['device_ids']}"
    saved = manifest["versions"]
    now = versions(where["platform"])
    for package in sorted(set(saved) | set(now)):
        if saved.get(package) != now.get(package):
            return f"compiled for {package} {saved.get(package)}, this is {now.get(package)}"
    fields = experiment_fields(exp)
    if fingerprint(fields) != manifest["fingerprint"]:
        was = manifest["fields"]
        differ = sorted(k for k in set(was) | set(fields) if was.get(k, ...) != fields.get(k, ...))
        if differ:
            more = f" (and {len(differ) - 1} more fields)" if len(differ) > 1 else ""
            k = differ[0]
            return f"compiled for {k}={_value(was, k)}, this run has {_value(fields, k)}{more}"
        return "compiled for a config of another fingerprint"
    return None


def _value(fields: dict, key: str) -> str:
    return json.dumps(fields[key]) if key in fields else "(no such field)"


def use_saved(exp, directory: str):
    """`exp` (a tfjax.runner.setup.Experiment) with its init, train and eval programs loaded
    from `directory` where everything they were compiled for matches; what does not is compiled
    as usual, after one log line saying why."""
    manifest = read_manifest(directory)  # its files were checked before any work (check_dir)
    why = mismatch(manifest, exp)
    if why:
        logging.warning("compiled_dir=%s: %s; compiling instead", directory, why)
        return exp
    arguments, described, loaded = step_arguments(exp), signatures(exp), {}
    for step in STEPS:
        entry = manifest["steps"].get(step)
        if entry is None:
            logging.info("compiled_dir=%s has no %s program; compiling it", directory, step)
            continue
        now, was = described[step], entry["arguments"]
        if now != was:
            i = next((i for i, (a, b) in enumerate(zip(was, now, strict=False)) if a != b), None)
            why = (
                f"{len(was)} arguments, this run has {len(now)}"
                if i is None
                else f"{was[i]}, this run has {now[i]}"
            )
            logging.warning(
                "compiled_dir=%s: the %s program was compiled for %s; compiling instead",
                directory,
                step,
                why,
            )
            continue
        path = os.path.join(os.path.expanduser(directory), entry["file"])
        data = _read(directory, step, entry)
        try:
            loaded[f"{step}_step"] = _load(data, arguments[step], exp.mesh)
        except Exception as e:  # noqa: BLE001 - the run goes on, compiling, and says why
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            logging.warning(
                "compiled_dir=%s: %s could not be loaded (%s); compiling instead",
                directory,
                path,
                first,
            )
            continue
        logging.info(
            "The %s program: loaded from %s (compiled for %s x %s, mesh %s)",
            step,
            path,
            manifest["target"]["devices"],
            manifest["target"]["device_kind"],
            manifest["target"]["mesh"],
        )
    if "init_step" in loaded:  # a fresh run's; parameters given (init_from) are jitted
        loaded["init"] = _fresh_or_given(loaded.pop("init_step"), exp.init)
    return dataclasses.replace(exp, **loaded) if loaded else exp


def _fresh_or_given(saved, jitted):
    """exp.init: the saved program for a new state, the jitted one for parameters given."""

    def init(rng, known=None):
        return saved(rng) if known is None else jitted(rng, known)

    return init


def _load(data: bytes, args, mesh):
    """The jax.stages.Compiled of a saved program's file, on the mesh's devices; its argument
    structure must be the one the runner passes."""
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = pickle.loads(data)
    expected = jax.tree.structure((args, {}))
    if in_tree != expected:
        raise ValueError(f"its arguments are structured {in_tree}, the runner's {expected}")
    devices = list(mesh.devices.flat)  # the program's, in its order (checked: device_ids)
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
    )
