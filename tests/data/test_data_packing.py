"""Packing, padding, splitting and masking: every token kept, examples whole unless asked."""

import collections
import pathlib

import numpy as np
import pytest

import tfjax.data as td
from tfjax.data import embedded, preprocess
from tfjax.data.tokenizers import BOS_ID, EOS_ID, MASK_ID, NUM_SPECIAL, ByteTokenizer


@pytest.fixture(scope="session")
def data_dir(data_dir):  # the session's (conftest.py), with these prepared
    path = pathlib.Path(data_dir)
    for name in ("pydoc", "numbers_translate"):
        td.prepare(name, path)
    return path


def segments(batches, key, by=None):
    """Each packed example of `key` as a tuple of ids, checking the segment ids and positions
    (those of `by`, default `key`)."""
    out, by = [], by or key
    for batch in batches:
        for row, seg, pos in zip(
            batch[key], batch[f"{by}_segment_ids"], batch[f"{by}_positions"], strict=True
        ):
            n = seg.max()
            np.testing.assert_array_equal(np.unique(seg[seg > 0]), np.arange(1, n + 1))
            assert not row[seg == 0].any() and not pos[seg == 0].any()  # padding is all zeros
            for s in range(1, n + 1):
                (where,) = np.nonzero(seg == s)
                np.testing.assert_array_equal(where, np.arange(where[0], where[0] + len(where)))
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                out.append(tuple(row[where].tolist()))
    return out


def padded_rows(batches, key):
    return [tuple(r[r != 0].tolist()) for b in batches for r in b[key] if r.any()]


def pydoc_examples(data_dir, split="test"):
    tok = ByteTokenizer()
    return [
        np.concatenate([[BOS_ID], tok.encode(r["text"].decode()), [EOS_ID]]).astype(np.int32)
        for r in td.open_source("pydoc", split, data_dir, cache=True)
    ]


def load(config, data_dir, split="test", batch_size=8):
    with td.make_loader(
        config,
        split=split,
        batch_size=batch_size,
        seed=0,
        shuffle=False,
        num_epochs=1,
        data_dir=data_dir,
    ) as loader:
        return list(loader)


def test_split_and_collate_helpers():
    example = {"tokens": np.arange(1, 12, dtype=np.int32), "weights": np.ones(11, np.float32)}
    pieces = preprocess.split_example(example, 4)
    assert [len(p["tokens"]) for p in pieces] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([p["tokens"] for p in pieces]), example["tokens"])
    batch = preprocess.collate(pieces, batch_size=5, length=4)  # ragged rows, partial batch
    assert batch["tokens"].shape == (5, 4) and batch["weights"].dtype == np.float32
    np.testing.assert_array_equal(batch["tokens"][2], [9, 10, 11, 0])
    np.testing.assert_array_equal(batch["weights"].sum(1), [4, 4, 3, 0, 0])
    with pytest.raises(ValueError, match="'tokens' has 11 items, more than 4"):
        preprocess.collate([example], batch_size=1, length=4)


@pytest.mark.parametrize("long_examples", ["split", "truncate"])
def test_packing_keeps_every_token_and_whole_examples(data_dir, long_examples):
    seq_len = 128
    examples = pydoc_examples(data_dir)
    assert max(map(len, examples)) > seq_len  # some examples are longer than a row
    if long_examples == "split":  # asked: long examples become consecutive pieces
        expected = [
            tuple(p["tokens"].tolist())
            for e in examples
            for p in preprocess.split_example({"tokens": e}, seq_len)
        ]
        assert sum(map(len, expected)) == sum(map(len, examples))  # every token
    else:  # not asked: one example, one segment, cut at the row length
        expected = [tuple(e[:seq_len].tolist()) for e in examples]
    config = {"name": "pydoc", "seq_len": seq_len, "long_examples": long_examples}
    packed = load({**config, "packing": True}, data_dir)
    padded = load({**config, "packing": False}, data_dir)
    assert collections.Counter(segments(packed, "tokens")) == collections.Counter(expected)
    assert collections.Counter(padded_rows(padded, "tokens")) == collections.Counter(expected)
    fill = [np.mean([(b["tokens"] != 0).mean() for b in x[:-1]]) for x in (packed, padded)]
    assert fill[0] > 0.9 and fill[0] > fill[1] + 0.15  # packing fills what padding leaves empty
    for batches in (packed, padded):
        assert {b["tokens"].shape for b in batches} == {(8, seq_len)}


def test_packed_masked_lm_batches(data_dir):
    batches = load({"name": "pydoc", "task": "mlm", "seq_len": 96}, data_dir)
    examples = [
        tuple(p["tokens"].tolist())
        for e in pydoc_examples(data_dir)
        for p in preprocess.split_example({"tokens": e}, 96)
    ]
    # The original ids sit in "targets", in the segments of the corrupted "tokens".
    targets = segments(batches, "targets", by="tokens")
    assert collections.Counter(targets) == collections.Counter(examples)
    picked = unchanged = real = 0
    for b in batches:
        keep = b["weights"] == 0
        np.testing.assert_array_equal(b["tokens"][keep], b["targets"][keep])
        assert not b["weights"][b["tokens_segment_ids"] == 0].any()
        assert (b["targets"][~keep] >= NUM_SPECIAL).all()
        picked += (~keep).sum()
        unchanged += (b["tokens"] == b["targets"])[~keep].sum()
        real += (b["tokens_segment_ids"] > 0).sum()
    assert 0.12 < picked / real < 0.16  # 15% of the non-special tokens
    assert 0.05 < unchanged / picked < 0.16  # 10% kept (+ random draws of the same id)


def test_mask_tokens_is_80_10_10():
    rng = np.random.default_rng(0)
    tokens = rng.integers(NUM_SPECIAL, 1000, 200_000).astype(np.int32)
    tokens[::7] = BOS_ID  # special ids are never picked
    corrupted, weights = preprocess.mask_tokens(tokens, rng=rng, vocab_size=1000)
    special = tokens < NUM_SPECIAL
    assert not weights[special].any()
    np.testing.assert_array_equal(corrupted[weights == 0], tokens[weights == 0])
    assert weights.sum() / (~special).sum() == pytest.approx(0.15, abs=0.005)
    picked = weights > 0
    masked = (corrupted[picked] == MASK_ID).mean()
    kept = (corrupted[picked] == tokens[picked]).mean()
    replaced = 1 - masked - kept
    assert (masked, replaced, kept) == pytest.approx((0.8, 0.1, 0.1), abs=0.01)
    assert (corrupted[picked & (corrupted != MASK_ID)] >= NUM_SPECIAL).all()


@pytest.mark.parametrize("packing", [True, False])
def test_translation_pairs_stay_aligned(data_dir, packing):
    config = {"name": "numbers_translate", "packing": packing, "cache": False}
    batches = load(config, data_dir, batch_size=32)
    tok = td.get_tokenizer(config, data_dir)
    if packing:
        inputs, targets = segments(batches, "inputs"), segments(batches, "targets")
        for b in batches:  # the same example occupies the same segment id in both
            for key in ("inputs", "targets"):
                assert (b[f"{key}_segment_ids"].max(1) == b["inputs_segment_ids"].max(1)).all()
    else:
        inputs, targets = padded_rows(batches, "inputs"), padded_rows(batches, "targets")
        assert len(batches) == 1000 // 32 + 1
    assert len(inputs) == len(targets) == 1000
    numbers = []
    for source, target in zip(inputs, targets, strict=True):
        assert source[-1] == target[-1] == EOS_ID and len(target) <= 24
        number = int(tok.decode(source))
        assert tok.decode(target) == embedded.number_to_words(number)
        numbers.append(number)
    assert sorted(numbers) == sorted(embedded.numbers_split("test").tolist())


@pytest.mark.parametrize("packing", [True, False])
def test_lm_weights_give_the_loss_of_token_id_0_padding(data_dir, packing):
    """The lm batches' "weights" (1 on every real token) weight the loss exactly as the old rule
    did (next token != 0, same segment) on the datasets whose id 0 is padding."""
    from tfjax.tasks import lm

    config = {"name": "pydoc", "seq_len": 64, "packing": packing, "long_examples": "split"}
    batches = load(config, data_dir, batch_size=16)
    for b in batches:
        np.testing.assert_array_equal(b["weights"], b["tokens"] != 0)
        labels, weights = (np.asarray(x) for x in lm.labels_and_weights(b))
        old = np.zeros_like(weights)  # the rule before "weights": next token != 0
        old[:, :-1] = b["tokens"][:, 1:] != 0
        if packing:
            seg = b["tokens_segment_ids"]
            old[:, :-1] &= seg[:, 1:] == seg[:, :-1]
        np.testing.assert_array_equal(labels[:, :-1], b["tokens"][:, 1:])
        np.testing.assert_array_equal(weights, old)
    assert sum(b["weights"].sum() for b in batches) > 10_000
