"""The user's own text files as a dataset (catalog name "files"): for fine-tuning a Hugging Face
checkpoint on data that is no TFDS dataset.

    spec = tfjax.data.resolve_config({"train_files": "data/*.jsonl", "tokenizer": "ckpt/"})
    loader = tfjax.data.make_loader(spec, split="train", batch_size=8, seed=0, shuffle=True,
                                    num_epochs=None)

`dataset.train_files` and `dataset.eval_files` are each a path, a glob or a comma-separated
list of them (so a path cannot hold a comma: a file named with one is refused with that
advice), local or `gs://` (read through `etils.epath`), naming each file once (a file named
twice, e.g. by a path and a glob, would be read twice: it is refused; an eval file that is also
a train file is allowed, with a warning line naming it):

  .txt              one row {"text": line} per non-empty line (whitespace-only lines are
                    empty), without its line ending. Lines rather than whole files: a file
                    larger than memory stays readable by random access (one offset per line,
                    as for JSON lines), errors name the line, and it is what Hugging Face
                    `datasets` makes of a text file by default. Text whose documents span
                    several lines belongs in JSON lines: {"text": "...\\n..."}.
  .jsonl, .json     JSON lines: one JSON object per line (blank lines are skipped). A .json
                    file holding one JSON array is refused with that advice.
  .parquet          read by row group; the last decoded row group is kept, so reading in file
                    order is cheap and a shuffled order decodes a row group per row: write
                    small row groups (a few MB), or set dataset.cache for data that fits in
                    memory.
  .arrow            Arrow files of a dataset saved by Hugging Face `datasets` (`save_to_disk`),
                    memory-mapped (a gs:// one is read into memory); the saved directory itself
                    is accepted and reads its files in the order its state.json lists.

`dataset.mixture` trains on several sources instead of train_files (which must then be empty),
each drawn at its weight: "WEIGHT:FILES;WEIGHT:FILES...", FILES as in train_files (gs:// paths
and comma lists of files included: an entry is split at its first ':', entries at ';'), weights
positive numbers, relative (normalised to sum to 1; drawn as Grain's integer proportions, each
weight over the smallest to 1/100):

    --config.dataset.mixture="3:data/chat/*.jsonl;1:gs://bucket/web.parquet"

trains on 3 rows of the chat files for each row of web.parquet. Each source goes through
shuffled epochs of its own (a small source repeats more often than a large one), each process
reads its share of every source, and the sources are mixed before packing by Grain's
`MapDataset.mix`, in a fixed interleave (3:1 is AAAB AAAB ...); the loader's saved position
resumes it exactly, and is refused by another mixture. A mixture has no epochs: its loader
repeats forever (num_epochs=None). The eval split stays dataset.eval_files. A malformed entry, a
weight that is not a positive number, an entry that matches no file: a ValueError (or
FileNotFoundError) naming dataset.mixture and the entry, before any file is read.

Each row is one of (`tfjax.data.checkpoint_tokenizer.row_format` tells them apart by their
keys; one dataset may mix them, each row is encoded by its own format):

  {"text": str}                                       every token trained
  {"prompt": str, "completion": str}                  the completion (and eos) trained
  {"messages": [{"role": str, "content": str}, ...]}  what encode_row trains of a chat: each
                                                      assistant turn, unless its "weight" is 0

A row that trains nothing once cut to dataset.seq_len (its prompt is seq_len tokens or more, an
empty text, a chat whose every assistant turn has "weight" 0) is dropped, counted and logged,
and a split of no other rows is refused when its loader is made (`RowEncoder`).

Columns that are null in a Parquet or Arrow row are dropped from it, so files written from
mixed rows read as they were written. Every row is checked once when its file is opened (the
whole of every file is scanned: a large dataset costs that scan at every start, on every
process); a bad one is a ValueError naming the file and its 1-based line (JSON lines, text) or
row (Parquet, Arrow) and what is wrong, or with dataset.skip_bad_rows it is skipped and the
number skipped is logged per file. The chat template is tried on the first row of each
conversation shape (its roles in order and its messages' keys) when the loader is made, so a
conversation it refuses is one line naming file:line before any step; a row it refuses for its
text alone is named when training reaches it (rendering every row would cost 2 to 8 times the
scan: `CHAT_SHAPES`). A Parquet or Arrow file that pyarrow cannot read (cut short,
damaged, of another format) is one line naming it: found by `check` (the run's checks, before
any work) from its footer or schema, else when its rows are read at opening.
An empty file (no rows: 0 bytes, blank lines only, a table of none) among others is skipped
with a line naming it; a split (or a mixture's source) without a row is refused naming its field.

The sources here are Grain random-access data sources (`__len__`, `__getitem__`, `read`) over
the rows that passed, read lazily; shuffling, sharding over processes, epochs and the
checkpointable position are the loader's as for every dataset (`tfjax.data.loader`); the position
names the files, their rows and their bytes' sha256 (`file_digest`), so a file rewritten in place
is refused on resume. Each row is encoded by `tfjax.data.checkpoint_tokenizer.encode_row` into
"tokens" and "weights".
"""

from __future__ import annotations

import bisect
import contextlib
import glob as globlib
import hashlib
import itertools
import json
import os
import threading
import time

import numpy as np
from absl import logging
from etils import epath

from tfjax import jsonfile

# extension -> the kind of file (what reads it)
EXTENSIONS = {
    ".txt": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a checkpoint's, one of them at least
TOKENIZER_FIELD = "dataset.tokenizer"  # the field naming their directory, unless init_from does


def _is_local(path) -> bool:
    return "://" not in str(path)


def _size(path) -> int:
    return epath.Path(path).stat().length


# ------------------------------------------------------------------------------------ file lists
def expand(patterns: str, field: str) -> list[tuple[epath.Path, str]]:
    """[(path, kind)] of a path, glob or comma-separated list of them, in the order given (each
    glob's matches sorted). A saved Hugging Face dataset directory gives its .arrow files. A
    pattern that matches nothing, a file of another extension, a directory that is no saved
    dataset, a file named twice (by two patterns, e.g. a path and a glob that matches it: its
    rows would be read twice; a source is drawn more often by dataset.mixture's weights): a
    FileNotFoundError / ValueError naming `field` (e.g. "dataset.train_files")."""
    out, named = [], {}  # named: a file's identity -> (the pattern, the path) that named it
    pieces = patterns.split(",")
    for i, pattern in enumerate(p.strip() for p in pieces):
        if not pattern:
            continue
        matches = _matches(pattern)
        if not matches:
            _refuse_comma(pieces, i, field)
            raise FileNotFoundError(f"{field}: {pattern!r} matches no file")
        for path, kind in (f for match in matches for f in _files_of(match, field)):
            identity = _identity(path)
            if identity in named:
                first_pattern, first = named[identity]
                if str(first) != str(path):
                    what = f"{first} and {path} are the same file"
                elif first_pattern != pattern:
                    what = f"{path} is named by both {first_pattern!r} and {pattern!r}"
                else:
                    what = f"{path} is listed twice"
                raise ValueError(
                    f"{field}: {what}, so its rows would be read twice; name each file once "
                    "(to draw a source more often, give it a larger weight in dataset.mixture)"
                )
            named[identity] = (pattern, path)
            out.append((path, kind))
    if not out:
        raise ValueError(f"{field}={patterns!r} names no file")
    return out


def _refuse_comma(pieces: list[str], i: int, field: str) -> None:
    """Piece i of a comma-separated list matches nothing: if it and its neighbours joined by
    commas name a file, its name holds a comma, which the list cannot; say so."""
    for start in range(i, -1, -1):
        for end in range(max(i, start + 1), len(pieces)):
            name = ",".join(pieces[start : end + 1]).strip()
            if _matches(name):
                raise FileNotFoundError(
                    f"{field}: commas separate files, so {name!r} was read as "
                    f"{[p.strip() for p in pieces[start : end + 1]]}; rename it without a comma"
                )


def _identity(path: epath.Path) -> str:
    """What tells two names of one file apart from two files: a local file's real path (after
    links, "..", "./"), a remote one's URL."""
    return os.path.realpath(path) if _is_local(path) else str(path)


def _matches(pattern: str) -> list[epath.Path]:
    path = epath.Path(pattern).expanduser() if _is_local(pattern) else epath.Path(pattern)
    if not globlib.has_magic(pattern):
        return [path] if path.exists() else []
    parts = str(path).split("/")
    first = next(i for i, part in enumerate(parts) if globlib.has_magic(part))
    base = "/".join(parts[:first]) or ("/" if str(path).startswith("/") else ".")
    base_path = epath.Path(base)
    if not base_path.is_dir():
        return []
    return sorted(base_path.glob("/".join(parts[first:])), key=str)


def _files_of(path: epath.Path, field: str) -> list[tuple[epath.Path, str]]:
    if path.is_dir():
        return [(f, "arrow") for f in _saved_dataset_files(path, field)]
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(
            f"{field}: {path} has an extension tfjax does not read; allowed: "
            f"{', '.join(EXTENSIONS)}, or a directory saved by Hugging Face datasets"
        )
    return [(path, kind)]


def _saved_json(path: epath.Path, field: str, key: str, entries: type) -> list:
    """The `key` list of the JSON object that `datasets` saved in `path`, else one line naming
    the file (a torn or hand-edited file is an error to name, not a traceback)."""
    value = jsonfile.parse_object(
        path.read_bytes(), f"{field}: {path}", "a file datasets saves", "save the dataset again"
    )
    items = value.get(key, [])
    if not isinstance(items, list) or not all(isinstance(i, entries) for i in items):
        raise ValueError(
            f"{field}: {path} is not what Hugging Face datasets writes: it needs a JSON object "
            f"whose {key!r} is a list of {entries.__name__}s; save the dataset again"
        )
    return items


def _saved_dataset_files(path: epath.Path, field: str) -> list[epath.Path]:
    """The .arrow files of a directory written by `datasets.Dataset.save_to_disk`."""
    if (path / "dataset_dict.json").exists():
        splits = _saved_json(path / "dataset_dict.json", field, "splits", str)
        raise ValueError(
            f"{field}: {path} holds a DatasetDict with splits {splits}; name one of them, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if state.exists():
        entries = _saved_json(state, field, "_data_files", dict)
        if not all(isinstance(f.get("filename"), str) for f in entries):
            raise ValueError(f"{field}: {state} has a _data_files entry without a filename")
        names = [f["filename"] for f in entries]
        files = [path / name for name in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{field}: {state} lists files that are missing: {missing}")
    else:
        files = sorted(path.glob("*.arrow"), key=str)
    if not files:
        raise ValueError(
            f"{field}: {path} is a directory without a dataset saved by Hugging Face datasets "
            "(no state.json, no .arrow files); give files or a glob such as "
            f"{path / '*.jsonl'}"
        )
    return files


def split_files(spec, split: str) -> list[tuple[epath.Path, str]]:
    """The files of `split` ("train": dataset.train_files, "eval": dataset.eval_files) of a
    resolved "files" DatasetSpec, checked to exist and to be of a kind tfjax reads."""
    if split not in ("train", "eval"):
        raise ValueError(
            f"dataset 'files' has the splits 'train' (dataset.train_files) and 'eval' "
            f"(dataset.eval_files); got split={split!r}"
        )
    field = f"{split}_files"
    if split == "train" and spec.mixture.strip():
        raise ValueError("dataset.mixture is set: the train split is its sources (mixture_files)")
    if not spec[field].strip():
        raise ValueError(
            f"dataset.{field} is empty: dataset 'files' has no {split} split; set "
            f"dataset.{field} to a path, a glob or a comma-separated list of files"
        )
    return expand(spec[field], f"dataset.{field}")


def mixture_files(spec) -> list[tuple[float, str, list[tuple[epath.Path, str]]]]:
    """The sources of dataset.mixture of a resolved "files" DatasetSpec: [(weight, entry,
    files)] in the order given, the weights normalised to sum to 1, `entry` the text naming the
    source, its files expanded as `split_files` does train_files; errors name dataset.mixture
    and the entry."""
    from tfjax.data import catalog

    entries = catalog.mixture_entries(spec.mixture)
    total = sum(weight for weight, _, _ in entries)
    return [
        (weight / total, entry, expand(files, f"dataset.mixture: entry {i} {entry!r}"))
        for i, (weight, files, entry) in enumerate(entries, start=1)
    ]


def check(spec, tokenizer_field: str = TOKENIZER_FIELD) -> None:
    """The checks of a "files" DatasetSpec that touch the file system but read no rows: the
    train files (or the mixture's) and eval files exist and are of a kind tfjax reads, Parquet
    and Arrow files open (`check_readable`), the tokenizer directory's tokenizer loads (a
    damaged file of it is a line here, not a traceback later; `tokenizer_field`: the config
    field that gave spec.tokenizer, as in `load_tokenizer`). Each error names its field or
    file. An eval file that is a train file too is a warning line naming it."""
    if spec.mixture.strip():
        lists = [file_list for _, _, file_list in mixture_files(spec)]
    else:
        lists = [split_files(spec, "train")]
    if spec.eval_files.strip():
        lists.append(split_files(spec, "eval"))
        _warn_not_held_out(lists[:-1], lists[-1], spec)
    for path, kind in (f for file_list in lists for f in file_list):
        check_readable(path, kind)
    load_tokenizer(spec.tokenizer, tokenizer_field)


def _warn_not_held_out(train_lists, eval_files, spec) -> None:
    """One line naming the eval files that are train files too: allowed (a smoke test), but
    the eval loss is then measured on rows the run trains on."""
    trained = {_identity(path) for file_list in train_lists for path, _ in file_list}
    both = [str(path) for path, _ in eval_files if _identity(path) in trained]
    if both:
        train_field = "dataset.mixture" if spec.mixture.strip() else "dataset.train_files"
        logging.warning(
            "dataset.eval_files: %s %s also in %s: the eval loss is not held out (it is "
            "measured on rows the run trains on)",
            ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else ""),
            "is" if len(both) == 1 else "are",
            train_field,
        )


def fingerprint(files: list[tuple[epath.Path, str]]) -> str:
    """A short name of a file list, for a loader's saved position (which files it read; what
    they hold is `FilesSource.digest`)."""
    digest = hashlib.sha256("\n".join(str(p) for p, _ in files).encode()).hexdigest()
    return f"{len(files)} files, sha256 {digest[:16]}"


def file_digest(path: epath.Path) -> str:
    """The sha256 of a file's bytes: what a loader's saved position names its files' contents by
    (`FilesSource.digest`), so that a file rewritten in place (shuffled, edited: the same path
    and row count) is not resumed as if unchanged. Taken just after the file's scan at opening,
    which reads every byte anyway: measured on 2 shared cores, sha256 added 0.3 s to a 1.6 s
    scan of 200 MB of 1 KB JSON lines, 0.04 s to 6 s for 1M short ones, 0.4 s to 1.1 s for a
    500 MB Arrow file of 1 KB texts; a gs:// file is read once more for it."""
    digest = hashlib.sha256()
    with epath.Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """A short name of a checkpoint tokenizer's files (their names and bytes), for a loader's
    saved position: the same tokenizer wherever it is read from."""
    digest = hashlib.sha256()
    for name, data in sorted(tokenizer.files.items()):
        digest.update(name.encode() + b"\0" + data)
    return f"sha256 {digest.hexdigest()[:16]}"


# ------------------------------------------------------------------------------------ tokenizer
def _check_tokenizer_dir(directory: str, field: str) -> epath.Path:
    path = epath.Path(directory).expanduser() if _is_local(directory) else epath.Path(directory)
    if field == TOKENIZER_FIELD:
        where, fix = f"{field}={directory!r}", ""
    else:  # the checkpoint's own: the user set no dataset.tokenizer
        where = f"{directory} (the checkpoint of {field}: dataset.tokenizer is unset)"
        fix = "; give the directory of its tokenizer files as dataset.tokenizer"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{where} is not a directory; give the directory of the checkpoint's tokenizer "
            f"files ({' or '.join(TOKENIZER_FILES)}){fix and ' as dataset.tokenizer'}"
        )
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{where} holds no tokenizer file; expected "
            f"{' or '.join(TOKENIZER_FILES)} (the files of a Hugging Face checkpoint){fix}"
        )
    return path


def tokenizer_field(config) -> str:
    """Which field of a run's config gives the "files" dataset's tokenizer directory:
    dataset.tokenizer where set, else config.init_from (the checkpoint's own tokenizer:
    `tfjax.runner.pretrained.dataset_spec`): what `check` and `load_tokenizer` name."""
    from tfjax.data import catalog

    return TOKENIZER_FIELD if catalog.dataset_spec(config).tokenizer else "config.init_from"


def load_tokenizer(directory: str, field: str = TOKENIZER_FIELD):
    """`CheckpointTokenizer.load(directory)`, after checking that the directory holds a
    tokenizer file. `field` is the config field that gave the directory: errors name
    dataset.tokenizer and its value, or, for "config.init_from" (dataset.tokenizer unset: the
    checkpoint's own tokenizer), the checkpoint's file at fault and config.init_from, not a
    field the user never set."""
    from tfjax.data.checkpoint_tokenizer import CheckpointTokenizer

    path = _check_tokenizer_dir(directory, field)
    try:
        return CheckpointTokenizer.load(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to read it: name the field
        if field == TOKENIZER_FIELD:
            raise ValueError(
                f"{field}={directory!r}: its tokenizer cannot be loaded ({type(e).__name__}: {e})"
            ) from e
        why = str(e).rstrip(".") if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if str(path) not in why:  # (the tokenizer's own errors name the file)
            why = f"{path}: {why}"
        raise ValueError(f"{why} (the tokenizer of {field}: dataset.tokenizer is unset)") from e


# ----------------------------------------------------------------------------------------- rows
def row_problem(row) -> str | None:
    """What is wrong with a row (None: nothing): not an object, a format row_format does not
    know or whose fields are missing, fields that are not text, or a message "weight" that is
    not 0 or 1 on an assistant message (`checkpoint_tokenizer.message_weight`)."""
    from tfjax.data.checkpoint_tokenizer import message_weight, row_format

    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    try:
        kind = row_format(row)
    except ValueError as e:
        return str(e)
    fields = {"text": ("text",), "prompt_completion": ("prompt", "completion")}.get(kind, ())
    for key in fields:
        if key not in row:
            return f"{kind} row without {key!r}"
        if not isinstance(row[key], str):
            return f"{key!r} must be a string, got {type(row[key]).__name__}"
    if kind == "messages":
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of {'role', 'content'} objects"
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                return f"message {i} must be an object with 'role' and 'content'"
            for key in ("role", "content"):
                if message.get(key) is None:
                    return f"message {i} has no {key!r}"
                if not isinstance(message[key], str):
                    return f"message {i}: {key!r} must be a string"
            try:
                message_weight(message)
            except ValueError as e:
                return f"message {i}: {e}"
        if not any(m["role"] == "assistant" for m in messages):
            return "'messages' has no 'assistant' turn: nothing to train on"
    return None


# Chat rows are checked against the template when the loader is made by encoding one row of
# each distinct conversation shape (`_chat_shape`), the first CHAT_SHAPES of them. Measured on
# 10k chat rows of 1 to 2 turns (2 shared cores): the scan at opening costs 10 us a row, and
# taking its shape 2 us more; rendering each whole conversation would cost 22 to 47 us (the
# Qwen3, Gemma 3 and Llama 3 test checkpoints' templates: 2 to 4 times the scan), and every
# rendering encode_row makes to split it into turns 92 to 109 us (8 times): too much at every
# start. A template's refusal usually depends on the shape (an order of roles it refuses, a role
# or key it does not know), rarely on the text; a row refused for its text alone is still one
# line naming it, when training reaches it.
CHAT_SHAPES = 256


def _chat_shape(row) -> tuple:
    """A chat row's roles in order, with each message's keys beyond role and content (and its
    "weight": a turn of weight 0 is not split out of the conversation)."""
    return tuple(
        m["role"]
        if len(m) == 2
        else (m["role"], m.get("weight"), *sorted(k for k, v in m.items() if v is not None))
        for m in row["messages"]
    )


def _add_chat(chats: dict, row, index: int) -> None:
    """Records the good row `index` if it is the first of its conversation shape."""
    if "messages" in row and len(chats) < CHAT_SHAPES:
        chats.setdefault(_chat_shape(row), index)


class Row(dict):
    """A row dict that knows where it comes from (`origin`: "path:line" or "path: row n"; `path`:
    its file), so that a row the tokenizer refuses while training is named as at opening."""

    origin = path = ""

    def __reduce__(self):  # (pickled to worker processes with its origin)
        return _row, (dict(self), self.origin, self.path)


def _row(items: dict, origin: str, path: str) -> Row:
    row = Row(items)
    row.origin, row.path = origin, path
    return row


def encode_example(row, *, tokenizer, seq_len: int, split_text: bool) -> tuple[dict, int]:
    """A row -> ({"tokens": i32 [L], "weights": f32 [L]} by `encode_row`, cut to seq_len tokens
    as the loader would cut it; its prompt: the tokens before the first weighted one, 0 where
    none is: no seq_len would train such a row). With
    `split_text` (long_examples="split") text rows stay whole (the loader cuts them in pieces
    of seq_len); prompt/completion and messages rows are always cut to their first seq_len."""
    from tfjax.data.checkpoint_tokenizer import encode_row, row_format

    try:
        example = encode_row(tokenizer, row)
    except ValueError as e:  # checked when opened, yet the tokenizer refuses it (chat template)
        where = getattr(row, "origin", "") or "a row"
        raise BadRowsError(f"{where}: {e}") from e
    tokens = np.asarray(example["tokens"], np.int32)
    weights = np.asarray(example["weights"], np.float32)
    if tokens.shape != weights.shape or tokens.ndim != 1:
        raise ValueError(
            f"encode_row gave tokens {tokens.shape} and weights {weights.shape}; both must be [L]"
        )
    weighted = weights > 0
    prompt = int(np.argmax(weighted))  # (0 where no token is weighted)
    if len(tokens) > seq_len and not (split_text and row_format(row) == "text"):
        tokens, weights = tokens[:seq_len], weights[:seq_len]
    return {"tokens": tokens, "weights": weights}, prompt


def trains(weights: np.ndarray, seq_len: int) -> bool:
    """Whether an example as `encode_example` cuts it trains a token: one weighted that is not
    the first of its row or piece (the loss predicts each token from those before it in its
    segment, so a first token is never a target)."""
    targets = weights > 0
    targets[::seq_len] = False  # (a text row that long_examples="split" cuts: each piece's first)
    return bool(targets.any())


class RowEncoder:
    """The loader's transform of the rows of one split (or one source of a mixture), as Grain's
    `map_with_index` (index = epoch * rows + row): `encode_example`, or None (Grain drops the
    element) for a row that trains nothing once cut to dataset.seq_len: a prompt of seq_len
    tokens or more leaves none of its completion (or assistant turn); an empty text without bos
    has none at all, nor has a chat whose every assistant turn has "weight" 0. Kept, it would
    fill its share of the batches with no target: a run of only such rows trains nothing
    (gradient 0, loss NaN on eval), silently.

    Which rows those are is known only once they are tokenised, and tokenising a row costs 20 to
    30 times its check at opening (measured: 150 us a prompt/completion row, 320 us a chat row,
    against 7 and 11 us), so the rows are not all tokenised up front; instead
      - `check` (when the loader is made, before any step or evaluation) tokenises the first
        chat row of each conversation shape (a template's refusal is one line then, naming the
        row), then rows until one trains: 16 spread over the split, then all in order. A split
        that trains costs about one row; one that does not costs one pass, and is refused in a
        line naming dataset.seq_len and the longest prompt.
      - every row is tested as the loader encodes it, at no extra cost, and one that trains
        nothing is dropped: a split whose rows all train gives the batches and saved positions
        it gave before. The first such row of each file is logged with why; their number, per
        file, is logged when this process has encoded each row of its share of one epoch (the
        eval split: at the end of the first evaluation), exactly (each row counted once). With
        num_workers (`share` None) each worker encodes part of an epoch: the first lines only.
    """

    def __init__(self, tokenizer, *, seq_len: int, split_text: bool, field: str, rows: int, share):
        self.tokenizer, self.seq_len, self.split_text = tokenizer, seq_len, split_text
        self.field, self.rows, self.share = field, rows, share  # share: rows of this process
        self._start()

    def _start(self):
        self._lock = threading.Lock()
        self._logged = set()  # files whose first row that trains nothing was logged
        self._epochs = {}  # epoch -> its count (_Dropped) while this process encodes it
        self._counted = self.share is None  # (no count to finish: no count line)

    def __getstate__(self):  # worker processes count on their own
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._start()

    def encode(self, row) -> tuple[dict | None, int]:
        """(the example as the loader cuts it, None if it trains nothing; its prompt)."""
        example, prompt = encode_example(
            row, tokenizer=self.tokenizer, seq_len=self.seq_len, split_text=self.split_text
        )
        return (example if trains(example["weights"], self.seq_len) else None), prompt

    def why(self, prompt: int, row) -> str:
        if prompt >= self.seq_len:
            return (
                f"its prompt is {prompt} tokens, and dataset.seq_len={self.seq_len} cuts it "
                "before its completion"
            )
        if _weighted_out(row):
            return "every assistant turn of it has weight 0"
        return "it has no token to train after its first (an empty row)"

    def check(self, rows) -> None:
        """A BadRowsError naming dataset.seq_len and the longest prompt unless a row of `rows`
        trains (see the class docstring); first, the first row of each conversation shape
        (`rows.chats`, `CHAT_SHAPES`) is encoded: one the chat template refuses is a
        BadRowsError naming its file and line."""
        for i in getattr(rows, "chats", ()):
            self.encode(rows[i])
        n = len(rows)
        longest = (-1, "", None)  # (prompt, origin, row)
        for i in itertools.chain((k * n // 16 for k in range(min(n, 16))), range(n)):
            row = rows[i]
            example, prompt = self.encode(row)
            if example is not None:
                return
            if prompt > longest[0]:
                longest = (prompt, getattr(row, "origin", "") or f"row {i}", row)
        prompt, origin, row = longest
        if prompt < self.seq_len:
            raise BadRowsError(f"{self.field}: no row trains: {origin}: {self.why(prompt, row)}")
        raise BadRowsError(
            f"{self.field}: no row trains: dataset.seq_len={self.seq_len} cuts every row before "
            f"its completion (the longest prompt, {origin}, is {prompt} tokens); raise "
            "dataset.seq_len above the prompts, or shorten them"
        )

    def __call__(self, index: int, row) -> dict | None:
        example, prompt = self.encode(row)
        path = getattr(row, "path", "") or "the files"
        if example is None and path not in self._logged and self._first(path):
            logging.warning(
                "%s: %s trains nothing: %s; it is dropped, and so is every such row of %s%s",
                self.field,
                getattr(row, "origin", "") or "a row",
                self.why(prompt, row),
                path,
                "" if self.share is None else " (counted at the end of an epoch)",
            )
        if not self._counted:
            self._count(index, path if example is None else None, prompt)
        return example

    def _first(self, path: str) -> bool:
        """Whether this is the first row of `path` that trains nothing (to log)."""
        with self._lock:  # (Grain's read threads)
            first = path not in self._logged
            self._logged.add(path)
        return first

    def _count(self, index: int, dropped: str | None, prompt: int) -> None:
        epoch, row = divmod(int(index), self.rows)
        with self._lock:
            if self._counted:
                return
            if epoch not in self._epochs:
                self._epochs[epoch] = _Dropped(self.rows)
            count = self._epochs[epoch]
            if count.seen[row]:  # (an eval split read again, a read ahead)
                return
            count.seen[row] = True
            count.encoded += 1
            if dropped is not None:
                count.files[dropped] = count.files.get(dropped, 0) + 1
                if prompt >= self.seq_len:
                    count.cut, count.longest = count.cut + 1, max(count.longest, prompt)
            if count.encoded < self.share:
                return
            self._counted, self._epochs = True, {}
        if not count.files:
            return
        dropped = sum(count.files.values())
        why = []
        if count.cut:
            why.append(
                f"{count.cut} cut by dataset.seq_len={self.seq_len} before their completion (the "
                f"longest prompt: {count.longest} tokens; raise dataset.seq_len above the prompts "
                "to train them)"
            )
        if dropped > count.cut:  # (empty, or of assistant turns of weight 0)
            why.append(f"{dropped - count.cut} with no token to train")
        logging.warning(
            "%s: %d of the %d rows this process read in epoch %d train nothing and were dropped "
            "(%s): %s",
            self.field,
            dropped,
            count.encoded,
            epoch,
            ", ".join(f"{path}: {n}" for path, n in count.files.items()),
            "; ".join(why),
        )


def _weighted_out(row) -> bool:
    """Whether a chat row's every assistant turn has "weight" 0 (`message_weight`)."""
    from tfjax.data.checkpoint_tokenizer import message_weight, row_format

    if row_format(row) != "messages":
        return False
    turns = [m for m in row["messages"] if m.get("role") == "assistant"]
    return bool(turns) and not any(message_weight(m) for m in turns)


class _Dropped:
    """One epoch's count of a RowEncoder: the rows encoded (each once) and those dropped."""

    def __init__(self, rows: int):
        self.seen = np.zeros(rows, bool)
        self.encoded, self.cut, self.longest, self.files = 0, 0, 0, {}


class BadRowsError(ValueError):
    """A row of the user's files that cannot be read or encoded, or a file that cannot be read
    at all: the message names the file and line (or row) and what is wrong. Raised when the
    files are opened, before any training; experiments/run.py reports it in one line."""


class _BadRows:
    """Counts (or raises on) the bad rows of one file."""

    def __init__(self, path, skip: bool, unit: str):
        self.path, self.skip, self.unit = path, skip, unit
        self.count, self.first = 0, None

    def __call__(self, number: int, problem: str) -> None:
        # path:line as editors and compilers write it; Parquet and Arrow rows have no lines.
        where = f"{self.path}: row {number}" if self.unit == "row" else f"{self.path}:{number}"
        if not self.skip:
            raise BadRowsError(f"{where}: {problem} (dataset.skip_bad_rows=True skips such rows)")
        self.count += 1
        self.first = self.first or f"{where}: {problem}"

    def log(self, total: int) -> None:
        if self.count:
            logging.warning(
                "dataset.skip_bad_rows: skipped %d of %d rows of %s (the first: %s)",
                self.count,
                total,
                self.path,
                self.first,
            )


# -------------------------------------------------------------------------------------- sources
class _LineFile:
    """The rows of a JSON lines or text file: one byte offset per good row, found by one scan;
    a row is read by seeking to it."""

    def __init__(self, path: epath.Path, kind: str, skip_bad_rows: bool):
        self.path, self.kind = path, kind
        bad = _BadRows(path, skip_bad_rows, "line")
        offsets, lines, total, position, chats = [], [], 0, 0, {}
        with path.open("rb") as f:
            for number, line in enumerate(f, start=1):
                start, position = position, position + len(line)
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    start, line = start + 3, line[3:]
                if not line.strip():
                    continue
                total += 1
                if number == 1 and kind == "jsonl" and line.lstrip().startswith(b"["):
                    raise BadRowsError(
                        f"{path}:1: the file is a JSON array; tfjax reads .json and .jsonl "
                        "files as JSON lines, one object per line"
                    )
                try:
                    row = self._parse(line)
                except json.JSONDecodeError as e:
                    bad(number, f"not JSON: {e.msg} at column {e.colno}")
                    continue
                except UnicodeDecodeError as e:
                    bad(number, f"not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                problem = row_problem(row)
                if problem:
                    bad(number, problem)
                    continue
                _add_chat(chats, row, len(offsets))
                offsets.append(start)
                lines.append(number)
        bad.log(total)
        self.chats = chats
        self.total = total  # rows, good or bad (0: an empty file)
        self.offsets = np.asarray(offsets, np.int64)
        self.lines = np.asarray(lines, np.int64 if lines and lines[-1] >= 2**32 else np.uint32)
        self._file, self._lock = None, threading.Lock()

    def _parse(self, line: bytes):
        if self.kind == "text":
            return {"text": line.decode("utf-8").rstrip("\r\n")}
        return json.loads(line.strip())

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> dict:
        with self._lock:  # one handle per process, shared by the read threads
            if self._file is None:
                self._file = self.path.open("rb")
            self._file.seek(int(self.offsets[index]))
            line = self._file.readline()
        return _row(self._parse(line), f"{self.path}:{self.lines[index]}", str(self.path))

    def __getstate__(self):  # worker processes open their own handle
        return {"path": self.path, "kind": self.kind, "offsets": self.offsets, "lines": self.lines}

    def __del__(self):  # the handle lives as long as the source (the loader holds it)
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._file, self._lock = None, threading.Lock()


def _without_nulls(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not None}


_KIND_NAMES = {"parquet": "Parquet", "arrow": "Arrow"}


def _columns_reader(path: epath.Path, kind: str, *, whole: bool = True):
    """pyarrow's reader of a Parquet file (its footer read) or of an Arrow file (its schema
    read), local ones memory-mapped. An Arrow file is an IPC stream (what `datasets` writes) or,
    when it starts with the magic "ARROW1", the IPC file format. A remote Arrow file is read
    into memory, or, unless `whole`, only as far as its reader reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.ParquetFile(str(path) if _is_local(path) else path.open("rb"))
    if _is_local(path):
        data = pa.memory_map(str(path))
    else:  # no memory map of a remote file
        data = pa.BufferReader(path.read_bytes()) if whole else pa.PythonFile(path.open("rb"))
    if data.read(6) == b"ARROW1":
        data.seek(0)
        return pa.ipc.open_file(data)
    data.seek(0)
    return pa.ipc.open_stream(data)


@contextlib.contextmanager
def _reading(path: epath.Path, kind: str):
    """pyarrow's errors reading `path` (a damaged, cut or foreign file) as one line naming it."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        name = _KIND_NAMES[kind]
        reason = (str(e).strip().splitlines() or [""])[0]
        raise BadRowsError(
            f"{path} cannot be read as {name} ({type(e).__name__}: {reason}): the file is "
            f"damaged, cut short or not {name}; write it again, or leave it out of the "
            "dataset's files"
        ) from e


def check_readable(path: epath.Path, kind: str) -> None:
    """A Parquet or Arrow file opens (its footer or schema: the magic bytes and the metadata),
    else a BadRowsError naming it; cheap: no rows are read."""
    if kind in _KIND_NAMES and _size(path):  # (an empty file has no rows: see open)
        with _reading(path, kind):
            _columns_reader(path, kind, whole=False)


class _Columns:
    """The rows of a Parquet file (read by row group) or of an Arrow file (memory-mapped), the
    good ones by their row numbers."""

    def __init__(self, path: epath.Path, kind: str, skip_bad_rows: bool):
        self.path, self.kind = path, kind
        self._open()
        bad = _BadRows(path, skip_bad_rows, "row")
        good, number, self.chats = [], 0, {}
        for group in range(len(self.starts) - 1):
            with _reading(path, kind):  # a damaged column chunk fails here, not at opening
                rows = self._group(group).to_pylist()
            for row in rows:
                number += 1
                row = _without_nulls(row)
                problem = row_problem(row)
                if problem:
                    bad(number, problem)
                else:
                    _add_chat(self.chats, row, len(good))
                    good.append(number - 1)
        bad.log(number)
        self.total = number  # rows, good or bad (0: an empty file)
        # All good (the usual case): no index array.
        self.rows = None if len(good) == number else np.asarray(good, np.int64)
        self._count = len(good)

    def _open(self):
        """Sets self.starts (the first row of each group, then the row count) and the readers."""
        self._lock, self._cache = threading.Lock(), (-1, None)
        with _reading(self.path, self.kind):
            if not _size(self.path):  # an empty file: no rows (not a damaged file)
                sizes = []
            elif self.kind == "parquet":
                self._parquet = _columns_reader(self.path, self.kind)
                meta = self._parquet.metadata
                sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            else:  # memory-mapped: the whole table costs no copy (a gs:// one is read in)
                self._batches = _columns_reader(self.path, self.kind).read_all().to_batches()
                sizes = [len(b) for b in self._batches]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def _group(self, group: int):
        if self.kind == "parquet":
            return self._parquet.read_row_group(group)
        return self._batches[group]

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> dict:
        row = int(self.rows[index]) if self.rows is not None else int(index)
        group = int(np.searchsorted(self.starts, row, side="right")) - 1
        with self._lock:  # one decoded row group is kept (replaced whole: threads stay safe)
            cached, table = self._cache
            if cached != group:
                table = self._group(group)
                self._cache = (group, table)
        offset = row - int(self.starts[group])
        items = _without_nulls(table.slice(offset, 1).to_pylist()[0])
        return _row(items, f"{self.path}: row {row + 1}", str(self.path))

    def __getstate__(self):  # worker processes open (map) the file again
        return {"path": self.path, "kind": self.kind, "rows": self.rows, "_count": self._count}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()


class FilesSource:
    """The good rows of several files as one random-access sequence of row dicts (Grain's
    RandomAccessDataSource), read on access. `digest` names the files' bytes (`file_digest`)."""

    def __init__(self, files: list[tuple[epath.Path, str]], *, skip_bad_rows: bool = False):
        start = time.perf_counter()
        opened, digest = [], hashlib.sha256()
        for path, kind in files:
            opened.append(
                (_LineFile if kind in ("jsonl", "text") else _Columns)(path, kind, skip_bad_rows)
            )
            digest.update(file_digest(path).encode())  # just scanned: read from the page cache
        self.digest = f"sha256 {digest.hexdigest()[:16]}"
        self.empty = [str(f.path) for f in opened if not f.total]
        for path in self.empty:
            logging.warning("%s is empty (no rows): skipped", path)
        self._files = [f for f in opened if len(f)]  # (an empty one is not opened again)
        self._ends = np.cumsum([len(f) for f in self._files]).tolist()
        chats = {}  # over all files: a shape -> its first row
        for f, end in zip(self._files, self._ends, strict=True):
            for shape, row in f.chats.items():
                if len(chats) < CHAT_SHAPES:
                    chats.setdefault(shape, end - len(f) + row)
        self.chats = sorted(chats.values())
        for f in opened:
            del f.chats
        logging.info(
            "Read the index of %d rows of %d files in %.1f s",
            len(self),
            len(files),
            time.perf_counter() - start,
        )

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        f = bisect.bisect_right(self._ends, index)
        return self._files[f][index - (self._ends[f - 1] if f else 0)]

    def read(self, keys) -> list[dict]:
        return [self[k] for k in keys]

    def __repr__(self) -> str:
        return f"FilesSource({len(self._files)} files, {len(self)} rows)"


class _Rows(list):
    """Rows read into memory (dataset.cache), with the `read`, `digest` and `chats` of
    FilesSource."""

    digest, chats = "", ()

    def read(self, keys) -> list:
        return [self[k] for k in keys]


def open_files(
    files, *, field: str = "the files", skip_bad_rows: bool = False, cache: bool = False
):
    """The good rows of `files` ([(path, kind)] from `split_files`): a FilesSource, or all rows
    read into memory once if `cache`. An empty file among others is skipped with a line; no
    good row at all is a BadRowsError naming `field` (e.g. "dataset.eval_files")."""
    source = FilesSource(files, skip_bad_rows=skip_bad_rows)
    if not len(source):
        names = ", ".join(str(p) for p, _ in files)
        if len(source.empty) == len(files):
            raise BadRowsError(
                f"{field}: no rows to read: {names} {'is' if len(files) == 1 else 'are'} empty; "
                "give files that hold rows"
            )
        raise BadRowsError(
            f"{field}: no rows to read in {names}: every row is bad and dataset.skip_bad_rows "
            "skipped it (logged per file); mend the rows"
        )
    if not cache:
        return source
    rows = _Rows(source.read(range(len(source))))
    rows.digest, rows.chats = source.digest, source.chats
    return rows
