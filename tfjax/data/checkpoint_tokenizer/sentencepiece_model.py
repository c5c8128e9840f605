"""The backend of a checkpoint's tokenizer.model: `sentencepiece`, with the added tokens split
out of the text first and transformers' two dummy-prefix modes (legacy or not)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tfjax.data.checkpoint_tokenizer.config_files import SENTENCEPIECE_MODEL


class SentencePieceBackend:
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
