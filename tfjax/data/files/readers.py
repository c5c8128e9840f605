"""One file's rows, scanned and checked once at opening, then read by index: JSON lines and text
files by byte offset (`LineFile`), Parquet files by row group and Arrow files memory-mapped
(`ColumnsFile`); a Parquet or Arrow file pyarrow cannot read is one line naming it."""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
from etils import epath

from tfjax.data.files.file_lists import is_local
from tfjax.data.files.rows import BadRows, BadRowsError, add_chat, located_row, row_problem


def _size(path) -> int:
    return epath.Path(path).stat().length


class LineFile:
    """The rows of a JSON lines or text file: one byte offset per good row, found by one scan;
    a row is read by seeking to it."""

    def __init__(self, path: epath.Path, kind: str, skip_bad_rows: bool):
        self.path, self.kind = path, kind
        bad = BadRows(path, skip_bad_rows, "line")
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
                add_chat(chats, row, len(offsets))
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
        return located_row(self._parse(line), f"{self.path}:{self.lines[index]}", str(self.path))

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
        return pq.ParquetFile(str(path) if is_local(path) else path.open("rb"))
    if is_local(path):
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


class ColumnsFile:
    """The rows of a Parquet file (read by row group) or of an Arrow file (memory-mapped), the
    good ones by their row numbers."""

    def __init__(self, path: epath.Path, kind: str, skip_bad_rows: bool):
        self.path, self.kind = path, kind
        self._open()
        bad = BadRows(path, skip_bad_rows, "row")
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
                    add_chat(self.chats, row, len(good))
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
        return located_row(items, f"{self.path}: row {row + 1}", str(self.path))

    def __getstate__(self):  # worker processes open (map) the file again
        return {"path": self.path, "kind": self.kind, "rows": self.rows, "_count": self._count}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()
