"""Config tables: a Hugging Face architecture's config.json <-> a tfjax model's fields.

A `Family` is one architecture: a table of `Field`s (a config key <-> a model field) and `Fixed`
keys (a key no model field holds, supported at one value), the model fields the architecture
fixes (`requires`), and the function giving its key rules. `model_fields` reads a config through
the table and `hf_config` writes one, so load and save read the same table both ways; every
refusal names the key, its value and what tfjax supports. Adding an architecture is adding a
family (see `convert` for the load and save every table-driven family shares).
"""

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfjax.interop.core.files import as_config
from tfjax.interop.core.rules import Rule

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
    skip: tuple[str, ...] = ()  # fnmatch patterns of the parts tfjax does not load (a
    # multimodal model's vision tower): not read, and a log line counts them
    tied: Callable[..., dict] = lambda model, prefix: {}  # key -> the key it must equal
    layout: Callable[..., dict] = lambda state: {}  # state dict -> keyword arguments of `rules`
    # that how a checkpoint stores its tensors decides (a mixture's experts one tensor each, or
    # fused); the export passes none: the rules' defaults are the layout it writes
    # Keys a table cannot tie to one field (DINOv2's mlp_ratio and use_swiglu_ffn): `read`
    # (family, config dict) -> fields replaces `table_fields`, `write` (family, model) -> config
    # replaces `table_config`; both call those for the rest.
    read: Callable[..., dict] | None = None
    write: Callable[..., dict] | None = None


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
    """The tfjax model fields a Hugging Face config (a dict, a transformers config or a path)
    means; a ValueError names any key whose value tfjax does not support, and the values it
    does."""
    c = as_config(config)
    return table_fields(family, c) if family.read is None else family.read(family, c)


def table_fields(family: Family, c: dict) -> dict:
    """The model fields of a config dict by the family's table alone."""
    what = family.architecture
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
    return table_config(family, model) if family.write is None else family.write(family, model)


def table_config(family: Family, model: nn.Module) -> dict:
    """The config dict of a model by the family's table alone."""
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


def bert_like(dropout: float, eps: float) -> tuple[Field, ...]:
    """The sizes and rates BertConfig and the configs modelled on it (ViTConfig, Dinov2Config)
    name alike, with the family's defaults for the rates and the norms' epsilon."""
    return (
        Field("hidden_size", "width"),
        Field("num_hidden_layers", "num_layers"),
        Field("num_attention_heads", "num_heads"),
        Field("hidden_dropout_prob", "dropout_rate", dropout),
        Field("attention_probs_dropout_prob", "attention_dropout_rate", dropout),
        Field("layer_norm_eps", "norm_eps", eps),
    )
