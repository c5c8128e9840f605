"""The "files" dataset: the user's own .txt / JSON lines / Parquet / Arrow files read through the
loader, with "weights" exactly on the trained tokens, resumable, sharded over processes, and
every bad row named by file and line before any training."""

import collections
import json
import logging
import pickle
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tfjax.data as td
from tfjax.data import checkpoint_tokenizer as ct
from tfjax.data import files as tf_files
from tfjax.tasks import lm

# ------------------------------------------------------------------ the checkpoint's tokenizer
CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_checkpoint_tokenizer(directory):
    """A small byte-level BPE checkpoint tokenizer like GPT-2's and Qwen's ("!" is id 0), with a
    ChatML template and no bos, as a Hugging Face checkpoint directory holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = [json.dumps(r) for r in TEXT_ROWS + PROMPT_ROWS + CHAT_ROWS] * 3
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------------------------- the files
# Each text ends in "wow!": "!" is a pre-token of its own, id 0.
TEXT_ROWS = [{"text": f"document {i}: " + "words " * (i % 7) + "wow!"} for i in range(12)]
PROMPT_ROWS = [{"prompt": f"Q{i}? ", "completion": f"A{i}" + "." * i} for i in range(8)]
CHAT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"hello {i}"},
            {"role": "assistant", "content": f"hi {i}!"},
        ]
    }
    for i in range(6)
]
TXT_LINES = ["first line", "", "second line!", "   ", "third"]
PARQUET_ROWS = [{"text": f"parquet {i}"} for i in range(10)] + [
    {"prompt": f"pq {i} ", "completion": f"done {i}"} for i in range(5)
]
ARROW_ROWS = [{"text": f"arrow row {i}" * (1 + i % 3)} for i in range(9)]


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def save_arrow_dataset(directory, rows):
    """A dataset as Hugging Face `datasets` saves it (save_to_disk), with `datasets` when
    installed, else the same layout written with pyarrow (an Arrow IPC stream + state.json)."""
    try:
        import datasets
    except ModuleNotFoundError:
        directory.mkdir()
        table = pa.Table.from_pylist(rows)
        name = "data-00000-of-00001.arrow"
        with pa.ipc.new_stream(str(directory / name), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=4):  # several record batches
                writer.write_batch(batch)
        (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        (directory / "dataset_info.json").write_text("{}")
        return
    datasets.Dataset.from_list(rows).save_to_disk(str(directory))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    write_checkpoint_tokenizer(root / "tok")
    write_jsonl(root / "text.jsonl", TEXT_ROWS, extra_lines=[""])  # a blank line is skipped
    write_jsonl(root / "chat.jsonl", PROMPT_ROWS + CHAT_ROWS)  # mixed formats in one file
    (root / "notes.txt").write_text("\n".join(TXT_LINES) + "\n")
    keys = ("text", "prompt", "completion")  # text and prompt rows: null columns
    table = pa.table({k: [r.get(k) for r in PARQUET_ROWS] for k in keys})
    pq.write_table(table, root / "rows.parquet", row_group_size=4)
    assert pq.ParquetFile(root / "rows.parquet").metadata.num_row_groups == 4
    save_arrow_dataset(root / "saved", ARROW_ROWS)
    return root


ALL_ROWS = (
    TEXT_ROWS
    + PROMPT_ROWS
    + CHAT_ROWS
    + [{"text": line} for line in TXT_LINES if line.strip()]
    + [{k: v for k, v in r.items() if v is not None} for r in PARQUET_ROWS]
    + ARROW_ROWS
)


def patterns(root):
    return ",".join(
        str(root / name)
        for name in ("text.jsonl", "chat.jsonl", "notes.txt", "rows.parquet", "saved")
    )


def config(root, **fields):
    return {
        "name": "files",
        "train_files": patterns(root),
        "tokenizer": str(root / "tok"),
        **fields,
    }


def loader(cfg, split="train", **kwargs):
    args = dict(split=split, batch_size=4, seed=0, shuffle=False, num_epochs=1)
    return td.make_loader(cfg, **{**args, **kwargs})


def expected_examples(tokenizer, rows, seq_len):
    """Counter of (tokens, weights) of each row as encode_row gives it, truncated."""
    out = collections.Counter()
    for row in rows:
        e = ct.encode_row(tokenizer, row)
        out[tuple(e["tokens"][:seq_len].tolist()), tuple(e["weights"][:seq_len].tolist())] += 1
    return out


@pytest.fixture(scope="module")
def tokenizer(data):
    tok = ct.CheckpointTokenizer.load(str(data / "tok"))
    assert tok.encode("wow!")[-1] == 0 and tok.pad_id != 0  # id 0 is a real token
    return tok


def unpacked_rows(batches):
    out = []
    for b in batches:
        for tokens, weights in zip(b["tokens"], b["weights"], strict=True):
            n = len(tokens) - np.argmax((weights[::-1] != 0) | (tokens[::-1] != 0))
            if (weights != 0).any() or (tokens != 0).any():
                out.append((tuple(tokens[:n].tolist()), tuple(weights[:n].tolist())))
    return out


def packed_segments(batches):
    """(tokens, weights) of each packed example, checking segment ids and positions."""
    out = []
    for b in batches:
        for tokens, weights, seg, pos in zip(
            b["tokens"], b["weights"], b["tokens_segment_ids"], b["tokens_positions"], strict=True
        ):
            assert not weights[seg == 0].any() and not tokens[seg == 0].any()
            for s in range(1, seg.max() + 1):
                (where,) = np.nonzero(seg == s)
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                out.append((tuple(tokens[where].tolist()), tuple(weights[where].tolist())))
    return out


# ----------------------------------------------------------------------------------------- tests
def test_every_kind_of_file_reads_its_rows_in_order(data, tokenizer):
    del tokenizer
    spec = td.resolve_config(config(data))
    files = tf_files.split_files(spec, "train")
    assert [k for _, k in files] == ["jsonl", "jsonl", "text", "parquet", "arrow"]
    source = tf_files.open_files(files)
    assert len(source) == len(ALL_ROWS)
    assert source.read(range(len(source))) == ALL_ROWS  # nulls dropped, blank lines skipped
    order = np.random.default_rng(0).permutation(len(source))  # random access
    assert [source[int(i)] for i in order] == [ALL_ROWS[i] for i in order]
    cached = tf_files.open_files(files, cache=True)
    assert list(cached) == ALL_ROWS


@pytest.mark.parametrize("packing", [False, True])
def test_batches_weigh_exactly_the_trained_tokens(data, tokenizer, packing):
    seq_len = 48
    cfg = config(data, seq_len=seq_len, packing=packing)
    with loader(cfg) as ld:
        batches = list(ld)
        spec = ld.element_spec
    assert spec == td.element_spec(cfg, 4)
    keys = {"tokens", "weights"} | (
        {"tokens_segment_ids", "tokens_positions"} if packing else set()
    )
    assert set(spec) == keys
    for b in batches:
        assert b.keys() == spec.keys()
        for k, v in b.items():
            assert (v.shape, v.dtype) == (spec[k].shape, spec[k].dtype), k
    got = packed_segments(batches) if packing else unpacked_rows(batches)
    assert collections.Counter(got) == expected_examples(tokenizer, ALL_ROWS, seq_len)
    # prompt/completion rows: the completion and eos are weighted, bos and prompt are not
    row = PROMPT_ROWS[3]
    tokens, weights = ct.encode_row(tokenizer, row).values()
    completion = tokenizer.encode(row["completion"])
    assert weights.sum() == len(completion) + 1 and tokens[-1] == tokenizer.eos_id


def test_loss_weights_follow_the_masks_and_train_token_id_0(data, tokenizer):
    """lm.labels_and_weights: label = the next token, weighted where the next token's weight is
    > 0 and it is in the same segment; the "!" (id 0) inside text is a trained label."""
    cfg = config(data, seq_len=48, packing=True)
    with loader(cfg) as ld:
        batches = list(ld)
    zero_labels = 0
    for b in batches:
        labels, weights = (np.asarray(x) for x in lm.labels_and_weights(b))
        seg, w = b["tokens_segment_ids"], b["weights"]
        expected = np.zeros_like(weights)
        expected[:, :-1] = (w[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        np.testing.assert_array_equal(weights, expected)
        np.testing.assert_array_equal(labels[:, :-1], b["tokens"][:, 1:])
        zero_labels += (weights & (labels == 0)).sum()
    assert zero_labels >= len(TEXT_ROWS)  # every text row ends in "!" = id 0, trained


def test_split_cuts_text_rows_and_truncates_the_others(data, tokenizer):
    seq_len = 16
    cfg = config(data, seq_len=seq_len, packing=True, long_examples="split")
    with loader(cfg) as ld:
        got = collections.Counter(packed_segments(list(ld)))
    expected = collections.Counter()
    for row in ALL_ROWS:
        e = ct.encode_row(tokenizer, row)
        if ct.row_format(row) == "text":
            for i in range(0, len(e["tokens"]), seq_len):
                piece = (e["tokens"][i : i + seq_len], e["weights"][i : i + seq_len])
                expected[tuple(piece[0].tolist()), tuple(piece[1].tolist())] += 1
        else:
            expected.update(expected_examples(tokenizer, [row], seq_len))
    assert got == expected


# OpenAI's chat format: an assistant turn of "weight" 0 is not trained.
WEIGHTED_OUT = {
    "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi", "weight": 0},
    ]
}
LONG_PROMPTS = [
    {"prompt": "Q? " * 30, "completion": "A."},
    {"prompt": "Why? " * 12, "completion": "Because."},
    {
        "messages": [
            {"role": "user", "content": "hello " * 20},
            {"role": "assistant", "content": "hi"},
        ]
    },
]


def test_rows_that_train_nothing_are_dropped_counted_and_a_split_of_them_refused(
    bad_dir, tokenizer, caplog
):
    """At dataset.seq_len=24 a prompt of 24 tokens or more leaves nothing of its completion
    (and an empty text without bos, or a chat whose assistant turns have weight 0, has nothing
    to train): such rows are dropped as they are
    encoded, the first of each file logged and their number logged once per split, exactly; the
    other rows come out as before. A split of nothing else is refused when its loader is made
    (before any step or evaluation) naming dataset.seq_len and the longest prompt."""
    seq_len = 24
    prompts = [int(np.argmax(ct.encode_row(tokenizer, r)["weights"] > 0)) for r in LONG_PROMPTS]
    assert min(prompts) >= seq_len and not tokenizer.add_bos
    good = PROMPT_ROWS[:3] + TEXT_ROWS[:2]
    rows = good[:2] + LONG_PROMPTS[:2] + good[2:] + [{"text": ""}, WEIGHTED_OUT] + LONG_PROMPTS[2:]
    path = write_jsonl(bad_dir / "some.jsonl", rows)
    cfg = config(bad_dir, train_files=str(path), eval_files=str(path), seq_len=seq_len)
    counted = (
        rf"dataset.eval_files: 5 of the 10 rows this process read in epoch 0 train nothing and "
        rf"were dropped \({path}: 5\): 3 cut by dataset.seq_len=24 before their completion "
        rf"\(the longest prompt: {max(prompts)} tokens; raise dataset.seq_len above the prompts "
        r"to train them\); 2 with no token to train"
    )
    with caplog.at_level(logging.WARNING):
        with loader({**cfg, "packing": False}, split="eval") as ld:
            got = unpacked_rows(list(ld))
            ld.reset()  # evaluated again: counted once
            assert unpacked_rows(list(ld)) == got
    assert collections.Counter(got) == expected_examples(tokenizer, good, seq_len)
    assert len(re.findall(counted, caplog.text)) == 1
    assert caplog.text.count("trains nothing:") == 1  # the first of the file
    first = (
        f"{path}:3 trains nothing: its prompt is {prompts[0]} tokens, and dataset.seq_len=24 cuts "
        f"it before its completion; it is dropped, and so is every such row of {path} (counted"
    )
    assert first in caplog.text
    with loader(cfg, shuffle=True) as ld:  # packed, shuffled
        assert collections.Counter(packed_segments(list(ld))) == expected_examples(
            tokenizer, good, seq_len
        )

    bad = write_jsonl(bad_dir / "long.jsonl", LONG_PROMPTS + [{"text": ""}])
    refused = (
        rf"^dataset.{{}}: no row trains: dataset.seq_len=24 cuts every row before its completion "
        rf"\(the longest prompt, {bad}:1, is {max(prompts)} tokens\); raise dataset.seq_len "
        r"above the prompts, or shorten them$"
    )
    for split in ("train", "eval"):
        with pytest.raises(tf_files.BadRowsError, match=refused.format(f"{split}_files")):
            loader(config(bad_dir, train_files=str(bad), eval_files=str(bad), seq_len=24), split)
    mixed = config(bad_dir, train_files="", mixture=f"1:{path};1:{bad}", seq_len=24)
    with pytest.raises(tf_files.BadRowsError, match=refused.format(r"mixture: entry 2 '1:.*'")):
        loader(mixed, num_epochs=None)
    empty = write_jsonl(bad_dir / "empty.jsonl", [{"text": ""}])
    with pytest.raises(
        tf_files.BadRowsError,
        match=rf"^dataset.train_files: no row trains: {empty}:1: it has no token to train",
    ):
        loader(config(bad_dir, train_files=str(empty)))
    weighted_out = write_jsonl(bad_dir / "weighted_out.jsonl", [WEIGHTED_OUT])
    with pytest.raises(
        tf_files.BadRowsError,
        match=rf"^dataset.train_files: no row trains: {weighted_out}:1: every assistant turn of "
        "it has weight 0$",
    ):
        loader(config(bad_dir, train_files=str(weighted_out)))


def check_resumes_exactly(make, batches=30, saved_at=7):
    """A loader from `make()` restored from the (JSON) state saved after `saved_at` batches
    gives the batches a loader that never stopped gives; returns that state."""
    with make() as first:
        reference = [next(first) for _ in range(batches)]
    with make() as first:
        for _ in range(saved_at):
            next(first)
        state = json.loads(json.dumps(first.get_state()))
    with make() as second:
        second.set_state(state)
        rest = [next(second) for _ in range(batches - saved_at)]
    for x, y in zip(rest, reference[saved_at:], strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    return state


@pytest.mark.parametrize("packing", [True, False])
def test_restored_state_continues_exactly(data, tokenizer, packing):
    cfg = config(data, seq_len=32, packing=packing)

    def make():
        return loader(cfg, seed=3, shuffle=True, num_epochs=None)

    state = check_resumes_exactly(make)
    other = {**cfg, "train_files": str(data / "text.jsonl")}
    with loader(other, seed=3, shuffle=True, num_epochs=None) as third:
        with pytest.raises(ValueError, match="saved with files='5 files"):
            third.set_state(state)


def test_a_file_rewritten_in_place_is_not_resumed(bad_dir, caplog):
    """The saved position names the files' bytes (their sha256), as it names the tokenizer's: a
    file shuffled in place (same path, same rows) is refused by name; a position saved before
    tfjax recorded the bytes still resumes exactly, with a line saying it was not checked."""
    path = write_jsonl(bad_dir / "rows.jsonl", TEXT_ROWS)
    cfg = config(bad_dir, train_files=str(path), seq_len=32, packing=False)

    def make(**fields):
        return loader({**cfg, **fields}, seed=3, shuffle=True, num_epochs=None)

    with make() as first:
        for _ in range(2):
            next(first)
        state = json.loads(json.dumps(first.get_state()))
        rest = [next(first) for _ in range(3)]
    with make(cache=True) as cached:  # rows read into memory: the same files, the same bytes
        cached.set_state(state)
    old = {k: v for k, v in state.items() if k != "content"}  # saved before issue 48
    with make() as second, caplog.at_level(logging.WARNING):
        second.set_state(old)
        for x, y in zip([next(second) for _ in range(3)], rest, strict=True):
            np.testing.assert_array_equal(x["tokens"], y["tokens"])
    assert "saved by an older tfjax, without the content of the data files" in caplog.text
    write_jsonl(path, TEXT_ROWS[::-1])  # shuffled in place
    with make() as third:
        with pytest.raises(
            ValueError,
            match=rf"^the data files changed since the loader state was saved: their bytes' "
            rf"sha256 was '{state['content']}', now 'sha256 [0-9a-f]{{16}}' \(same files, same "
            r"number of rows: rewritten in place\).*resume with the files as they were$",
        ):
            third.set_state(state)
        third.set_state(old)  # (what an older position cannot tell)


def test_two_processes_read_disjoint_shares_covering_the_data(data, tokenizer):
    cfg = config(data, seq_len=64, packing=False)
    shares = []
    for index in (0, 1):
        with loader(cfg, shuffle=True, seed=1, process_index=index, process_count=2) as ld:
            batches = list(ld)
            assert len(batches) == ld.num_batches
        shares.append(collections.Counter(unpacked_rows(batches)))
    everything = expected_examples(tokenizer, ALL_ROWS, 64)
    assert set(everything.values()) == {1}  # distinct rows: a covering sum is disjoint
    assert shares[0] + shares[1] == everything
    n = len(ALL_ROWS)
    assert [sum(s.values()) for s in shares] == [(n + 1) // 2, n // 2]


def test_globs_comma_lists_and_the_saved_directory(data, tokenizer):
    del tokenizer
    spec = td.resolve_config(config(data, train_files=f"{data}/*.jsonl, {data}/saved/*.arrow"))
    files = tf_files.split_files(spec, "train")
    assert [p.name for p, _ in files] == ["chat.jsonl", "text.jsonl", "data-00000-of-00001.arrow"]
    assert len(tf_files.open_files(files)) == len(PROMPT_ROWS + CHAT_ROWS + TEXT_ROWS + ARROW_ROWS)
    spec = td.resolve_config(config(data, eval_files=str(data / "saved")))
    with loader(spec, split="eval") as ld:  # the saved directory itself
        assert len(packed_segments(list(ld))) == len(ARROW_ROWS)


def test_train_files_switch_a_dataset_config_to_files(data):
    import ml_collections

    dataset = ml_collections.ConfigDict({"name": "pydoc", "seq_len": 64})
    td.with_placeholders(dataset)
    dataset.train_files = str(data / "text.jsonl")
    dataset.tokenizer = str(data / "tok")
    spec = td.dataset_spec(ml_collections.ConfigDict({"task": "lm", "dataset": dataset}))
    assert (spec.name, spec.seq_len, spec.packing, spec.eval_files) == ("files", 64, True, "")
    with pytest.raises(ValueError, match="'files' has no config field 'vocab_size'.*became"):
        td.resolve_config({"name": "lm1b", "vocab_size": 100, "train_files": "x.jsonl"})
    with pytest.raises(ValueError, match="task='mlm' is not available"):
        td.resolve_config({"name": "files", "task": "mlm", "train_files": "x", "tokenizer": "t"})
    # The tokenizer may be left unset (a fine-tune's is its checkpoint's); without a checkpoint
    # to take it from, the run's dataset names the field.
    assert td.resolve_config({"train_files": "x.jsonl"}).tokenizer == ""
    from tfjax.runner import pretrained

    config = ml_collections.ConfigDict({"task": "lm", "init_from": "", "dataset": dataset})
    config.dataset.tokenizer = ""
    with pytest.raises(ValueError, match="dataset.tokenizer is unset and config.init_from is not"):
        pretrained.dataset_spec(config, None)


# ------------------------------------------------------------------------------------ mixtures
# Source A: the text rows; source B, a comma list of two files: the prompt, chat and .txt rows.
MIX_A = TEXT_ROWS
MIX_B = PROMPT_ROWS + CHAT_ROWS + [{"text": line} for line in TXT_LINES if line.strip()]


def mixture(root, weight_a=3, weight_b=1):
    return (
        f"{weight_a}:{root / 'text.jsonl'}; {weight_b}:{root / 'chat.jsonl'},{root / 'notes.txt'}"
    )


def mixture_config(root, **fields):
    return config(root, train_files="", mixture=mixture(root), **fields)


def drawn(tokenizer, batches, seq_len):
    """The rows of unpacked batches, each as (source "A" or "B", its index in the source)."""
    where = {}
    for name, rows in (("A", MIX_A), ("B", MIX_B)):
        for i, row in enumerate(rows):
            e = ct.encode_row(tokenizer, row)
            key = (tuple(e["tokens"][:seq_len].tolist()), tuple(e["weights"][:seq_len].tolist()))
            assert key not in where  # every row tells its source
            where[key] = (name, i)
    return [where[row] for row in unpacked_rows(batches)]


def test_a_mixture_draws_its_sources_at_their_weights(data, tokenizer):
    seq_len, rows = 64, 400
    cfg = mixture_config(data, seq_len=seq_len, packing=False)
    with loader(cfg, seed=5, shuffle=True, num_epochs=None) as ld:
        got = drawn(tokenizer, [next(ld) for _ in range(rows // 4)], seq_len)
    assert len(got) == rows
    share = sum(name == "A" for name, _ in got) / rows
    # Grain's mix interleaves in a fixed pattern (no randomness): 3:1 is AAAB AAAB ...
    assert abs(share - 0.75) <= 0.01, share
    # Each source goes through whole shuffled epochs of its own: every row of it is drawn
    # equally often, to one (a partial last epoch).
    for name, source in (("A", MIX_A), ("B", MIX_B)):
        counts = collections.Counter(i for n, i in got if n == name)
        draws = sum(counts.values())
        assert set(counts) == set(range(len(source)))
        assert set(counts.values()) <= {draws // len(source), draws // len(source) + 1}
    # Weights are relative: 0.3:0.1 is exactly 3:1 (Grain's own truncation of 0.7499...:0.25
    # would make it 299:100, another pattern from row 398 on); the rows of a source are shuffled.
    same = {**cfg, "mixture": mixture(data, 0.3, 0.1)}
    with loader(same, seed=5, shuffle=True, num_epochs=None) as ld:
        assert drawn(tokenizer, [next(ld) for _ in range(rows // 4)], seq_len) == got
    in_order = [(n, i) for n, i in got if n == "A"][: len(MIX_A)]
    assert in_order != [("A", i) for i in range(len(MIX_A))]


@pytest.mark.parametrize("packing", [True, False])
def test_a_mixture_resumes_exactly(data, tokenizer, packing):
    del tokenizer
    cfg = mixture_config(data, seq_len=32, packing=packing)

    def make(cfg=cfg):
        return loader(cfg, seed=3, shuffle=True, num_epochs=None)

    state = check_resumes_exactly(make)  # over several epochs of each source
    with make({**cfg, "mixture": mixture(data, 1, 1)}) as other:  # the mixture is its identity
        with pytest.raises(ValueError, match=r"saved with mixture=\[0.75, 0.25\]"):
            other.set_state(state)


def test_each_process_mixes_its_own_share_of_every_source(data, tokenizer):
    seq_len = 64
    cfg = mixture_config(data, seq_len=seq_len, packing=False)
    firsts = collections.defaultdict(list)  # source -> each process's first epoch of it
    for index in (0, 1):
        with loader(
            cfg, shuffle=True, seed=1, process_index=index, process_count=2, num_epochs=None
        ) as ld:
            got = drawn(tokenizer, [next(ld) for _ in range(50)], seq_len)
        assert sum(name == "A" for name, _ in got) == 3 * len(got) // 4  # 3:1 in each process
        for name, source in (("A", MIX_A), ("B", MIX_B)):
            share = len(range(index, len(source), 2))  # its rows of every epoch of the source
            firsts[name].append([i for n, i in got if n == name][:share])
    for name, source in (("A", MIX_A), ("B", MIX_B)):  # disjoint shares covering the source
        first, second = firsts[name]
        assert sorted(first + second) == list(range(len(source))), name


def test_mixture_errors_name_the_entry_before_any_work(data, tmp_path):
    a, b = data / "text.jsonl", data / "chat.jsonl"
    fmt = r"\(dataset.mixture is 'WEIGHT:FILES;WEIGHT:FILES...'"
    malformed = [
        (f"3:{a};{b}", rf"dataset.mixture: entry 2 '{b}' has no WEIGHT: {fmt}"),
        (f"3:{a};0:{b}", rf"entry 2 '0:{b}': its weight '0' is not a positive number {fmt}"),
        (f"-1:{a}", r"entry 1 '-1:.*': its weight '-1' is not a positive number"),
        (f"nan:{a}", r"entry 1 'nan:.*': its weight 'nan' is not a positive number"),
        (f"inf:{a}", r"its weight 'inf' is not a positive number"),
        ("gs://bucket/x.parquet", r"entry 1 'gs://bucket/x.parquet': its weight 'gs' is not"),
        (f"1:{a};2: , ", r"dataset.mixture: entry 2 '2: ,' names no files"),
        (" ; ", r"dataset.mixture=' ; ' names no source"),
    ]
    for value, error in malformed:  # when the config is resolved: no file is looked at
        with pytest.raises(ValueError, match=error):
            td.resolve_config(config(data, train_files="", mixture=value))
    with pytest.raises(
        ValueError, match=r"dataset.mixture='1:.*' and dataset.train_files='.*' are both set"
    ):
        td.resolve_config(config(data, mixture=f"1:{a}"))
    # the files, when they are checked (the run's path checks) or the loader opens them
    missing = td.resolve_config(
        config(data, train_files="", mixture=f"3:{a};1:{b},{data}/none*.txt")
    )
    for run in (tf_files.check, lambda spec: loader(spec, num_epochs=None)):
        with pytest.raises(
            FileNotFoundError,
            match=rf"dataset.mixture: entry 2 '1:{b},{data}/none\*.txt': '.*none\*.txt' matches no",
        ):
            run(missing)
    with pytest.raises(ValueError, match=r"dataset.mixture=.* num_epochs must be None, got 1"):
        loader(mixture_config(data), num_epochs=1)
    one_row = write_jsonl(tmp_path / "one.jsonl", TEXT_ROWS[:1])
    cfg = config(data, train_files="", mixture=f"1:{a};1:{one_row}")
    with pytest.raises(ValueError, match=r"entry 2 '1:.*one.jsonl' has 1 examples, fewer than"):
        loader(cfg, process_count=2, process_index=0, num_epochs=None)


def test_a_mixture_on_the_command_line_and_its_eval_files(data, tmp_path, tokenizer):
    """--config.dataset.mixture on the finetune config: the run's path checks name a bad entry
    before a workdir exists; the eval split stays dataset.eval_files."""
    from conftest import ROOT

    from tfjax.runner import checks, train

    config = train.load_config(f"{ROOT}/configs/finetune.py:tiny")
    config.dataset.mixture = f"3:{data / 'text.jsonl'};1:{data}/none*.jsonl"
    config.dataset.eval_files = str(data / "notes.txt")
    config.dataset.tokenizer = str(data / "tok")
    with pytest.raises(FileNotFoundError, match=r"dataset.mixture: entry 2 .* matches no file"):
        checks.check_paths(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    config.dataset.mixture = mixture(data)
    checks.check_paths(config, str(tmp_path / "run"))
    spec = td.dataset_spec(config)
    with loader(spec, split="eval") as ld:
        got = packed_segments(list(ld))
    rows = [{"text": line} for line in TXT_LINES if line.strip()]
    assert collections.Counter(got) == expected_examples(tokenizer, rows, spec.seq_len)


# ----------------------------------------------------------------------------------- bad input
@pytest.fixture
def bad_dir(data, tmp_path):
    (tmp_path / "tok").symlink_to(data / "tok")
    return tmp_path


def open_one(path, **kwargs):
    return tf_files.open_files(tf_files.expand(str(path), "dataset.train_files"), **kwargs)


@pytest.mark.parametrize(
    "line, error",
    [
        ("{not json", r"bad.jsonl:3: not JSON: Expecting property name .* at column 2"),
        ('{"prompt": "no completion"}', r"bad.jsonl:3: .*'completion'"),
        ('{"title": "x"}', r"bad.jsonl:3: a row needs 'text', .* it has \['title'\]"),
        ('{"messages": [{"role": "user"}]}', r"bad.jsonl:3: message 0 has no 'content'"),
        ('{"messages": [{"content": "hi"}]}', r"bad.jsonl:3: message 0 has no 'role'"),
        ('{"text": 5}', r"bad.jsonl:3: 'text' must be a string"),
        ("[1, 2]", r"bad.jsonl:3: a row must be a JSON object, got list"),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": "b", "weight": 2}]}',
            r"bad.jsonl:3: message 1: 'weight' must be 0 \(the assistant turn is not trained\) "
            r"or 1 \(trained\), got 2",
        ),
        (
            '{"messages": [{"role": "system", "content": "a", "weight": 0}, '
            '{"role": "assistant", "content": "b"}]}',
            r"bad.jsonl:3: message 0: 'weight' is allowed only on an assistant message",
        ),
    ],
)
def test_a_bad_row_names_its_file_and_line(bad_dir, tokenizer, line, error):
    del tokenizer
    path = write_jsonl(bad_dir / "bad.jsonl", TEXT_ROWS[:2], extra_lines=[line, '{"text": "ok"}'])
    with pytest.raises(ValueError, match=error):
        open_one(path)
    assert len(open_one(path, skip_bad_rows=True)) == 3


def test_skip_bad_rows_counts_them_per_file(bad_dir, tokenizer, caplog):
    del tokenizer
    write_jsonl(bad_dir / "a.jsonl", TEXT_ROWS[:3], extra_lines=["{", "{}", '{"text": "x"}'])
    pq.write_table(
        pa.Table.from_pylist([{"text": "a"}, {"text": None}, {"text": "b"}]), bad_dir / "b.parquet"
    )
    with pytest.raises(ValueError, match=r"b.parquet: row 2: a row needs 'text'"):
        open_one(bad_dir / "b.parquet")
    with caplog.at_level(logging.WARNING):
        source = open_one(f"{bad_dir}/a.jsonl,{bad_dir}/b.parquet", skip_bad_rows=True)
    assert source.read(range(len(source))) == [
        *TEXT_ROWS[:3],
        {"text": "x"},
        {"text": "a"},
        {"text": "b"},
    ]
    log = caplog.text
    assert "skipped 2 of 6 rows of" in log and "a.jsonl:4: not JSON: Expecting" in log
    assert "skipped 1 of 3 rows of" in log and "b.parquet: row 2" in log
    cfg = config(bad_dir, train_files=str(bad_dir / "a.jsonl"), skip_bad_rows=True, packing=False)
    with loader(cfg) as ld:  # the loader reads what passed
        assert len(unpacked_rows(list(ld))) == 4


def test_errors_before_any_work_name_the_field(bad_dir, tokenizer):
    del tokenizer
    write_jsonl(bad_dir / "ok.jsonl", TEXT_ROWS[:2])
    ok = config(bad_dir, train_files=str(bad_dir / "ok.jsonl"))
    (bad_dir / "data.csv").write_text("a,b\n")
    write_jsonl(bad_dir / "with,comma.jsonl", TEXT_ROWS[:2])
    (bad_dir / "cut").mkdir()  # a tokenizer.json cut short: read by the checks, not later
    (bad_dir / "cut" / "tokenizer.json").write_bytes(
        (bad_dir / "tok" / "tokenizer.json").read_bytes()[:500]
    )
    cases = [
        (
            {"train_files": f"{bad_dir}/ok.jsonl,{bad_dir}/none*.jsonl"},
            FileNotFoundError,
            r"dataset.train_files: '.*none\*.jsonl' matches no file",
        ),
        (
            {"train_files": str(bad_dir / "missing.jsonl")},
            FileNotFoundError,
            "dataset.train_files: '.*missing.jsonl' matches no file",
        ),
        (
            {"train_files": f"{bad_dir}/ok.jsonl,{bad_dir}/with,comma.jsonl"},
            FileNotFoundError,
            r"^dataset.train_files: commas separate files, so '.*/with,comma.jsonl' was read as "
            r"\['.*/with', 'comma.jsonl'\]; rename it without a comma$",
        ),
        (
            {"train_files": str(bad_dir / "data.csv")},
            ValueError,
            r"dataset.train_files: .*data.csv has an extension .*allowed: .txt, .jsonl, .json, "
            r".parquet, .arrow",
        ),
        (
            {"eval_files": str(bad_dir / "missing.parquet")},
            FileNotFoundError,
            "dataset.eval_files: '.*missing.parquet' matches no file",
        ),
        (
            {"tokenizer": str(bad_dir / "nowhere")},
            FileNotFoundError,
            "dataset.tokenizer='.*nowhere' is not a directory",
        ),
        (
            {"tokenizer": str(bad_dir)},
            FileNotFoundError,
            "dataset.tokenizer=.* holds no tokenizer file; expected tokenizer.json or "
            "tokenizer.model",
        ),
        (
            {"tokenizer": str(bad_dir / "cut")},
            ValueError,
            "dataset.tokenizer=.*cut': its tokenizer cannot be loaded .*cut/tokenizer.json is cut "
            "short: its JSON ends mid-way, after 500 bytes; download it again",
        ),
    ]
    for fields, kind, error in cases:
        spec = td.resolve_config({**ok, **fields})
        with pytest.raises(kind, match=error):
            tf_files.check(spec)
        if "eval_files" not in fields:  # the train loader does not read the eval files
            with pytest.raises(kind, match=error):
                loader(spec)
    with pytest.raises(
        ValueError, match="dataset.eval_files is empty: dataset 'files' has no eval"
    ):
        loader(ok, split="eval")
    with pytest.raises(ValueError, match="splits 'train' .* and 'eval'.*got split='test'"):
        loader(ok, split="test")
    (bad_dir / "array.json").write_text(json.dumps(TEXT_ROWS))
    with pytest.raises(ValueError, match="array.json:1: the file is a JSON array"):
        open_one(bad_dir / "array.json")
    (bad_dir / "plain").mkdir()
    with pytest.raises(ValueError, match="plain is a directory without a dataset saved"):
        open_one(bad_dir / "plain")
    # A torn or hand-edited file that `datasets` saved: named, not a traceback.
    for i, (name, text, error) in enumerate(
        [
            ("dataset_dict.json", '{"splits": ', r"dataset_dict.json is not valid JSON"),
            ("dataset_dict.json", '{"splits": "train"}', r"dataset_dict.json .*'splits' is a list"),
            ("state.json", "\x00\x01", r"state.json is not valid JSON"),
            ("state.json", "[]", r"state.json holds a JSON list"),
            (
                "state.json",
                '{"_data_files": [1]}',
                r"state.json .*'_data_files' is a list of dicts",
            ),
            ("state.json", '{"_data_files": [{}]}', r"state.json has a _data_files entry without"),
        ]
    ):
        saved = bad_dir / f"saved{i}"
        saved.mkdir()
        (saved / name).write_text(text)
        spec = td.resolve_config({**ok, "train_files": str(saved)})
        with pytest.raises(ValueError, match=f"dataset.train_files: .*{error}"):
            tf_files.check(spec)


def test_a_file_named_twice_is_refused_and_an_eval_file_trained_on_is_a_warning(bad_dir, caplog):
    """Rows read twice without a word: a file listed twice, a glob over a listed path, two
    names of one file (a link, "..") are refused naming the field and the file; the same file
    as train and eval file is allowed (a smoke test) with a line saying the eval is not held
    out."""
    a = write_jsonl(bad_dir / "a.jsonl", TEXT_ROWS[:2])
    b = write_jsonl(bad_dir / "b.jsonl", TEXT_ROWS[2:4])
    (bad_dir / "link.jsonl").symlink_to(a)
    up = f"{bad_dir}/../{bad_dir.name}/b.jsonl"
    twice = "so its rows would be read twice; name each file once"
    for files, what in [
        (f"{a},{b},{a}", rf"{a} is listed twice"),
        (f"{a},{bad_dir}/*.jsonl", rf"{a} is named by both '{a}' and '{bad_dir}/\*.jsonl'"),
        (f"{a},{up},{b}", rf"{up} and {b} are the same file"),
        (f"{bad_dir}/link.jsonl,{a}", rf"{bad_dir}/link.jsonl and {a} are the same file"),
    ]:
        for field in ("train_files", "eval_files"):
            spec = td.resolve_config(config(bad_dir, **{"train_files": str(b), field: files}))
            with pytest.raises(ValueError, match=rf"^dataset.{field}: {what}, {twice}"):
                tf_files.check(spec)
    mixture = config(bad_dir, train_files="", mixture=f"1:{a};2:{b},{b}")
    with pytest.raises(ValueError, match=rf"^dataset.mixture: entry 2 .*{b} is listed twice"):
        loader(mixture, num_epochs=None)
    with caplog.at_level(logging.WARNING):
        tf_files.check(td.resolve_config(config(bad_dir, train_files=str(a), eval_files=str(b))))
        assert "held out" not in caplog.text
        tf_files.check(
            td.resolve_config(config(bad_dir, train_files=f"{a},{b}", eval_files=str(a)))
        )
    assert (
        f"dataset.eval_files: {a} is also in dataset.train_files: the eval loss is not held out"
        in caplog.text
    )


def test_the_checkpoints_own_tokenizer_is_named_by_its_file_and_init_from(bad_dir, data):
    """dataset.tokenizer unset: the run reads config.init_from's tokenizer, and its errors name
    the checkpoint's file at fault and config.init_from, not dataset.tokenizer (unset)."""
    from conftest import ROOT

    from tfjax.runner import train

    run = train.load_config(f"{ROOT}/configs/finetune.py:tiny")
    run.dataset.train_files = run.dataset.eval_files = str(data / "text.jsonl")
    assert tf_files.tokenizer_field(run) == "config.init_from"
    run.dataset.tokenizer = str(data / "tok")
    assert tf_files.tokenizer_field(run) == "dataset.tokenizer"
    tok_config = json.loads((data / "tok" / "tokenizer_config.json").read_text())
    for name, files, error in [
        (
            "broken",
            {"generation_config.json": '{"eos_token_id": '},
            r"/broken/generation_config.json is not valid JSON \(.*\).*download it again",
        ),
        (
            "noeos",
            {"tokenizer_config.json": json.dumps({**tok_config, "eos_token": None})},
            r"/noeos names no eos token: tokenizer_config.json has no eos_token and "
            "generation_config.json no eos_token_id",
        ),
    ]:
        directory = bad_dir / name
        directory.mkdir()
        for original in (data / "tok").iterdir():
            (directory / original.name).write_bytes(original.read_bytes())
        for file, text in files.items():
            (directory / file).write_text(text)
        spec = td.resolve_config(
            config(bad_dir, train_files=str(data / "text.jsonl"), tokenizer=str(directory))
        )
        with pytest.raises(ValueError, match=rf"^dataset.tokenizer='{directory}': .*{error}"):
            tf_files.check(spec)
        with pytest.raises(
            ValueError,
            match=rf"^{bad_dir}{error}.* \(the tokenizer of config.init_from: dataset.tokenizer "
            r"is unset\)$",
        ) as raised:
            tf_files.check(spec, "config.init_from")
        assert "dataset.tokenizer=" not in str(raised.value)
    with pytest.raises(
        FileNotFoundError,
        match=rf"^{bad_dir} \(the checkpoint of config.init_from: dataset.tokenizer is unset\) "
        "holds no tokenizer file; .*; give the directory of its tokenizer files as "
        "dataset.tokenizer$",
    ):
        tf_files.load_tokenizer(str(bad_dir), "config.init_from")


def test_sources_pickle_for_worker_processes(data, tokenizer):
    del tokenizer
    spec = td.resolve_config(config(data))
    source = tf_files.open_files(tf_files.split_files(spec, "train"))
    source[0], source[len(source) - 1]  # open handles and a decoded row group: not pickled
    copy = pickle.loads(pickle.dumps(source))
    rows = copy.read(range(len(copy)))
    assert rows == ALL_ROWS
    assert [r.origin for r in rows] == [r.origin for r in source.read(range(len(source)))]
    assert rows[len(TEXT_ROWS) + 2].origin == f"{data / 'chat.jsonl'}:3"
    assert rows[-1].origin == f"{data / 'saved' / 'data-00000-of-00001.arrow'}: row 9"


def test_a_row_the_tokenizer_refuses_is_named_by_its_line(data, tokenizer, monkeypatch):
    encode_row = ct.encode_row

    def refusing(tok, row):
        if "document 3:" in row.get("text", ""):
            raise ValueError("the template cannot render it")
        return encode_row(tok, row)

    monkeypatch.setattr(ct, "encode_row", refusing)
    cfg = config(data, train_files=str(data / "text.jsonl"))
    with pytest.raises(ValueError, match=r"text.jsonl:4: the template cannot render it"):
        with loader(cfg) as ld:
            list(ld)


def test_a_conversation_the_template_refuses_is_named_before_any_step(bad_dir, data):
    """The first row of each conversation shape (roles in order, message keys) is encoded when
    the loader is made: a later row whose order of roles the template refuses is one line
    naming its file and line then, not when training reaches it."""
    alternate = (
        "{%- for m in messages %}{%- if not loop.first and loop.previtem['role'] == m['role'] %}"
        "{{ raise_exception('Conversation roles must alternate') }}{%- endif %}{%- endfor %}"
    )
    tok = bad_dir / "alternating"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((data / "tok" / "tokenizer.json").read_bytes())
    tok_config = json.loads((data / "tok" / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = alternate + CHATML
    (tok / "tokenizer_config.json").write_text(json.dumps(tok_config))
    user_user = {"messages": [{"role": "user", "content": "a"}, *CHAT_ROWS[0]["messages"]]}
    rows = [*CHAT_ROWS[:3], *TEXT_ROWS[:2], WEIGHTED_OUT, user_user, *CHAT_ROWS[3:]]
    path = write_jsonl(bad_dir / "chats.jsonl", rows)
    assert open_one(path).chats == [0, 5, 6]  # the first of each shape
    refused = (
        rf"^{path}:7: the chat template of {tok} failed on this conversation: TemplateError: "
        "Conversation roles must alternate"
    )
    for cache in (False, True):
        cfg = config(bad_dir, train_files=str(path), tokenizer=str(tok), cache=cache)
        with pytest.raises(tf_files.BadRowsError, match=refused):
            loader(cfg)  # made, not read


def test_more_bad_rows_named_before_training(bad_dir, tokenizer):
    del tokenizer
    (bad_dir / "latin1.txt").write_bytes(b"good line\n\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1.txt:3: not UTF-8 \(invalid continuation"):
        open_one(bad_dir / "latin1.txt")
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(bad_dir / "chat.jsonl", [user_only])
    with pytest.raises(ValueError, match=r"chat.jsonl:1: 'messages' has no 'assistant' turn"):
        open_one(path)
    write_jsonl(bad_dir / "bad.jsonl", [{"title": "x"}])
    with pytest.raises(ValueError, match=r"no rows to read"):
        open_one(bad_dir / "bad.jsonl", skip_bad_rows=True)


def test_an_empty_file_is_skipped_by_name_and_a_split_of_them_refused(bad_dir, caplog):
    """0 bytes, blank lines only, a Parquet or Arrow file of no rows: among other files each is
    skipped with a line naming it; a split of nothing else is refused naming its field."""
    ok = write_jsonl(bad_dir / "ok.jsonl", TEXT_ROWS[:2])
    (bad_dir / "empty.jsonl").write_bytes(b"")
    (bad_dir / "blank.txt").write_text("\n  \n\n")
    (bad_dir / "empty.parquet").write_bytes(b"")
    (bad_dir / "empty.arrow").write_bytes(b"")
    no_rows = pa.table({"text": pa.array([], pa.string())})
    pq.write_table(no_rows, bad_dir / "no-rows.parquet")
    with pa.ipc.new_stream(str(bad_dir / "no-rows.arrow"), no_rows.schema) as writer:
        writer.write_table(no_rows)
    names = ("empty.jsonl", "blank.txt", "empty.parquet", "empty.arrow", "no-rows.parquet")
    for name in (*names, "no-rows.arrow"):
        path = bad_dir / name
        with caplog.at_level(logging.WARNING):
            assert len(open_one(f"{ok},{path}")) == 2
        assert f"{path} is empty (no rows): skipped" in caplog.text
        for split in ("train", "eval"):
            cfg = config(bad_dir, train_files=str(path), eval_files=str(path))
            with pytest.raises(
                tf_files.BadRowsError,
                match=rf"^dataset.{split}_files: no rows to read: {path} is empty; give files",
            ):
                loader(cfg, split=split)
    cfg = config(bad_dir, train_files="", mixture=f"1:{ok};1:{bad_dir}/empty.*")
    with pytest.raises(
        tf_files.BadRowsError,
        match=r"^dataset.mixture: entry 2 '1:.*empty.\*': no rows to read: .*empty.arrow, .*"
        r"empty.jsonl, .*empty.parquet are empty",
    ):
        loader(cfg, num_epochs=None)


def test_a_run_checks_the_files_before_any_work(data, tmp_path):
    """--config.dataset.train_files on the lm config: the runner's path checks name the field
    before a workdir or a loader exists."""
    from conftest import ROOT

    from tfjax.runner import checks, train

    config = train.load_config(f"{ROOT}/configs/lm.py:tiny")
    config.data_dir = str(tmp_path)
    config.dataset.train_files = str(data / "text.jsonl")
    config.dataset.tokenizer = str(data / "tok")
    with pytest.raises(ValueError, match="dataset.eval_files is empty: a run evaluates"):
        checks.check_paths(config, str(tmp_path / "run"))
    config.dataset.eval_files = str(data / "text.jsonl")
    checks.check_paths(config, str(tmp_path / "run"))
    assert td.dataset_spec(config).name == "files"
    config.dataset.eval_files = str(data / "nothing*.parquet")
    with pytest.raises(FileNotFoundError, match="dataset.eval_files: .* matches no file"):
        checks.check_paths(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
