"""What is checked of the files before any work (`check`: they exist, are of a kind tfjax
reads and open; the tokenizer loads), and what a loader's saved position names them by: the
file list (`fingerprint`) and each file's bytes (`file_digest`)."""

from __future__ import annotations

import hashlib

from absl import logging
from etils import epath

from tfjax.data.files.file_lists import file_identity, mixture_files, split_files
from tfjax.data.files.readers import check_readable
from tfjax.data.files.tokenizer import TOKENIZER_FIELD, load_tokenizer


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
    trained = {file_identity(path) for file_list in train_lists for path, _ in file_list}
    both = [str(path) for path, _ in eval_files if file_identity(path) in trained]
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
