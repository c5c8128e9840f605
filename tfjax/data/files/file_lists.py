"""The files that a field names (dataset.train_files, eval_files, each source of
dataset.mixture): paths, globs and comma-separated lists of them, local or gs://, and the
directories Hugging Face `datasets` saves; each file named once, of a kind tfjax reads."""

from __future__ import annotations

import glob as globlib
import os

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


def is_local(path) -> bool:
    return "://" not in str(path)


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
            identity = file_identity(path)
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


def file_identity(path: epath.Path) -> str:
    """What tells two names of one file apart from two files: a local file's real path (after
    links, "..", "./"), a remote one's URL."""
    return os.path.realpath(path) if is_local(path) else str(path)


def _matches(pattern: str) -> list[epath.Path]:
    path = epath.Path(pattern).expanduser() if is_local(pattern) else epath.Path(pattern)
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
