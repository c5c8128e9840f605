"""The machinery every converter shares: checkpoint files, key rules and config tables.

A Hugging Face architecture is a `Family`: a table of `Field`s and `Fixed` keys that ties its
config.json to the tfjax model's fields, and a function giving its key `Rule`s. `from_hf` and
`to_hf` read the same family both ways, so adding an architecture is adding a family.

The key mapping is a list of `Rule`s, each tying one or more PyTorch state-dict keys to one or more
tfjax parameter paths, with a function each way. `import_state` applies the rules to a state
dict and checks everything before returning: a missing key, an unexpected key or a shape that
does not match the model built from the config is a ValueError that names the key and the file
it came from, so nothing is ever loaded half-way. `export_state` runs the same rules backwards.

Parameter trees here are the plain "params" collection (no {"params": ...} wrapper, no logical
boxes), in the unrolled layout (`layers_0`, `layers_1`, ...); `finish` stacks them for models
with `scan_layers=True` and `unrolled` undoes that before export.
"""

import dataclasses
import fnmatch
import json
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfjax.nn import scanned_to_unrolled, unrolled_to_scanned

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
CONFIG = "config.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)

Path = tuple[str, ...]


# ----------------------------------------------------------------------------------------------
# Files.


class StateDict(dict):
    """name -> numpy array, remembering which file each name came from (for error messages)."""

    def __init__(self, arrays=(), files=None, origin="<state dict>"):
        super().__init__(arrays)
        self.files = dict(files or {})
        self.origin = origin

    def where(self, key: str) -> str:
        return self.files.get(key, self.origin)


def as_state_dict(state, origin="<state dict>") -> StateDict:
    """A StateDict of numpy arrays from torch tensors, numpy arrays or a StateDict."""
    if isinstance(state, StateDict):
        return state
    if not isinstance(state, dict):
        raise ValueError(f"expected a state dict (name -> tensor), got {type(state).__name__}")
    return StateDict({k: _to_numpy(v) for k, v in state.items()}, origin=origin)


def _to_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch  # noqa: PLC0415 (torch is optional)

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes  # noqa: PLC0415

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def _read_safetensors(path):
    from safetensors.numpy import load_file  # noqa: PLC0415 (an optional dependency)

    return load_file(path)


def _read_torch(path):
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"reading {path} needs torch; or convert it to safetensors") from e
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: _to_numpy(v) for k, v in state.items()}


def read_state_dict(directory) -> StateDict:
    """All weights in a local checkpoint directory (safetensors first, then torch files).

    Reads model.safetensors, a sharded model.safetensors.index.json, pytorch_model.bin or its
    index. Raises FileNotFoundError naming the directory and the files looked for.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    for name, reader in (
        (SAFETENSORS, _read_safetensors),
        (SAFETENSORS_INDEX, _read_safetensors),
        (TORCH_BIN, _read_torch),
        (TORCH_BIN_INDEX, _read_torch),
    ):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        else:
            shards = [name]
        state = StateDict(origin=path)
        for shard in shards:
            shard_path = os.path.join(directory, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(f"{path} lists the shard {shard!r}, which is missing")
            for key, value in reader(shard_path).items():
                state[key] = value
                state.files[key] = shard_path
        return state
    raise FileNotFoundError(
        f"no weights in {directory!r}: looked for {', '.join(WEIGHT_FILES)}; "
        f"found {listing(os.listdir(directory)) or 'nothing'}"
    )


def read_config(directory) -> dict:
    """The Hugging Face config.json of a checkpoint directory, as a dict."""
    path = os.path.join(os.fspath(directory), CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {CONFIG} in {os.fspath(directory)!r}")
    with open(path) as f:
        return json.load(f)


def as_config(config) -> dict:
    """A config dict from a dict, a transformers PretrainedConfig or a directory."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, str | os.PathLike):
        return read_config(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"config must be a dict, a PretrainedConfig or a path, got {type(config)}")


def load_source(source, config=None) -> tuple[StateDict, dict]:
    """(state dict, config dict) from a checkpoint directory, or a state dict and its config."""
    if isinstance(source, dict):
        if config is None:
            raise ValueError("a state dict needs its config (a dict or a transformers config)")
        return as_state_dict(source), as_config(config)
    state = read_state_dict(source)
    return state, as_config(source if config is None else config)


def write_safetensors(state: dict, directory, config: dict | None = None) -> str:
    """Writes model.safetensors (and config.json) into directory; returns the weights' path."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SAFETENSORS)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path, {"format": "pt"})
    if config is not None:
        with open(os.path.join(directory, CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return path


# ----------------------------------------------------------------------------------------------
# Rules.


@dataclasses.dataclass(frozen=True)
class Rule:
    """keys (PyTorch) <-> paths (tfjax). `to_jax(*arrays, shapes)` -> tuple, `to_torch(*params)`
    -> tuple; both must be exact (transposes, reshapes, splits), so round trips are bitwise."""

    keys: tuple[str, ...]
    paths: tuple[Path, ...]
    to_jax: Callable
    to_torch: Callable


def _one(fn):
    return lambda *xs: (fn(*xs),)


def identity(key, path) -> Rule:
    """Same shape on both sides (norm scales, biases, embeddings, Conv1D kernels [in, out])."""
    return Rule((key,), (path,), lambda x, shapes: (x,), lambda y: (y,))


def linear(key, path) -> Rule:
    """torch.nn.Linear weight [out, in] <-> Dense kernel [in, out] or attention [D, N, H]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.T.reshape(shapes[0]),),
        _one(lambda y: y.reshape(y.shape[0], -1).T),
    )


def linear_out(key, path) -> Rule:
    """torch.nn.Linear weight [D, N*H] <-> attention out_kernel [N, H, D]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.T.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1, y.shape[-1]).T),
    )


def reshaped(key, path) -> Rule:
    """A flat bias [N*H] <-> [N, H] (or any shape with the same elements, flattened back)."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1)),
    )


def rows_out(key, path) -> Rule:
    """GPT-2's Conv1D weight [N*H, D] (already [in, out]) <-> attention out_kernel [N, H, D]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        _one(lambda y: y.reshape(-1, y.shape[-1])),
    )


def merged_rows(key, paths) -> Rule:
    """One [in, N*H]-like tensor split into len(paths) params along its last axis (GPT-2's
    fused c_attn: [D, 3D] -> query/key/value [D, N, H]; bias [3D] -> [N, H] each)."""

    def to_jax(x, shapes):
        parts = np.split(x, len(paths), axis=-1)
        return tuple(p.reshape(s) for p, s in zip(parts, shapes, strict=True))

    def to_torch(*ys):
        flat = [y.reshape(-1) if y.ndim == 2 else y.reshape(y.shape[0], -1) for y in ys]
        return (jnp.concatenate(flat, axis=-1),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def stacked_linear(key, paths) -> Rule:
    """torch MHA's in_proj_weight [3 D, D] (rows q, k, v) <-> three [D, N, H] kernels; for a
    1-D in_proj_bias [3 D] <-> three [N, H] biases."""

    def to_jax(x, shapes):
        parts = np.split(x, len(paths), axis=0)
        if x.ndim == 1:
            return tuple(p.reshape(s) for p, s in zip(parts, shapes, strict=True))
        return tuple(p.T.reshape(s) for p, s in zip(parts, shapes, strict=True))

    def to_torch(*ys):
        if ys[0].ndim == 2:
            return (jnp.concatenate([y.reshape(-1) for y in ys]),)
        return (jnp.concatenate([y.reshape(y.shape[0], -1).T for y in ys], axis=0),)

    return Rule((key,), tuple(paths), to_jax, to_torch)


def conv(key, path) -> Rule:
    """torch Conv2d weight [out, in, kh, kw] <-> Flax Conv kernel [kh, kw, in, out]."""
    return Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.transpose(2, 3, 1, 0),),
        _one(lambda y: y.transpose(3, 2, 0, 1)),
    )


def norm(key, path) -> list[Rule]:
    """A LayerNorm's weight and bias <-> a Flax LayerNorm's scale and bias."""
    return [identity(f"{key}.weight", (*path, "scale")), identity(f"{key}.bias", (*path, "bias"))]


def dense(key, path) -> list[Rule]:
    """A torch.nn.Linear with bias <-> a Flax Dense."""
    return [linear(f"{key}.weight", (*path, "kernel")), identity(f"{key}.bias", (*path, "bias"))]


# ----------------------------------------------------------------------------------------------
# Trees.


def flatten(tree, prefix: Path = ()) -> dict[Path, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def unflatten(flat: dict[Path, object]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def param_shapes(model: nn.Module, *inputs, **kwargs) -> dict[Path, jax.ShapeDtypeStruct]:
    """Flat path -> ShapeDtypeStruct of `model`'s params, in the unrolled layout (no compute)."""
    if getattr(model, "scan_layers", False):
        model = model.clone(scan_layers=False)
    shapes = jax.eval_shape(lambda *xs: model.init(jax.random.key(0), *xs, **kwargs), *inputs)
    return flatten(nn.unbox(shapes["params"]))


def _fmt(path: Path) -> str:
    return "/".join(path)


def listing(names, limit=8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def import_state(
    state: StateDict,
    rules: Sequence[Rule],
    expected: dict[Path, jax.ShapeDtypeStruct],
    *,
    what: str,
    ignore: Sequence[str] = (),
    tied: dict[str, str] | None = None,
) -> dict:
    """Applies `rules` to `state`; returns the unrolled params tree (numpy, expected dtypes).

    Args:
      expected: the params of the model built from the config (from `param_shapes`).
      what: the architecture's name, for messages ("GPT2LMHeadModel").
      ignore: fnmatch patterns of keys that hold no parameters (buffers like rotary inv_freq).
      tied: optional key -> key it must equal (an output matrix tied to the embeddings).
    Raises:
      ValueError naming every missing or unexpected key, or the first key whose shape does not
      match, and the file it is in.
    """
    used = set()
    missing = [k for r in rules for k in r.keys if k not in state]
    if missing:
        sample = listing(state)
        raise ValueError(
            f"{what}: {len(missing)} key(s) missing from {state.origin}: {listing(missing)}. "
            f"The checkpoint holds {len(state)} keys such as {sample}; is it a {what} checkpoint "
            "of the configured size?"
        )
    flat = {}
    for rule in rules:
        for path in rule.paths:
            if path not in expected:  # a converter bug, not a user error; still say what
                raise ValueError(f"{what}: the model has no parameter {_fmt(path)}")
        structs = [expected[p] for p in rule.paths]
        want = jax.eval_shape(rule.to_torch, *structs)
        arrays = [state[k] for k in rule.keys]
        for key, arr, w in zip(rule.keys, arrays, want, strict=True):
            if tuple(arr.shape) != tuple(w.shape):
                raise ValueError(
                    f"{what}: {key!r} in {state.where(key)} has shape {tuple(arr.shape)}, but the "
                    f"model built from the config expects {tuple(w.shape)} (for "
                    f"{', '.join(_fmt(p) for p in rule.paths)}); do the config and the weights "
                    "belong together?"
                )
        outs = rule.to_jax(*arrays, [s.shape for s in structs])
        for path, out, s in zip(rule.paths, outs, structs, strict=True):
            flat[path] = np.asarray(out).astype(s.dtype)
        used.update(rule.keys)
    for key, source in (tied or {}).items():
        if key in state:
            used.add(key)
            if not np.array_equal(state[key], state[source]):
                raise ValueError(
                    f"{what}: {key!r} in {state.where(key)} differs from {source!r}, but the "
                    "model ties them (one matrix); set the config's tie_word_embeddings to False "
                    "if they are separate"
                )
    unexpected = [
        k for k in state if k not in used and not any(fnmatch.fnmatch(k, p) for p in ignore)
    ]
    if unexpected:
        raise ValueError(
            f"{what}: {len(unexpected)} unexpected key(s) in {state.origin}: "
            f"{listing(unexpected)}; the checkpoint holds weights this model has no place for "
            "(another architecture or head?)"
        )
    absent = sorted(set(expected) - set(flat))
    if absent:
        raise ValueError(
            f"{what}: no weights for the model's parameters {listing(map(_fmt, absent))}"
        )
    return unflatten(flat)


def export_state(params, rules: Sequence[Rule]) -> dict[str, np.ndarray]:
    """The inverse of `import_state`: unrolled params tree -> {torch key: numpy array}."""
    flat = flatten(nn.unbox(params))
    out = {}
    for rule in rules:
        for path in rule.paths:
            if path not in flat:
                raise ValueError(f"params have no {_fmt(path)}; do they belong to this model?")
        outs = rule.to_torch(*(np.asarray(flat[p]) for p in rule.paths))
        for key, value in zip(rule.keys, outs, strict=True):
            out[key] = np.asarray(value)
    covered = {p for r in rules for p in r.paths}
    extra = sorted(set(flat) - covered)
    if extra:
        raise ValueError(
            f"params hold {listing(map(_fmt, extra))}, which the export has no key for"
        )
    return out


def finish(model: nn.Module, params: dict):
    """Unrolled numpy params -> jax arrays in the model's layout (stacked for scan_layers)."""
    params = jax.tree.map(jnp.asarray, params)
    if getattr(model, "scan_layers", False):
        params = unrolled_to_scanned(params)
    return params


def unrolled(model: nn.Module, params):
    """The params in the unrolled layout (the layout the rules are written for)."""
    params = nn.unbox(params)
    if isinstance(params, dict) and set(params) == {"params"}:
        params = params["params"]
    if getattr(model, "scan_layers", False):
        params = scanned_to_unrolled(params)
    return params


# ----------------------------------------------------------------------------------------------
# Config tables: one per Hugging Face architecture, read by load and by save.

REQUIRED = object()  # Field.default: a config without the key is refused
TOKENS = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # an example token batch, to trace shapes


@dataclasses.dataclass(frozen=True)
class Field:
    """A config.json key <-> a model field. Several keys may hold one field (Marian's encoder_
    and decoder_layers); load then refuses a config where they differ, and save writes each."""

    key: str  # dotted for nested dicts: "rope_parameters.rope_theta"
    field: str  # the tfjax model's field
    default: Any = REQUIRED  # what a config without the key (or with null) means; None: nothing
    # (the field's other keys or the family's defaults decide); a callable gets the fields so far
    values: Mapping | None = None  # config value -> field value, the only values supported;
    # save writes the first config value that maps to the model's
    to_model: Callable | None = None  # (config value, fields read so far) -> field value (after
    # `values`); a ValueError it raises is a refusal (the family's name is put before it)
    to_config: Callable | None = None  # field value -> config value (after `values`)
    why: str = ""  # added to a refusal
    read: bool = True  # False: written by save, not read (a rate tfjax does not keep apart)
    write: bool = True  # False: read by load, not written (an older spelling)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A config.json key no model field holds, supported at one value: load refuses any other,
    save writes it."""

    key: str
    value: Any  # or a callable of the model's fields ("head_dim": width // num_heads)
    default: Any = None  # what a config without the key means; None: `value`
    why: str = ""
    read: bool = True  # False: written by save only (a value tfjax's numbers do not depend on)
    write: bool = True  # False: read by load only (an older spelling)


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face architecture <-> a tfjax model: its config table and its key rules."""

    architecture: str  # the config's "architectures" entry; names the family in messages
    model_type: str  # the config's "model_type"
    model: Callable  # the tfjax model factory (decoder.Model)
    config: tuple[Field | Fixed, ...]  # read in order; a callable default sees earlier fields
    rules: Callable[..., list[Rule]]  # (model, prefix) -> the state-dict key rules
    inputs: tuple = (TOKENS,)  # example inputs (arrays or ShapeDtypeStructs) to trace shapes
    prefix: str = ""  # the base model's key prefix in the full model's state dict ("model.")
    bare: str = ""  # how a bare base model's keys start ("layers."); "" when not read
    requires: dict = dataclasses.field(default_factory=dict)  # model fields the architecture
    # fixes: load sets them, save refuses a model with others
    defaults: dict = dataclasses.field(default_factory=dict)  # model fields its config does
    # not hold: load sets them unless the config does
    ignore: tuple[str, ...] = ()  # fnmatch patterns of keys that hold buffers, not parameters
    tied: Callable[..., dict] = lambda model, prefix: {}  # key -> the key it must equal


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _put(config: dict, key: str, value):
    *parents, last = key.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def _pairs(fields: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())


def _why(entry) -> str:
    return f" ({entry.why})" if entry.why else ""


def model_fields(family: Family, config) -> dict:
    """The tfjax model fields a Hugging Face config means; a ValueError names any key whose
    value tfjax does not support, and the values it does."""
    c, what = as_config(config), family.architecture
    fields, keys, raw = {}, {}, {}
    for entry in family.config:
        if not entry.read:
            continue
        value = _lookup(c, entry.key)
        if isinstance(entry, Fixed):
            want = entry.value(fields) if callable(entry.value) else entry.value
            if value is None:
                value = want if entry.default is None else entry.default
            if value != want:
                raise ValueError(
                    f"{what}: {entry.key}={value!r} is not supported (needs {want!r}){_why(entry)}"
                )
            continue
        if value is None:
            if entry.default is REQUIRED:
                raise ValueError(f"{what}: the config has no {entry.key!r}")
            if entry.default is None:
                continue
            value = entry.default(fields) if callable(entry.default) else entry.default
        given = value
        if entry.values is not None:
            if not isinstance(value, Hashable) or value not in entry.values:
                raise ValueError(
                    f"{what}: {entry.key}={value!r} is not supported; allowed: "
                    f"{tuple(entry.values)}{_why(entry)}"
                )
            value = entry.values[value]
        if entry.to_model is not None:
            try:
                value = entry.to_model(value, fields)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
        name = entry.field
        if name in fields and fields[name] != value:
            raise ValueError(
                f"{what}: {keys[name]}={raw[name]!r} differs from {entry.key}={given!r}; tfjax's "
                f"model has one {name} for both"
            )
        fields[name], keys[name], raw[name] = value, entry.key, given
    return {**family.defaults, **fields, **family.requires}


def build(family: Family, config, **overrides):
    """The tfjax model of a Hugging Face config; `overrides` set fields (scan_layers, dtype)."""
    return family.model(**{**model_fields(family, config), **overrides})


def hf_config(family: Family, model: nn.Module) -> dict:
    """The Hugging Face config dict of a tfjax model; a ValueError names any field the
    architecture cannot express."""
    what = family.architecture
    names = {e.field for e in family.config if isinstance(e, Field)} | set(family.requires)
    if not all(hasattr(model, n) for n in names):
        raise ValueError(f"{what}: no export for a {type(model).__name__}")
    have = {k: getattr(model, k) for k in family.requires}
    if have != family.requires:
        raise ValueError(f"{what} needs a model with {_pairs(family.requires)}; got {_pairs(have)}")
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}
    config = {"architectures": [what], "model_type": family.model_type}
    written = {}  # key -> the field that wrote it
    for entry in family.config:
        if not entry.write:
            continue
        if isinstance(entry, Fixed):
            _put(config, entry.key, entry.value(fields) if callable(entry.value) else entry.value)
            continue
        value = fields[entry.field]
        if entry.values is not None:
            names = [k for k, v in entry.values.items() if v == value]
            if not names:
                supported = tuple(dict.fromkeys(entry.values.values()))
                raise ValueError(
                    f"{what} has no {entry.key} for the model's {entry.field}={value!r}; "
                    f"supported: {supported}"
                )
            value = names[0]
        if entry.to_config is not None:
            value = entry.to_config(value)
        earlier = written.get(entry.key)
        if earlier is not None and fields[earlier] != fields[entry.field]:
            raise ValueError(
                f"{what} has one {entry.key} for the model's {earlier}={fields[earlier]!r} and "
                f"{entry.field}={fields[entry.field]!r}"
            )
        written[entry.key] = entry.field
        _put(config, entry.key, value)
    return config


def key_prefix(family: Family, state: StateDict) -> str:
    """The family's prefix, or "" for a bare base model's state dict (GPT2Model's "h.0...")."""
    if family.bare and not any(k.startswith(family.prefix) for k in state):
        if any(k.startswith(family.bare) for k in state):
            return ""
    return family.prefix


def import_params(family: Family, model, state: StateDict, *, inputs=None, rules=None):
    """`model`'s params from `state` by the family's rules (or `rules`), every key checked, in
    the model's layout. `inputs` replace the family's example inputs (ViT's image size)."""
    prefix = key_prefix(family, state)
    params = import_state(
        state,
        family.rules(model, prefix) if rules is None else rules,
        param_shapes(model, *(family.inputs if inputs is None else inputs)),
        what=family.architecture,
        ignore=family.ignore,
        tied=family.tied(model, prefix),
    )
    return finish(model, params)


def from_hf(family: Family, source, config=None, **overrides):
    """(tfjax model, params) from a checkpoint directory or (state dict, config)."""
    state, c = load_source(source, config)
    model = build(family, c, **overrides)
    return model, import_params(family, model, state)


def to_hf(family: Family, model, params, *, rules=None):
    """({Hugging Face key: numpy array}, config dict) for a tfjax model of the family."""
    config = hf_config(family, model)
    rules = family.rules(model, family.prefix) if rules is None else rules
    return export_state(unrolled(model, params), rules), config


def _id2label(n: int) -> dict:
    return {str(i): f"LABEL_{i}" for i in range(n)}


def _label2id(n: int) -> dict:
    return {f"LABEL_{i}": i for i in range(n)}


# num_classes <-> id2label / label2id; num_labels is read when id2label is absent.
LABELS = (
    Field(
        "id2label", "num_classes", None, to_model=lambda labels, _: len(labels), to_config=_id2label
    ),
    Field("label2id", "num_classes", None, read=False, to_config=_label2id),
    Field("num_labels", "num_classes", None, write=False),
)
