"""`open_files`: the good rows of a split's files as one Grain random-access data source
(`FilesSource`), or read into memory (dataset.cache)."""

from __future__ import annotations

import bisect
import hashlib
import time

import numpy as np
from absl import logging
from etils import epath

from tfjax.data.files.checks import file_digest
from tfjax.data.files.readers import ColumnsFile, LineFile
from tfjax.data.files.rows import CHAT_SHAPES, BadRowsError


class FilesSource:
    """The good rows of several files as one random-access sequence of row dicts (Grain's
    RandomAccessDataSource), read on access. `digest` names the files' bytes (`file_digest`)."""

    def __init__(self, files: list[tuple[epath.Path, str]], *, skip_bad_rows: bool = False):
        start = time.perf_counter()
        opened, digest = [], hashlib.sha256()
        for path, kind in files:
            opened.append(
                (LineFile if kind in ("jsonl", "text") else ColumnsFile)(path, kind, skip_bad_rows)
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
