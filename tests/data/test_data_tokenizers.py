"""Tokenizers: round trips, the shared special ids, SentencePiece trained once and reused."""

import os
import pathlib
import pickle

import numpy as np
import pytest

import tfjax.data as td
from tfjax.data import sources, tokenizers

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and  double  spaces,\ttabs and\nnewlines\n",
    "naïve café — 数字 ✓ 🙂",
    "",
]


@pytest.fixture(scope="session")
def data_dir(data_dir):  # the session's (conftest.py), with pydoc prepared
    path = pathlib.Path(data_dir)
    td.prepare("pydoc", path)
    return path


def test_byte_tokenizer_round_trips_and_special_ids():
    tok = td.ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.vocab_size == 261
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and (ids >= 5).all() and (ids < tok.vocab_size).all()
        assert tok.decode(ids) == text
    ids = tok.encode("ab")
    # decode reads model output: skips pad/bos/mask and stops at the first eos
    assert tok.decode([td.BOS_ID, *ids, td.MASK_ID, td.EOS_ID, *tok.encode("junk"), 0]) == "ab"
    # whole=True shows a prompt as the model read it: every id, the special ones as text
    prompt = [td.BOS_ID, *ids, td.MASK_ID, td.EOS_ID, *tok.encode("junk"), 0, td.UNK_ID]
    assert tok.decode(prompt, whole=True) == "<s>ab<mask></s>junk<pad><unk>"


def test_sentencepiece_is_trained_once_and_reused(data_dir, monkeypatch):
    config = {"name": "pydoc", "tokenizer": "sentencepiece", "vocab_size": 700}
    path = td.tokenizer_path(config, data_dir)
    assert path.startswith(str(data_dir)) and not os.path.exists(path)
    tok = td.get_tokenizer(config, data_dir)
    assert os.path.exists(path) and tok.path == path
    assert 300 < tok.vocab_size <= 700
    mtime = os.path.getmtime(path)

    def no_training(*args, **kwargs):
        raise AssertionError("SentencePiece was trained a second time")

    monkeypatch.setattr(sources, "train_sentencepiece", no_training)
    again = td.get_tokenizer(config, data_dir)
    with td.make_loader(
        config,
        split="test",
        batch_size=2,
        seed=0,
        shuffle=False,
        num_epochs=1,
        data_dir=data_dir,
    ) as loader:
        batch = next(loader)
    assert os.path.getmtime(path) == mtime
    assert again.vocab_size == loader.tokenizer.vocab_size == tok.vocab_size
    assert batch["tokens"].max() < tok.vocab_size

    # Round trips, on the corpus and on text it never saw (bytes fall back).
    paragraphs = [
        r["text"].decode() for r in td.open_source("pydoc", "test", data_dir).read(range(50))
    ]
    for text in TEXTS + paragraphs:
        assert tok.decode(tok.encode(text)) == text
    long_text = " ".join(paragraphs)
    assert len(tok.encode(long_text)) < 0.5 * len(long_text.encode())  # it learnt pieces

    # The shared special ids, and the tokenizer travels to worker processes.
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.decode([td.BOS_ID, *tok.encode("x = 1"), td.EOS_ID, 77]) == "x = 1"
    whole = [td.BOS_ID, *tok.encode("x = 1"), td.EOS_ID, *tok.encode("y"), td.MASK_ID]
    assert tok.decode(whole, whole=True) == "<s>x = 1</s>y<mask>"
    # Ids past the vocabulary (a model's vocabulary rounded up to a multiple of 128) are
    # dropped, as a sampling model may emit them, rather than raising in SentencePiece.
    beyond = [tok.vocab_size, tok.vocab_size + 100]
    ids = tok.encode("x = 1").tolist()
    assert tok.decode(ids[:1] + beyond + ids[1:]) == "x = 1"
    copy = pickle.loads(pickle.dumps(tok))
    np.testing.assert_array_equal(copy.encode(long_text), tok.encode(long_text))


def test_translation_vocabulary_is_shared(data_dir):
    td.prepare("numbers_translate", data_dir)
    tok = td.get_tokenizer({"name": "numbers_translate"}, data_dir)
    for text in ("905017", "nine hundred five thousand seventeen"):
        assert tok.decode(tok.encode(text)) == text
    # Digits are single pieces (numbers are spelled digit by digit), words whole pieces.
    assert len(tok.encode("905017")) <= 7
    assert len(tok.encode("nine hundred five thousand seventeen")) == 5


def test_sentencepiece_vocab_size_is_checked(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        tokenizers.train_sentencepiece(["some text"], str(tmp_path / "m.model"), vocab_size=100)


def test_a_damaged_sentencepiece_model_is_one_line_naming_it(tmp_path):
    path = tmp_path / "pydoc.model"
    for data, what in ((b"", "it is empty"), (b"\x00\x01cut", r"its 5 bytes do not parse as one")):
        path.write_bytes(data)
        with pytest.raises(
            ValueError,
            match=f"^{path} is not a SentencePiece model: {what}.*"
            "delete it and it is trained again",
        ):
            tokenizers.SentencePieceTokenizer.load(str(path))
