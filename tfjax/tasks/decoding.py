"""The optional decode-eval hook of a task: what an evaluation decodes beside the task's metrics.

A task whose evaluation also generates text names its hook class

    DECODE_EVAL = <a DecodeEval subclass>; DECODE_EVAL.from_config(config) -> instance | None
                                                    (None: this config decodes nothing)

and the runner's evaluation (`tfjax.runner.evaluation`) asks `tfjax.tasks.decode_eval(config)`,
never naming a task: for every eval batch it calls `decode(exp, tokenizer, params, batch, step=,
index=)` and collects the outputs, then `finish(outputs)` once, which gives the metrics to add
and the samples to write to WORKDIR/samples.jsonl. `generate_args(exp, batch)` says what
decode() generates from a batch; `tfjax.runner.aot` lowers the same from an abstract eval batch.
"""

from __future__ import annotations

import abc

import numpy as np
from jax.experimental import multihost_utils


class DecodeEval(abc.ABC):
    """Base of the decode-eval hooks (translation: BLEU; lm: samples): each subclass defines
    the four methods."""

    # The eval loader reads unpacked rows (one example per row) because decode() decodes each
    # row on its own; a property of the task, so it holds whether or not a config decodes.
    unpacked_eval_rows = False
    # The names of the metrics finish() adds (checked against config.checkpoint.best_metric).
    metrics: tuple[str, ...] = ()

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config) -> DecodeEval | None:
        """The hook of a run config, or None when the config asks for no decoding."""

    @abc.abstractmethod
    def generate_args(self, exp, batch) -> tuple[object, dict]:
        """(prompts, keyword arguments of `tfjax.decode.generate` other than eos_id, rng and
        check; decoder prompts' `mask` among them) with which decode() generates from eval batch
        `batch` (global arrays). For an abstract batch (jax.ShapeDtypeStructs with shardings, as
        `tfjax.runner.aot` lowers the decode) the prompts (and mask) are ShapeDtypeStructs of
        the largest prompts decode() feeds."""

    @abc.abstractmethod
    def decode(self, exp, tokenizer, params, batch, *, step: int, index: int) -> list[dict]:
        """The outputs of eval batch number `index` (global arrays) at training step `step`, as
        JSON-serialisable dicts, the same on every process; [] for a batch it does not decode."""

    @abc.abstractmethod
    def finish(self, outputs: list[dict]) -> tuple[dict[str, float], list[dict]]:
        """(metrics to add to the eval metrics, samples to log) from the outputs of one eval."""


def eos_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a generated sequence: the tokenizer's `eos_ids` where it has them (a
    chat checkpoint's tokenizer ends a turn at any of several), else its one `eos_id`."""
    ids = getattr(tokenizer, "eos_ids", None)
    return (tokenizer.eos_id,) if ids is None else tuple(ids)


def gather(x) -> np.ndarray:
    """A global array (rows sharded over processes) -> the whole of it on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
