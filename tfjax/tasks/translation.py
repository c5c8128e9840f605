"""Translation with an encoder-decoder: teacher-forced next-token prediction of the targets.

Batch: "inputs" i32 [B, S], "targets" i32 [B, T] (each ends with eos; 0 = padding), with
packing also "{inputs,targets}_{segment_ids,positions}". The model shifts the targets right
itself, so logits [B, T, V] predict `targets` position by position. Metrics: loss, token
accuracy, perplexity (BLEU needs decoding and comes with it).
"""

from tfjax.tasks import losses

UNIT = "tokens"
DATA_TASKS = ("translation",)
_PACKED = ("inputs_segment_ids", "targets_segment_ids", "inputs_positions", "targets_positions")


def model_inputs(batch):
    kwargs = {k: batch[k] for k in _PACKED if k in batch}
    return (batch["inputs"], batch["targets"]), kwargs


def labels_and_weights(batch):
    """([B, T] targets, [B, T] weights: 1 on every real target token, 0 on padding)."""
    targets = batch["targets"]
    return targets, targets != 0


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
    """Source and target tokens."""
    return batch["inputs"].shape[0] * (batch["inputs"].shape[1] + batch["targets"].shape[1])
