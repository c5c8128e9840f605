"""A run's parameters as a Hugging Face checkpoint directory, or its LoRA adapters as a peft
adapter directory (`experiments/export.py`).

    from tfjax.runner import export
    export.export_run("/tmp/ft", "/tmp/ft_hf")          # the newest checkpoint; step=N for another
    export.export_run("/tmp/ft", "/tmp/ft_lora", adapters_only=True)   # a LoRA run's adapters

The full export writes what `transformers`' `from_pretrained` and `generate` read: config.json
(the family's, with the special token ids), generation_config.json, the weights
(model.safetensors, or shards with an index above 5 GB; LoRA adapters merged into their
kernels) and the tokenizer files of the checkpoint the run started from (`workdir/pretrained`,
see `tfjax.runner.pretrained`). A run trained from scratch gets the ids of tfjax's own
tokenizers and no tokenizer files. A vision run's export holds its head's class names as
id2label / label2id and the checkpoint's preprocessor_config.json, and no
generation_config.json; a model Hugging Face has no class for (a CLIP or SigLIP tower with a
linear head) is refused, naming what each class needs. A QLoRA run's adapters are merged into
the dequantized kernels they were trained on: the export computes the trained model.

`adapters_only=True` writes a LoRA run's adapters alone, as `peft` saves them:
adapter_config.json (LORA, CAUSAL_LM, r, lora_alpha, lora_dropout, the Hugging Face names of
the adapted Linear layers as target_modules, base_model_name_or_path = config.init_from) and
adapter_model.safetensors, beside the same tokenizer files. Loaded onto the checkpoint the run
started from,

    base = transformers.AutoModelForCausalLM.from_pretrained(init_from)
    model = peft.PeftModel.from_pretrained(base, "/tmp/ft_lora")

it computes what the full export computes. Each adapted kernel maps to the Linear layer its
converter writes it as (`tfjax.interop`'s key rules): the kernel's x W + (x A) B alpha / r,
with W in its matmul layout [in, out] (the attention kernels [D, N, H] as [D, N H]), is the
layer's x V.T + lora_B(lora_A(x)) lora_alpha / r with V = W.T [out, in] the converter's
weight, so lora_A.weight = A.T [r, in] and lora_B.weight = B.T [out, r] (peft's scale is
tfjax's: lora_alpha / r, no rsLoRA). A Conv1D layer (GPT-2's: its weight is W [in, out]
itself) takes the same lora_A and lora_B, with fan_in_fan_out. A layer that holds several
kernels side by side (GPT-2's c_attn [D, 3 D]: query, key and value) takes them all:
lora_A [k r, in] stacks the adapted kernels' A.T, lora_B [out, k r] holds each kernel's B.T
in its columns (zero in the columns of a kernel not adapted), so its rank is k r and its alpha
k alpha (rank_pattern, alpha_pattern): the same scale, the same sum.

Refused by name before anything is written (all but the last before the checkpoint is read):
a run without LoRA (lora.rank 0), a QLoRA run (lora.base_dtype: its adapters were trained on
the quantized base, which no base peft loads reproduces: the float checkpoint gives other
logits and bitsandbytes quantizes otherwise; the full export, adapters merged into the
dequantized kernels, is the trained model), a config.init_from that is not the Hugging Face
checkpoint directory the run started from (from scratch, from another run's workdir, or
moved), a checkpoint that is not a decoder-only LM (what AutoModelForCausalLM loads: GPT-2's
GPT2LMHeadModel too), a kernel that no Linear or Conv1D layer of the checkpoint holds as
its matmul (an embedding as the tied output head), and a dense or shared MLP layer named as a
mixture's experts' Linear layers (DeepSeek-V3's mlp.gate_proj: peft maps that name onto the
experts' fused weights).

`init_from` (experiments/export.py's --config.init_from, the flag run.py and decode.py take) is
the checkpoint's new place when it has moved since the run; the base found there must be the
one the run recorded (`pretrained.check_base`), and the adapters' base_model_name_or_path
names it.

`output` is written whole or not at all: everything goes into a hidden directory beside it
(".NAME" STAGED "XXXXXXXX", created before the checkpoint is read, so an unwritable `output` is
refused first), synced and renamed to `output` at the end; an existing `output` is never
touched. A read-only or full file system (the space is checked before writing, too) is an
ExportWriteError naming `output` and why, the partial directory removed. An export killed
part-way leaves its hidden directory; the next export into the same parent removes it (each
export holds an flock on its own, so a live one's is left alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import shutil
import tempfile

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from tfjax import lora
from tfjax.models import decoder
from tfjax.models.common import linen_of
from tfjax.nnx.functional import Functional
from tfjax.runner import checkpoint, pretrained, train, workdirs

GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# peft's file names (peft.utils.constants CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME) and the prefix
# of its LoRA tensors' keys: PeftModelForCausalLM.base_model (LoraModel).model (the base).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class ExportWriteError(OSError):
    """`output` could not be written (a read-only or full file system, no permission): the
    message names it and why; nothing is left there (see the module docstring)."""

    def __str__(self):
        return self.strerror  # the line itself, without "[Errno N]"


def export_run(
    workdir: str,
    output: str,
    *,
    step: int | None = None,
    adapters_only: bool = False,
    init_from: str | None = None,
) -> str:
    """Writes the run's parameters (newest checkpoint, or `step`) to `output` as a Hugging Face
    checkpoint directory, or with `adapters_only` its LoRA adapters as a peft adapter directory
    (see the module docstring); returns `output`. `init_from`: where the checkpoint the run
    started from is now, when it has moved (the run's config.init_from otherwise). Refuses an
    existing `output`, an unwritable one, a `workdir` that is a Hugging Face checkpoint (not a
    run's: nothing to export) and a run without LoRA or Hugging Face base (`adapters_only`)
    before any work, and adapters peft cannot load before writing."""
    from tfjax import interop  # safetensors: the interop extra
    from tfjax.interop.pretrained import family_of

    output = os.path.abspath(os.path.expanduser(output))
    if os.path.lexists(output):
        raise FileExistsError(f"--output={output!r} exists; give a new directory")
    if pretrained.is_checkpoint_dir(workdir) and not checkpoint.has_checkpoint(workdir):
        # Its config.json is Hugging Face's, not a run's: read as one, it failed by a field.
        raise ValueError(
            f"--workdir={workdir!r} is a Hugging Face checkpoint, not a run's workdir (it has "
            "no checkpoints/): there is nothing to export; transformers and --config.init_from "
            "take it as it is"
        )
    config = workdirs.read_config(workdir)
    if init_from:
        if not config.get("init_from"):
            raise ValueError(
                f"--config.init_from={init_from!r}: the run did not start from a checkpoint "
                "(its config.json has no init_from); leave the flag out"
            )
        config.init_from = init_from
    kept = os.path.join(workdir, pretrained.KEPT)
    base = _adapter_base(config, kept) if adapters_only else None
    staged = _Staged(output)  # writable, before the checkpoint is read
    try:
        model, params, tokenizer = train.restore_model(
            config,
            workdir,
            step=step,
            devices=jax.devices()[:1],
            merge_lora=not adapters_only,
            float_base=adapters_only,
        )
        params = jax.device_get(params)
        if isinstance(model, Functional):  # model.api="nnx": the Linen model of the same params
            model = linen_of(model.spec)
        if adapters_only:
            layers, targets = adapter_layers(model, params, _peft_family(*family_of(base)))
            state = _state(layers)
            adapter_config = _adapter_config(config, base, targets, layers)
        else:
            state, hf_config = interop.export(model, params)
            ids = _special_ids(kept, tokenizer)
            hf_config.update({k: v for k, v in ids.items() if v is not None})
            classes = os.path.join(workdir, pretrained.CLASSES)
            if os.path.isfile(classes):  # the head's labels by name
                with open(classes) as f:
                    names = json.load(f)
                hf_config["id2label"] = {str(i): name for i, name in enumerate(names)}
                hf_config["label2id"] = {name: i for i, name in enumerate(names)}
        staged.check_space(sum(np.asarray(v).nbytes for v in state.values()))
        with staged.writing():
            tmp = staged.path
            if adapters_only:  # the tokenizer files; the model's config is the base's
                _write_adapters(state, adapter_config, tmp)
                skip = ("config.json", GENERATION_CONFIG)
            else:
                interop.write_safetensors(state, tmp, hf_config)
                skip = ("config.json",)
            for name in pretrained.SMALL_FILES:
                path = os.path.join(kept, name)
                if name not in skip and os.path.isfile(path):
                    shutil.copy2(path, os.path.join(tmp, name))
            if (
                not adapters_only
                and tokenizer is not None
                and not os.path.exists(os.path.join(tmp, GENERATION_CONFIG))
            ):
                with open(os.path.join(tmp, GENERATION_CONFIG), "w") as f:
                    json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
            staged.finish()
    finally:
        staged.close()
    return output


# Every export writes into a hidden directory beside `output`, ".{name}" + STAGED + 8 random
# characters, renamed to `output` once all is written and synced. It holds an flock on the
# directory while its export lives: one that was killed leaves it unlocked, and the next export
# into the same parent removes every such unlocked directory (a live export's stays).
STAGED = ".tfjax-export-"


class _Staged:
    """The hidden directory an export writes into (see STAGED), made (its parent too) when
    created: an unwritable `output` is an ExportWriteError before any work."""

    def __init__(self, output: str):
        self.output = output
        self.parent, name = os.path.split(output)
        self.path, self._fd = None, None
        with self.writing():
            os.makedirs(self.parent, exist_ok=True)
            remove_stale(self.parent)
            for _ in range(3):  # a stale-directory sweep of another export may take a new one
                self.path = tempfile.mkdtemp(prefix=f".{name}{STAGED}", dir=self.parent)
                self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                _lock(self._fd, blocking=True)
                if os.path.isdir(self.path) and os.path.samestat(
                    os.fstat(self._fd), os.stat(self.path)
                ):
                    return
                os.close(self._fd)
            raise OSError(errno.EBUSY, "other exports keep removing its temporary directory")

    @contextlib.contextmanager
    def writing(self):
        """OSErrors (and safetensors' errors of the OS) while writing: an ExportWriteError
        naming `output`, the partial directory removed."""
        try:
            yield
        except Exception as e:
            code = _os_error_code(e)
            name = os.path.abspath(getattr(e, "filename", None) or self.parent)
            if code is None or not (name.startswith(self.parent) or self.parent.startswith(name)):
                raise  # not a write here (a file of the workdir that could not be read)
            self.close()
            reason = os.strerror(code).lower()
            if code == errno.ENOSPC:
                reason += f" ({_free(self.parent)})"
                what = "make room, or give another --output"
            else:
                what = "give another --output, one this user may write"
            raise ExportWriteError(
                code,
                f"--output={self.output!r} could not be written: {reason} (in {self.parent}); "
                f"nothing was left there; {what}",
            ) from None

    def check_space(self, size: int) -> None:
        """An ExportWriteError when the file system of `output` has less than `size` bytes
        free, before anything is written."""
        free = shutil.disk_usage(self.path).free
        if size > free:
            self.remove()
            raise ExportWriteError(
                errno.ENOSPC,
                f"--output={self.output!r}: the export needs {_size(size)}, and its file system "
                f"has {_free(self.parent)}; nothing was written; make room or give another "
                "--output",
            )

    def finish(self) -> None:
        """Syncs every file and renames the directory to `output` (call inside `writing`)."""
        for entry in os.scandir(self.path):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.path, 0o777 & ~umask)  # as os.makedirs would make it (mkdtemp's is 0700)
        os.fsync(self._fd)
        if os.path.lexists(self.output):  # made by someone else meanwhile: never replaced
            raise FileExistsError(f"--output={self.output!r} exists; give a new directory")
        os.rename(self.path, self.output)
        self.path = None
        parent = os.open(self.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(parent)
        finally:
            os.close(parent)

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def close(self) -> None:
        """Removes what is left unless `finish` renamed it, and lets the lock go."""
        self.remove()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def remove_stale(parent: str) -> list[str]:
    """Removes the directories in `parent` that exports killed part-way left (STAGED, no longer
    locked); returns their paths. A live export's (locked) is left alone."""
    removed = []
    for entry in os.scandir(parent):
        if STAGED not in entry.name or not entry.name.startswith("."):
            continue
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # not this user's: not an export of theirs either
            continue
        try:
            if not _lock(fd, blocking=False):
                continue  # a live export's
            logging.warning(
                "Removing %s: an export into %s that did not finish (killed?) left it",
                entry.path,
                parent,
            )
            shutil.rmtree(entry.path)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


def _lock(fd: int, *, blocking: bool) -> bool:
    """flock(fd): False when another process holds it (not blocking); True where the file
    system cannot lock (nothing to tell a live export by there)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    return True


def _os_error_code(e: BaseException) -> int | None:
    """The errno of an OSError, or of safetensors' SafetensorError ("... (os error 28)"), which
    is no OSError; None for anything else."""
    if isinstance(e, OSError) and not isinstance(e, ExportWriteError):
        return e.errno
    if type(e).__name__ == "SafetensorError":
        found = re.search(r"\(os error (\d+)\)", str(e))
        return int(found.group(1)) if found else None
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _free(path: str) -> str:
    usage = shutil.disk_usage(path)
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _adapter_base(config, kept: str) -> str:
    """The checkpoint directory a LoRA run started from (config.init_from, absolute), which
    peft loads the adapters onto; a ValueError naming --adapters_only when there is none."""
    from tfjax import interop
    from tfjax.interop.pretrained import family_of, pretrained_model

    flag = "--adapters_only"
    if not config.get("lora") or not config.lora.get("rank"):
        raise ValueError(
            f"{flag}: the run has no LoRA adapters (lora.rank=0: every parameter trained); "
            "export the whole model without the flag"
        )
    if config.lora.get("base_dtype"):
        raise ValueError(
            f"{flag}: lora.base_dtype={config.lora.base_dtype!r}: this QLoRA run's adapters were "
            "trained on its quantized base, which no base that peft loads reproduces (the float "
            "checkpoint gives other logits, and bitsandbytes' 4- and 8-bit bases are other "
            "quantizers); export without the flag: the adapters merged into the dequantized "
            "kernels they were trained on, the trained model itself"
        )
    init_from = config.get("init_from") or ""
    if not init_from:
        raise ValueError(
            f"{flag}: the run trained from scratch (config.init_from is empty), so there is no "
            "Hugging Face checkpoint to load the adapters onto; export without the flag"
        )
    base = os.path.abspath(os.path.expanduser(init_from))
    if not pretrained.is_checkpoint_dir(base):
        raise ValueError(
            f"{flag}: config.init_from={init_from!r} is not a Hugging Face checkpoint directory "
            "(config.json and weights), so peft has no base to load the adapters onto (a run's "
            "workdir, or a checkpoint moved since the run); export without the flag"
        )
    started = os.path.join(kept, "config.json")
    if os.path.isfile(started) and interop.read_config(base) != interop.read_config(kept):
        raise ValueError(
            f"{flag}: the config.json of config.init_from={init_from!r} differs from the one "
            f"the run started from ({started}): the adapters belong to another base"
        )
    if not isinstance(pretrained_model(base), decoder.Decoder):  # no weights read
        raise ValueError(
            f"{flag}: config.init_from={init_from!r} is a {family_of(base)[0].architecture}"
            ", not a decoder-only LM; peft adapters are written for causal LMs (task_type "
            "CAUSAL_LM) only"
        )
    return base


def _peft_family(family, config: dict):
    """The family whose key names peft's modules take: the checkpoint's, unless
    AutoModelForCausalLM loads the multimodal wrapper as its text model (transformers 5: a
    Qwen3_5ForConditionalGeneration as a Qwen3_5ForCausalLM, whose layers are model.layers.i...,
    not model.language_model.layers.i...; a Gemma 3 one stays itself)."""
    from transformers.models.auto import modeling_auto

    from tfjax.interop import ARCHITECTURES
    from tfjax.interop.core import multimodal

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    for wrapper in multimodal.WRAPPERS:
        if wrapper.architecture == family.architecture and causal == wrapper.text:
            return ARCHITECTURES[wrapper.text].family
    return family


@dataclasses.dataclass(frozen=True)
class PeftLayer:
    """A layer of the checkpoint that peft adapts: `module` (its Hugging Face name), lora_A
    weight `a` [R, in] and lora_B weight `b` [out, R], R the rank times `parts`, the adapted
    kernels written into the layer (GPT-2's c_attn holds query, key and value: A stacks theirs,
    B places each kernel's beside the others' in the columns its kernel fills, zero where a
    kernel in it is not adapted); `conv1d`: its weight is a Conv1D's [in, out]."""

    module: str
    a: np.ndarray
    b: np.ndarray
    parts: int
    conv1d: bool


def adapter_state(model, params, family) -> tuple[dict[str, np.ndarray], list[str]]:
    """({peft key: array}, target_modules) of the LoRA adapters in `params` (the LoRA `model`'s,
    unboxed on the host), named by `family`'s key rules (`tfjax.interop.core.tables.Family`):
    each layer of `adapter_layers` gets its lora_A.weight and lora_B.weight."""
    layers, targets = adapter_layers(model, params, family)
    return _state(layers), targets


def _state(layers: list[PeftLayer]) -> dict[str, np.ndarray]:
    state = {}
    for layer in layers:
        state[f"{PEFT_PREFIX}{layer.module}.lora_A.weight"] = layer.a
        state[f"{PEFT_PREFIX}{layer.module}.lora_B.weight"] = layer.b
    return state


def adapter_layers(model, params, family) -> tuple[list[PeftLayer], list[str]]:
    """(the layers peft adapts, target_modules) for the LoRA adapters in `params` (see
    `adapter_state`): each adapted kernel's layer is the one its key rule writes it into, a
    Linear weight [out, in] (the kernel's matmul layout [in, out] transposed) or a Conv1D [in,
    out], alone or beside other kernels' columns, checked on index probes.
    target_modules: the layers' last names ("q_proj") when they name exactly the adapted
    layers, else their full names. A kernel with no such layer is a ValueError naming it."""
    from tfjax.interop.core import rules as key_rules

    flat = key_rules.flatten(key_rules.unrolled(model, nn.unbox(params)))
    rules = family.rules(model, family.prefix)
    by_path = {path: rule for rule in rules for path in rule.paths}
    suffix_a, suffix_b = lora.ADAPTER_SUFFIXES
    adapted, groups = {}, {}  # kernel path -> (A, B); id(rule) -> (rule, its adapted paths)
    for path in sorted(flat):
        if not path[-1].endswith(suffix_a):
            continue
        kernel_path = (*path[:-1], path[-1][: -len(suffix_a)])
        b_path = (*path[:-1], kernel_path[-1] + suffix_b)
        adapted[kernel_path] = np.asarray(flat[path]), np.asarray(flat[b_path])
        rule = by_path.get(kernel_path)
        if rule is None:
            raise ValueError(
                f"--adapters_only: the adapted kernel {'/'.join(kernel_path)} has no key in the "
                f"{family.architecture} converter"
            )
        key = _key_of(rule, kernel_path, flat)
        groups.setdefault((id(rule), key), (rule, key, []))[2].append(kernel_path)
    if not adapted:
        raise ValueError("the params hold no LoRA adapters")
    _refuse_expert_names([(rule.keys[k], paths) for rule, k, paths in groups.values()], rules)
    layers = sorted(
        (_peft_layer(rule, k, paths, flat, adapted) for rule, k, paths in groups.values()),
        key=lambda layer: layer.module,
    )
    modules = [layer.module for layer in layers]
    last = {m.rsplit(".", 1)[-1] for m in modules}
    named = {
        k[: -len(".weight")]
        for rule in rules
        for k in rule.keys
        if k.endswith(".weight") and k[: -len(".weight")].rsplit(".", 1)[-1] in last
    }
    return layers, sorted(last) if named == set(modules) else modules


def _refuse_expert_names(groups, rules) -> None:
    """peft (0.21, with transformers 5) loads a target module named as a mixture's expert
    Linear (gate_proj, up_proj, down_proj of mlp.experts.j) onto the experts' fused weights
    (gate_up_proj, down_proj), whichever layer it names: adapters of a dense layer or a shared
    expert under those names (DeepSeek-V3's) would not load onto their layer. Refused by name."""
    experts = set()
    for rule in rules:
        for key in rule.keys:
            if ".experts." in key:
                parts = key.split(".experts.", 1)[1].split(".")
                experts.add(parts[-2] if parts[-1] == "weight" else parts[-1])
    if "gate_up_proj" in experts:  # transformers 5's fused experts: peft maps both halves there
        experts |= {"gate_proj", "up_proj"}
    for key, paths in groups:
        module = key.removesuffix(".weight")
        name = module.rsplit(".", 1)[-1]
        if ".experts." not in module and name in experts:
            raise ValueError(
                f"--adapters_only: the adapted kernel {'/'.join(paths[0])} is written as "
                f"{module}, named as the mixture's experts' {name} layers: peft (with "
                "transformers 5) loads adapters on any layer of that name onto the experts' "
                "fused weights, not onto this one; export without the flag (adapters merged) or "
                "leave it out of lora.targets"
            )


def _probes(rule, flat, numbered=None) -> list[np.ndarray]:
    """Index arrays shaped as the rule's params: each element of the params `numbered` (their
    indices in rule.paths; all when None) its own index, in order; the others' -1."""
    probes, start = [], 0
    for j, path in enumerate(rule.paths):
        shape = flat[path].shape
        if numbered is None or j in numbered:
            size = math.prod(shape)
            probes.append(np.arange(start, start + size, dtype=np.int64).reshape(shape))
            start += size
        else:
            probes.append(np.full(shape, -1, np.int64))
    return probes


def _key_of(rule, path, flat) -> int:
    """The index of the key of `rule` that holds the kernel `path` (its first element): a rule
    may write several layers (Qwen3.5's Gated DeltaNet: in_proj_qkv, in_proj_z, out_proj, ...)."""
    probes = _probes(rule, flat)
    first = probes[rule.paths.index(path)].flat[0]
    written = rule.to_torch(*probes)
    return next(k for k, w in enumerate(written) if (np.asarray(w) == first).any())


def _peft_layer(rule, k: int, paths, flat, adapted) -> PeftLayer:
    """The layer `rule` writes the adapted kernels `paths` into as its key k (with the rule's
    other kernels there, adapted or not), its lora_A and lora_B: see PeftLayer."""
    where = f"--adapters_only: the adapted kernel {'/'.join(paths[0])}"
    instead = "export without the flag (adapters merged) or leave it out of lora.targets"
    key = rule.keys[k]
    if not key.endswith(".weight"):
        raise ValueError(f"{where} is written as {key}: no layer weight for peft's LoRA; {instead}")
    fan_in = None
    for path in paths:
        a, b = adapted[path]
        shape = flat[path].shape
        fan_in, fan_out = math.prod(a.shape[:-1]), math.prod(b.shape[1:])
        if fan_in * fan_out != math.prod(shape):
            raise ValueError(
                f"--adapters_only: the adapted kernel {'/'.join(path)}: its adapters A "
                f"{a.shape} and B {b.shape} do not fit its shape {shape}"
            )
    if len({math.prod(adapted[p][0].shape[:-1]) for p in paths}) != 1:
        raise ValueError(f"{where} shares {key} with kernels of other inputs; {instead}")
    probes = _probes(rule, flat)
    first = np.asarray(rule.to_torch(*probes)[k])
    inside = [j for j, p in enumerate(probes) if np.isin(p.flat[0], first)]  # written there
    probes = _probes(rule, flat, inside)
    written = np.asarray(rule.to_torch(*probes)[k])
    found = _columns(written, [probes[j] for j in inside], fan_in)
    if found is None:
        raise ValueError(
            f"{where} is written as {key} {written.shape}, neither a Linear weight [out, in] nor "
            f"a Conv1D [in, out] of its matmul's {fan_in} inputs (the kernels of "
            f"{', '.join('/'.join(rule.paths[j]) for j in inside)} side by side); {instead}"
        )
    conv1d, owner, column = found
    here = [rule.paths[j] for j in inside]  # owner indexes these
    ordered = [p for p in here if p in paths]  # the rule's order
    rank = adapted[ordered[0]][0].shape[-1]
    dtype = np.result_type(*(adapted[p][1] for p in ordered))
    a_parts, b_all = [], np.zeros((len(owner), rank * len(ordered)), dtype)
    for t, path in enumerate(ordered):
        a, b = adapted[path]
        a_parts.append(a.reshape(fan_in, rank).T)
        mine = np.flatnonzero(owner == here.index(path))
        b_all[mine, t * rank : (t + 1) * rank] = b.reshape(rank, -1).T[column[mine]]
    return PeftLayer(key[: -len(".weight")], np.concatenate(a_parts), b_all, len(ordered), conv1d)


def _columns(written, probes, fan_in: int):
    """How the written weight (of index `probes`, one per kernel of its rule) lays the kernels'
    matmuls [fan_in, out_j] out: (conv1d, owner, column), for each output column of the
    layer the kernel (index into probes) and the column of its matmul it is; None when it is
    neither a Conv1D [in, out] nor a Linear [out, in] of them, whole and each once."""
    sizes = [p.size for p in probes]
    if written.ndim != 2 or any(size % fan_in for size in sizes):
        return None
    starts = np.cumsum([0, *sizes])
    owner_of = np.repeat(np.arange(len(sizes)), sizes)
    outs = np.array([size // fan_in for size in sizes])
    for conv1d, oriented in ((True, written), (False, written.T)):
        if oriented.shape != (fan_in, outs.sum()):
            continue
        ids = oriented.astype(np.int64)
        owner = owner_of[ids]
        local = ids - starts[owner]
        row, column = local // outs[owner], local % outs[owner]
        if (
            (row == np.arange(fan_in)[:, None]).all()
            and (owner == owner[0]).all()
            and (column == column[0]).all()
            and len(set(zip(owner[0].tolist(), column[0].tolist(), strict=True))) == outs.sum()
        ):
            return conv1d, owner[0], column[0]
    return None


def _adapter_config(config, base: str, targets: list[str], layers: list[PeftLayer]) -> dict:
    """peft's LoraConfig of the run's adapters: tfjax's scale alpha / rank is peft's without
    rsLoRA; the adapters' dropout is on their input, as peft's. A layer holding k adapted
    kernels has rank k r and alpha k alpha (rank_pattern, alpha_pattern: the same scale);
    fan_in_fan_out for Conv1D layers (GPT-2's)."""
    rank, alpha = int(config.lora.rank), float(config.lora.alpha)
    fused = [layer for layer in layers if layer.parts > 1]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": float(config.lora.dropout),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": all(layer.conv1d for layer in layers),
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {layer.module: rank * layer.parts for layer in fused},
        "alpha_pattern": {layer.module: alpha * layer.parts for layer in fused},
    }


def _write_adapters(state: dict, adapter_config: dict, directory: str) -> None:
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
    save_file(arrays, os.path.join(directory, ADAPTER_WEIGHTS), {"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)


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
