"""Datasets by name: their default configs, where their records come from, their tokenizers.

Every dataset is a TFDS builder prepared as ArrayRecord and read as a random-access
`tfds` data source. The embedded ones (`digits`, `pydoc`, `numbers_translate`, see
`tfjax.data.embedded`) are built from files on the machine; the catalog ones are the public
TFDS datasets for users who have them prepared or can download them.

Dataset config fields (`default_dataset_config(name)` fills them all):

  name              dataset name, a key of CATALOG
  task              "image_classification" | "text_classification" | "lm" | "mlm" | "translation"
  train_split       TFDS split for training, e.g. "train" or "train[:90%]"
  eval_split        TFDS split for evaluation
  num_workers       worker processes, each building whole batches (0: all in this process)
  read_threads      threads per process reading records ahead (0: none); they only pay off on
                    slow storage: the per-record work holds Python's GIL (measured on 2 CPUs:
                    8 threads halve the throughput of a local dataset)
  prefetch_batches  batches assembled ahead in a background thread (0: none); JAX's async
                    dispatch already overlaps batch assembly with the step
  cache             read the whole split into memory once (the small embedded datasets)
images:
  image_size        output height = width, pixels
  num_channels      1 (grey) or 3 (RGB), as stored
  num_classes       number of labels
  crop              "pad" (pad-and-random-crop), "inception" (random-area crop; resize and
                    center crop at eval) or "none"; random crops only in training
  crop_padding      pixels of zero padding for crop="pad"
  random_flip       random horizontal flips in training (not for digits)
text:
  tokenizer         "bytes" (no training) or "sentencepiece" (trained on train_split once)
  vocab_size        SentencePiece vocabulary size (an upper bound); unused for bytes
  seq_len           fixed length T of every token row
  packing           pack several examples per row with segment ids and positions
  long_examples     "split" cuts examples longer than seq_len into several; "truncate" keeps
                    their first seq_len tokens (translation and classification only truncate)
  mlm_probability   fraction of tokens picked for prediction when task == "mlm"
  source_lang, target_lang   translation: the feature names of source and target text
  num_classes       text_classification: number of labels
"""

from __future__ import annotations

import copy
import importlib
import itertools
import os
import time

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from ml_collections import config_dict

from tfjax import metrics
from tfjax.data import embedded, preprocess
from tfjax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, train_sentencepiece

_COMMON = dict(num_workers=0, read_threads=0, prefetch_batches=0, cache=False)
_TEXT = dict(long_examples="truncate", packing=False)

# name -> how to read it (`module`: TFDS module to import so its builder is registered;
# `features`: which record fields hold what; `tasks`: allowed tasks) and its default config.
CATALOG: dict[str, dict] = {
    "digits": dict(
        features=dict(image="image", label="label"),
        tasks=("image_classification",),
        config=dict(
            cache=True,
            task="image_classification",
            train_split="train",
            eval_split="test",
            image_size=8,
            num_channels=1,
            num_classes=10,
            crop="pad",
            crop_padding=1,
            random_flip=False,
        ),
    ),
    "mnist": dict(
        features=dict(image="image", label="label"),
        tasks=("image_classification",),
        config=dict(
            task="image_classification",
            train_split="train",
            eval_split="test",
            image_size=28,
            num_channels=1,
            num_classes=10,
            crop="pad",
            crop_padding=2,
            random_flip=False,
        ),
    ),
    "cifar10": dict(
        features=dict(image="image", label="label"),
        tasks=("image_classification",),
        config=dict(
            task="image_classification",
            train_split="train",
            eval_split="test",
            image_size=32,
            num_channels=3,
            num_classes=10,
            crop="pad",
            crop_padding=4,
            random_flip=True,
        ),
    ),
    "imagenet2012": dict(
        features=dict(image="image", label="label"),
        tasks=("image_classification",),
        config=dict(
            task="image_classification",
            train_split="train",
            eval_split="validation",
            image_size=224,
            num_channels=3,
            num_classes=1000,
            crop="inception",
            crop_padding=0,
            random_flip=True,
        ),
    ),
    "pydoc": dict(
        features=dict(text="text"),
        tasks=("lm", "mlm"),
        config=dict(
            cache=True,
            task="lm",
            train_split="train",
            eval_split="test",
            tokenizer="bytes",
            vocab_size=8000,
            seq_len=128,
            packing=True,
            long_examples="split",
            mlm_probability=0.15,
        ),
    ),
    "lm1b": dict(
        features=dict(text="text"),
        tasks=("lm", "mlm"),
        config=dict(
            task="lm",
            train_split="train",
            eval_split="test",
            tokenizer="sentencepiece",
            vocab_size=32000,
            seq_len=128,
            packing=True,
            long_examples="split",
            mlm_probability=0.15,
        ),
    ),
    "numbers_translate": dict(
        features=dict(),
        tasks=("translation",),
        config=dict(
            cache=True,
            task="translation",
            train_split="train",
            eval_split="test",
            tokenizer="sentencepiece",
            vocab_size=384,
            seq_len=24,
            **_TEXT,
            source_lang="digits",
            target_lang="en",
        ),
    ),
    "wmt14_translate/de-en": dict(
        module="tensorflow_datasets.translate.wmt14",
        features=dict(),
        tasks=("translation",),
        config=dict(  # English -> German with a shared 37k vocabulary, as in the paper
            task="translation",
            train_split="train",
            eval_split="test",
            tokenizer="sentencepiece",
            vocab_size=37000,
            seq_len=256,
            long_examples="truncate",
            packing=True,
            source_lang="en",
            target_lang="de",
        ),
    ),
    "glue/sst2": dict(
        module="tensorflow_datasets.text.glue",
        features=dict(text="sentence", label="label"),
        tasks=("text_classification",),
        config=dict(
            task="text_classification",
            train_split="train",
            eval_split="validation",
            tokenizer="sentencepiece",
            vocab_size=8000,
            seq_len=128,
            **_TEXT,
            num_classes=2,
        ),
    ),
}

# Up to this many training records (evenly strided) feed SentencePiece training.
_SPM_MAX_RECORDS = 250_000


def _entry(name: str) -> dict:
    if name not in CATALOG:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(CATALOG)}")
    return CATALOG[name]


def default_dataset_config(name: str) -> ml_collections.ConfigDict:
    """The full, editable config of a dataset (fields in the module docstring)."""
    return ml_collections.ConfigDict({"name": name, **_COMMON, **_entry(name)["config"]})


def with_placeholders(dataset_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds each field of the named dataset that `dataset_config` leaves unset as a typed
    placeholder (None: the catalog's default, for whatever dataset the name is by then), so that
    every field can be set on the command line (--config.dataset.tokenizer=sentencepiece).
    Returns `dataset_config`."""
    with dataset_config.unlocked():
        for key, value in default_dataset_config(dataset_config.name).items():
            if key not in dataset_config:
                dataset_config[key] = config_dict.placeholder(type(value))
    return dataset_config


def resolve_config(dataset_config) -> ml_collections.ConfigDict:
    """Defaults of the named dataset overridden by the given fields, checked.

    Accepts a ConfigDict or plain dict with at least `name`; fields that are None take the
    default. An unknown field, a value of the wrong type or out of range is a ValueError naming
    the field.
    """
    given = {key: value for key, value in dict(dataset_config).items() if value is not None}
    if "name" not in given:
        raise ValueError("dataset config needs a 'name', e.g. {'name': 'digits'}")
    cfg = default_dataset_config(given["name"])
    for key, value in given.items():
        if key not in cfg:
            raise ValueError(
                f"dataset {cfg.name!r} has no config field {key!r}; its fields: {', '.join(cfg)}"
            )
        default = cfg[key]
        if type(value) is not type(default) and not (
            isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)
        ):
            raise ValueError(
                f"dataset {cfg.name!r}: field {key!r} must be {type(default).__name__}, "
                f"got {value!r}"
            )
        cfg[key] = value
    _check(cfg)
    return cfg


def _check(cfg) -> None:
    def fail(field, why):
        raise ValueError(f"dataset {cfg.name!r}: {field}={cfg[field]!r} {why}")

    if cfg.task not in _entry(cfg.name)["tasks"]:
        fail("task", f"is not available; choose one of {_entry(cfg.name)['tasks']}")
    for field in ("num_workers", "read_threads", "prefetch_batches"):
        if cfg[field] < 0:
            fail(field, "must be >= 0")
    if cfg.task == "image_classification":
        if cfg.image_size < 1:
            fail("image_size", "must be >= 1")
        if cfg.crop not in preprocess.CROPS:
            fail("crop", f"must be one of {preprocess.CROPS}")
        return
    if cfg.tokenizer not in ("bytes", "sentencepiece"):
        fail("tokenizer", "must be 'bytes' or 'sentencepiece'")
    # The shortest row: bos + 1 token + eos for classification; 1 token + eos (or bos) else.
    min_len = 3 if cfg.task == "text_classification" else 2
    if cfg.seq_len < min_len:
        fail("seq_len", f"cannot hold one token with its bos/eos; use seq_len >= {min_len}")
    if cfg.long_examples not in ("split", "truncate"):
        fail("long_examples", "must be 'split' or 'truncate'")
    if cfg.long_examples == "split" and cfg.task not in ("lm", "mlm"):
        fail("long_examples", "must be 'truncate': only lm/mlm examples can be cut in pieces")
    if cfg.task == "text_classification" and cfg.packing:
        fail("packing", "must be False: classification needs one example per row")
    if cfg.task == "mlm" and not 0 < cfg.mlm_probability < 1:
        fail("mlm_probability", "must be in (0, 1)")


# ------------------------------------------------------------------------------------ data dirs
def default_data_dir() -> str:
    """$TFJAX_DATA_DIR, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    path = os.environ.get("TFJAX_DATA_DIR") or os.environ.get("TFDS_DATA_DIR")
    return os.path.expanduser(path or "~/tensorflow_datasets")


def _data_dir(data_dir: str | os.PathLike | None) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(data_dir or default_data_dir())))


def _prepare_hint(name: str, data_dir: str, *, damaged: bool = False) -> str:
    hint = f'run `python -c "import tfjax.data; tfjax.data.prepare({name!r}, {data_dir!r})"`'
    if damaged:
        hint += " (it moves the damaged folder aside, deleting nothing, and builds it again"
        return hint + (", offline in seconds)" if name in embedded.BUILDERS else ")")
    if name in embedded.BUILDERS:
        return hint + " (builds it offline in seconds)"
    build = f"tfds build {name} --file_format=array_record --data_dir={data_dir}"
    hint += f" (downloads it; or `{build}`)"
    if name == "imagenet2012":
        hint += f"; ImageNet needs its archives in {data_dir}/downloads/manual first"
    return hint


def _builder(name: str, data_dir: str, **kwargs) -> tfds.core.DatasetBuilder:
    entry = _entry(name)
    if name in embedded.BUILDERS:
        return embedded.BUILDERS[name](data_dir=data_dir, **kwargs)
    if "module" in entry:  # these modules fail to auto-register without TensorFlow
        importlib.import_module(entry["module"])
    return tfds.builder(name, data_dir=data_dir, **kwargs)


def prepare(name: str, data_dir: str | os.PathLike | None = None) -> str:
    """Builds dataset `name` as ArrayRecord in `data_dir` once; later calls reuse it.

    Embedded datasets build offline. Catalog datasets download (and mnist/cifar10 need
    TensorFlow installed to encode their images while preparing; reading never does).
    Never deletes anything: a damaged folder (no dataset_info.json) is renamed
    `<version>.damaged-<n>` and the dataset built again. Returns the dataset's folder.
    """
    data_dir = _data_dir(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    builder = _builder(name, data_dir, file_format="array_record")
    if builder.is_prepared():
        if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
            raise ValueError(_wrong_format(name, builder))
        return os.fspath(builder.data_dir)
    if os.path.exists(builder.data_path):
        # tfds writes dataset_info.json before it renames a finished build into place, so this
        # folder is damaged; tfds itself would "reuse" it and build nothing.
        aside = _move_aside(os.fspath(builder.data_path))
        logging.warning("%s has no dataset_info.json (damaged): moved it to %s; preparing %r "
                        "again", builder.data_path, aside, name)  # fmt: skip
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
    data_dir = _data_dir(data_dir)
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
def tokenizer_path(dataset_config, data_dir: str | os.PathLike | None = None) -> str:
    """Where the SentencePiece model of a dataset lives: beside the data, one per vocab size."""
    cfg = dataset_config
    return os.path.join(
        _data_dir(data_dir),
        "tokenizers",
        f"{cfg['name'].replace('/', '_')}-sp{cfg['vocab_size']}.model",
    )


def text_fields(cfg) -> tuple[str, ...]:
    """The record fields holding text (both languages for translation: a shared vocabulary)."""
    if cfg.task == "translation":
        return (cfg.source_lang, cfg.target_lang)
    return (_entry(cfg.name)["features"]["text"],)


def as_text(value) -> str:
    """TFDS gives text as bytes (its mock data as str)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def get_tokenizer(dataset_config, data_dir: str | os.PathLike | None = None):
    """The tokenizer of a text dataset config: bytes, or SentencePiece trained on the training
    split the first time (stored at `tokenizer_path`) and loaded afterwards.

    In a multi-host run let one process create it first (files are written atomically, so
    concurrent training is safe but wasteful).
    """
    cfg = resolve_config(dataset_config)
    if cfg.task == "image_classification":
        raise ValueError(f"dataset {cfg.name!r} is an image dataset; it has no tokenizer")
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    path = tokenizer_path(cfg, data_dir)
    if os.path.exists(path):
        return SentencePieceTokenizer.load(path)
    source = open_source(cfg.name, cfg.train_split, data_dir)
    n = min(len(source), _SPM_MAX_RECORDS)
    keys = np.unique(np.linspace(0, len(source) - 1, n).astype(int)).tolist()
    fields = text_fields(cfg)
    logging.info(
        "Training SentencePiece (%d pieces) for %s on %d records -> %s",
        cfg.vocab_size,
        cfg.name,
        len(keys),
        path,
    )

    # SentencePiece reads every record first (the bar), then trains (no progress to show).
    bar = metrics.progress(total=len(keys), unit="record", desc="SentencePiece: reading")
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
        logging.info("SentencePiece: read %s; training", metrics.throughput(len(keys), "records",
                                                                             elapsed))  # fmt: skip

    train_sentencepiece(texts(), path, vocab_size=cfg.vocab_size)
    logging.info("SentencePiece for %s trained in %.1f s", cfg.name, time.perf_counter() - start)
    return SentencePieceTokenizer.load(path)


def features(name: str) -> dict:
    """Record field names of dataset `name` (image/label/text), a copy."""
    return copy.deepcopy(_entry(name)["features"])
