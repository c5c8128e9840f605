"""Masked language modelling (BERT-like encoders): recover the picked tokens.

Batch: "tokens" i32 [B, T] (corrupted), "targets" i32 [B, T] (original), "weights" f32 [B, T]
(1 where picked for prediction), with packing also "tokens_segment_ids" and "tokens_positions".
Model output: logits [B, T, V]. Metrics: loss, accuracy on the picked tokens (masked-token
accuracy), perplexity.
"""

from tfjax.tasks import losses

# The same inputs (tokens, packing ids) and units (tokens) as causal language modelling.
from tfjax.tasks.lm import model_inputs, units_per_batch  # noqa: F401

UNIT = "tokens"


def labels_and_weights(batch):
    """([B, T] original tokens, [B, T] weights: 1 where picked for prediction)."""
    return batch["targets"], batch["weights"]


loss_and_stats = losses.cross_entropy_loss(labels_and_weights)
summarize = losses.token_metrics
