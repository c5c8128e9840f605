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

Modules: file_lists (the files a field names: paths, globs, saved datasets, the mixture),
checks (`check`, the run's checks before any work; the digests a saved position names files
by), tokenizer (the checkpoint tokenizer the rows are encoded with), rows (a row's checks, its
origin, `BadRowsError`), readers (one file's rows: JSON lines and text, Parquet and Arrow),
source (`open_files`: the files' good rows as one Grain data source), row_encoder (`RowEncoder`:
rows -> examples, dropping those that train nothing).
"""

from tfjax.data.files.checks import check, file_digest, fingerprint
from tfjax.data.files.file_lists import EXTENSIONS, expand, mixture_files, split_files
from tfjax.data.files.readers import check_readable
from tfjax.data.files.row_encoder import RowEncoder, encode_example, trains
from tfjax.data.files.rows import CHAT_SHAPES, BadRowsError, Row, row_problem
from tfjax.data.files.source import FilesSource, open_files
from tfjax.data.files.tokenizer import (
    TOKENIZER_FIELD,
    TOKENIZER_FILES,
    load_tokenizer,
    tokenizer_field,
    tokenizer_fingerprint,
)

__all__ = [
    "CHAT_SHAPES",
    "EXTENSIONS",
    "TOKENIZER_FIELD",
    "TOKENIZER_FILES",
    "BadRowsError",
    "FilesSource",
    "Row",
    "RowEncoder",
    "check",
    "check_readable",
    "encode_example",
    "expand",
    "file_digest",
    "fingerprint",
    "load_tokenizer",
    "mixture_files",
    "open_files",
    "row_problem",
    "split_files",
    "tokenizer_field",
    "tokenizer_fingerprint",
    "trains",
]
