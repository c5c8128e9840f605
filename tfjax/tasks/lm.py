"""Causal language modelling (GPT-like decoders): predict every next token.

Batch: "tokens" i32 [B, T] (0 = padding), with packing also "tokens_segment_ids" and
"tokens_positions" [B, T]. Model output: logits [B, T, V], logits[:, t] predicting
tokens[:, t + 1]. A position is predicted when the next token is real and, in packed rows,
belongs to the same example. Metrics: loss, perplexity (from the unsmoothed NLL), accuracy.
"""

import jax.numpy as jnp

from tfjax.tasks import losses

UNIT = "tokens"
DATA_TASKS = ("lm",)


def model_inputs(batch):
    kwargs = {}
    if "tokens_segment_ids" in batch:
        kwargs = dict(segment_ids=batch["tokens_segment_ids"], positions=batch["tokens_positions"])
    return (batch["tokens"],), kwargs


def _next(a, *, fill):
    """[B, T] -> [B, T]: a[:, t + 1] at position t, `fill` at the last position."""
    return jnp.pad(a[:, 1:], ((0, 0), (0, 1)), constant_values=fill)


def labels_and_weights(batch):
    """([B, T] labels, [B, T] weights): the next token of every position, 0 (padding: weight 0)
    after the last one; in packed rows a position whose next token starts another example has
    weight 0. All T positions are kept: slicing off the last one copied the [B, T, V] logits
    and padded their gradient back (about 1.5% of a GPT-2-small step on CPU)."""
    labels = _next(batch["tokens"], fill=0)
    weights = labels != 0
    if "tokens_segment_ids" in batch:
        seg = batch["tokens_segment_ids"]
        weights = weights & (seg == _next(seg, fill=-1))
    return labels, weights


def loss_and_stats(logits, batch, *, label_smoothing=0.0, z_loss=0.0):
    stats = losses.cross_entropy_sums(
        logits, *labels_and_weights(batch), label_smoothing=label_smoothing, z_loss=z_loss
    )
    return stats["loss"], stats


def summarize(stats):
    return {
        "loss": losses.ratio(stats, "loss"),
        "perplexity": losses.perplexity(stats),
        "accuracy": losses.ratio(stats, "correct"),
    }


def units_per_batch(batch):
    return batch["tokens"].shape[0] * batch["tokens"].shape[1]
