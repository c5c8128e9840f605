"""Classification of images (ViT) or token sequences (an encoder with head="classifier").

Batch: "image" f32 [B, H, W, C] or "tokens" i32 [B, T], "label" i32 [B], optionally "weights"
f32 [B] (0 on the padding rows of a last partial batch). Model output: logits [B, C].
Metrics: loss, accuracy.
"""

import jax.numpy as jnp

from tfjax.tasks import losses

UNIT = "examples"


def model_inputs(batch):
    return ((batch["image"] if "image" in batch else batch["tokens"]),), {}


def labels_and_weights(batch):
    """([B] labels, [B] weights): every row counts unless batch["weights"] says otherwise."""
    if "weights" in batch:
        return batch["label"], batch["weights"]
    return batch["label"], jnp.ones(batch["label"].shape, jnp.float32)


loss_and_stats = losses.cross_entropy_loss(labels_and_weights)  # logits [B, C] vs labels [B]


def summarize(stats):
    return {"loss": losses.ratio(stats, "loss"), "accuracy": losses.ratio(stats, "correct")}


def units_per_batch(batch):
    return batch["label"].shape[0]
