"""The pure step functions of training: TrainState, train_step and eval_step.

    train_step = steps.make_train_step(model, task, tx, mesh=mesh, rules=rules)
    state, stats = train_step(state, batch, rng)        # one optimizer update
    stats = steps.make_eval_step(model, task, mesh=mesh, rules=rules)(params, batch)

They are plain functions of arrays: `tfjax.runner.setup.set_up` jits them with their shardings
and donation, and the runner, `experiments/compile.py`, the benchmarks and the tests call that.
`mesh` and `rules` only give the model's logical activation constraints a context.

With loss_chunks C > 1 (tasks.TOKEN_TASKS) both steps take the model's final hidden states
(`apply_head=False`) and make the logits and the loss in C slices of T
(`tasks.losses.chunked_cross_entropy_sums`): the [B, T, V] logits are never all in memory.

The train step also collects the auxiliary losses the model's layers write (the AUX_LOSSES
collection: a mixture of experts' load-balancing and router z losses, tfjax.nn.moe) and adds
their weighted sum to the task's loss (`with_aux_losses`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from tfjax import sharding
from tfjax.nn.moe import AUX_LOSSES
from tfjax.ops import axes
from tfjax.tasks import losses

AUX_PREFIX = "aux_"  # the stats (and metrics) of the model's auxiliary losses: aux_<name>


@flax.struct.dataclass
class TrainState:
    """Everything the optimizer updates. Parameters and optimizer state stay float32."""

    step: jax.Array  # int32 []: updates done so far
    params: Any
    opt_state: Any
    ema_params: Any = None  # moving average of params (config.optim.ema_decay > 0), for eval
    skipped: Any = None  # int32 []: updates dropped for a non-finite loss or gradient
    skipped_in_a_row: Any = None  # int32 []: of those, how many just before this step


def split_params(params, trainable):
    """(the parameters that train, the frozen rest): two nested dicts with the paths of
    `params`, split by `trainable` ('/'-joined path -> bool); `merge_params` undoes it."""
    flat = traverse_util.flatten_dict(params)
    train = {k: v for k, v in flat.items() if trainable("/".join(k))}
    frozen = {k: v for k, v in flat.items() if k not in train}
    return traverse_util.unflatten_dict(train), traverse_util.unflatten_dict(frozen)


def merge_params(train, frozen):
    return traverse_util.unflatten_dict(
        {**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(train)}
    )


def loss_and_stats(
    model,
    task,
    params,
    batch,
    *,
    train,
    rngs=None,
    loss_chunks=1,
    label_smoothing=0.0,
    z_loss=0.0,
    aux_losses=False,
):
    """(summed loss, stats) of the model on a batch: the task's loss of the full logits, or with
    loss_chunks > 1 the same sums made from the final hidden states in slices of T; with
    `aux_losses`, and the model's auxiliary losses (`with_aux_losses`)."""
    args, kwargs = task.model_inputs(batch)
    variables = {"params": params}

    def apply(**extra):
        kw = dict(kwargs, train=train, rngs=rngs, **extra)
        if not aux_losses:
            return model.apply(variables, *args, **kw), {}
        out, state = model.apply(variables, *args, **kw, mutable=[AUX_LOSSES])
        return out, state.get(AUX_LOSSES, {})

    if loss_chunks == 1:
        (logits, _), sown = apply()
        loss, stats = task.loss_and_stats(
            logits, batch, label_smoothing=label_smoothing, z_loss=z_loss
        )
        return with_aux_losses(loss, stats, sown)
    (hidden, _), sown = apply(apply_head=False)
    stats = losses.chunked_cross_entropy_sums(
        functools.partial(model.apply, variables, method="logits"),
        hidden,
        *task.labels_and_weights(batch),
        chunks=loss_chunks,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
    )
    return with_aux_losses(stats["loss"], stats, sown)


def with_aux_losses(loss, stats, sown):
    """(loss, stats) with the auxiliary losses the layers wrote, `sown` (the AUX_LOSSES
    collection: per layer, named scalars): each name's mean over the layers becomes a stat
    "aux_<name>", and the mean of the "loss" entries (the layers' weighted sums) joins the loss.
    Both are per token, so they enter the sums as if every weighted token carried them
    (times stats["weight"]): a mean over the batch, micro-batches and steps alike."""
    values = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        values.setdefault(name, []).append(jnp.ravel(leaf))
    if not values:
        return loss, stats
    weight = stats["weight"]
    means = {name: jnp.mean(jnp.concatenate(v)) for name, v in values.items()}
    stats = dict(stats) | {AUX_PREFIX + name: m * weight for name, m in means.items()}
    if "loss" in means:
        loss = loss + means["loss"] * weight
        stats["loss"] = stats["loss"] + means["loss"] * weight
    return loss, stats


def make_train_step(
    model,
    task,
    tx,
    *,
    mesh,
    rules,
    num_microbatches=1,
    label_smoothing=0.0,
    z_loss=0.0,
    ema_decay=0.0,
    loss_chunks=1,
    trainable=None,
):
    """train_step(state, batch, rng) -> (state, stats): one optimizer update on a global batch.

    `trainable` ('/'-joined parameter path -> bool; None: all) picks what trains: the
    gradient is taken of those alone (the frozen ones are constants of the step: no gradient
    of theirs is ever formed) and the optimizer state holds only theirs (`split_params`).

    `rng` is the run's dropout key; the step's key is fold_in(rng, state.step), so the
    randomness of a step does not depend on when or on which mesh it runs. With
    num_microbatches M > 1 the batch is processed in M parts whose gradients are summed
    (gradient accumulation); as every loss is a sum normalised once by the total weight, the
    update equals that of one big batch. `stats` are sums (see tfjax.tasks; with the model's
    auxiliary losses, `with_aux_losses`) plus "grad_norm".
    With loss_chunks C > 1 the logits and the loss are made in C slices of T (see above).

    A step whose loss or gradient has a NaN or Inf leaves params, opt_state and the EMA as they
    were (only step and the skip counters move); its stats are zeros except "nonfinite" (1),
    "bad_loss" and "bad_grad_norm" (the non-finite values, for the error message). "skipped"
    and "skipped_in_a_row" are the state's counters after the step (not sums).
    """

    def loss_fn(params, batch, rng):
        loss, stats = loss_and_stats(
            model,
            task,
            params,
            batch,
            train=True,
            rngs={"dropout": rng},
            loss_chunks=loss_chunks,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            aux_losses=True,
        )
        if num_microbatches == 1:
            # The mean's division at the root of the backward pass: the gradients come out
            # normalised, with no pass over them (which would also be materialised for the
            # lax.cond below).
            loss = loss / jnp.maximum(stats["weight"], 1.0)
        return loss, stats

    if trainable is None:
        grad_fn = jax.grad(loss_fn, has_aux=True)
    else:
        grad_of_part = jax.grad(
            lambda train, frozen, batch, rng: loss_fn(merge_params(train, frozen), batch, rng),
            has_aux=True,
        )

        def grad_fn(params, batch, rng):  # the gradient of the trainable part only
            return grad_of_part(*split_params(params, trainable), batch, rng)

    def train_step(state, batch, rng):
        with sharding.logical_context(mesh, rules):
            step_rng = jax.random.fold_in(rng, state.step)
            if num_microbatches == 1:
                grads, stats = grad_fn(state.params, batch, step_rng)
            else:
                grads, stats = _accumulated(
                    grad_fn, state.params, batch, step_rng, num_microbatches
                )
            return _guarded_update(tx, state, grads, stats, ema_decay, trainable)

    return train_step


def make_eval_step(model, task, *, mesh, rules, loss_chunks=1):
    """eval_step(params, batch) -> stats (sums, as in training, without dropout). The eval
    "loss" is the plain cross-entropy: no label smoothing, no z-loss. loss_chunks as in
    training."""

    def eval_step(params, batch):
        with sharding.logical_context(mesh, rules):
            return loss_and_stats(model, task, params, batch, train=False, loss_chunks=loss_chunks)[
                1
            ]

    return eval_step


def _accumulated(grad_fn, params, batch, step_rng, m):
    """(gradients, stats) of `batch` processed in `m` micro-batches whose gradients and stats
    are summed, the gradients then divided by the whole batch's weight (a sum-then-normalise
    loss makes this equal one big batch)."""

    def split(x):
        # [B, ...] -> [M, B/M, ...], micro-batch i = rows i, i + M, ...: each device's
        # contiguous rows divide evenly, so splitting moves no data.
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        names = (None, axes.BATCH) + (None,) * (x.ndim - 2)
        return nn.with_logical_constraint(x, names)

    micro = jax.tree.map(split, batch)

    def body(carry, xs):
        i, mb = xs
        g, s = grad_fn(params, mb, jax.random.fold_in(step_rng, i))
        return jax.tree.map(jnp.add, carry, (g, s)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first, step_rng)
    )
    (grads, stats), _ = jax.lax.scan(body, zeros, (jnp.arange(m), micro))
    # Losses are sums: one division by the weight of the whole batch makes the mean.
    grads = jax.tree.map(lambda g: g / jnp.maximum(stats["weight"], 1.0), grads)
    return grads, stats


def _guarded_update(tx, state, grads, stats, ema_decay, trainable=None):
    """(the next TrainState, stats): the optimizer update (of the `trainable` parameters, whose
    gradients `grads` are), or, when the loss or the gradient has a NaN or Inf, the state
    unchanged but for the step and skip counters (see make_train_step)."""
    grad_norm = optax.tree.norm(grads)
    # An Inf or NaN anywhere in the gradient makes its norm non-finite.
    ok = jnp.isfinite(stats["loss"]) & jnp.isfinite(grad_norm)

    def update(grads, state):
        if trainable is None:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        else:
            train, frozen = split_params(state.params, trainable)
            updates, opt_state = tx.update(grads, state.opt_state, train)
            params = merge_params(optax.apply_updates(train, updates), frozen)
        ema = state.ema_params
        if ema_decay:
            # Warm-up of the average (TF's ExponentialMovingAverage with num_updates):
            # early parameters, far from the final ones, are forgotten quickly.
            decay = jnp.minimum(ema_decay, (1.0 + state.step) / (10.0 + state.step))
            ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
        return params, opt_state, ema

    def keep(grads, state):
        return state.params, state.opt_state, state.ema_params

    # A cond, not where(ok, new, old) over the trees: that would be one more pass over the
    # parameters and both Adam moments (1.8 of 17.7 GB accessed by a GPT-2-small step, XLA's
    # cost analysis).
    params, opt_state, ema = jax.lax.cond(ok, update, keep, grads, state)
    skipped = (0 if state.skipped is None else state.skipped) + (~ok).astype(jnp.int32)
    previous = 0 if state.skipped_in_a_row is None else state.skipped_in_a_row
    in_a_row = jnp.where(ok, 0, 1 + previous)
    bad = dict(
        nonfinite=(~ok).astype(jnp.float32),
        bad_loss=jnp.where(ok, 0.0, stats["loss"]),
        bad_grad_norm=jnp.where(ok, 0.0, grad_norm),
        skipped=skipped,
        skipped_in_a_row=in_a_row,
    )
    # A dropped step counts nowhere: its zeros leave the logged means of the others.
    stats = dict(stats, grad_norm=grad_norm, steps=jnp.float32(1))
    stats = {k: jnp.where(ok, v, jnp.zeros_like(v)) for k, v in stats.items()} | bad
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        ema_params=ema,
        skipped=skipped.astype(jnp.int32),
        skipped_in_a_row=in_a_row.astype(jnp.int32),
    )
    return new_state, stats
