"""Losses and counts shared by the tasks. Everything returns sums, never means, so that
micro-batches, steps and evaluation batches add up exactly before one final division.

Letters: B batch, T length, D model width, V vocab (or classes C).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfjax.nn import axes

SUMS = ("loss", "nll", "correct", "weight")  # the keys of cross_entropy_sums' result


def cross_entropy_sums(logits, labels, weights, *, label_smoothing=0.0, z_loss=0.0):
    """Weighted cross-entropy sums for integer labels.

    Args:
      logits: [..., V] (any float dtype; computed in float32).
      labels: [...] ints in [0, V).
      weights: [...] floats, 0 where nothing is predicted (padding).
      label_smoothing: eps of Szegedy et al.: the target puts 1 - eps on the label and eps / V
        on every class (Vaswani et al. use 0.1).
      z_loss: coefficient of log(Z)^2, which keeps the softmax normaliser near 1 (PaLM: 1e-4).
    Returns:
      {"loss": sum of w * (smoothed CE + z_loss * log(Z)^2) (the training objective),
       "nll": sum of w * CE against the true label, "correct": sum of w * [argmax == label],
       "weight": sum of w}.
    """
    loss, nll = token_cross_entropy(logits, labels, label_smoothing, z_loss)
    weights = weights.astype(jnp.float32)
    correct = (first_argmax(logits) == labels).astype(jnp.float32)  # no gradient
    return {
        "loss": jnp.sum(loss * weights),
        "nll": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "weight": jnp.sum(weights),
    }


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def token_cross_entropy(logits, labels, label_smoothing=0.0, z_loss=0.0):
    """([...] loss, [...] nll) of each position, in float32: the smoothed cross-entropy plus
    z_loss * log(Z)^2, and the cross-entropy against the label (see cross_entropy_sums).

    The backward pass is written out: softmax - target in float32, made from what the forward
    keeps (the [..., V] logits in their own dtype and log Z [...]), rounded once to the logits'
    dtype: the float32 formula's gradient, as autodiff gave it when the label's logit was read
    from a float32 copy. Autodiff of the forward below, which reads it from the bf16 logits,
    would add the label's part in bf16 (rounded twice).
    """
    return _token_cross_entropy_fwd(logits, labels, label_smoothing, z_loss)[0]


def _token_cross_entropy_fwd(logits, labels, label_smoothing, z_loss):
    label_logit = label_logits(logits, labels)
    x = logits.astype(jnp.float32)
    # [...]: log Z, read straight from the logits. The [..., V] log-probabilities are never
    # formed: that saves a full pass over the largest tensor.
    log_z = jax.nn.logsumexp(x, axis=-1)
    nll = log_z - label_logit
    loss = nll
    if label_smoothing:
        smooth = log_z - x.mean(axis=-1)  # CE against the uniform distribution over V
        loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    return (loss, nll), (logits, labels, log_z)


def label_logits(logits, labels):
    """[...] float32: logits[..., labels], as a masked sum over V (exact: one term is not zero).

    Not a gather: XLA fuses this sum with the logits' conversion to float32, as it fuses
    log Z's, so it reads the logits where they are. A gather from the float32 logits made
    XLA:TPU write a float32 copy of all [..., V] of them for the gather to read (0.98 GiB a row
    of 2,048 tokens at V = 128,256), and libtpu 0.0.50 fails to compile a gather from the bf16
    logits of a large batch (its SparseCore offload: 13 rows of 8,192 tokens of the 8B).
    """
    classes = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    x = logits.astype(jnp.float32)
    return jnp.sum(jnp.where(classes == labels[..., None], x, 0.0), axis=-1)


def _token_cross_entropy_bwd(label_smoothing, z_loss, residuals, cotangents):
    logits, labels, log_z = residuals
    d_loss, d_nll = cotangents  # [...] each
    # d loss / d logits = p (1 + 2 z log Z) - (1 - eps) onehot - eps / V, d nll = p - onehot,
    # p = softmax(logits): one elementwise pass over the logits, in float32, to their dtype.
    p = jnp.exp(logits.astype(jnp.float32) - log_z[..., None])
    on_p = d_loss * (1.0 + 2.0 * z_loss * log_z) + d_nll
    on_label = d_loss * (1.0 - label_smoothing) + d_nll
    classes = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    onehot = classes == labels[..., None]
    grad = p * on_p[..., None] - jnp.where(onehot, on_label[..., None], 0.0)
    if label_smoothing:
        grad = grad - (d_loss * (label_smoothing / logits.shape[-1]))[..., None]
    return grad.astype(logits.dtype), None


token_cross_entropy.defvjp(_token_cross_entropy_fwd, _token_cross_entropy_bwd)


def chunked_cross_entropy_sums(
    logits_fn, hidden, labels, weights, *, chunks, label_smoothing=0.0, z_loss=0.0
):
    """cross_entropy_sums(logits_fn(hidden), labels, weights, ...) made over `chunks` slices of
    T, so that the [B, T, V] logits are never all in memory, in the forward or the backward pass.

    A scan over the slices makes each slice's logits [B, T/chunks, V], reduces them to the four
    sums and drops them. Each slice is a jax.checkpoint: the backward pass keeps only the slice's
    hidden states and makes its logits again (one more output-projection matmul per step, the
    price of the memory), and the gradient of the parameters logits_fn closes over (a tied
    embedding or an output kernel [D, V]) adds up across the slices in the scan's backward.
    The same sums as the plain loss, up to float rounding (they are added slice by slice).

    Args:
      logits_fn: [B, T/chunks, D] -> [B, T/chunks, V], the model's output head closed over its
        parameters (`functools.partial(model.apply, variables, method="logits")`).
      hidden: [B, T, D] what the head takes (`model.apply(..., apply_head=False)`).
      labels: [B, T] ints in [0, V).
      weights: [B, T], 0 where nothing is predicted.
      chunks: the number of slices; divides T.
      label_smoothing, z_loss: as in cross_entropy_sums.
    Returns:
      the dict of cross_entropy_sums.
    """
    b, t = labels.shape
    if chunks < 1 or t % chunks:
        raise ValueError(f"chunks={chunks} must be >= 1 and divide the length T={t}")

    def split(x):
        # [B, T, ...] -> [chunks, B, T/chunks, ...]: slice c holds the positions from c T/chunks.
        x = jnp.moveaxis(x.reshape(b, chunks, t // chunks, *x.shape[2:]), 1, 0)
        # Each slice keeps the batch split over the devices as the rows were.
        names = (None, axes.BATCH, axes.LENGTH, axes.ACT_EMBED)[: x.ndim]
        return nn.with_logical_constraint(x, names)

    # prevent_cse=False: inside a scan the recomputation cannot be merged with the forward.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def slice_sums(h, y, w):
        return cross_entropy_sums(
            logits_fn(h), y, w, label_smoothing=label_smoothing, z_loss=z_loss
        )

    def body(total, xs):
        return jax.tree.map(jnp.add, total, slice_sums(*xs)), None

    zeros = {k: jnp.zeros((), jnp.float32) for k in SUMS}
    sums, _ = jax.lax.scan(body, zeros, (split(hidden), split(labels), split(weights)))
    return sums


def first_argmax(x):
    """jnp.argmax(x, axis=-1) (the first index among ties) for non-NaN x, computed as the
    smallest index holding the maximum: the maximum, then the least index whose value equals
    it, which is argmax's answer by definition, ties included (two plain reductions where
    argmax makes one over (value, index) pairs; measured in docs/performance.md, "What changed
    the CPU step").
    Ties must not all count as correct (`label_logit >= max` would give a zero-initialised
    head 100% accuracy), hence the index rather than a comparison with the label's logit.
    """
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def ratio(stats, key, denominator="weight") -> float:
    """stats[key] / stats[denominator] as a float (0 when nothing was counted)."""
    d = float(stats[denominator])
    return float(stats[key]) / d if d else float("nan")


def perplexity(stats) -> float:
    """exp of the mean negative log-likelihood (no label smoothing, no z-loss)."""
    return float(np.exp(min(ratio(stats, "nll"), 700.0)))


def cross_entropy_loss(labels_and_weights):
    """The `loss_and_stats(logits, batch, *, label_smoothing, z_loss)` of a task whose loss is
    the cross-entropy of the logits against its `labels_and_weights(batch)` (every task here)."""

    def loss_and_stats(logits, batch, *, label_smoothing=0.0, z_loss=0.0):
        stats = cross_entropy_sums(
            logits, *labels_and_weights(batch), label_smoothing=label_smoothing, z_loss=z_loss
        )
        return stats["loss"], stats

    return loss_and_stats


def token_metrics(stats) -> dict:
    """The metrics of a task that predicts tokens: mean loss, accuracy and perplexity."""
    return {
        "loss": ratio(stats, "loss"),
        "accuracy": ratio(stats, "correct"),
        "perplexity": perplexity(stats),
    }
