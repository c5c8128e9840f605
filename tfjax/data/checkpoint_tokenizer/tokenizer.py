"""`CheckpointTokenizer`: a Hugging Face checkpoint's tokenizer (one of the two backends,
tokenizer_json or sentencepiece_model), its special tokens and ids, and its chat template (see
the package docstring)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfjax import jsonfile
from tfjax.data.checkpoint_tokenizer.chat_template import (
    compile_template,
    plain_data,
    template_messages,
)
from tfjax.data.checkpoint_tokenizer.config_files import (
    ADDED_TOKENS,
    CHAT_TEMPLATE_FILE,
    FILES,
    GENERATION_CONFIG,
    NAMED_TOKENS,
    SENTENCEPIECE_MODEL,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    added_tokens,
    generation_ids,
    one_line,
    token_text,
)
from tfjax.data.checkpoint_tokenizer.sentencepiece_model import SentencePieceBackend
from tfjax.data.checkpoint_tokenizer.tokenizer_json import TokenizersBackend


class CheckpointTokenizer:
    """A Hugging Face checkpoint's tokenizer and chat template (see the package docstring).

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
            self._backend = TokenizersBackend(self._files[TOKENIZER_JSON], where)
        elif SENTENCEPIECE_MODEL in self._files:
            self._backend = SentencePieceBackend(
                self._files[SENTENCEPIECE_MODEL], where, legacy=config.get("legacy", True)
            )
        else:
            raise ValueError(
                f"{where} has no tokenizer: looked for {TOKENIZER_JSON} (read with the tokenizers "
                f"library) and {SENTENCEPIECE_MODEL} (SentencePiece)."
            )
        for token_id, spec in added_tokens(config, self._json(ADDED_TOKENS), where):
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
            text = token_text(value, f"{where}/{source}", name)
            if text is not None:
                self.special_tokens[name] = text
        extra = config.get("extra_special_tokens")
        named_extra = dict(extra) if isinstance(extra, Mapping) else {}
        for name, value in config.items():  # e.g. Gemma 3's boi_token, image_token
            if name.endswith("_token") and name not in NAMED_TOKENS and name not in named_extra:
                if isinstance(value, str) or (isinstance(value, Mapping) and "content" in value):
                    named_extra[name] = value
        for name, value in named_extra.items():
            text = token_text(value, f"{where}/{TOKENIZER_CONFIG}", name)
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
        gen = generation_ids(generation, f"{where}/{GENERATION_CONFIG}", self.vocab_size)
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
        chat = template_messages(messages)
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_vars}
        variables = plain_data(variables)
        try:
            return template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as e:  # raise_exception, undefined names, a template's own bugs
            raise ValueError(
                f"the chat template of {self.path or 'the checkpoint'} failed on this "
                f"conversation: {type(e).__name__}: {one_line(e)}"
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
                self._template_cache = compile_template(self.chat_template)
            except Exception as e:
                raise ValueError(
                    f"the chat template of {self.path or 'the checkpoint'} does not compile: "
                    f"{type(e).__name__}: {one_line(e)}"
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
