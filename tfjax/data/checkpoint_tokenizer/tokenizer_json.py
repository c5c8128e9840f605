"""The backend of a checkpoint's tokenizer.json: the `tokenizers` library, and why it refused
a file, in one line."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tfjax.data.checkpoint_tokenizer.config_files import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    one_line,
)


class TokenizersBackend:
    """tokenizer.json through the `tokenizers` library."""

    file = TOKENIZER_JSON

    def __init__(self, data: bytes, where: str):
        import tokenizers

        self._tokenizers = tokenizers
        try:
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:
            raise ValueError(
                _unreadable_tokenizer_json(data, f"{where}/{TOKENIZER_JSON}", e)
            ) from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self._post_processor = self._tok.post_processor
        # Without a post-processor the ids are the same (no special tokens are added) and the
        # offsets are the pre-tokenizer's own (ByteLevel's trim_offsets would shrink them).
        self._tok.post_processor = None

    def add_token(self, token_id: int, spec: Mapping[str, Any], where: str) -> None:
        """An added token that tokenizer_config.json declares; tokenizer.json must agree."""
        content = spec["content"]
        known = self._tok.token_to_id(content)
        if known is None:
            added = self._tokenizers.AddedToken(
                content,
                special=bool(spec.get("special", False)),
                **{
                    k: bool(spec[k])
                    for k in ("lstrip", "rstrip", "single_word", "normalized")
                    if k in spec
                },
            )
            self._tok.add_tokens([added])
            known = self._tok.token_to_id(content)
        if known != token_id:
            raise ValueError(
                f"{where}: {TOKENIZER_CONFIG} gives added token {content!r} id {token_id}, "
                f"{TOKENIZER_JSON} gives it {known}."
            )

    def mark_special(self, content: str, token_id: int) -> None:
        """A named special token is matched whole in text and dropped by decode, as
        transformers makes it (an added token marked special)."""
        added = self._tok.get_added_tokens_decoder().get(token_id)
        if added is None or added.content != content:
            self._tok.add_special_tokens(
                [self._tokenizers.AddedToken(content, special=True, normalized=False)]
            )

    def default_tokens(self) -> dict[str, str]:
        return {}

    def token_to_id(self, content: str) -> int | None:
        return self._tok.token_to_id(content)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def max_id(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values())

    def special_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def adds_bos(self, bos_id: int, config_add_bos: bool) -> bool:
        """Whether tokenizer.json's post-processor starts a single sequence with bos."""
        if self._post_processor is None:
            return False
        self._tok.post_processor = self._post_processor
        try:
            ids = self._tok.encode("a", add_special_tokens=True).ids
        finally:
            self._tok.post_processor = None
        return bool(ids) and ids[0] == bos_id

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int], *, special: bool) -> str:
        # The caller has dropped what it does not show; the rest is written, special or not.
        return self._tok.decode(ids, skip_special_tokens=False)


def _unreadable_tokenizer_json(data: bytes, name: str, error: BaseException) -> str:
    """Why the tokenizers library refused tokenizer.json `name`, in one line with what to do:
    empty, cut short, not JSON, JSON of something else, or a tokenizer it cannot read."""
    from tfjax.data.tokenizers import not_the_file

    fix = "download it again"
    damage = not_the_file(data)
    if damage is not None:
        return f"{name} is not a tokenizer: {damage}; {fix}"
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        # json names the start of a string that never ends, else where it stopped: the end.
        if isinstance(e, json.JSONDecodeError) and (
            e.msg.startswith("Unterminated string") or e.pos >= len(e.doc.rstrip())
        ):
            return f"{name} is cut short: its JSON ends mid-way, after {len(data)} bytes; {fix}"
        return f"{name} is not valid JSON ({one_line(e)}): damaged; {fix}"
    if not isinstance(value, dict) or "model" not in value:
        held = (
            f"an object with keys {sorted(value)[:8]}"
            if isinstance(value, dict)
            else f"a JSON {type(value).__name__}"
        )
        return (
            f"{name} is JSON but not a tokenizer: it holds {held}, and a tokenizer.json has a "
            f"'model'; {fix}"
        )
    import tokenizers

    return (
        f"{name} cannot be read by the tokenizers library {tokenizers.__version__} "
        f"({one_line(error)}): {fix}, or, if the checkpoint is newer than this library, "
        "`pip install -U tokenizers`"
    )
