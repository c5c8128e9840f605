"""The tokenizer and chat template of a Hugging Face checkpoint, and training examples from rows.

    tok = CheckpointTokenizer.load("/path/to/Qwen2.5-0.5B-Instruct")   # a local directory
    tok.encode("Hello") -> int32 [n]          # no special tokens added
    tok.decode(ids) -> str                    # up to the first stop id, control tokens dropped
    tok.decode(ids, whole=True) -> str        # a prompt: every id, special tokens as text
    tok.render_chat(messages, add_generation_prompt=True) -> str   # the checkpoint's template
    tok.encode_chat(messages, add_generation_prompt=True) -> int32 [n]  # a prompt to generate from
    tok.save(workdir)                         # the files it was loaded from, byte for byte

Neither transformers nor torch is imported. Files read from the directory:

  tokenizer.json          through the `tokenizers` library (preferred when both are there)
  tokenizer.model         else through `sentencepiece`
  tokenizer_config.json   bos/eos/pad/unk/... tokens (strings or {"content": ...}),
                          added_tokens_decoder, chat_template (a string, or a list of named
                          templates: "default" is used), add_bos_token and legacy (SentencePiece)
  chat_template.jinja     the template as newer transformers save it; wins over the config's
  special_tokens_map.json the named tokens tokenizer_config.json leaves out
  added_tokens.json       older SentencePiece checkpoints' added tokens {"token": id}
  generation_config.json  eos_token_id (an int or a list: all of them stop generation),
                          bos_token_id and pad_token_id where the tokenizer names none

A damaged file (empty, cut short, not JSON, JSON of something else, a Git LFS pointer, bytes
SentencePiece cannot parse) is a ValueError of one line naming it and what to do.

Ids: `bos_id`, `pad_id` are None where the checkpoint has none (never assumed to be 0);
`eos_id` is the tokenizer's eos (else generation_config's first); `eos_ids` are every id
generation stops at, `eos_id` first. `vocab_size` is max id + 1 over the base vocabulary and
the added tokens (the model's embedding may be larger: ids past it are never produced).
`add_bos` says whether a document starts with bos, as the checkpoint does it: for
tokenizer.json, whether its post-processor adds bos (Llama 3, Gemma: yes; Qwen: no; the
config's add_bos_token is ignored there, as transformers does); for tokenizer.model, the
config's add_bos_token (default True, the SentencePiece tokenizers' default).

Encoding follows the `tokenizers` library on tokenizer.json exactly (transformers does the same
for PreTrainedTokenizerFast checkpoints; a few transformers 5 classes such as LlamaTokenizer
rebuild their pipeline instead). For tokenizer.model the text is split at the added tokens and
each piece encoded by SentencePiece, with its dummy prefix on every piece, or, where the config
says "legacy": false, only on the text's first (transformers' two modes). Unlike transformers'
conversion, text that starts with a space keeps SentencePiece's own "▁▁" (the original
tokenizer's ids). Decoding never applies clean_up_tokenization_spaces.

Chat templates render as transformers renders them: jinja2's immutable sandbox with trim_blocks
and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, transformers' `tojson`
(non-ASCII kept; indent, separators, sort_keys), a guarded `dict` and `namespace`, the
`{% generation %}` tag (rendered as its body), and the variables `messages`,
`add_generation_prompt`, `tools`, `documents` (None) and every named special token
(`bos_token`, `eos_token`, ...; bos, eos and pad must be in the vocabulary, the others may be
only text). Message keys whose value is None are dropped first. A template that fails
(raise_exception, a bug, a conversation it refuses) is a ValueError.

Rows -> training examples (the file reader calls these two):

  row_format(row) -> "text" | "prompt_completion" | "messages"
      {"messages": [...]} wins over the others (datasets often carry a "prompt" column too);
      then "completion" or "prompt" (without "text") means prompt_completion; then "text".
      Other keys are ignored. A row with none of them: ValueError.
  encode_row(tokenizer, row) -> {"tokens": int32 [L], "weights": float32 [L]}
      weights[t] is 1.0 where token t is a target of the loss (predicted from position t-1).
      text               [bos if add_bos] + encode(text) + [eos]; weight 1 after the first token.
      prompt_completion  [bos if add_bos] + encode(prompt) + encode(completion) + [eos]; weight 1
                         on the completion's tokens and the eos. The two are encoded apart, so
                         the boundary is exact, and plain: the chat template is never applied
                         (use "messages" for a chat).
      messages           the whole conversation rendered by the chat template and encoded
                         (transformers' apply_chat_template ids; bos prepended only where
                         add_bos and the template did not print bos first itself, so never
                         doubled); weight 1 on each assistant turn: its content and the
                         end-of-turn token(s) the template writes right after it (<|im_end|>,
                         <|eot_id|>, <end_of_turn>, </s>) so the model learns to stop; 0 on the
                         system, user and tool turns, on the assistant headers and on the
                         template's layout whitespace around a turn. A turn is found by
                         rendering messages[:i] with the generation prompt and messages[:i+1]:
                         the first must be a prefix of the second (up to trailing whitespace)
                         and the second a prefix of the whole rendering, or the row is refused
                         (a template that renders earlier turns differently cannot be split this
                         way: Qwen3's writes a think block only in the turns after the last user
                         message; such conversations need one row per assistant turn).
                         Offsets map the characters to tokens: the `tokenizers` library's for
                         tokenizer.json, SentencePiece's offset mapping for tokenizer.model.
                         An assistant message's "weight" (OpenAI's chat fine-tuning format,
                         also honoured by axolotl; TRL's SFTTrainer ignores it) is 1, trained
                         (as without it or null), or 0: that turn is rendered but weighted 0
                         like a user turn. Any other value, or a weight on a message of another
                         role, is refused (`message_weight`). A row whose every assistant turn
                         has weight 0 trains nothing: all its weights are 0.
  A row missing a field, a message without "role" or "content", content that is not a string,
  a "weight" that is not 0 or 1 on an assistant message, or a conversation without an assistant
  turn: ValueError naming it (the caller adds the file and line).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from tfjax import jsonfile

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
ROW_FORMATS = ("text", "prompt_completion", "messages")


class CheckpointTokenizer:
    """A Hugging Face checkpoint's tokenizer and chat template (see the module docstring).

    Built from the files' bytes, so it pickles as those bytes (Grain worker processes rebuild
    it). `load(directory)` is the usual way in.
    """

    def __init__(self, files: Mapping[str, bytes], path: str | None = None):
        self.path = path  # the directory it was loaded from, for messages
        # With tokenizer.json, a tokenizer.model beside it is neither used nor saved.
        unused = SENTENCEPIECE_MODEL if TOKENIZER_JSON in files else None
        self._files = {n: bytes(files[n]) for n in FILES if n in files and n != unused}
        self._template_cache = None
        where = path or "the checkpoint"
        config = self._json(TOKENIZER_CONFIG)
        generation = self._json(GENERATION_CONFIG)

        if TOKENIZER_JSON in self._files:
            self._backend = _TokenizersBackend(self._files[TOKENIZER_JSON], where)
        elif SENTENCEPIECE_MODEL in self._files:
            self._backend = _SentencePieceBackend(
                self._files[SENTENCEPIECE_MODEL], where, legacy=config.get("legacy", True)
            )
        else:
            raise ValueError(
                f"{where} has no tokenizer: looked for {TOKENIZER_JSON} (read with the tokenizers "
                f"library) and {SENTENCEPIECE_MODEL} (SentencePiece)."
            )
        for token_id, spec in _added_tokens(config, self._json(ADDED_TOKENS), where):
            self._backend.add_token(token_id, spec, where)

        # Named special tokens: the config, else special_tokens_map.json, else (SentencePiece)
        # the model's own pieces; then each must be in the vocabulary.
        special_map = self._json(SPECIAL_TOKENS_MAP)
        defaults = self._backend.default_tokens()
        self.special_tokens: dict[str, str] = {}  # name -> text, as chat templates see them
        for name in NAMED_TOKENS:
            source, value = TOKENIZER_CONFIG, config.get(name)
            if name not in config:
                source, value = SPECIAL_TOKENS_MAP, special_map.get(name, defaults.get(name))
            text = _token_text(value, f"{where}/{source}", name)
            if text is not None:
                self.special_tokens[name] = text
        extra = config.get("extra_special_tokens")
        named_extra = dict(extra) if isinstance(extra, Mapping) else {}
        for name, value in config.items():  # e.g. Gemma 3's boi_token, image_token
            if name.endswith("_token") and name not in NAMED_TOKENS and name not in named_extra:
                if isinstance(value, str) or (isinstance(value, Mapping) and "content" in value):
                    named_extra[name] = value
        for name, value in named_extra.items():
            text = _token_text(value, f"{where}/{TOKENIZER_CONFIG}", name)
            if text is not None:
                self.special_tokens[name] = text
        token_ids = {}
        for name, text in self.special_tokens.items():
            token_id = self._backend.token_to_id(text)
            if token_id is None and name not in ("bos_token", "eos_token", "pad_token"):
                continue  # a template may still print it; it has no id of its own
            if token_id is None:
                raise ValueError(
                    f"{where}: {name} {text!r} is not in the vocabulary of "
                    f"{self._backend.file} (a token the model has no embedding for)."
                )
            self._backend.mark_special(text, token_id)
            token_ids[name] = token_id

        self.vocab_size: int = self._backend.max_id() + 1
        gen = _generation_ids(generation, f"{where}/{GENERATION_CONFIG}", self.vocab_size)
        self.bos_id: int | None = token_ids.get("bos_token", gen["bos_token_id"])
        self.pad_id: int | None = token_ids.get("pad_token", gen["pad_token_id"])
        eos = ([token_ids["eos_token"]] if "eos_token" in token_ids else []) + gen["eos_token_id"]
        if not eos:
            raise ValueError(
                f"{where} names no eos token: {TOKENIZER_CONFIG} has no eos_token and "
                f"{GENERATION_CONFIG} no eos_token_id."
            )
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.eos_id: int = self.eos_ids[0]
        self.add_bos: bool = self.bos_id is not None and self._backend.adds_bos(
            self.bos_id, config.get("add_bos_token", True)
        )
        # Ids decode drops: the added tokens marked special and the named ones.
        self._skip_ids = frozenset(self._backend.special_ids()) | frozenset(token_ids.values())
        self.chat_template: str | None = self._find_chat_template(config, where)

    # -- loading, saving, pickling -----------------------------------------------------------

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CheckpointTokenizer:
        """The tokenizer of a Hugging Face checkpoint directory (local)."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ValueError(f"{directory} is not a directory (a Hugging Face checkpoint's).")
        files = {}
        for name in FILES:  # tokenizer.json first: a tokenizer.model beside it is not read
            path = os.path.join(directory, name)
            if name == SENTENCEPIECE_MODEL and TOKENIZER_JSON in files:
                continue
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
        return cls(files, path=directory)

    @property
    def files(self) -> dict[str, bytes]:
        """The files it was built from: name -> bytes."""
        return dict(self._files)

    @property
    def backend(self) -> str:
        """The file that tokenizes: "tokenizer.json" or "tokenizer.model"."""
        return self._backend.file

    def save(self, directory: str | os.PathLike) -> None:
        """Writes the files it was loaded from into `directory` (each atomically), byte for byte,
        so that `load(directory)` gives the same tokenizer (a run's workdir, an export)."""
        from tfjax.data.tokenizers import _write_atomically

        for name, data in self._files.items():
            _write_atomically(os.path.join(os.fspath(directory), name), data)

    # The Rust and C++ tokenizers do not pickle; worker processes rebuild from the file bytes.
    def __getstate__(self):
        return {"files": self._files, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["files"], path=state["path"])

    def __repr__(self) -> str:
        template = "yes" if self.chat_template is not None else "none"
        return (
            f"CheckpointTokenizer(path={self.path!r}, {self.backend}, "
            f"vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={self.eos_ids}, pad_id={self.pad_id}, "
            f"add_bos={self.add_bos}, chat_template={template})"
        )

    # -- text --------------------------------------------------------------------------------

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids [n]. No bos/eos added; added tokens written in the text (e.g.
        "<|im_end|>") become their ids, as in transformers' encode(add_special_tokens=False)."""
        ids, _ = self._backend.encode(text)
        return np.asarray(ids, np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """`encode`, plus each token's (start, end) character span in `text`."""
        ids, offsets = self._backend.encode(text)
        return np.asarray(ids, np.int32), list(offsets)

    def decode(self, ids: Sequence[int] | np.ndarray, *, whole: bool = False) -> str:
        """Generated text: the ids up to the first of `eos_ids` -> text, without the special
        tokens (bos, pad, the added tokens marked special). whole=True: a prompt as the model
        read it: every id, the special tokens written as their text, a chat's earlier
        end-of-turn tokens too ("<|im_start|>system ...<|im_end|> <|im_start|>user ...").
        Ids >= vocab_size (the padding rows of a model's embedding, which an untrained model
        may sample) are dropped either way."""
        stops = () if whole else frozenset(self.eos_ids)
        skip = () if whole else self._skip_ids
        kept = []
        for i in np.asarray(ids).reshape(-1).tolist():
            if i in stops:
                break
            if 0 <= i < self.vocab_size and i not in skip:
                kept.append(i)
        return self._backend.decode(kept, special=whole)

    # -- chat --------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **template_vars: Any,
    ) -> str:
        """The conversation as the checkpoint's chat template writes it (transformers'
        apply_chat_template(tokenize=False)). `template_vars` reach the template too (e.g.
        enable_thinking=False, tools=[...])."""
        template = self._template()
        chat = _template_messages(messages)
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_vars}
        variables = _plain(variables)
        try:
            return template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as e:  # raise_exception, undefined names, a template's own bugs
            raise ValueError(
                f"the chat template of {self.path or 'the checkpoint'} failed on this "
                f"conversation: {type(e).__name__}: {_one_line(e)}"
            ) from e

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> np.ndarray:
        """The rendered conversation's ids, bos prepended as `encode_row` does it: a prompt to
        generate the next assistant turn from."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        ids, _ = self._backend.encode(text)
        return np.asarray(self._with_bos(ids, text), np.int32)

    def _with_bos(self, ids: list[int], text: str) -> list[int]:
        """bos + the ids of a rendered chat, where add_bos and the template did not print bos
        first itself (after whitespace: some templates start with a newline)."""
        if not self.add_bos or text.lstrip().startswith(self._backend.id_to_token(self.bos_id)):
            return list(ids)
        return [self.bos_id, *ids]

    def _template(self):
        if self.chat_template is None:
            raise ValueError(
                f"{self.path or 'the checkpoint'} has no chat template (looked for "
                f"{CHAT_TEMPLATE_FILE} and chat_template in {TOKENIZER_CONFIG}); a chat needs one."
            )
        if self._template_cache is None:
            try:
                self._template_cache = _compile_template(self.chat_template)
            except Exception as e:
                raise ValueError(
                    f"the chat template of {self.path or 'the checkpoint'} does not compile: "
                    f"{type(e).__name__}: {_one_line(e)}"
                ) from e
        return self._template_cache

    def _find_chat_template(self, config: Mapping[str, Any], where: str) -> str | None:
        if CHAT_TEMPLATE_FILE in self._files:
            try:
                return self._files[CHAT_TEMPLATE_FILE].decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}/{CHAT_TEMPLATE_FILE} is not UTF-8 text ({e}): damaged; download it "
                    "again"
                ) from None
        template = config.get("chat_template")
        if template is None or isinstance(template, str):
            return template
        if isinstance(template, list) and all(
            isinstance(t, Mapping) and isinstance(t.get("template"), str) for t in template
        ):
            named = {t.get("name"): t["template"] for t in template}
            if "default" in named:
                return named["default"]
            raise ValueError(
                f"{where}/{TOKENIZER_CONFIG}: chat_template is a list of named templates without "
                f"a 'default' one (names: {sorted(map(str, named))})."
            )
        raise ValueError(
            f"{where}/{TOKENIZER_CONFIG}: chat_template must be a string or a list of "
            f'{{"name", "template"}} dicts, got {type(template).__name__}.'
        )

    def _json(self, name: str) -> dict:
        if name not in self._files:
            return {}
        where = f"{self.path or 'the checkpoint'}/{name}"
        return jsonfile.parse_object(self._files[name], where, name, "download it again")


# -- rows -> training examples ---------------------------------------------------------------


def row_format(row: Mapping[str, Any]) -> str:
    """Which of ROW_FORMATS a row is: "messages" if it has messages, else "prompt_completion"
    if it has a completion or a prompt (and no text), else "text" (see the module docstring)."""
    if not isinstance(row, Mapping):
        raise ValueError(f"a row must be a dict, got {type(row).__name__}.")
    if "messages" in row:
        return "messages"
    if "completion" in row or ("prompt" in row and "text" not in row):
        return "prompt_completion"
    if "text" in row:
        return "text"
    raise ValueError(
        "a row needs 'text', 'prompt' and 'completion', or 'messages'; it has "
        f"{sorted(map(str, row)) or 'no keys'}."
    )


def encode_row(tokenizer: CheckpointTokenizer, row: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One row -> {"tokens": int32 [L], "weights": float32 [L]}; weights is 1.0 on the tokens
    the loss trains on (see the module docstring for each format)."""
    fmt = row_format(row)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    if fmt == "text":
        body = _encode_field(tokenizer, row, "text")
        tokens = bos + body + [tokenizer.eos_id]
        weights = [0.0] + [1.0] * (len(tokens) - 1)
    elif fmt == "prompt_completion":
        prompt = bos + _encode_field(tokenizer, row, "prompt")
        completion = _encode_field(tokenizer, row, "completion") + [tokenizer.eos_id]
        tokens = prompt + completion
        weights = [0.0] * len(prompt) + [1.0] * len(completion)
    else:
        tokens, weights = _encode_messages(tokenizer, row["messages"])
    return {"tokens": np.asarray(tokens, np.int32), "weights": np.asarray(weights, np.float32)}


def _encode_field(tokenizer: CheckpointTokenizer, row: Mapping[str, Any], key: str) -> list[int]:
    if row.get(key) is None:
        raise ValueError(f"a {row_format(row)} row needs {key!r}; it has {sorted(map(str, row))}.")
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}.")
    return tokenizer._backend.encode(value)[0]


def _encode_messages(tokenizer: CheckpointTokenizer, messages: Any) -> tuple[list, list]:
    messages = _checked_messages(messages)
    whole = tokenizer.render_chat(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("'messages' has no 'assistant' turn: nothing to train on.")
    spans = []  # [start, end) character spans of the trained assistant turns in `whole`
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message_weight(message):
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1])
        # The turn starts where the two part; a generation prompt may end with whitespace that
        # the turn's rendering lacks (templates written without {{- }} often do).
        start = len(os.path.commonprefix([before, through]))
        if before[start:].strip():
            raise ValueError(
                f"the chat template cannot be split into turns: messages[:{i}] rendered with "
                f"add_generation_prompt=True is not a prefix of messages[:{i + 1}] rendered, "
                "up to trailing whitespace (its "
                "generation prompt differs from how it starts an assistant turn, or it renders "
                "earlier messages differently depending on what follows)."
            )
        if not whole.startswith(through):
            raise ValueError(
                f"the chat template cannot be split into turns: it renders messages[:{i + 1}] "
                "differently inside the whole conversation (it rewrites earlier turns, e.g. drops "
                "their reasoning as Qwen3's does); split the conversation into one row per "
                "assistant turn."
            )
        # The turn is what the template writes after the generation prompt: the content and the
        # end-of-turn token(s). Whitespace around them that is not the content's own is the
        # template's layout, left untrained.
        content = message["content"]
        if not (content and through.startswith(content, start)):
            start = len(through) - len(through[start:].lstrip())
        end = len(through.rstrip())
        if content and through.rfind(content, start) >= 0:
            end = max(end, through.rfind(content, start) + len(content))
        spans.append((start, max(end, start)))
    ids, offsets = tokenizer._backend.encode(whole)
    weights = [0.0] * len(ids)
    k = 0  # spans and offsets are both in order: one pass
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        # A token overlapping the turn is trained; so is a zero-width one inside it
        # (SentencePiece's dummy prefix "▁" at the start of a piece of text).
        if start < spans[k][1] and (end > spans[k][0] or start == end >= spans[k][0]):
            weights[t] = 1.0
    tokens = tokenizer._with_bos(ids, whole)
    weights = [0.0] * (len(tokens) - len(ids)) + weights
    return tokens, weights


def _checked_messages(messages: Any) -> list[dict]:
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            "'messages' must be a list of {'role', 'content'} dicts, "
            f"got {type(messages).__name__}."
        )
    if not messages:
        raise ValueError("'messages' is empty.")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise ValueError(f"messages[{i}] has no {key!r}.")
            if not isinstance(message[key], str):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, got {type(message[key]).__name__}."
                )
        try:
            message_weight(message)
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
    return _template_messages(messages)


def message_weight(message: Mapping[str, Any]) -> int:
    """A message's "weight" as OpenAI's chat fine-tuning format defines it: on an assistant
    message, 1 (its turn is trained; also when absent or null) or 0 (not trained); a ValueError
    for any other value, or for a weight on a message of another role (whose turn is never
    trained)."""
    weight = message.get("weight")
    if weight is None:
        return 1
    if message.get("role") != "assistant":
        raise ValueError(
            f"'weight' is allowed only on an assistant message (0: its turn is not trained, "
            f"1: trained); this one's role is {message.get('role')!r}, whose turn is never "
            "trained: remove its weight"
        )
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float, np.number))
        or weight not in (0, 1)
    ):
        raise ValueError(
            f"'weight' must be 0 (the assistant turn is not trained) or 1 (trained), got {weight!r}"
        )
    return int(weight)


# -- chat templates (jinja2, as transformers renders them) -----------------------------------

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: Any) -> list[dict]:
    """Messages as a template sees them: plain data, keys whose value is None dropped, and the
    reasoning under each name templates read (transformers does the same)."""
    messages = _plain(messages)
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """Only JSON-like types reach the sandbox: numpy values become Python ones, anything else
    a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    return _environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: transformers' marker of assistant text, which
        some templates carry; here it renders as its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(format):
        return datetime.now().strftime(format)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    class GuardedDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def refuse_private(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set underscore names on a namespace ({name!r})"
            )

    class GuardedNamespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):  # jinja2's signature: `self` may be a keyword too
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                refuse_private(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=GuardedDict(),
        namespace=GuardedNamespace,
    )
    return env


# -- the two tokenizer backends --------------------------------------------------------------


class _TokenizersBackend:
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


class _SentencePieceBackend:
    """tokenizer.model through `sentencepiece`, with the added tokens split out first."""

    file = SENTENCEPIECE_MODEL

    def __init__(self, data: bytes, where: str, *, legacy: bool):
        from tfjax.data.tokenizers import sentencepiece_processor

        fix = "download it again"
        self._sp = sentencepiece_processor(data, f"{where}/{SENTENCEPIECE_MODEL}", fix)
        self._size = self._sp.get_piece_size()
        self._added: dict[str, int] = {}  # content -> id: split out of the text before encoding
        self._texts: dict[int, str] = {}  # id -> text for ids SentencePiece cannot decode
        self._special: set[int] = set()
        self._split = None
        # legacy (SentencePiece's own behaviour): every piece of text between added tokens gets
        # the dummy prefix "▁"; otherwise only a piece at the start of the text does.
        self._later = self._sp
        if not legacy and self._sp.encode("a", out_type=str)[0].startswith("▁"):
            self._later = _without_dummy_prefix(data)

    def add_token(self, token_id: int, spec: Mapping[str, Any], where: str) -> None:
        content = spec["content"]
        self._added[content] = token_id
        if token_id >= self._size or self._sp.id_to_piece(token_id) != content:
            self._texts[token_id] = content
        if spec.get("special", False):
            self._special.add(token_id)
        self._split = None

    def mark_special(self, content: str, token_id: int) -> None:
        self._added.setdefault(content, token_id)
        self._special.add(token_id)
        self._split = None

    def default_tokens(self) -> dict[str, str]:
        sp = self._sp
        ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
        ids["pad_token"] = sp.pad_id()
        return {name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}

    def token_to_id(self, content: str) -> int | None:
        if content in self._added:
            return self._added[content]
        piece_id = self._sp.piece_to_id(content)
        return piece_id if self._sp.id_to_piece(piece_id) == content else None

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._texts:
            return self._texts[token_id]
        return self._sp.id_to_piece(token_id)

    def max_id(self) -> int:
        return max([self._size - 1, *self._added.values()])

    def special_ids(self) -> set[int]:
        control = (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id(), self._sp.unk_id())
        return self._special | {i for i in control if i >= 0}

    def adds_bos(self, bos_id: int, config_add_bos: bool) -> bool:
        return bool(config_add_bos)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._split is None and self._added:
            longest_first = sorted(self._added, key=len, reverse=True)
            self._split = re.compile("|".join(map(re.escape, longest_first)))
        ids, offsets = [], []
        start = 0
        for match in self._split.finditer(text) if self._split is not None else ():
            self._encode_piece(text, start, match.start(), ids, offsets)
            ids.append(self._added[match.group()])
            offsets.append(match.span())
            start = match.end()
        self._encode_piece(text, start, len(text), ids, offsets)
        return ids, offsets

    def _encode_piece(self, text, start, end, ids, offsets) -> None:
        if start == end:
            return
        sp = self._sp if start == 0 else self._later
        mapping = sp.encode_as_offset_mapping(text[start:end])
        ids.extend(mapping["ids"])
        offsets.extend((start + a, start + b) for a, b in mapping["offsets"])

    def decode(self, ids: list[int], *, special: bool) -> str:
        """The ids' text; with `special`, control pieces (<s>, </s>) are written as their
        piece, as the added tokens are (SentencePiece's own decode drops them)."""
        out, run = [], []
        for i in ids:
            control = i < self._size and self._sp.is_control(i)
            if i in self._texts or (special and control):
                out.append(self._sp.decode(run))
                out.append(self.id_to_token(i))
                run = []
            elif i < self._size and not control:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)


def _without_dummy_prefix(data: bytes):
    """The same SentencePiece model with add_dummy_prefix off (needs protobuf, which
    tensorflow-datasets installs)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(data)
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


# -- small helpers ---------------------------------------------------------------------------


def _added_tokens(config: Mapping[str, Any], added_json: Mapping[str, Any], where: str):
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


def _token_text(value: Any, source: str, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f'{source}: {name} must be a string or {{"content": ...}}, got {type(value).__name__}.'
    )


def _generation_ids(config: Mapping[str, Any], source: str, vocab_size: int) -> dict:
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
        return f"{name} is not valid JSON ({_one_line(e)}): damaged; {fix}"
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
        f"({_one_line(error)}): {fix}, or, if the checkpoint is newer than this library, "
        "`pip install -U tokenizers`"
    )


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
