"""Tokenizers: a byte-level one that needs no training and SentencePiece trained on the data.

Both share one id scheme so that models, losses and masks never need to know which is used:

  0 pad   (everywhere: padding, and the start token the decoder shifts in)
  1 bos   (starts each language-modelling / masked-LM / classification example)
  2 eos   (ends each example; appended to translation inputs and targets)
  3 unk   (SentencePiece only; bytes cover everything)
  4 mask  (the [MASK] of the masked-LM task)
  5..     real tokens: the 256 bytes for `ByteTokenizer` (vocab_size 261), pieces for SentencePiece.

`encode` returns the ids of the text alone (no bos/eos: the pipeline adds them per task);
`decode` stops at the first eos and drops the other special ids, so it can be fed raw model
output; `decode(ids, whole=True)` shows a prompt as the model read it: every id, the special
ones written as SPECIAL_TEXT ("<s>def f(x):</s>").
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import sentencepiece as spm

PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL = 5  # ids below this never stand for text
MIN_SENTENCEPIECE_VOCAB = NUM_SPECIAL + 256 + 1  # the special ids, the byte fallback, a piece
MASK_PIECE = "<mask>"
# The special ids as `decode(ids, whole=True)` writes them (SentencePiece's own piece names).
SPECIAL_TEXT = {
    PAD_ID: "<pad>",
    BOS_ID: "<s>",
    EOS_ID: "</s>",
    UNK_ID: "<unk>",
    MASK_ID: MASK_PIECE,
}


def _decode(ids: Iterable[int], vocab_size: int, text: Callable[[list[int]], str], whole: bool):
    """Generated text (whole=False): the ids up to the first eos, without pad/bos/unk/mask;
    a prompt (whole=True): every id, the special ones as SPECIAL_TEXT. Ids >= vocab_size (the
    padding rows of a model vocabulary rounded up, which an untrained model may sample) are
    dropped either way. `text` decodes a run of ordinary ids."""
    out, run = [], []
    for i in np.asarray(ids).reshape(-1).tolist():
        if i == EOS_ID and not whole:
            break
        if NUM_SPECIAL <= i < vocab_size:
            run.append(i)
        elif whole and i in SPECIAL_TEXT:
            out += [text(run), SPECIAL_TEXT[i]]
            run = []
    out.append(text(run))
    return "".join(out)


def not_the_file(data: bytes) -> str | None:
    """What a file's bytes are when they are plainly not the file (else None): nothing, or the
    pointer Git LFS leaves where a repository was cloned without git-lfs."""
    if not data.strip():
        return f"it is empty ({len(data)} bytes)"
    if data.startswith(b"version https://git-lfs.github.com/spec/"):
        return (
            "it is a Git LFS pointer, not the file (its repository was cloned "
            "without git-lfs: run `git lfs pull` there)"
        )
    return None


def sentencepiece_processor(data: bytes, name: str, fix: str) -> spm.SentencePieceProcessor:
    """SentencePiece's processor of the model bytes read from file `name`; bytes that are not a
    model are a ValueError of one line naming the file, ending in `fix` (what to do).
    SentencePiece itself takes empty bytes for a model without pieces, and names no file."""
    damage = not_the_file(data)
    if damage is None:
        try:
            return spm.SentencePieceProcessor(model_proto=data)
        except Exception:  # noqa: BLE001 - its only message: "ParseFromArray" failed
            json_text = data.lstrip()[:1] in (b"{", b"[")
            what = "they are JSON text" if json_text else "cut short or damaged"
            damage = f"its {len(data)} bytes do not parse as one ({what})"
    raise ValueError(f"{name} is not a SentencePiece model: {damage}; {fix}")


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: exact round trip, no training, no files."""

    pad_id, bos_id, eos_id, unk_id, mask_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID
    vocab_size = 256 + NUM_SPECIAL

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids [len(utf-8 bytes)]."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + NUM_SPECIAL

    def decode(self, ids: Sequence[int] | np.ndarray, *, whole: bool = False) -> str:
        """Generated text: up to the first eos, special ids dropped; whole=True: a prompt, every
        id, the special ones as SPECIAL_TEXT."""

        def text(run):  # model output may cut a multi-byte character: shown, not an error
            return bytes(i - NUM_SPECIAL for i in run).decode("utf-8", errors="replace")

        return _decode(ids, self.vocab_size, text, whole)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class SentencePieceTokenizer:
    """A trained SentencePiece model with the shared special ids (see the module docstring)."""

    pad_id, bos_id, eos_id, unk_id, mask_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID

    def __init__(self, model_proto: bytes, path: str | None = None):
        self.path = path  # where it was loaded from, for messages
        self._proto = model_proto
        fix = (
            "if it is a dataset's, delete it and it is trained again; a run's copy (in its "
            "workdir) is the model the run was trained with: put it back from a backup"
        )
        self._sp = sentencepiece_processor(model_proto, path or "the SentencePiece model", fix)
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID) or self._sp.piece_to_id(MASK_PIECE) != MASK_ID:
            raise ValueError(
                f"SentencePiece model {path or ''} does not use the tfjax special ids "
                f"(pad, bos, eos, unk, mask = 0..4); retrain it with train_sentencepiece()."
            )

    @classmethod
    def load(cls, path: str) -> SentencePieceTokenizer:
        with open(path, "rb") as f:
            return cls(f.read(), path=path)

    @property
    def proto(self) -> bytes:
        """The serialised model (what `save` writes)."""
        return self._proto

    def save(self, path: str) -> None:
        """Writes the model file to `path` (atomically), for SentencePieceTokenizer.load."""
        _write_atomically(path, self._proto)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> np.ndarray:
        """Text -> int32 ids [n]."""
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, whole: bool = False) -> str:
        """Generated text: up to the first eos, special ids dropped; whole=True: a prompt, every
        id, the special ones as SPECIAL_TEXT."""
        return _decode(ids, self.vocab_size, self._sp.decode, whole)

    # The C++ processor does not pickle; worker processes rebuild it from the model bytes.
    def __getstate__(self):
        return {"proto": self._proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["proto"], path=state["path"])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size}, path={self.path!r})"


def train_sentencepiece(texts: Iterable[str], path: str, *, vocab_size: int) -> None:
    """Trains a unigram SentencePiece model on `texts` and writes it to `path` atomically.

    Byte fallback, identity normalisation and kept whitespace make decode(encode(s)) == s for
    any text. Digits are split into single pieces so numbers are spelled digit by digit.
    `vocab_size` is an upper bound: a small corpus yields fewer pieces instead of an error.
    """
    if vocab_size < MIN_SENTENCEPIECE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for SentencePiece with byte fallback; "
            f"use at least {MIN_SENTENCEPIECE_VOCAB} or tokenizer='bytes'."
        )

    def lines():  # SentencePiece skips "sentences" longer than max_sentence_length bytes.
        for text in texts:
            for line in text.splitlines():
                if line.strip():
                    yield line

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        user_defined_symbols=[MASK_PIECE],
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
        character_coverage=0.9995,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    _write_atomically(path, model.getvalue())


def _write_atomically(path: str, data: bytes) -> None:
    """Write then rename: a concurrent reader never sees half a model."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
