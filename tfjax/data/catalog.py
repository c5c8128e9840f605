"""Datasets by name: their default configs, and a dataset config resolved once (DatasetSpec).

Every dataset but one is a TFDS builder prepared as ArrayRecord and read as a random-access
`tfds` data source (`tfjax.data.sources`). The embedded ones (`digits`, `pydoc`,
`numbers_translate`, see `tfjax.data.embedded`) are built from files on the machine; the
catalog ones are the public TFDS datasets for users who have them prepared or can download them.
Two others read the user's own data as it is, for fine-tuning a Hugging Face checkpoint:
`files` text files, with the checkpoint's tokenizer (`tfjax.data.files`), and `image_folders`
labelled images in one folder per class, with the checkpoint's image processing
(`tfjax.data.image_folders`).

This module is plain data and checks: it imports neither TFDS nor Grain, so that configs can
import it (`with_placeholders`) and stay light.

A dataset config is resolved once, by `resolve_config` (or `dataset_spec` for a run config),
into a frozen DatasetSpec that the loaders, the tokenizers and the runner read.

Dataset config fields (`default_dataset_config(name)` fills them all):

  name              dataset name, a key of CATALOG
  task              the `tfjax.tasks` task whose batches to make, one of the dataset's `tasks`
                    ("classification" | "lm" | "mlm" | "translation"); in a run config it
                    follows config.task
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
  num_classes       classification of text: number of labels
the user's files (name "files"; also chosen by setting train_files or mixture on any dataset
config):
  train_files       the training files: a path, a glob or a comma-separated list of them, of
                    .txt (one row per non-empty line), .jsonl / .json (JSON lines), .parquet and
                    .arrow files, or the directory a Hugging Face dataset was saved to
                    (`save_to_disk`); local or gs:// (`tfjax.data.files`). Rows are
                    {"text"}, {"prompt", "completion"} or {"messages": [{"role", "content"}]}
  mixture           instead of train_files (which must then be empty): several training
                    sources drawn at weights, "WEIGHT:FILES;WEIGHT:FILES..." with FILES as in
                    train_files, e.g. "3:data/chat/*.jsonl;1:gs://bucket/web.parquet" (3/4 of
                    the rows from the chat files); "" (default): train_files alone
  eval_files        the evaluation files, the same way; "" (default): no eval split
  train_split, eval_split   "train" and "eval", the loader split names of train_files and
                    eval_files (fixed: make_loader(split="train") reads train_files or the
                    mixture)
  tokenizer         the directory of the checkpoint's tokenizer files (tokenizer.json or
                    tokenizer.model), loaded with tfjax.data.checkpoint_tokenizer
  seq_len, packing  as above; packing defaults to True
  long_examples     "truncate" (default) keeps the first seq_len tokens of a row; "split" cuts
                    long text rows into several (prompt/completion and messages rows are
                    always truncated: a completion without its prompt would teach nothing)
  skip_bad_rows     False: a bad row (a line that is not JSON, a row of unknown format or
                    without its fields) stops the loader with file:line; True: skipped, and
                    the number skipped is logged per file
the user's images (name "image_folders"; also chosen by setting train_files on a dataset
config of task "classification"):
  train_files       a directory with one folder of images per class (the sorted folder names
                    are the classes)
  eval_files        a directory of the same kind, its folders among the training classes
  train_split, eval_split   "train" and "eval" (fixed, as for "files")
  preprocessor      the directory of the checkpoint's preprocessor_config.json (image size,
                    resizing, normalisation)
  image_size        the side of the square images the preprocessor makes
  num_channels      3 (images are made RGB)
  num_classes       the class folders of train_files
  (a run from a checkpoint fills preprocessor, image_size and num_classes:
  `tfjax.runner.pretrained.dataset_spec`)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import ml_collections
from ml_collections import config_dict

from tfjax import allowed
from tfjax.allowed import integer, number, one_of

_COMMON = dict(num_workers=0, read_threads=0, prefetch_batches=0, cache=False)
_TEXT = dict(long_examples="truncate", packing=False)
CROPS = ("pad", "inception", "none")  # crop= of image datasets (`preprocess.fit_image`)
# What each field allows besides its type (the type of its default, `resolve_config`), whatever
# the dataset; `_check` adds what depends on the dataset and the task (seq_len: the shortest row).
ALLOWED = {
    "num_workers": integer(0),
    "read_threads": integer(0),
    "prefetch_batches": integer(0),
    "image_size": integer(1),
    "num_channels": integer(1),
    "num_classes": integer(0),  # not fewer than the catalog's (`_check`); image_folders: 0
    "crop": one_of(*CROPS),
    "crop_padding": integer(0),
    "vocab_size": integer(1),
    "long_examples": one_of("split", "truncate"),
    "mlm_probability": number(above=0, below=1),
}


def _dataset(features, tasks, *, eval_split="test", embedded=None, **config):
    """A catalog entry: which record fields hold what (`features`), the `tasks` it serves and
    its config, the splits "train" and `eval_split` then `config`; built offline by the
    tfjax.data.embedded `embedded` builder class (small: kept in memory), else a TFDS dataset."""
    entry = dict(
        features=features,
        tasks=tasks,
        config=dict(train_split="train", eval_split=eval_split, **config),
    )
    if embedded:
        entry.update(embedded=embedded)
        entry["config"]["cache"] = True
    return entry


def _images(size, channels, classes, *, crop="pad", crop_padding, random_flip, **options):
    """A catalog entry of labelled square images (train / eval splits, crops, flips)."""
    return _dataset(
        dict(image="image", label="label"),
        ("classification",),
        image_size=size,
        num_channels=channels,
        num_classes=classes,
        crop=crop,
        crop_padding=crop_padding,
        random_flip=random_flip,
        **options,
    )


def _documents(tokenizer, vocab_size, *, embedded=None):
    """A catalog entry of text documents for language modelling (causal and masked): packed
    rows of 128 tokens, longer documents split over rows."""
    return _dataset(
        dict(text="text"),
        ("lm", "mlm"),
        embedded=embedded,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        seq_len=128,
        packing=True,
        long_examples="split",
        mlm_probability=0.15,
    )


def _translation(source_lang, target_lang, vocab_size, seq_len, **config):
    """A catalog entry of sentence pairs for translation, with one SentencePiece vocabulary
    shared by both languages."""
    return _dataset(
        dict(),
        ("translation",),
        tokenizer="sentencepiece",
        vocab_size=vocab_size,
        seq_len=seq_len,
        source_lang=source_lang,
        target_lang=target_lang,
        **config,
    )


def _files():
    """The catalog entry of the user's own text files (`tfjax.data.files`)."""
    return dict(
        files=True,
        **_dataset(
            dict(text="text"),
            ("lm",),
            eval_split="eval",
            train_files="",
            mixture="",
            eval_files="",
            tokenizer="",
            seq_len=1024,
            packing=True,
            long_examples="truncate",
            skip_bad_rows=False,
        ),
    )


def _image_folders():
    """The catalog entry of the user's images in class folders (`tfjax.data.image_folders`)."""
    return dict(
        image_folders=True,
        **_dataset(
            dict(image="image", label="label"),
            ("classification",),
            eval_split="eval",
            train_files="",
            eval_files="",
            preprocessor="",
            image_size=224,
            num_channels=3,
            num_classes=0,
        ),
    )


# The fields that read the user's files; every dataset config of an "lm" dataset gets them as
# placeholders (`with_placeholders`), so that setting train_files or mixture switches to "files".
FILES_FIELDS = ("train_files", "mixture", "eval_files", "skip_bad_rows")


# name -> how to read it and its default config:
#   features  which record fields hold what ("image" marks an image dataset)
#   tasks     the `tfjax.tasks` tasks it serves (the first is the default)
#   embedded  the `tfjax.data.embedded` builder class (offline); else a TFDS dataset
#   module    TFDS module to import so that its builder is registered
#   files     the user's files (`tfjax.data.files`), not TFDS
#   image_folders  the user's images in class folders (`tfjax.data.image_folders`), not TFDS
CATALOG: dict[str, dict] = {
    "digits": _images(8, 1, 10, crop_padding=1, random_flip=False, embedded="Digits"),
    "mnist": _images(28, 1, 10, crop_padding=2, random_flip=False),
    "cifar10": _images(32, 3, 10, crop_padding=4, random_flip=True),
    "imagenet2012": _images(
        224, 3, 1000, crop="inception", crop_padding=0, random_flip=True, eval_split="validation"
    ),
    "pydoc": _documents("bytes", 8000, embedded="Pydoc"),
    "lm1b": _documents("sentencepiece", 32000),
    "numbers_translate": _translation(
        "digits", "en", 384, 24, embedded="NumbersTranslate", **_TEXT
    ),
    # English -> German with a shared 37k vocabulary, as in the paper
    "wmt14_translate/de-en": dict(
        _translation("en", "de", 37000, 256, long_examples="truncate", packing=True),
        module="tensorflow_datasets.translate.wmt14",
    ),
    "glue/sst2": dict(
        _dataset(
            dict(text="sentence", label="label"),
            ("classification",),
            eval_split="validation",
            tokenizer="sentencepiece",
            vocab_size=8000,
            seq_len=128,
            **_TEXT,
            num_classes=2,
        ),
        module="tensorflow_datasets.text.glue",
    ),
    "files": _files(),
    "image_folders": _image_folders(),
}


def _entry(name: str) -> dict:
    if name not in CATALOG:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(CATALOG)}")
    return CATALOG[name]


def is_embedded(name: str) -> bool:
    """Whether dataset `name` is built offline from files on the machine (in seconds)."""
    return "embedded" in _entry(name)


def is_files(name: str) -> bool:
    """Whether dataset `name` reads the user's own files (`tfjax.data.files`), not TFDS."""
    return bool(_entry(name).get("files"))


def is_image_folders(name: str) -> bool:
    """Whether dataset `name` reads the user's images in class folders
    (`tfjax.data.image_folders`), not TFDS."""
    return bool(_entry(name).get("image_folders"))


def default_dataset_config(name: str) -> ml_collections.ConfigDict:
    """The full, editable config of a dataset (fields in the module docstring)."""
    entry = _entry(name)
    return ml_collections.ConfigDict(
        {"name": name, "task": entry["tasks"][0], **_COMMON, **entry["config"]}
    )


def with_placeholders(dataset_config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds each field of the named dataset that `dataset_config` leaves unset as a typed
    placeholder (None: the catalog's default, for whatever dataset the name is by then), so that
    every field can be set on the command line (--config.dataset.tokenizer=sentencepiece).
    Returns `dataset_config`."""
    defaults = dict(default_dataset_config(dataset_config.name))
    if "lm" in _entry(dataset_config.name)["tasks"]:  # --config.dataset.train_files=... works
        files = default_dataset_config("files")
        defaults.update({k: files[k] for k in FILES_FIELDS if k not in defaults})
    with dataset_config.unlocked():
        for key, value in defaults.items():
            if key not in dataset_config:
                dataset_config[key] = config_dict.placeholder(type(value))
    return dataset_config


@dataclasses.dataclass(frozen=True)
class DatasetSpec(Mapping):
    """A dataset config resolved once: the catalog's defaults overridden by the given fields,
    checked (`resolve_config`, `dataset_spec`). Fields as in the module docstring; those that
    do not apply to the dataset (the image fields of a text dataset) are None. As a read-only
    mapping it holds the fields that apply, the keys of `default_dataset_config(name)`.
    A variant is `dataclasses.replace(spec, packing=False)`."""

    name: str
    task: str
    train_split: str
    eval_split: str
    num_workers: int
    read_threads: int
    prefetch_batches: int
    cache: bool
    num_classes: int | None = None
    image_size: int | None = None
    num_channels: int | None = None
    crop: str | None = None
    crop_padding: int | None = None
    random_flip: bool | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    packing: bool | None = None
    long_examples: str | None = None
    mlm_probability: float | None = None
    source_lang: str | None = None
    target_lang: str | None = None
    train_files: str | None = None
    mixture: str | None = None
    eval_files: str | None = None
    skip_bad_rows: bool | None = None
    preprocessor: str | None = None

    @property
    def images(self) -> bool:
        """Records hold images (else text)."""
        return "image" in _entry(self.name)["features"]

    @property
    def features(self) -> dict[str, str]:
        """Which record fields hold what: {"image"|"text"|"label": field name}."""
        return dict(_entry(self.name)["features"])

    @property
    def text_fields(self) -> tuple[str, ...]:
        """The record fields holding text (both languages for translation: one vocabulary)."""
        if self.task == "translation":
            return (self.source_lang, self.target_lang)
        return (self.features["text"],)

    @property
    def one_example_per_row(self) -> bool:
        """Rows hold one example each (no packing, no splitting), so batch counts are known."""
        return not self.packing and self.long_examples != "split"

    def _applying(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str):
        if key not in self._applying():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._applying())

    def __len__(self) -> int:
        return len(self._applying())


def resolve_config(dataset_config) -> DatasetSpec:
    """Defaults of the named dataset overridden by the given fields, checked.

    Accepts a ConfigDict or plain dict with at least `name` (fields that are None take the
    default), or a DatasetSpec (returned as it is: resolved already). A non-empty `train_files`
    or `mixture` makes it the "files" dataset whatever the name, or "image_folders" for task
    "classification" (the fields given must then be fields of that dataset). An unknown field,
    a value of the wrong type or out of range is a ValueError naming the field.
    """
    if isinstance(dataset_config, DatasetSpec):
        return dataset_config
    given = {key: value for key, value in dict(dataset_config).items() if value is not None}
    switched = ""
    user_data = "image_folders" if given.get("task") == "classification" else "files"
    field = next((f for f in ("train_files", "mixture") if given.get(f)), None)
    if field and given.get("name") not in ("files", "image_folders"):
        if given.get("name"):
            switched = (
                f" ({field} reads the user's files: dataset {given['name']!r} became {user_data!r})"
            )
        given["name"] = user_data
    if "name" not in given:
        raise ValueError("dataset config needs a 'name', e.g. {'name': 'digits'}")
    cfg = default_dataset_config(given["name"])
    for key, value in given.items():
        if key not in cfg:
            raise ValueError(
                f"dataset {cfg.name!r} has no config field {key!r}; its fields: "
                f"{', '.join(cfg)}{switched}"
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
    spec = DatasetSpec(**cfg.to_dict())
    _check(spec)
    return spec


def dataset_spec(config) -> DatasetSpec:
    """The dataset of a run config: config.dataset resolved for config.task (one task name:
    dataset.task follows config.task and may only repeat it)."""
    given = dict(config.dataset)
    if given.get("task") not in (None, config.task):
        raise ValueError(
            f"dataset.task={given['task']!r} differs from task={config.task!r}; leave "
            "dataset.task unset: it follows task"
        )
    return resolve_config({**given, "task": config.task})


def _check(spec: DatasetSpec) -> None:
    def fail(field, why):
        raise ValueError(f"dataset {spec.name!r}: {field}={spec[field]!r} {why}")

    if spec.task not in _entry(spec.name)["tasks"]:
        fail("task", f"is not available; choose one of {_entry(spec.name)['tasks']}")
    allowed.check(spec, ALLOWED, owner=f"dataset {spec.name!r}: ")
    declared = _entry(spec.name)["config"]  # what the dataset's records hold
    if declared.get("num_classes") and spec.num_classes < declared["num_classes"]:
        fail("num_classes", f"is fewer than the dataset's {declared['num_classes']} labels")
    if spec.images and spec.num_channels != declared["num_channels"]:
        fail("num_channels", f"must be {declared['num_channels']}, the channels of its images")
    if is_files(spec.name):
        _check_files(spec, fail)
        return
    if is_image_folders(spec.name):
        for field, split in (("train_split", "train"), ("eval_split", "eval")):
            if spec[field] != split:
                fail(field, f"is fixed for dataset 'image_folders': {split!r} names {split}_files")
        return
    if spec.images:
        return
    if spec.tokenizer not in ("bytes", "sentencepiece"):
        fail("tokenizer", "must be 'bytes' or 'sentencepiece'")
    if spec.tokenizer == "sentencepiece":
        from tfjax.data.tokenizers import MIN_SENTENCEPIECE_VOCAB  # here: configs import this

        if spec.vocab_size < MIN_SENTENCEPIECE_VOCAB:
            fail(
                "vocab_size",
                f"is too small for SentencePiece with byte fallback; use at least "
                f"{MIN_SENTENCEPIECE_VOCAB} or tokenizer='bytes'",
            )
    # The shortest row: bos + 1 token + eos for classification; 1 token + eos (or bos) else.
    min_len = 3 if spec.task == "classification" else 2
    if spec.seq_len < min_len:
        fail("seq_len", f"cannot hold one token with its bos/eos; use seq_len >= {min_len}")
    if spec.long_examples == "split" and spec.task not in ("lm", "mlm"):
        fail("long_examples", "must be 'truncate': only lm/mlm examples can be cut in pieces")
    if spec.task == "classification" and spec.packing:
        fail("packing", "must be False: classification needs one example per row")


def _check_files(spec: DatasetSpec, fail) -> None:
    """The value checks of the "files" dataset; the files themselves (and that train_files and
    the tokenizer are given) are checked when they are opened (`tfjax.data.files.check`), not
    here: configs resolve on hosts without them, for compiling ahead of time, and a run from a
    checkpoint takes its tokenizer (`tfjax.runner.pretrained.dataset_spec`)."""
    for field, split in (("train_split", "train"), ("eval_split", "eval")):
        if spec[field] != split:
            fail(field, f"is fixed for dataset 'files': {split!r} names the {split}_files")
    if spec.seq_len < 2:
        fail("seq_len", "cannot hold one token with its bos/eos; use seq_len >= 2")
    if spec.mixture.strip():
        if spec.train_files.strip():
            raise ValueError(
                f"dataset.mixture={spec.mixture!r} and dataset.train_files="
                f"{spec.train_files!r} are both set: a mixture names all the training files; "
                "leave dataset.train_files empty (its files can be one more mixture entry)"
            )
        mixture_entries(spec.mixture)


MIXTURE_FORMAT = (
    "dataset.mixture is 'WEIGHT:FILES;WEIGHT:FILES...', each WEIGHT a positive number and "
    "FILES as in dataset.train_files, e.g. '3:data/chat/*.jsonl;1:gs://bucket/web.parquet'"
)


def mixture_entries(mixture: str) -> list[tuple[float, str, str]]:
    """The sources of a dataset.mixture string: [(weight, files, entry)], `files` a path, a glob
    or a comma-separated list of them as train_files is, `entry` the text that named them (for
    errors). An entry is WEIGHT:FILES, split at its first ':' (so FILES may be gs:// paths);
    entries are separated by ';' (so a path cannot hold one). A malformed entry or a weight that
    is not a positive number is a ValueError naming dataset.mixture and the entry."""
    out = []
    for entry in (e.strip() for e in mixture.split(";")):
        if not entry:
            continue
        weight, colon, files = entry.partition(":")
        where = f"dataset.mixture: entry {len(out) + 1} {entry!r}"
        if not colon:
            raise ValueError(f"{where} has no WEIGHT: ({MIXTURE_FORMAT})")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise ValueError(
                f"{where}: its weight {weight.strip()!r} is not a positive number "
                f"({MIXTURE_FORMAT})"
            )
        if not any(p.strip() for p in files.split(",")):
            raise ValueError(f"{where} names no files ({MIXTURE_FORMAT})")
        out.append((value, files.strip(), entry))
    if not out:
        raise ValueError(f"dataset.mixture={mixture!r} names no source ({MIXTURE_FORMAT})")
    return out


def element_spec(dataset_config, batch_size: int) -> dict:
    """Shapes and dtypes of the batches of a loader for this config (B = batch_size), as
    {key: jax.ShapeDtypeStruct}."""
    import jax  # here: configs import this module without needing JAX
    import numpy as np

    spec = resolve_config(dataset_config)
    b, i32, f32 = batch_size, np.int32, np.float32
    s = jax.ShapeDtypeStruct
    if spec.images:
        size, c = spec.image_size, spec.num_channels
        return {"image": s((b, size, size, c), f32), "label": s((b,), i32), "weights": s((b,), f32)}
    t = spec.seq_len
    if spec.task == "classification":
        return {"tokens": s((b, t), i32), "label": s((b,), i32), "weights": s((b,), f32)}
    names = {"lm": ["tokens"], "mlm": ["tokens", "targets"], "translation": ["inputs", "targets"]}
    shapes = {k: s((b, t), i32) for k in names[spec.task]}
    if spec.task in ("lm", "mlm"):  # lm: the tokens the loss trains; mlm: those picked
        shapes["weights"] = s((b, t), f32)
    if spec.packing:
        for k in ("tokens",) if spec.task in ("lm", "mlm") else ("inputs", "targets"):
            shapes[f"{k}_segment_ids"] = s((b, t), i32)
            shapes[f"{k}_positions"] = s((b, t), i32)
    return shapes


# ------------------------------------------------------------------------------------ data dirs
def default_data_dir() -> str:
    """$TFJAX_DATA_DIR, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    path = os.environ.get("TFJAX_DATA_DIR") or os.environ.get("TFDS_DATA_DIR")
    return os.path.expanduser(path or "~/tensorflow_datasets")


def data_dir_path(data_dir: str | os.PathLike | None) -> str:
    """The absolute data directory: `data_dir`, or `default_data_dir()` when None or ""."""
    return os.path.abspath(os.path.expanduser(os.fspath(data_dir or default_data_dir())))


def tokenizer_path(dataset_config, data_dir: str | os.PathLike | None = None) -> str:
    """Where the SentencePiece model of a dataset lives: beside the data, one per vocab size."""
    cfg = dataset_config
    return os.path.join(
        data_dir_path(data_dir),
        "tokenizers",
        f"{cfg['name'].replace('/', '_')}-sp{cfg['vocab_size']}.model",
    )
