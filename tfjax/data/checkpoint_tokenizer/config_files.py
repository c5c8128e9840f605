"""The files of a checkpoint's tokenizer by name, and what its config files say of its tokens:
the added tokens (tokenizer_config.json's added_tokens_decoder, added_tokens.json), a named
special token's text, generation_config.json's ids; both backends and `CheckpointTokenizer`
read them, and word a file's errors in one line (`one_line`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
ADDED_TOKENS = "added_tokens.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
# Every file `load` reads when present (and `save` writes back), the tokenizer files first.
FILES = (
    TOKENIZER_JSON,
    SENTENCEPIECE_MODEL,
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS_MAP,
    ADDED_TOKENS,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
)
# The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def added_tokens(config: Mapping[str, Any], added_json: Mapping[str, Any], where: str):
    """(id, {"content", "special", ...}) of tokenizer_config.json's added_tokens_decoder and
    added_tokens.json, in id order."""
    tokens = {}
    for token, token_id in added_json.items():
        if not isinstance(token_id, int):
            raise ValueError(f"{where}/{ADDED_TOKENS}: {token!r} needs an integer id.")
        tokens[token_id] = {"content": token, "special": False}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise ValueError(f"{where}/{TOKENIZER_CONFIG}: added_tokens_decoder must be an object.")
    for key, spec in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(
                f"{where}/{TOKENIZER_CONFIG}: added_tokens_decoder key {key!r} is not an id."
            ) from None
        if isinstance(spec, str):
            spec = {"content": spec}
        if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
            raise ValueError(
                f"{where}/{TOKENIZER_CONFIG}: added_tokens_decoder[{key!r}] needs a 'content' "
                "string."
            )
        tokens[token_id] = dict(spec)
    return sorted(tokens.items())


def token_text(value: Any, source: str, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f'{source}: {name} must be a string or {{"content": ...}}, got {type(value).__name__}.'
    )


def generation_ids(config: Mapping[str, Any], source: str, vocab_size: int) -> dict:
    """generation_config.json's bos/pad ids (int or None) and eos ids (a list)."""
    out = {}
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = config.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if type(v) is not int or not 0 <= v < vocab_size:
                raise ValueError(
                    f"{source}: {key} must be an id below the vocabulary size {vocab_size} (or "
                    f"a list of them for eos_token_id), got {value!r}."
                )
        if key == "eos_token_id":
            out[key] = values
        elif isinstance(value, list):
            raise ValueError(f"{source}: {key} must be one id, got {value!r}.")
        else:
            out[key] = value
    return out


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
