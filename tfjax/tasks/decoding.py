"""The optional decode-eval hook of a task: what an evaluation decodes beside the task's metrics.

A task whose evaluation also generates text defines

    decode_eval(config) -> DecodeEval | None      (None: this config decodes nothing)

and the runner's evaluation (`tfjax.evaluation`) asks `tfjax.tasks.decode_eval(config)`, never
naming a task: for every eval batch it calls `decode(exp, tokenizer, params, batch, step=,
index=)` and collects the outputs, then `finish(outputs)` once, which gives the metrics to add
and the samples to write to WORKDIR/samples.jsonl.
"""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils


class DecodeEval:
    """Base of the decode-eval hooks (translation: BLEU; lm: samples)."""

    kind = ""  # what the decoding gives, "bleu" or "samples" (`tfjax.aot` lowers it by this)
    one_example_per_row = False  # eval rows must not be packed: each is decoded on its own

    def decode(self, exp, tokenizer, params, batch, *, step: int, index: int) -> list[dict]:
        """The outputs of eval batch number `index` (global arrays) at training step `step`, as
        JSON-serialisable dicts, the same on every process; [] for a batch it does not decode."""
        raise NotImplementedError

    def finish(self, outputs: list[dict]) -> tuple[dict[str, float], list[dict]]:
        """(metrics to add to the eval metrics, samples to log) from the outputs of one eval."""
        raise NotImplementedError


def gather(x) -> np.ndarray:
    """A global array (rows sharded over processes) -> the whole of it on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
