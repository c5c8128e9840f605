"""Multimodal `...ForConditionalGeneration` checkpoints read as their text model.

A published Gemma 3 4B / 12B / 27B is a wrapper: config.json holds the text model's config as
`text_config` (beside `vision_config` and the image token ids), and its weights hold the text
model's under a prefix beside a vision tower and a multimodal projector, which tfjax does not
load. `WRAPPERS` is the one table of such architectures, a line each: the text architecture
whose family (`tables.Family`) reads `text_config`, and the parts skipped. `wrapped` makes the
wrapper's family from the text family's:

  config    `text_config`, with the keys the wrapper's config holds at its top level (`top`:
            transformers 5's Gemma3Config ties the head by its own tie_word_embeddings, True
            when absent) read from there, and the text config class's defaults for the keys
            it leaves out (`text_defaults`); a `text_config` of another model_type is refused,
            and one setting a key the wrapper's forward does not apply (`unapplied`: Gemma 3's
            final_logit_softcapping, which only Gemma3ForCausalLM applies)
  keys      the text family's "model." -> "model.language_model." (transformers 5's names) or
            "language_model.model." (the older files'), "lm_head." -> "lm_head." or
            "language_model.lm_head." (`TEXT_KEYS`); the checkpoint's keys decide which
  skipped   each of `skipped` at the top level or under "model." (the two layouts' places);
            `convert` logs how many tensors of each it skipped. Any other key the text rules
            do not read is refused as usual, every key and shape checked before a tensor is read

The export of the loaded model is the text family's (`Gemma3ForCausalLM`): text only, which
`interop.export` says. A new wrapper whose text family exists is one line of `WRAPPERS`, e.g.
    Wrapper("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen 3.5, text part",
            ("visual",), top={"tie_word_embeddings": False}),  # Qwen3_5Config's default
`with_wrappers` adds each line's row to the family that loads its text architecture.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tfjax.interop.core import convert
from tfjax.interop.core.registry import Converts, Row
from tfjax.interop.core.rules import Rule
from tfjax.interop.core.tables import Family, model_fields

# The text model's key prefixes -> the wrapper's: transformers 5's names first (its in-memory
# state dict), then the older files' (what the Hub's Gemma 3 files and save_pretrained hold).
TEXT_KEYS = (
    {"model.": "model.language_model.", "lm_head.": "lm_head."},
    {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
)
SKIPPED_UNDER = ("model.", "")  # where a skipped part sits in either layout


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A multimodal architecture read as its text model (one line of `WRAPPERS`)."""

    architecture: str  # config.json's architecture: "Gemma3ForConditionalGeneration"
    text: str  # the text model's architecture, whose family reads text_config
    source: str  # the docs table's "source" cell
    skipped: tuple[str, ...]  # the sub-modules tfjax does not load: ("vision_tower", ...)
    # text_config keys the wrapper's config holds at its top level -> transformers' default
    top: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"tie_word_embeddings": True}
    )
    # the text config class's defaults for the keys the Hub's text_config leaves out (its
    # files write only what differs: gemma-3-4b-it's names no vocab_size or heads)
    text_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # text_config keys the wrapper's forward does not apply, refused unless null (the text
    # model would apply them, and the logits differ)
    unapplied: tuple[str, ...] = ()
    layouts: tuple[Mapping[str, str], ...] = TEXT_KEYS


# transformers' Gemma3TextConfig defaults where tfjax's Gemma 3 table has none or another
# (sizes it requires, num_key_value_heads, sliding_window: Gemma3ForCausalLM configs write them)
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}

WRAPPERS = (
    Wrapper(
        "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM",
        "Gemma 3 4B / 12B / 27B (multimodal), text part",
        ("vision_tower", "multi_modal_projector"),
        text_defaults=GEMMA3_TEXT_DEFAULTS,
        unapplied=("final_logit_softcapping",),  # only Gemma3ForCausalLM caps its logits
    ),
    # Qwen3.5's published checkpoints (Qwen3_5Config: untied unless it says so); "mtp" the
    # multi-token-prediction head at the top level, which transformers skips too.
    Wrapper(
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3.5 (image-text), text part",
        ("visual", "mtp"),
        top={"tie_word_embeddings": False},
    ),
    Wrapper(
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3.5-MoE (image-text), text part",
        ("visual", "mtp"),
        top={"tie_word_embeddings": False},
    ),
    # Llama 4 Scout and Maverick as published (Llama4Config: untied unless it says so); the
    # language model's keys under "language_model." (transformers 5 keeps that name).
    Wrapper(
        "Llama4ForConditionalGeneration",
        "Llama4ForCausalLM",
        "Llama 4 Scout / Maverick (image-text), text part",
        ("vision_model", "multi_modal_projector"),
        top={"tie_word_embeddings": False},
    ),
)


def text_config(wrapper: Wrapper, text: Family, config: dict) -> dict:
    """The text family's config dict of a wrapper's config: its text_config, with the keys the
    wrapper holds at its top level (`wrapper.top`) taken from there."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        found = "none" if inner is None else f"a {type(inner).__name__}"
        raise ValueError(
            f"{wrapper.architecture}: the config has no text_config object (found {found})"
        )
    kind = inner.get("model_type")
    if kind is not None and kind != text.model_type:
        raise ValueError(
            f"{wrapper.architecture}: text_config.model_type={kind!r} is not supported (needs "
            f"{text.model_type!r}, the text model {text.architecture})"
        )
    for key in wrapper.unapplied:
        if inner.get(key) is not None:
            raise ValueError(
                f"{wrapper.architecture}: text_config.{key}={inner[key]!r} is not supported "
                f"(needs null): {wrapper.architecture} does not apply it, {text.architecture} "
                "does, so which model is meant is unclear"
            )
    top = {k: config.get(k, default) for k, default in wrapper.top.items()}
    return {**wrapper.text_defaults, **inner, **top}


def renamed(key: str, layout: Mapping[str, str]) -> str:
    """A text-model key (or ignore pattern) under the wrapper's prefix for it; a key under no
    text prefix (a "*..." pattern) stays as it is."""
    for theirs, ours in layout.items():
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    return key


def _rename_rules(rules: Sequence[Rule], layout: Mapping[str, str], what: str) -> list[Rule]:
    out = []
    for rule in rules:
        keys = tuple(renamed(k, layout) for k in rule.keys)
        stray = [k for k in keys if not any(k.startswith(p) for p in layout.values())]
        if stray:  # a converter bug: a text key under no prefix the table maps
            raise ValueError(f"{what}: no wrapper prefix for the text keys {stray}")
        out.append(dataclasses.replace(rule, keys=keys))
    return out


def _layout_index(wrapper: Wrapper, text: Family, state) -> int:
    """The layout whose base-model prefix the checkpoint's keys use (the first when none)."""
    for i, layout in enumerate(wrapper.layouts):
        where = layout[text.prefix]
        if any(k.startswith(where) for k in state):
            return i
    return 0


def wrapped(wrapper: Wrapper, text: Family) -> Family:
    """The family reading a `wrapper` checkpoint as `text`'s model (read only: the export is
    the text family's)."""
    what = wrapper.architecture
    named = dataclasses.replace(text, architecture=f"{what} (text_config)")

    def rules(model, prefix="", *, layout: int = 0, **options):
        del prefix  # the text family's own, renamed by the layout
        return _rename_rules(
            text.rules(model, text.prefix, **options), wrapper.layouts[layout], what
        )

    def tied(model, prefix=""):  # each layout's pairs: a checkpoint holds one layout's keys
        del prefix
        pairs = text.tied(model, text.prefix).items()
        return {renamed(k, lay): renamed(v, lay) for lay in wrapper.layouts for k, v in pairs}

    layouts = wrapper.layouts
    return dataclasses.replace(
        text,
        architecture=what,
        config=(),
        rules=rules,
        prefix="",
        bare="",
        ignore=tuple(dict.fromkeys(renamed(p, lay) for lay in layouts for p in text.ignore)),
        skip=tuple(f"{under}{name}.*" for under in SKIPPED_UNDER for name in wrapper.skipped),
        tied=tied,
        layout=lambda state: {"layout": _layout_index(wrapper, text, state), **text.layout(state)},
        read=lambda family, c: model_fields(named, text_config(wrapper, text, c)),
        write=None,
    )


def with_wrappers(converts: Sequence[Converts], wrappers=WRAPPERS) -> list[Converts]:
    """`converts` with each wrapper's row added to the family that loads its text architecture
    (after that family's rows: the docs table's order); a wrapper whose text architecture no
    family loads with a config table is a ValueError."""
    out = list(converts)
    for wrapper in wrappers:
        at = [
            i
            for i, c in enumerate(out)
            if wrapper.text in c.loads and hasattr(c.loads[wrapper.text], "family")
        ]
        if not at:
            raise ValueError(
                f"{wrapper.architecture}: no family loads its text model {wrapper.text} from a "
                "config table"
            )
        c = out[at[0]]
        out[at[0]] = dataclasses.replace(c, rows=(*c.rows, _row(wrapper, c)))
    return out


def _row(wrapper: Wrapper, converts: Converts) -> Row:
    family = converts.loads[wrapper.text].family
    text_row = next(r for r in converts.rows if wrapper.text in r.loads)
    return Row(
        wrapper.source,
        f"`load` / exported as `{wrapper.text}` (text only)",
        text_row.model,
        f"(`text_config` read as `{wrapper.text}`'s; "
        + ", ".join(f"`{name}`" for name in wrapper.skipped)
        + " skipped)",
        loads={wrapper.architecture: loader(wrapped(wrapper, family))},
    )


def loader(family: Family) -> Callable:
    """`load(source, config=None, **overrides)` of a wrapper's family (`family` set, for a
    run starting from it)."""

    def load(source, config=None, **overrides):
        return convert.from_hf(family, source, config, **overrides)

    load.__doc__ = (
        f"(tfjax model, params) of a {family.architecture} checkpoint's text model, from a "
        "directory or (state dict, config)."
    )
    load.__name__ = load.__qualname__ = f"load_{family.architecture}"
    load.family = family
    return load


def text_only(architecture: str, wrappers=WRAPPERS) -> list[str]:
    """The wrappers whose text model `architecture` is (an export of it is text only)."""
    return [w.architecture for w in wrappers if w.text == architecture]
