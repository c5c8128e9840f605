"""Masked language modelling (BERT-like encoders): recover the picked tokens.

Batch: "tokens" i32 [B, T] (corrupted), "targets" i32 [B, T] (original), "weights" f32 [B, T]
(1 where picked for prediction), with packing also "tokens_segment_ids" and "tokens_positions".
Model output: logits [B, T, V]. Metrics: loss, accuracy on the picked tokens (masked-token
accuracy), perplexity.
"""

from tfjax.tasks import losses
from tfjax.tasks.lm import model_inputs  # noqa: F401 (the same inputs: tokens, packing ids)

UNIT = "tokens"


def labels_and_weights(batch):
    """([B, T] original tokens, [B, T] weights: 1 where picked for prediction)."""
    return batch["targets"], batch["weights"]


def loss_and_stats(logits, batch, *, label_smoothing=0.0, z_loss=0.0):
    stats = losses.cross_entropy_sums(
        logits, *labels_and_weights(batch), label_smoothing=label_smoothing, z_loss=z_loss
    )
    return stats["loss"], stats


def summarize(stats):
    return {
        "loss": losses.ratio(stats, "loss"),
        "accuracy": losses.ratio(stats, "correct"),
        "perplexity": losses.perplexity(stats),
    }


def units_per_batch(batch):
    return batch["tokens"].shape[0] * batch["tokens"].shape[1]
