"""Where records come from: TFDS builders prepared as ArrayRecord, read as data sources, and
the tokenizers trained on them. The datasets, their fields and their configs are
`tfjax.data.catalog`; this module is the one that touches TFDS.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import importlib
import itertools
import os
import re
import time

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from tfjax import progress
from tfjax.data import catalog, embedded
from tfjax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, train_sentencepiece

# Up to this many training records (evenly strided) feed SentencePiece training.
_SPM_MAX_RECORDS = 250_000


def _prepare_hint(name: str, data_dir: str, *, damaged: bool = False) -> str:
    hint = f'run `python -c "import tfjax.data; tfjax.data.prepare({name!r}, {data_dir!r})"`'
    if damaged:
        hint += " (it moves the damaged folder aside, deleting nothing, and builds it again"
        return hint + (", offline in seconds)" if catalog.is_embedded(name) else ")")
    if catalog.is_embedded(name):
        return hint + " (builds it offline in seconds)"
    build = f"tfds build {name} --file_format=array_record --data_dir={data_dir}"
    hint += f" (downloads it; or `{build}`)"
    if name == "imagenet2012":
        hint += f"; ImageNet needs its archives in {data_dir}/downloads/manual first"
    return hint


class DamagedInfoError(ValueError):
    """A prepared dataset whose dataset_info.json tfds cannot read (`infos`: the version folders'
    info files; `reason`: tfds's error)."""

    def __init__(self, name: str, data_dir: str, infos: list[str], reason: str):
        super().__init__(
            f"dataset {name!r}: {' or '.join(infos)} cannot be read by tfds ({reason}); the "
            f"prepared folder is damaged: {_prepare_hint(name, data_dir, damaged=True)}"
        )
        self.infos, self.reason = infos, reason


def _builder(name: str, data_dir: str, **kwargs) -> tfds.core.DatasetBuilder:
    if catalog.is_embedded(name):  # (an unknown name fails here, listing the known ones)
        make = getattr(embedded, catalog.CATALOG[name]["embedded"])
    else:
        if "module" in catalog.CATALOG[name]:  # these fail to auto-register without TensorFlow
            importlib.import_module(catalog.CATALOG[name]["module"])
        make = functools.partial(tfds.builder, name)
    try:
        return make(data_dir=data_dir, **kwargs)
    except Exception as e:  # noqa: BLE001 - tfds raises several kinds for a bad info file
        # A builder reads nothing but a prepared version's dataset_info.json (in a folder named
        # as a version, not one set aside or still being built).
        pattern = os.path.join(glob.escape(data_dir), *name.split("/"), "**", "dataset_info.json")
        infos = [
            path
            for path in sorted(glob.glob(pattern, recursive=True))
            if re.fullmatch(r"\d+\.\d+\.\d+", os.path.basename(os.path.dirname(path)))
        ]
        if not infos:
            raise
        lines = str(e).strip().splitlines() or [""]
        raise DamagedInfoError(name, data_dir, infos, f"{type(e).__name__}: {lines[0]}") from e


def prepare(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """Builds dataset `name` as ArrayRecord in `data_dir` once; later calls reuse it.

    Embedded datasets build offline. Catalog datasets download (and mnist/cifar10 need
    TensorFlow installed to encode their images while preparing; reading never does).
    Never deletes anything: a damaged folder (no dataset_info.json) is renamed
    `<version>.damaged-<n>` and the dataset built again. Returns the dataset's folder.
    """
    data_dir = catalog.data_dir_path(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    with _preparing(data_dir, name):
        return _prepare(name, data_dir)


@contextlib.contextmanager
def _preparing(data_dir: str, name: str):
    """Holds `data_dir`'s lock of dataset `name` (the operating system's flock, released when its
    process ends): runs that share a data_dir (several jobs, test workers) prepare a dataset
    once, the others wait and then find it prepared."""
    path = os.path.join(data_dir, f".prepare-{name.replace('/', '--')}.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prepare(name: str, data_dir: str) -> str:
    try:
        builder = _builder(name, data_dir, file_format="array_record")
    except DamagedInfoError as e:
        if len(e.infos) > 1:  # which version is damaged is not known: touch none
            raise
        aside = _move_aside(os.path.dirname(e.infos[0]))
        logging.warning(
            "%s cannot be read by tfds (%s), the folder is damaged: moved it to %s; preparing "
            "%r again",
            e.infos[0],
            e.reason,
            aside,
            name,
        )
        builder = _builder(name, data_dir, file_format="array_record")
    if builder.is_prepared():
        if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
            raise ValueError(_wrong_format(name, builder))
        return os.fspath(builder.data_dir)
    if os.path.exists(builder.data_path):
        # tfds writes dataset_info.json before it renames a finished build into place, so this
        # folder is damaged; tfds itself would "reuse" it and build nothing.
        aside = _move_aside(os.fspath(builder.data_path))
        logging.warning(
            "%s has no dataset_info.json (damaged): moved it to %s; preparing %r again",
            builder.data_path,
            aside,
            name,
        )
    start = time.perf_counter()  # tfds shows its own progress bars in a terminal
    try:
        builder.download_and_prepare(file_format="array_record")
    except ModuleNotFoundError as e:
        if "tensorflow" not in str(e):
            raise
        raise ModuleNotFoundError(
            f"preparing {name!r} needs TensorFlow to encode its images: "
            "`pip install tensorflow-cpu`, prepare once, then it is read without TensorFlow."
        ) from e
    logging.info("Prepared %r in %s in %.1f s", name, builder.data_dir, time.perf_counter() - start)
    return os.fspath(builder.data_dir)


def _move_aside(path: str) -> str:
    for n in itertools.count(1):
        aside = f"{path}.damaged-{n}"  # not a version name: tfds ignores it
        if not os.path.exists(aside):
            os.rename(path, aside)
            return aside


def _wrong_format(name: str, builder) -> str:
    return (
        f"dataset {name!r} at {builder.data_dir} is prepared as {builder.info.file_format.value}, "
        "but tfjax reads ArrayRecord. Convert it with `tfds convert_format "
        f"--dataset_version_dir={builder.data_dir} --out_file_format=array_record` or prepare it "
        "again into another data_dir; the existing files are left as they are."
    )


class _Source:
    """A tfds data source whose read errors name the dataset and what to do."""

    def __init__(self, source, name: str, split: str, where: str):
        self._source, self._name, self._split, self._where = source, name, split, where

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, key: int):
        try:
            return self._source[key]
        except Exception as e:  # noqa: BLE001 - any failure to read or decode a record
            raise ValueError(
                f"record {key} of dataset {self._name!r} split {self._split!r} is corrupt or "
                f"unreadable ({type(e).__name__}: {e}). The prepared files in {self._where} are "
                "left untouched: move that folder away and prepare the dataset again."
            ) from e

    def read(self, keys) -> list:
        """Records at `keys`, read in chunks (several times faster than one by one)."""
        keys, out = list(keys), []
        for start in range(0, len(keys), 1024):
            chunk = keys[start : start + 1024]
            try:
                out.extend(self._source.__getitems__(chunk))
            except Exception:  # noqa: BLE001 - reread one by one to name the bad record
                out.extend(self[key] for key in chunk)
        return out

    def __repr__(self) -> str:
        return f"Source({self._name}:{self._split}, {len(self)} records)"


class _Records(list):
    """A split read into memory, with the `read` of `_Source`."""

    def read(self, keys) -> list:
        return [self[k] for k in keys]


def _empty(name: str, split: str) -> ValueError:
    return ValueError(
        f"split {split!r} of dataset {name!r} is empty (0 examples); choose a split that has "
        "examples (config train_split / eval_split)"
    )


def open_source(
    name: str, split: str, data_dir: str | os.PathLike | None = None, *, cache: bool = False
):
    """The records of `split` of dataset `name` as a random-access sequence of feature dicts,
    read from disk on access, or all read once into a list if `cache`."""
    data_dir = catalog.data_dir_path(data_dir)
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            f"data directory {data_dir} for dataset {name!r} does not exist; set $TFJAX_DATA_DIR "
            f"or pass data_dir, and {_prepare_hint(name, data_dir)}"
        )
    builder = _builder(name, data_dir)
    try:
        source = builder.as_data_source(split=split)
    except Exception as e:  # noqa: BLE001 - diagnose below, keep the original as the cause
        if not builder.is_prepared():
            if os.path.exists(builder.data_path):  # `tfds build` would "reuse" it
                raise FileNotFoundError(
                    f"dataset {name!r} in {builder.data_path} is damaged (no dataset_info.json); "
                    f"{_prepare_hint(name, data_dir, damaged=True)}"
                ) from e
            raise FileNotFoundError(
                f"dataset {name!r} is not prepared in {data_dir}; {_prepare_hint(name, data_dir)}"
            ) from e
        if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
            raise ValueError(_wrong_format(name, builder)) from e
        try:
            num_examples = builder.info.splits[split].num_examples
        except Exception as unknown:  # noqa: BLE001 - tfds raises several kinds here
            raise ValueError(
                f"dataset {name!r} has no split {split!r} (a TFDS split such as 'train' or "
                f"'train[:90%]'); its splits are {list(builder.info.splits)}"
            ) from unknown
        if num_examples == 0:
            raise _empty(name, split) from e
        raise ValueError(
            f"dataset {name!r} in {builder.data_dir} cannot be opened ({type(e).__name__}: {e}). "
            "If its files are damaged, move that folder away and prepare it again; tfjax never "
            "deletes prepared data."
        ) from e
    if len(source) == 0:
        raise _empty(name, split)
    source = _Source(source, name, split, os.fspath(builder.data_dir))
    return _Records(source.read(range(len(source)))) if cache else source


# ----------------------------------------------------------------------------------- tokenizers
def as_text(value) -> str:
    """TFDS gives text as bytes (its mock data as str)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def get_tokenizer(dataset_config, data_dir: str | os.PathLike | None = None):
    """The tokenizer of a text dataset config: bytes, or SentencePiece trained on the training
    split the first time (stored at `tokenizer_path`) and loaded afterwards; for the "files"
    dataset the checkpoint's tokenizer in the directory dataset.tokenizer
    (`tfjax.data.checkpoint_tokenizer.CheckpointTokenizer`).

    In a multi-host run let one process create it first (files are written atomically, so
    concurrent training is safe but wasteful).
    """
    cfg = catalog.resolve_config(dataset_config)
    if cfg.images:
        raise ValueError(f"dataset {cfg.name!r} is an image dataset; it has no tokenizer")
    if catalog.is_files(cfg.name):  # the checkpoint's own, from dataset.tokenizer
        from tfjax.data import files

        return files.load_tokenizer(cfg.tokenizer)
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    path = catalog.tokenizer_path(cfg, data_dir)
    if os.path.exists(path):
        return SentencePieceTokenizer.load(path)
    source = open_source(cfg.name, cfg.train_split, data_dir)
    n = min(len(source), _SPM_MAX_RECORDS)
    keys = np.unique(np.linspace(0, len(source) - 1, n).astype(int)).tolist()
    fields = cfg.text_fields
    logging.info(
        "Training SentencePiece (%d pieces) for %s on %d records -> %s",
        cfg.vocab_size,
        cfg.name,
        len(keys),
        path,
    )

    # SentencePiece reads every record first (the bar), then trains (no progress to show).
    bar = progress.bar(total=len(keys), unit="record", desc="SentencePiece: reading")
    start = time.perf_counter()

    def texts():
        for begin in range(0, len(keys), 8192):
            batch = keys[begin : begin + 8192]
            for record in source.read(batch):
                for field in fields:
                    yield as_text(record[field])
            bar.update(len(batch))
        bar.close()
        elapsed = time.perf_counter() - start
        logging.info(
            "SentencePiece: read %s; training", progress.throughput(len(keys), "records", elapsed)
        )

    train_sentencepiece(texts(), path, vocab_size=cfg.vocab_size)
    logging.info("SentencePiece for %s trained in %.1f s", cfg.name, time.perf_counter() - start)
    return SentencePieceTokenizer.load(path)
