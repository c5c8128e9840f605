"""Grain loaders: records -> examples -> fixed-shape numpy batches, with a checkpointable position.

The order of examples is a pure function of (seed, epoch, process): every epoch the whole split
is shuffled with the seed and dealt round-robin to the processes (process i takes positions
i, i + P, i + 2P, ... of the shuffled epoch), so the shards are disjoint and cover the epoch.
Random augmentation and MLM masking are keyed by (seed, epoch, record), so they do not depend
on the number of processes either.

Images (fixed size once fitted) are cut into batches first, then each batch reads its records
together, fits each image and shifts, flips and normalises them at once:

  positions epoch*n+record -> shuffle per epoch, shard, repeat -> batch(read, fit, augment)

Text is variable-length, so it goes example by example through packing:

  records -> tokenise, mask (random_map) -> shuffle, shard, repeat -> split or truncate
    -> pack (segment ids, positions) or not -> batch(pad rows to seq_len)

The user's own files (`tfjax.data.files`) take the same path: their rows are the records,
tokenised with the checkpoint's tokenizer into "tokens" and "weights", and a row that trains
nothing once cut to seq_len is dropped there (`files.RowEncoder`: counted, logged, and a split
of no other rows refused when the loader is made). A mixture of several sources of them
(dataset.mixture) mixes the sources at their weights before packing:

  each source: records -> tokenise (drop) -> shuffle per epoch of its own, shard, repeat forever
  the sources -> mix (Grain's MapDataset.mix) -> split or truncate -> pack or not -> batch

Every batch has the same shapes: the last partial batch is padded with zero rows. Worker
processes (num_workers) each build whole batches: image batches are cut before the workers and
come out exactly as without them; text batches are packed per worker from every k-th example,
so they depend on num_workers (a saved position resumes only with the same number).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import grain
import jax
import numpy as np
from absl import logging

from tfjax.data import catalog, files, preprocess, sources
from tfjax.data.tokenizers import BOS_ID, EOS_ID

_STATE_VERSION = 1
# Identity keys that positions saved by an older tfjax lack: such a position resumes, unchecked
# on that key, with a warning (the user's files' contents: issue 48).
_NEWER_KEYS = ("content",)
# Task names that positions saved before the one task vocabulary of `tfjax.tasks` recorded.
_OLD_TASK_NAMES = {
    "image_classification": "classification",
    "text_classification": "classification",
}


class LabelError(ValueError):
    """A record's label has no logit: it lies outside [0, dataset.num_classes) (a loss over it
    would be NaN, or learn nothing)."""


def _label(record, *, fields, cfg, where: str) -> int:
    """The label of a classification `record` (of `where` in the dataset), checked."""
    label = int(record[fields["label"]])
    if not 0 <= label < cfg.num_classes:
        raise LabelError(
            f"dataset {cfg.name!r}, {where}: field {fields['label']!r} is {label}, outside "
            f"dataset.num_classes={cfg.num_classes} (allowed: 0 to {cfg.num_classes - 1}); "
            "use a split whose records are labelled, or set dataset.num_classes to the "
            "dataset's number of classes"
        )
    return label


# --------------------------------------------------------------------------- per-record transforms
def _image_batch(positions, *, source, fields, cfg, train, seed, batch_size, split):
    """Stream positions [b <= B] (epoch * n + record) -> {"image": f32 [B, S, S, C],
    "label": i32 [B], "weights": f32 [B] (0 on the padding rows of a last partial batch)}.

    Images are decoded and fitted one by one (their sizes differ), then shifted, flipped and
    normalised together; every random choice is keyed by (seed, position).
    """
    positions = np.asarray(positions, np.int64)
    b, size, channels = len(positions), cfg.image_size, cfg.num_channels
    images = np.zeros((batch_size, size, size, channels), np.uint8)
    labels = np.zeros(batch_size, np.int32)
    weights = (np.arange(batch_size) < b).astype(np.float32)
    indices = (positions % len(source)).tolist()
    records = source.read(indices)
    for i, (position, record) in enumerate(zip(positions.tolist(), records, strict=True)):
        rng = np.random.default_rng([seed, position]) if cfg.crop == "inception" else None
        image = np.asarray(record[fields["image"]])
        images[i] = preprocess.fit_image(image, size=size, crop=cfg.crop, train=train, rng=rng)
        where = f"split {split!r} record {indices[i]}"
        labels[i] = _label(record, fields=fields, cfg=cfg, where=where)
    shifts, flips = np.zeros((batch_size, 2), np.int32), np.zeros(batch_size, bool)
    padding = cfg.crop_padding if cfg.crop == "pad" else 0
    if train:
        u = preprocess.keyed_uniform(seed, positions, 3)  # [b, 3]
        shifts[:b], flips[:b] = preprocess.draw_augmentations(
            u, padding=padding, random_flip=cfg.random_flip
        )
    image = preprocess.augment_batch(images, shifts, flips, padding)
    image[b:] = 0  # padding rows: zeros, as in every other key
    return {"image": image, "label": labels, "weights": weights}


def _classification_text_example(record, rng, *, fields, tokenizer, cfg, split):
    """Record -> {"tokens": i32 [<= T] (bos, text ids cut to fit, eos), "label", "weights"}."""
    del rng
    text = sources.as_text(record[fields["text"]])
    ids = tokenizer.encode(text)[: cfg.seq_len - 2]
    label = _label(record, fields=fields, cfg=cfg, where=f"split {split!r} text {text[:40]!r}")
    return {
        "tokens": np.concatenate([[BOS_ID], ids, [EOS_ID]]).astype(np.int32),
        "label": np.int32(label),
        "weights": np.float32(1),
    }


def _lm_example(record, rng, *, fields, tokenizer, mlm_probability):
    """Record -> {"tokens": i32 [L] = bos, text ids, eos, "weights": f32 [L]}: for LM 1.0 on
    every token (each is a target of the loss but the first, which nothing precedes); for MLM
    "tokens" corrupted, "targets" the original ids and "weights" 1.0 where picked."""
    ids = tokenizer.encode(sources.as_text(record[fields["text"]]))
    tokens = np.concatenate([[BOS_ID], ids, [EOS_ID]]).astype(np.int32)
    if mlm_probability is None:
        return {"tokens": tokens, "weights": np.ones(len(tokens), np.float32)}
    corrupted, weights = preprocess.mask_tokens(
        tokens, rng=rng, vocab_size=tokenizer.vocab_size, probability=mlm_probability
    )
    return {"tokens": corrupted, "targets": tokens, "weights": weights}


def _translation_example(record, rng, *, source, target, tokenizer, seq_len):
    """Record -> {"inputs": i32 [<= T], "targets": i32 [<= T]}: ids then eos, truncated."""
    del rng

    def encode(field):
        ids = tokenizer.encode(sources.as_text(record[field]))
        return np.concatenate([ids, [EOS_ID]]).astype(np.int32)[:seq_len]

    return {"inputs": encode(source), "targets": encode(target)}


@dataclasses.dataclass(frozen=True)
class _SplitLong(grain.experimental.FlatMapTransform):
    """Cuts long LM examples into pieces of at most `length` tokens."""

    length: int
    max_fan_out: int = 1 << 30  # only bounds MapDataset flat maps; ours runs on an IterDataset

    def flat_map(self, example):
        return preprocess.split_example(example, self.length)


def _keep(batch, *, keys):
    return {k: batch[k] for k in keys}


# --------------------------------------------------------------------------------------- loader
class Loader:
    """Iterates over numpy batch dicts of fixed shapes (`element_spec`) and can save and restore
    its exact position (`get_state` / `set_state`, a small JSON-serialisable dict).

    Attributes:
      element_spec: {key: jax.ShapeDtypeStruct} of every batch.
      num_batches: batches this process yields for a finite number of epochs when rows hold
        one example each (equal on every process: the shorter shards end with padding
        batches); None when infinite or unknowable ahead (packing, split examples).
      tokenizer: the text tokenizer, None for images.
    """

    def __init__(self, dataset, *, element_spec, num_batches, tokenizer, identity):
        self._dataset = dataset
        self.element_spec = element_spec
        self.num_batches = num_batches
        self.tokenizer = tokenizer
        self._identity = identity  # what a saved position is only valid for
        self._iterator = None
        self._batches = 0  # batches yielded so far, padding batches included

    def _iter(self):
        if self._iterator is None:  # lazy: worker processes start on first use
            self._iterator = iter(self._dataset)
        return self._iterator

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            batch = next(self._iter())
        except StopIteration:
            if self.num_batches is None or self._batches >= self.num_batches:
                raise
            # This shard is shorter than the longest one: keep step counts equal across hosts.
            batch = {k: np.zeros(v.shape, v.dtype) for k, v in self.element_spec.items()}
        self._batches += 1
        return batch

    def get_state(self) -> dict:
        return {
            "version": _STATE_VERSION,
            **self._identity,
            "batches": self._batches,
            "iterator": self._iter().get_state(),
        }

    def set_state(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not supported")
        for key, value in self._identity.items():
            saved = state.get(key)
            if key == "config.task":
                saved = _OLD_TASK_NAMES.get(saved, saved)
            if key in _NEWER_KEYS and key not in state:
                logging.warning(
                    "The loader state was saved by an older tfjax, without the %s of the data "
                    "files (%s now): resuming without checking that they are unchanged",
                    key,
                    value,
                )
                continue
            if key == "content" and saved != value:
                raise ValueError(
                    f"the data files changed since the loader state was saved: their bytes' "
                    f"sha256 was {saved!r}, now {value!r} (same files, same number of rows: "
                    "rewritten in place), so the saved position would resume on other rows; "
                    "resume with the files as they were"
                )
            if saved != value:
                raise ValueError(
                    f"loader state was saved with {key}={saved!r}, but this loader has "
                    f"{key}={value!r}; resume with the data settings the state was saved with"
                )
        self._iter().set_state(state["iterator"])
        self._batches = state["batches"]

    def reset(self) -> None:
        """Back to the first batch (e.g. before each evaluation)."""
        self.close()
        self._batches = 0

    def close(self) -> None:
        """Stops worker processes and threads (also done when garbage collected)."""
        if self._iterator is not None and hasattr(self._iterator, "close"):
            self._iterator.close()
        self._iterator = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Loader({self._identity}, num_batches={self.num_batches})"


class _Positions(grain.MapDataset):
    """The records of an n-record split as stream positions: element `epoch * n + record` is
    that number itself (a source would wrap it to `record` and lose the epoch). Image batches
    are read from these, a batch at a time."""

    def __init__(self, n: int):
        super().__init__()
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __str__(self) -> str:
        return f"Positions({self._n})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return index

    def _getitems(self, indices):
        return list(indices)


class _EpochShuffle(grain.MapDataset):
    """Reshuffles its parent every epoch with a numpy permutation.

    Grain's `shuffle` computes each position with a Feistel network, ~30 us per element on a
    small CPU: as much as all of the digits preprocessing. A cached permutation per epoch is an
    array lookup. Index `epoch * n + i` maps to `epoch * n + perm_epoch[i]`, as with Grain, so
    downstream random maps still see (epoch, record).
    """

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._seed = seed
        self._cache = (-1, None)  # (epoch, permutation); replaced whole, so threads stay safe

    def __len__(self) -> int:
        return len(self._parent)

    def __str__(self) -> str:
        return f"EpochShuffle(seed={self._seed})"

    def _permutation(self, epoch: int) -> np.ndarray:
        cached_epoch, perm = self._cache
        if cached_epoch != epoch:
            n = len(self._parent)
            perm = np.random.default_rng([self._seed, epoch]).permutation(n).astype(np.uint32)
            self._cache = (epoch, perm)
        return perm

    def _shuffled(self, index: int) -> int:
        n = len(self._parent)
        epoch, i = divmod(index, n)
        return epoch * n + int(self._permutation(epoch)[i])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[self._shuffled(index)]

    def _getitems(self, indices):
        return self._parent._getitems([self._shuffled(i) for i in indices])


def _shuffle(ds: grain.MapDataset, seed: int) -> grain.MapDataset:
    # A permutation of up to 2**24 records is at most 64 MiB per process; beyond, Grain's
    # memory-free shuffle (large datasets are bound by reading anyway).
    return _EpochShuffle(ds, seed) if len(ds) <= 1 << 24 else ds.shuffle(seed=seed)


def _seed(seed: int, *purpose: int) -> int:
    """Independent 32-bit seeds for shuffling and for per-example randomness (of each source of
    a mixture)."""
    return int(np.random.SeedSequence([seed, *purpose]).generate_state(1)[0])


def _proportions(weights) -> list[int]:
    """Mixture weights as the integers Grain's mix draws by: each over the smallest, x 100.
    Rounded here: Grain truncates, which makes 0.75:0.25 of floats a little under 300:100."""
    smallest = min(weights)
    return [round(100 * weight / smallest) for weight in weights]


def _text_batches(it, cfg, spec, batch_size):
    """Batches of tokenized records: long examples split over rows or truncated, rows packed
    (with segment ids) when cfg.packing, padded to seq_len and to batch_size rows."""
    if cfg.long_examples == "split":
        it = grain.experimental.FlatMapIterDataset(it, _SplitLong(cfg.seq_len))
    elif cfg.task in ("lm", "mlm"):  # the others are truncated per record
        it = it.map(functools.partial(preprocess.truncate_example, length=cfg.seq_len))
    if cfg.packing:
        lengths = {k: cfg.seq_len for k in ("tokens", "targets", "weights", "inputs") if k in spec}
        it = grain.experimental.FirstFitPackIterDataset(
            it, length_struct=lengths, num_packing_bins=batch_size, shuffle_bins=False
        )
        # MLM packs targets and weights alongside tokens; keep one set of segment ids.
        it = it.map(functools.partial(_keep, keys=tuple(spec)))
    # Fixed shapes: rows padded to seq_len, the last partial batch padded to batch_size.
    collate = functools.partial(preprocess.collate, batch_size=batch_size, length=cfg.seq_len)
    return it.batch(batch_size, drop_remainder=False, batch_fn=collate)


def _batches_of(examples: int, workers: int, batch_size: int) -> int:
    """Batches that `examples` one-per-row examples make when each of `workers` batches its own
    every k-th example (the last batch of each partial)."""
    return sum(math.ceil(len(range(w, examples, workers)) / batch_size) for w in range(workers))


def make_loader(
    dataset_config,
    *,
    split: str,
    batch_size: int,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    process_index: int | None = None,
    process_count: int | None = None,
    data_dir: str | os.PathLike | None = None,
    augment: bool | None = None,
) -> Loader:
    """A loader over `split` of the configured dataset for this process.

    Args:
      dataset_config: a DatasetSpec, or a ConfigDict or dict with `name` and any fields to
        override (see `tfjax.data.catalog`), resolved here.
      split: TFDS split, e.g. "train", "test", "train[:90%]"; for the "files" dataset "train"
        (its train_files, or its mixture) or "eval" (its eval_files).
      batch_size: per-process batch size B.
      seed: fixes the shuffle order, augmentation and masking.
      shuffle: reshuffle every epoch.
      num_epochs: passes over the split; None repeats forever (a mixture's only choice: its
        sources are drawn at their weights, each through epochs of its own).
      process_index, process_count: this process's shard; default jax.process_index/count().
      data_dir: where prepared datasets live; default $TFJAX_DATA_DIR or ~/tensorflow_datasets.
      augment: random crops/flips (images); default: the same as `shuffle` (training).
    """
    cfg = catalog.resolve_config(dataset_config)
    if process_index is None:
        process_index = jax.process_index()
    if process_count is None:
        process_count = jax.process_count()
    _check_arguments(cfg, batch_size, process_index, process_count, num_epochs)
    if augment is None:
        augment = shuffle

    opened = _open_sources(cfg, split, num_epochs=num_epochs, data_dir=data_dir)
    _check_shares(opened, cfg, split, process_count)
    spec = catalog.element_spec(cfg, batch_size)
    read_options = grain.ReadOptions(
        num_threads=cfg.read_threads, prefetch_buffer_size=4 * batch_size
    )
    order = functools.partial(
        _in_order,
        shuffle=shuffle,
        process_index=process_index,
        process_count=process_count,
        num_epochs=num_epochs,
    )
    tokenizer = opened.tokenizer
    if cfg.images:
        it = _image_batches(
            opened, cfg, split, order=order, seed=seed, augment=augment, batch_size=batch_size
        ).to_iter_dataset(read_options)
    else:
        tokenizer = tokenizer or sources.get_tokenizer(cfg, data_dir)
        records = _text_records(
            opened,
            cfg,
            split,
            tokenizer,
            order=order,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )
        it = _text_batches(records.to_iter_dataset(read_options), cfg, spec, batch_size)
    it = _prefetched(it, cfg)
    identity = _identity(
        cfg,
        opened,
        tokenizer,
        split=split,
        seed=seed,
        shuffle=shuffle,
        augment=augment,
        num_epochs=num_epochs,
        batch_size=batch_size,
        process_index=process_index,
        process_count=process_count,
    )
    return Loader(
        it,
        element_spec=spec,
        num_batches=_num_batches(cfg, opened, num_epochs, process_count, batch_size),
        tokenizer=tokenizer,
        identity=identity,
    )


def _check_arguments(cfg, batch_size, process_index, process_count, num_epochs) -> None:
    if batch_size < 1:
        raise ValueError(f"dataset {cfg.name!r}: batch_size must be >= 1, got {batch_size}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")


@dataclasses.dataclass
class _Opened:
    """The sources a loader reads (one, or a mixture's) and what else reading them needed:
    for the user's files their lists, the field naming each and the mixture's entries (None
    without one), and the tokenizer; for image folders the checkpoint's preprocessor."""

    sources: list
    tokenizer: Any = None
    file_lists: list | None = None
    fields: list[str] | None = None
    mixture: list | None = None
    preprocessor: Any = None


def _open_sources(cfg, split, *, num_epochs, data_dir) -> _Opened:
    if catalog.is_image_folders(cfg.name):
        from tfjax.data import image_folders

        preprocessor = image_folders.Preprocessor.read(cfg.preprocessor)
        return _Opened([image_folders.open_split(cfg, split)], preprocessor=preprocessor)
    if catalog.is_files(cfg.name):
        return _open_files(cfg, split, num_epochs=num_epochs, data_dir=data_dir)
    return _Opened([sources.open_source(cfg.name, split, data_dir, cache=cfg.cache)])


def _open_files(cfg, split, *, num_epochs, data_dir) -> _Opened:
    """The user's files of `split` (or the mixture's sources), opened after the cheap checks
    (paths, extensions, the tokenizer) so that those fail before the files are scanned."""
    mixture = None
    if split == "train" and cfg.mixture.strip():
        if num_epochs is not None:
            raise ValueError(
                f"dataset.mixture={cfg.mixture!r} draws its sources at their weights, each "
                f"through epochs of its own, forever: num_epochs must be None, got "
                f"{num_epochs}"
            )
        mixture = files.mixture_files(cfg)
        file_lists = [file_list for _, _, file_list in mixture]
        fields = [f"dataset.mixture: entry {i} {e!r}" for i, (_, e, _) in enumerate(mixture, 1)]
    else:
        file_lists = [files.split_files(cfg, split)]
        fields = [f"dataset.{split}_files"]
    tokenizer = sources.get_tokenizer(cfg, data_dir)
    opened = [
        files.open_files(f, field=field, skip_bad_rows=cfg.skip_bad_rows, cache=cfg.cache)
        for f, field in zip(file_lists, fields, strict=True)
    ]
    return _Opened(opened, tokenizer, file_lists, fields, mixture)


def _check_shares(opened: _Opened, cfg, split, process_count) -> None:
    """Each process reads a share of every source: none may be empty."""
    for i, source in enumerate(opened.sources):
        if len(source) < process_count:
            what = f"split {split!r} of dataset {cfg.name!r}"
            if opened.mixture:
                what = f"dataset.mixture: entry {i + 1} {opened.mixture[i][1]!r}"
            raise ValueError(
                f"{what} has {len(source)} examples, fewer than the {process_count} processes "
                "reading it"
            )


def _in_order(ds, shuffle_seed, *, shuffle, process_index, process_count, num_epochs):
    """`ds` shuffled every epoch (if `shuffle`), this process's share of it, `num_epochs` times.
    Elements of `ds` are indexed epoch * n + record below this point, so the random maps above
    it see (epoch, record) whatever the shard."""
    if shuffle:
        ds = _shuffle(ds, shuffle_seed)
    return ds[process_index::process_count].repeat(num_epochs)


def _image_batches(opened: _Opened, cfg, split, *, order, seed, augment, batch_size):
    """Whole batches from the start: one Python step per image, the rest vectorised."""
    source = opened.sources[0]
    positions = order(_Positions(len(source)), _seed(seed, 0))
    if opened.preprocessor is not None:  # the checkpoint's image processing, no augmentation
        from tfjax.data import image_folders

        make_batch = functools.partial(
            image_folders.image_batch,
            source=source,
            preprocessor=opened.preprocessor,
            batch_size=batch_size,
        )
    else:
        make_batch = functools.partial(
            _image_batch,
            source=source,
            fields=cfg.features,
            cfg=cfg,
            train=augment,
            seed=_seed(seed, 1),
            batch_size=batch_size,
            split=split,
        )
    return positions.batch(batch_size, batch_fn=make_batch)


def _text_records(
    opened: _Opened, cfg, split, tokenizer, *, order, seed, process_index, process_count
):
    """The tokenised records of a text dataset in this process's order: a TFDS split's by the
    task's transform, the user's rows by a `files.RowEncoder` each (checked to train); a
    mixture's sources each in its own order, mixed at their weights."""
    if opened.file_lists is None:
        transform = _text_transform(cfg, cfg.features, tokenizer, split)
        source = grain.MapDataset.source(opened.sources[0])
        encoded = [source.random_map(transform, seed=_seed(seed, 1))]
    else:
        encoded = [
            _encoded_rows(s, field, cfg, tokenizer, process_index, process_count)
            for s, field in zip(opened.sources, opened.fields, strict=True)
        ]
    if opened.mixture is None:
        return order(encoded[0], _seed(seed, 0))
    # Each process draws from its own share of every source, at the weights; Grain interleaves
    # the sources in a fixed pattern (3:1 is AAAB AAAB ...), so the saved position is one index
    # as without a mixture.
    return grain.MapDataset.mix(
        [order(e, _seed(seed, 0, i)) for i, e in enumerate(encoded)],
        _proportions([weight for weight, _, _ in opened.mixture]),
    )


def _encoded_rows(source, field, cfg, tokenizer, process_index, process_count):
    """The user's rows encoded; those that train nothing once cut are dropped (None), and a
    source of no row that trains is refused here, before any step."""
    share = len(range(process_index, len(source), process_count))  # rows per epoch
    encoder = files.RowEncoder(
        tokenizer,
        seq_len=cfg.seq_len,
        split_text=cfg.long_examples == "split",
        field=field,
        rows=len(source),
        share=None if cfg.num_workers else share,  # (workers: part of it each)
    )
    encoder.check(source)
    return grain.MapDataset.source(source).map_with_index(encoder)


def _prefetched(it, cfg):
    """`it` built by cfg.num_workers worker processes and read ahead cfg.prefetch_batches."""
    if cfg.num_workers:
        _allow_grain_flags_defaults()
        # Workers build whole batches (shipping single examples costs more than making them).
        # Image batches are cut before the workers, so they come out as without workers; text
        # batches are packed per worker from every k-th example, so they depend on num_workers.
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    if cfg.prefetch_batches:
        it = grain.experimental.ThreadPrefetchIterDataset(
            it, prefetch_buffer_size=cfg.prefetch_batches
        )
    return it


def _num_batches(cfg, opened: _Opened, num_epochs, process_count, batch_size) -> int | None:
    """`Loader.num_batches`: known ahead only for finite epochs of one example per row."""
    if num_epochs is None or not cfg.one_example_per_row:
        return None
    # The longest shard sets the count; each worker batches its own every k-th example.
    examples = num_epochs * math.ceil(len(opened.sources[0]) / process_count)
    workers = 1 if cfg.images else max(cfg.num_workers, 1)
    return _batches_of(examples, workers, batch_size)


def _identity(cfg, opened: _Opened, tokenizer, **arguments) -> dict:
    """What a saved position is valid for: the loader's `arguments` and everything of `cfg`
    that changes which batches come out (speed-only fields may change on resume)."""
    speed_only = ("read_threads", "prefetch_batches", "cache", "train_split", "eval_split")
    # The user's files are named by the files of this split and their rows, not the patterns;
    # the tokenizer by its files' bytes, not its directory (a run's copy of it is the same).
    if opened.file_lists is not None:
        speed_only += ("train_files", "mixture", "eval_files", "tokenizer")
    identity = dict(
        **arguments, **{f"config.{k}": v for k, v in cfg.items() if k not in speed_only}
    )
    if opened.file_lists is None:
        return identity
    identity["tokenizer"] = files.tokenizer_fingerprint(tokenizer)
    if opened.mixture is None:
        source = opened.sources[0]
        identity.update(
            files=files.fingerprint(opened.file_lists[0]), rows=len(source), content=source.digest
        )
    else:  # lists, as they come back from the JSON of a saved position
        identity.update(
            mixture=[weight for weight, _, _ in opened.mixture],
            files=[files.fingerprint(f) for f in opened.file_lists],
            rows=[len(s) for s in opened.sources],
            content=[s.digest for s in opened.sources],
        )
    return identity


def _text_transform(cfg, fields, tokenizer, split):
    """The per-record transform of a text task (of a TFDS dataset), as a picklable partial."""
    if cfg.task == "classification":
        return functools.partial(
            _classification_text_example, fields=fields, tokenizer=tokenizer, cfg=cfg, split=split
        )
    if cfg.task == "translation":
        return functools.partial(
            _translation_example,
            source=cfg.source_lang,
            target=cfg.target_lang,
            tokenizer=tokenizer,
            seq_len=cfg.seq_len,
        )
    mlm_probability = cfg.mlm_probability if cfg.task == "mlm" else None
    return functools.partial(
        _lm_example, fields=fields, tokenizer=tokenizer, mlm_probability=mlm_probability
    )


def _allow_grain_flags_defaults() -> None:
    # Grain's worker processes read absl flags; outside an absl app (tests, notebooks) they are
    # unparsed and reading them fails, so take their defaults.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
