"""The training loop: config -> sharded jit training and evaluation, checkpoints, metrics.

    from tfjax import train
    config = train.load_config("configs/vit.py:digits")      # as --config= on the command line
    result = train.train_and_evaluate(config, "/tmp/vit_digits")

Data flows one way: the config gives the mesh (`tfjax.sharding`), the input (`tfjax.data`),
the model (`tfjax.models.<config.model.name>`, by importlib), the loss (`tfjax.tasks`), the
optimizer (`tfjax.optim`); `tfjax.checkpoint` restores; then the loop runs `train_step`, and
`tfjax.metrics` reports. Everything of a run lives in the workdir:

  config.json       the resolved config
  tokenizer.model   the run's SentencePiece model (text datasets not tokenized as bytes), so
                    that decoding needs only the workdir
  checkpoints/      Orbax checkpoints (parameters, optimizer state, step, rng, data position)
  metrics.jsonl     one JSON object per logged step and split
  tensorboard/      TensorBoard events of the same scalars

Running again with the same workdir resumes from the newest checkpoint, data position included,
and continues exactly as if never stopped.

Stopping and failing safely:
  * SIGTERM or SIGINT (preemption, Ctrl-C) finishes the current step, saves a checkpoint and
    returns with result["stopped_by"] set (a second Ctrl-C aborts at once). One process: a
    Python signal handler sets a flag the loop reads after every step (no host sync). Several
    processes: SIGTERM goes to JAX's preemption service (its handler, installed by
    jax.distributed.initialize), which agrees on one step for all processes through the
    coordination service, read each step with `manager.reached_preemption`; SIGINT is turned
    into SIGTERM to join the same path. With that service switched off, the flags of all
    processes are combined at log steps instead (the loop's existing host sync).
  * A NaN or Inf loss or gradient never updates the state: the update of that step is dropped
    inside train_step. config.nonfinite="error" (the default) then stops the run naming the
    step, before any checkpoint of later state is written; "skip" goes on, logging each skip
    and stopping after config.max_nonfinite_skips skips in a row. The host learns of it at the
    next log step, evaluation or save (no extra host sync).

Parallelism is the mesh and the logical axis rules only (see `tfjax.sharding`). The state is
created shape-first: `jax.eval_shape` of the initialiser gives the shapes and logical names,
the rules turn those into shardings, and `jax.jit(init, out_shardings=...)` creates every
parameter directly in its shards, so no device ever holds a full copy of a sharded model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from absl import logging
from jax.experimental import multihost_utils

from tfjax import checkpoint, metrics, optim, sharding, tasks

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NONFINITE = ("error", "skip")  # config.nonfinite: what a NaN/Inf loss or gradient does
NONFINITE_STATS = ("nonfinite", "bad_loss", "bad_grad_norm", "skipped", "skipped_in_a_row")
VOCAB_MULTIPLE = 128  # a vocabulary taken from the tokenizer is padded to a multiple of this


@flax.struct.dataclass
class TrainState:
    """Everything the optimizer updates. Parameters and optimizer state stay float32."""

    step: jax.Array  # int32 []: updates done so far
    params: Any
    opt_state: Any
    ema_params: Any = None  # moving average of params (config.optim.ema_decay > 0), for eval
    skipped: Any = None  # int32 []: updates dropped for a non-finite loss or gradient
    skipped_in_a_row: Any = None  # int32 []: of those, how many just before this step


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Loads "configs/vit.py:digits,tiny" as --config= does: get_config("digits,tiny")."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_tfjax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


# ---------------------------------------------------------------------------------- the model
def build_model(config, *, vocab_size: int | None = None, num_classes: int | None = None):
    """tfjax.models.<config.model.name>.Model(**config.model without name), compute dtype from
    config.dtype. Fields that are None take the model's default, except vocab_size (the
    tokenizer's, padded to a multiple of VOCAB_MULTIPLE) and num_classes (the dataset's)."""
    fields = dict(config.model)
    name = fields.pop("name")
    try:
        module = importlib.import_module(f"tfjax.models.{name}")
    except ModuleNotFoundError:
        module = None
    if not hasattr(module, "Model"):
        raise ValueError(
            f"model.name={name!r}: tfjax.models has no such model family; allowed: "
            "transformer, encoder, decoder, vit"
        )
    if fields.get("vocab_size") is None and vocab_size is not None:
        # Rounded up so that the vocab axis shards evenly over any tensor-parallel size up to
        # 128 (and matmuls tile well); the extra ids never occur, their logits learn to be low.
        fields["vocab_size"] = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size is not None and fields["vocab_size"] < vocab_size:
        raise ValueError(
            f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
            f"{vocab_size} ids"
        )
    if "num_classes" in fields and fields["num_classes"] is None:
        fields["num_classes"] = num_classes
    fields = {k: v for k, v in fields.items() if v is not None}
    if config.dtype != "float32":
        fields["dtype"] = COMPUTE_DTYPES[config.dtype]
    return module.Model(**fields)


def _dummy_batch(element_spec: dict, rows: int) -> dict:
    """Zeros shaped like a batch of `rows` rows (for shapes and names at initialisation)."""
    return {k: jnp.zeros((rows, *s.shape[1:]), s.dtype) for k, s in element_spec.items()}


# ---------------------------------------------------------------------------------- the steps
def make_train_step(model, task, tx, *, mesh, rules, num_microbatches=1, label_smoothing=0.0,
                    z_loss=0.0, ema_decay=0.0):  # fmt: skip
    """train_step(state, batch, rng) -> (state, stats): one optimizer update on a global batch.

    `rng` is the run's dropout key; the step's key is fold_in(rng, state.step), so the
    randomness of a step does not depend on when or on which mesh it runs. With
    num_microbatches M > 1 the batch is processed in M parts whose gradients are summed
    (gradient accumulation); as every loss is a sum normalised once by the total weight, the
    update equals that of one big batch. `stats` are sums (see tfjax.tasks) plus "grad_norm".

    A step whose loss or gradient has a NaN or Inf leaves params, opt_state and the EMA as they
    were (only step and the skip counters move); its stats are zeros except "nonfinite" (1),
    "bad_loss" and "bad_grad_norm" (the non-finite values, for the error message). "skipped"
    and "skipped_in_a_row" are the state's counters after the step (not sums).
    """

    def loss_fn(params, batch, rng):
        args, kwargs = task.model_inputs(batch)
        logits, _ = model.apply(
            {"params": params}, *args, **kwargs, train=True, rngs={"dropout": rng}
        )
        loss, stats = task.loss_and_stats(
            logits, batch, label_smoothing=label_smoothing, z_loss=z_loss
        )
        if num_microbatches == 1:
            # The mean's division at the root of the backward pass: the gradients come out
            # normalised, with no pass over them (which would also be materialised for the
            # lax.cond below).
            loss = loss / jnp.maximum(stats["weight"], 1.0)
        return loss, stats

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def train_step(state, batch, rng):
        with sharding.logical_context(mesh, rules):
            step_rng = jax.random.fold_in(rng, state.step)
            if num_microbatches == 1:
                grads, stats = grad_fn(state.params, batch, step_rng)
            else:
                m = num_microbatches

                def split(x):
                    # [B, ...] -> [M, B/M, ...], micro-batch i = rows i, i + M, ...: each
                    # device's contiguous rows divide evenly, so splitting moves no data.
                    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
                    names = (None, sharding.BATCH) + (None,) * (x.ndim - 2)
                    return nn.with_logical_constraint(x, names)

                micro = jax.tree.map(split, batch)

                def body(carry, xs):
                    i, mb = xs
                    g, s = grad_fn(state.params, mb, jax.random.fold_in(step_rng, i))
                    return jax.tree.map(jnp.add, carry, (g, s)), None

                first = jax.tree.map(lambda x: x[0], micro)
                zeros = jax.tree.map(
                    lambda s: jnp.zeros(s.shape, s.dtype),
                    jax.eval_shape(grad_fn, state.params, first, step_rng),
                )
                (grads, stats), _ = jax.lax.scan(body, zeros, (jnp.arange(m), micro))
                # Losses are sums: one division by the weight of the whole batch makes the mean.
                grads = jax.tree.map(lambda g: g / jnp.maximum(stats["weight"], 1.0), grads)
            grad_norm = optax.tree.norm(grads)
            # An Inf or NaN anywhere in the gradient makes its norm non-finite.
            ok = jnp.isfinite(stats["loss"]) & jnp.isfinite(grad_norm)

            def update(grads, state):
                updates, opt_state = tx.update(grads, state.opt_state, state.params)
                params = optax.apply_updates(state.params, updates)
                ema = state.ema_params
                if ema_decay:
                    # Warm-up of the average (TF's ExponentialMovingAverage with num_updates):
                    # early parameters, far from the final ones, are forgotten quickly.
                    decay = jnp.minimum(ema_decay, (1.0 + state.step) / (10.0 + state.step))
                    ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
                return params, opt_state, ema

            def keep(grads, state):
                return state.params, state.opt_state, state.ema_params

            # A cond, not where(ok, new, old) over the trees: that would be one more pass over
            # the parameters and both Adam moments (1.8 of 17.7 GB accessed by a GPT-2-small
            # step, XLA's cost analysis).
            params, opt_state, ema = jax.lax.cond(ok, update, keep, grads, state)
            skipped = (0 if state.skipped is None else state.skipped) + (~ok).astype(jnp.int32)
            in_a_row = jnp.where(ok, 0, 1 + (0 if state.skipped_in_a_row is None
                                             else state.skipped_in_a_row))  # fmt: skip
            bad = dict(nonfinite=(~ok).astype(jnp.float32),
                       bad_loss=jnp.where(ok, 0.0, stats["loss"]),
                       bad_grad_norm=jnp.where(ok, 0.0, grad_norm),
                       skipped=skipped, skipped_in_a_row=in_a_row)  # fmt: skip
            # A dropped step counts nowhere: its zeros leave the logged means of the others.
            stats = dict(stats, grad_norm=grad_norm, steps=jnp.float32(1))
            stats = {k: jnp.where(ok, v, jnp.zeros_like(v)) for k, v in stats.items()} | bad
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                              ema_params=ema, skipped=skipped.astype(jnp.int32),
                              skipped_in_a_row=in_a_row.astype(jnp.int32)), stats  # fmt: skip

    return train_step


def make_eval_step(model, task, *, mesh, rules):
    """eval_step(params, batch) -> stats (sums, as in training, without dropout). The eval
    "loss" is the plain cross-entropy: no label smoothing, no z-loss."""

    def eval_step(params, batch):
        with sharding.logical_context(mesh, rules):
            args, kwargs = task.model_inputs(batch)
            logits, _ = model.apply({"params": params}, *args, **kwargs, train=False)
            return task.loss_and_stats(logits, batch)[1]

    return eval_step


def _like_params(tree, params_treedef, param_leaves, other):
    """Maps every subtree of `tree` shaped like the parameters (Adam's moments, the EMA) to
    `param_leaves` and every other leaf (counters, scalars) to `other`."""

    def is_params(x):
        return jax.tree.structure(x) == params_treedef

    return jax.tree.map(lambda x: param_leaves if is_params(x) else other, tree, is_leaf=is_params)


def _init_variables_fn(model, task, element_spec, *, mesh, rules):
    rows = sharding.data_parallel_size(mesh, rules)  # smallest batch that shards evenly

    def init_variables(rng):
        with sharding.logical_context(mesh, rules):
            args, kwargs = task.model_inputs(_dummy_batch(element_spec, rows))
            return model.init({"params": rng}, *args, **kwargs, train=False)

    return init_variables


def abstract_params(model, task, element_spec, *, mesh, rules):
    """(abstract parameters with their shardings, the shardings), without allocating."""
    init_variables = _init_variables_fn(model, task, element_spec, mesh=mesh, rules=rules)
    boxed = jax.eval_shape(init_variables, jax.random.key(0))["params"]
    param_shardings = sharding.logical_shardings(boxed, mesh, rules)
    params = nn.unbox(boxed)
    sharding.check_divisible(params, param_shardings)
    return checkpoint.abstract_like(params, param_shardings), param_shardings


def abstract_train_state(model, tx, task, element_spec, *, mesh, rules, ema: bool):
    """(init_fn, abstract TrainState with shardings, param shardings), without allocating.

    init_fn(rng) creates the state; jit it with out_shardings=the abstract state's shardings.
    """
    init_variables = _init_variables_fn(model, task, element_spec, mesh=mesh, rules=rules)
    abstract_params_, param_shardings = abstract_params(
        model, task, element_spec, mesh=mesh, rules=rules
    )

    def init_fn(rng):
        params = nn.unbox(init_variables(rng)["params"])
        ema_params = params if ema else None
        zero = jnp.zeros((), jnp.int32)
        return TrainState(step=zero, params=params, opt_state=tx.init(params),
                          ema_params=ema_params, skipped=zero, skipped_in_a_row=zero)  # fmt: skip

    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    treedef = jax.tree.structure(abstract_params_)
    repl = sharding.replicated(mesh)
    shardings = TrainState(
        step=repl,
        params=param_shardings,
        opt_state=_like_params(abstract.opt_state, treedef, param_shardings, repl),
        ema_params=param_shardings if ema else None,
        skipped=repl,
        skipped_in_a_row=repl,
    )
    return init_fn, checkpoint.abstract_like(abstract, shardings), param_shardings


# ------------------------------------------------------------------------------------- checks
def check_config(config) -> None:
    """Value checks ml_collections cannot do (its locking already rejects unknown keys and
    wrong types); each error names the field."""
    if config.task not in tasks.TASKS:
        raise ValueError(f"task={config.task!r} is unknown; allowed: {tasks.TASKS}")
    if config.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={config.dtype!r} is unknown; allowed: {tuple(COMPUTE_DTYPES)}")
    for field in ("batch_size", "eval_batch_size", "num_train_steps", "num_microbatches",
                  "log_every"):  # fmt: skip
        if config[field] < 1:
            raise ValueError(f"{field} must be >= 1, got {config[field]}")
    for field in ("eval_every", "eval_steps"):
        if config[field] < 0:
            raise ValueError(f"{field} must be >= 0, got {config[field]}")
    if config.checkpoint.every < 0:
        raise ValueError(f"checkpoint.every must be >= 0, got {config.checkpoint.every}")
    if config.get("nonfinite", "error") not in NONFINITE:
        raise ValueError(f"nonfinite={config.nonfinite!r} is unknown; allowed: {NONFINITE}")
    if config.get("max_nonfinite_skips", 1) < 1:
        raise ValueError(f"max_nonfinite_skips must be >= 1, got {config.max_nonfinite_skips}")
    if not 0.0 <= config.optim.ema_decay < 1.0:
        raise ValueError(f"optim.ema_decay must be in [0, 1), got {config.optim.ema_decay}")
    _check_decode(config)
    if not 0.0 <= config.loss.label_smoothing < 1.0:
        raise ValueError(
            f"loss.label_smoothing must be in [0, 1), got {config.loss.label_smoothing}"
        )


def _check_batch(name, size, mesh, rules, num_microbatches=1):
    dp = sharding.data_parallel_size(mesh, rules)
    if size % (dp * num_microbatches):
        what = f"{dp} (the data-parallel size: mesh {dict(mesh.shape)} under the 'batch' rule)"
        if num_microbatches > 1:
            what += f" x num_microbatches={num_microbatches}"
        raise ValueError(f"{name}={size} is not divisible by {what}")


def restore_model(config, workdir: str, *, average_last: int = 1, devices=None):
    """(model, params, tokenizer) of a run's newest checkpoint, for decoding and analysis.

    The model is built from `config` as training built it; params land on the config's mesh
    (over `devices`, all by default); average_last=N > 1 averages the newest N checkpoints.
    tokenizer is None for image datasets.
    """
    import tfjax.data

    check_config(config)
    task = tasks.get(config.task)
    rules = sharding.check_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, devices)
    data_config = tfjax.data.resolve_config(dict(config.dataset))
    workdir = os.path.expanduser(workdir)
    tokenizer = None
    stored = os.path.join(workdir, TOKENIZER_FILE)
    if os.path.exists(stored):
        tokenizer = tfjax.data.SentencePieceTokenizer.load(stored)
    elif data_config.task != "image_classification":  # bytes, or a workdir from before the copy
        tokenizer = tfjax.data.get_tokenizer(data_config, config.data_dir or None)
    model = build_model(
        config,
        vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
        num_classes=data_config.get("num_classes"),
    )
    spec = tfjax.data.element_spec(data_config, 1)
    target, _ = abstract_params(model, task, spec, mesh=mesh, rules=rules)
    params = checkpoint.restore_params(workdir, target, average_last=average_last, what="workdir")
    return model, params, tokenizer


# ------------------------------------------------------------------------------------ running
def _preemption_service() -> bool:
    """Whether JAX's preemption service runs (multi-process, jax.distributed initialised)."""
    from jax._src import distributed

    return jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step (see the module docstring).

    `signal` is the name of the first signal this process received (None: none). Installed
    only from the main thread (Python delivers signals there); restored on exit.
    """

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        wanted = [signal.SIGINT]
        if not _preemption_service():  # else SIGTERM is the service's (its C++ handler)
            wanted.append(signal.SIGTERM)
        for signum in wanted:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal = self.signal or name
        logging.warning(
            "%s received: finishing the current step, then saving a checkpoint and stopping%s",
            name, " (Ctrl-C again to abort at once)" if signum == signal.SIGINT else "",
        )  # fmt: skip
        if signum != signal.SIGTERM and _preemption_service():
            os.kill(os.getpid(), signal.SIGTERM)  # join the path every process agrees on

    def reached(self, manager, step: int, log_step: bool) -> bool:
        """Whether to save and stop after `step`; the same answer on every process."""
        if jax.process_count() == 1:
            return self.signal is not None
        if _preemption_service():
            return manager.reached_preemption(step)
        if not log_step:
            return False
        # No preemption service: combine the flags at log steps (a host sync happens anyway).
        flags = multihost_utils.process_allgather(np.int32(self.signal is not None))
        return bool(np.any(flags))


def _primary_first(fn):
    """Runs fn on process 0, then on the others (who then find what it prepared: datasets,
    tokenizers), so that several processes never build the same files at once."""
    if jax.process_count() == 1:
        return fn()
    out = fn() if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("tfjax: primary prepared data")
    return out if jax.process_index() == 0 else fn()


def _evaluate(eval_step, params, loader, mesh, rules, max_batches, on_batch=None):
    """Sums of eval stats over the eval split (or its first max_batches batches);
    on_batch(params, global batch), when given, sees every batch too (decoding)."""
    loader.reset()
    total, n = None, 0
    agree = jax.process_count() > 1 and loader.num_batches is None
    iterator = iter(loader)
    while not max_batches or n < max_batches:
        batch = next(iterator, None)
        if agree:  # shards of unknown length: go on while any process has data
            more = multihost_utils.process_allgather(np.int32(batch is not None))
            if not more.any():
                break
            if batch is None:
                batch = {k: np.zeros(s.shape, s.dtype) for k, s in loader.element_spec.items()}
        elif batch is None:
            break
        batch = sharding.shard_batch(batch, mesh, rules)
        stats = eval_step(params, batch)
        if on_batch is not None:
            on_batch(params, batch)
        total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        n += 1
    if total is None:
        raise ValueError("the eval split gave no batches")
    return jax.tree.map(float, jax.device_get(total))


# ----------------------------------------------------------------------------- decoding in eval
DECODE_METHODS = ("greedy", "beam")  # in eval; sampling is for experiments/decode.py


def _check_decode(config) -> None:
    d = config.get("decode")
    if d is None:
        return
    if d.method not in DECODE_METHODS + ("sample",):
        raise ValueError(f"decode.method={d.method!r} is unknown; allowed: greedy, sample, beam")
    for field in ("beam_size", "max_new_tokens"):
        if d[field] < 0:
            raise ValueError(f"decode.{field} must be >= 0, got {d[field]}")
    if d.method == "beam" and d.beam_size < 1:
        raise ValueError(f"decode.beam_size must be at least 1 for beam search, got {d.beam_size}")


def _gather(x) -> np.ndarray:
    """A global array (rows sharded over processes) -> the whole of it on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def make_bleu_fn(model, tokenizer, decode_config, *, max_new_tokens, mesh, rules):
    """translate(params, batch) -> (hypotheses, references): detokenised strings of the
    batch's real rows (padding rows dropped), decoded with `decode_config` (method greedy or
    beam, beam_size, alpha), the same on every process. sacrebleu scores the lists."""
    from tfjax import decode

    method = decode_config.method if decode_config.method in DECODE_METHODS else "greedy"

    def translate(params, batch):
        with sharding.logical_context(mesh, rules):
            tokens, _ = decode.generate(
                model, params, batch["inputs"], max_new_tokens=max_new_tokens,
                eos_id=tokenizer.eos_id, method=method, beam_size=decode_config.beam_size,
                alpha=decode_config.alpha, check=False,
            )  # fmt: skip
        tokens, targets = _gather(tokens), _gather(batch["targets"])
        real = (targets != 0).any(1)
        return (
            [tokenizer.decode(t) for t in tokens[real]],
            [tokenizer.decode(t) for t in targets[real]],
        )

    return translate


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU (13a tokenisation, as WMT reports) of detokenised text."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def lm_samples(model, params, tokenizer, batch, decode_config, *, mesh, rules, rng):
    """[(prompt, continuation)] for the first decode.num_samples rows of an eval batch: each
    prompt is the row's first decode.prompt_length tokens, continued with decode.method."""
    from tfjax import decode

    d = decode_config
    rows = _gather(batch["tokens"])[: d.num_samples, : d.prompt_length]
    rows = rows[(rows != 0).all(1)]  # a prompt must not end in padding
    if not len(rows):
        return []
    max_new = min(d.max_new_tokens or 32, model.max_len - rows.shape[1])
    with sharding.logical_context(mesh, rules):
        tokens, _ = decode.generate(
            model, params, rows, max_new_tokens=max_new, eos_id=tokenizer.eos_id,
            method=d.method, beam_size=d.beam_size, alpha=d.alpha, temperature=d.temperature,
            top_k=d.top_k, top_p=d.top_p, rng=rng,
        )  # fmt: skip
    tokens = _gather(tokens)
    return [(tokenizer.decode(r), tokenizer.decode(t)) for r, t in zip(rows, tokens, strict=True)]


def _sum(stats_list):
    host = jax.device_get(stats_list)
    return {k: float(np.sum([s[k] for s in host], dtype=np.float64)) for k in host[0]}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_after_step: int | None = None, devices=None) -> dict:  # fmt: skip
    """Trains and evaluates as configured; resumes from the workdir's newest checkpoint.

    Args:
      config: a config as from configs/*.py (fields documented there).
      workdir: where everything of the run is kept (see the module docstring).
      stop_after_step: return after this step, checkpoint saved, as a preempted job would;
        running again continues from there (notebooks train in pieces this way).
      devices: the devices of the mesh; all of them (of every process) when None.
    Returns:
      {"state": the final TrainState, "model": the module, "tokenizer": the data's tokenizer
       (None for images), "step": int, "train": last train metrics, "eval": last eval metrics,
       "workdir", "checkpoints": absolute paths, "curves": the PNG of the curves (process 0),
       "stopped_by": None, or the signal ("SIGTERM", "SIGINT") that stopped the run early
       after saving a checkpoint ("preemption" on a process that received none itself)}.
    Raises:
      FloatingPointError: a non-finite loss or gradient (config.nonfinite, max_nonfinite_skips).
    """
    with StopSignals() as stop:  # from the start: a signal during set-up stops after step 1
        return _train_and_evaluate(config, workdir, stop_after_step=stop_after_step,
                                   devices=devices, stop=stop)  # fmt: skip


def _train_and_evaluate(config, workdir, *, stop_after_step, devices, stop):
    import tfjax.data  # the input pipeline's dependencies are only needed to train

    check_config(config)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    task = tasks.get(config.task)
    rules = sharding.check_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, devices)
    _check_batch("batch_size", config.batch_size, mesh, rules, config.num_microbatches)
    _check_batch("eval_batch_size", config.eval_batch_size, mesh, rules)

    # ---- data: each process loads its distinct part of the global batch
    data_config = tfjax.data.resolve_config(dict(config.dataset))
    if data_config.task not in task.DATA_TASKS:
        raise ValueError(
            f"task={config.task!r} needs a dataset of task {task.DATA_TASKS}, but dataset "
            f"{data_config.name!r} is configured as {data_config.task!r} (dataset.task)"
        )
    shard, shards = sharding.data_shard(mesh, rules)
    data_dir = config.data_dir or None

    def loaders():
        if data_config.name in tfjax.data.embedded.BUILDERS:  # offline, seconds: build on demand
            tfjax.data.prepare(data_config.name, data_dir)
        common = dict(process_index=shard, process_count=shards, data_dir=data_dir)
        train_loader = tfjax.data.make_loader(
            data_config, split=data_config.train_split, batch_size=config.batch_size // shards,
            seed=config.seed, shuffle=True, num_epochs=None, **common,
        )  # fmt: skip
        eval_data_config = data_config
        if data_config.task == "translation" and data_config.packing:
            # One sentence pair per row: BLEU decodes each source on its own.
            eval_data_config = ml_collections.ConfigDict(dict(data_config, packing=False))
        eval_loader = tfjax.data.make_loader(
            eval_data_config, split=data_config.eval_split,
            batch_size=config.eval_batch_size // shards, seed=config.seed, shuffle=False,
            num_epochs=1, **common,
        )  # fmt: skip
        return train_loader, eval_loader

    with contextlib.ExitStack() as cleanup:  # closes loaders and checkpoint writers on errors too
        train_loader, eval_loader = _primary_first(loaders)
        cleanup.callback(eval_loader.close)
        cleanup.callback(train_loader.close)
        return _run(config, workdir, task=task, mesh=mesh, rules=rules,
                    data_config=data_config, train_loader=train_loader,
                    eval_loader=eval_loader, stop_after_step=stop_after_step,
                    cleanup=cleanup, stop=stop)  # fmt: skip


TOKENIZER_FILE = "tokenizer.model"  # in the workdir: the run's SentencePiece model


def _check_workdir_tokenizer(workdir: str, tokenizer) -> None:
    """A workdir trained with one SentencePiece model resumes only with the same one: token ids
    of another vocabulary would silently mean other pieces to the restored embeddings."""
    path = os.path.join(workdir, TOKENIZER_FILE)
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        stored = f.read()
    if stored != getattr(tokenizer, "proto", None):
        raise ValueError(
            f"workdir {workdir} was trained with the SentencePiece model {path}, which differs "
            f"from the tokenizer the dataset config gives now ({tokenizer!r}): every token id "
            f"would mean another piece to the restored model. Train on with the stored "
            f"tokenizer (copy {path} to the dataset's tokenizer path) or use a new workdir."
        )


def _run(config, workdir, *, task, mesh, rules, data_config, train_loader, eval_loader,
         stop_after_step, cleanup, stop):  # fmt: skip
    """train_and_evaluate from the point where the data loaders exist."""
    tokenizer = train_loader.tokenizer
    model = build_model(
        config,
        vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
        num_classes=data_config.get("num_classes"),
    )

    # ---- optimizer and the abstract state
    schedule = optim.make_schedule(config.optim, d_model=model.width,
                                   num_train_steps=config.num_train_steps)  # fmt: skip
    tx = optim.make_optimizer(config.optim, d_model=model.width,
                              num_train_steps=config.num_train_steps)  # fmt: skip
    ema = config.optim.ema_decay > 0
    init_fn, abstract_state, param_shardings = abstract_train_state(
        model, tx, task, train_loader.element_spec, mesh=mesh, rules=rules, ema=ema
    )
    state_shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
    repl = sharding.replicated(mesh)

    # ---- restore (every check before anything in the workdir is written)
    _check_workdir_tokenizer(workdir, tokenizer)
    os.makedirs(workdir, exist_ok=True)
    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), config.checkpoint)
    cleanup.callback(manager.close)
    cleanup.callback(checkpoint.wait_until_finished, manager)  # runs first: pending writes
    latest = manager.latest_step()
    # Keys are made and converted inside jit: in a multi-process run every array the loop
    # touches must be a global array, replicated over the mesh.
    init_key, dropout_key = jax.jit(
        lambda: tuple(jax.random.split(jax.random.key(config.seed))), out_shardings=(repl, repl)
    )()
    key_data = jax.jit(jax.random.key_data, out_shardings=repl)

    def ckpt_state(state, key):
        d = dict(step=state.step, opt_state=state.opt_state, rng=key_data(key),
                 skipped=state.skipped, skipped_in_a_row=state.skipped_in_a_row)  # fmt: skip
        if ema:
            d["ema_params"] = state.ema_params
        return d

    if latest is not None:
        abstract_ckpt_state = dict(step=abstract_state.step, opt_state=abstract_state.opt_state)
        rng_shape = jax.eval_shape(jax.random.key_data, dropout_key)
        abstract_ckpt_state["rng"] = jax.ShapeDtypeStruct(rng_shape.shape, rng_shape.dtype,
                                                          sharding=repl)  # fmt: skip
        if ema:
            abstract_ckpt_state["ema_params"] = abstract_state.ema_params
        # Checkpoints written before the skip counters existed have none: they start at 0.
        counters = {"skipped", "skipped_in_a_row"} & checkpoint.stored_state_keys(manager, latest)
        for name in counters:
            abstract_ckpt_state[name] = getattr(abstract_state, name)
        restored = checkpoint.restore(
            manager, latest, abstract_params=abstract_state.params,
            abstract_state=abstract_ckpt_state,
        )  # fmt: skip
        s = restored["state"]
        zero = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=repl)
        state = TrainState(step=s["step"], params=restored["params"], opt_state=s["opt_state"],
                           ema_params=s.get("ema_params"),
                           skipped=s["skipped"] if "skipped" in s else zero(),
                           skipped_in_a_row=s["skipped_in_a_row"] if "skipped_in_a_row" in s
                           else zero())  # fmt: skip
        dropout_key = jax.jit(jax.random.wrap_key_data, out_shardings=repl)(s["rng"])
        if restored["data"] is not None:
            train_loader.set_state(restored["data"])
        else:
            logging.warning(
                "Checkpoint %d has no data position for %d processes; the data starts over.",
                latest,
                jax.process_count(),
            )
        logging.info("Resumed from %s/checkpoints/%d", workdir, latest)
    else:
        state = jax.jit(init_fn, out_shardings=state_shardings)(init_key)
        if config.init_from:
            params = checkpoint.restore_params(config.init_from, abstract_state.params)
            state = state.replace(params=params, ema_params=params if ema else None)

    start_step = int(state.step)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
        stored = os.path.join(workdir, TOKENIZER_FILE)
        # SentencePiece only (bytes need no file); a stored one was checked equal above.
        if hasattr(tokenizer, "save") and not os.path.exists(stored):
            tokenizer.save(stored)
    writer = metrics.MetricWriter(workdir, resume_step=start_step)
    cleanup.callback(writer.close)

    # ---- the compiled steps: one signature each, so they compile once
    batch_shardings = {
        k: sharding.batch_sharding(mesh, rules, len(s.shape))
        for k, s in train_loader.element_spec.items()
    }
    eval_batch_shardings = {
        k: sharding.batch_sharding(mesh, rules, len(s.shape))
        for k, s in eval_loader.element_spec.items()
    }
    train_step = jax.jit(
        make_train_step(
            model, task, tx, mesh=mesh, rules=rules, num_microbatches=config.num_microbatches,
            label_smoothing=config.loss.label_smoothing, z_loss=config.loss.z_loss,
            ema_decay=config.optim.ema_decay,
        ),
        in_shardings=(state_shardings, batch_shardings, repl),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )  # fmt: skip
    eval_step = jax.jit(
        make_eval_step(model, task, mesh=mesh, rules=rules),
        in_shardings=(param_shardings, eval_batch_shardings),
        out_shardings=repl,
    )

    # ---- decoding in eval: BLEU for translation, sample continuations for LM
    decode_config = config.get("decode")
    bleu_fn = None
    if config.task == "translation" and decode_config is not None:
        target_len = eval_loader.element_spec["targets"].shape[1]
        bleu_fn = make_bleu_fn(
            model, tokenizer, decode_config, mesh=mesh, rules=rules,
            max_new_tokens=decode_config.max_new_tokens or target_len,
        )  # fmt: skip
    samples_path = os.path.join(workdir, "samples.jsonl")

    def evaluate(params, step):
        """Eval metrics at `step`; BLEU and samples when the task decodes."""
        hyps, refs, first = [], [], []

        def on_batch(params, batch):
            if not first:
                first.append(batch)
            if bleu_fn is not None:
                h, r = bleu_fn(params, batch)
                hyps.extend(h)
                refs.extend(r)

        result = task.summarize(
            _evaluate(eval_step, params, eval_loader, mesh, rules, config.eval_steps, on_batch)
        )
        samples = []
        if bleu_fn is not None:
            result["bleu"] = corpus_bleu(hyps, refs)
            samples = [{"output": h, "reference": r} for h, r in zip(hyps, refs, strict=True)]
            samples = samples[: decode_config.num_samples]
        elif config.task == "lm" and decode_config is not None and decode_config.num_samples:
            rng = jax.random.fold_in(jax.random.key(config.seed), step)
            pairs = lm_samples(model, params, tokenizer, first[0], decode_config, mesh=mesh,
                               rules=rules, rng=rng)  # fmt: skip
            samples = [{"prompt": a, "output": b} for a, b in pairs]
        if samples and jax.process_index() == 0:
            with open(samples_path, "a") as f:
                for s in samples:
                    f.write(json.dumps({"step": step, **s}) + "\n")
            for s in samples:
                logging.info("Step %d sample: %s", step, s)
        return result

    # ---- throughput accounting
    global_spec = {
        k: jax.ShapeDtypeStruct((config.batch_size, *s.shape[1:]), s.dtype)
        for k, s in train_loader.element_spec.items()
    }
    units = task.units_per_batch(global_spec)
    example = {k: s.shape for k, s in global_spec.items()}
    flops_per_step = config.batch_size * metrics.training_flops_per_example(
        model, abstract_state.params, example
    )
    peak_flops = metrics.measure_peak_flops(mesh, COMPUTE_DTYPES[config.dtype])
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))
    logging.info(
        "Model %s: %s parameters; mesh %s; %.3g model FLOPs per step; measured matmul peak "
        "%.3g FLOP/s", config.model.name, f"{num_params:,}", dict(mesh.shape),
        flops_per_step, peak_flops,
    )  # fmt: skip

    # ---- the loop
    total = config.num_train_steps
    last_step = total if stop_after_step is None else min(total, stop_after_step)
    pending, train_metrics, eval_metrics = [], {}, {}
    step, timer_step, timer = start_step, start_step, time.perf_counter()
    saved_step = start_step if latest is not None else None
    unchecked = []  # (step, stats) not yet checked for non-finite values
    nonfinite = config.get("nonfinite", "error")
    max_skips = config.get("max_nonfinite_skips", 1)

    def check_finite():
        """Raises for a non-finite step ("error") or too many skips in a row ("skip").

        Called before every save, so no checkpoint is written after a step that must stop the
        run; the host sync it costs happens only at log steps, evaluations and saves."""
        if not unchecked:
            return
        host = jax.device_get([s for _, s in unchecked])
        steps = [k for k, _ in unchecked]
        unchecked.clear()
        for k, s in zip(steps, host, strict=True):
            if not s["nonfinite"]:
                continue
            what = f"loss {float(s['bad_loss'])}, gradient norm {float(s['bad_grad_norm'])}"
            where = (f"the newest checkpoint is step {saved_step}" if saved_step is not None
                     else "no checkpoint was written")  # fmt: skip
            if nonfinite == "error":
                raise FloatingPointError(
                    f"step {k}: non-finite loss or gradient ({what}). The update was not "
                    f"applied and no checkpoint of later state was written ({where}). Lower "
                    "the learning rate or set nonfinite='skip' to drop such updates."
                )
            in_a_row, skipped = int(s["skipped_in_a_row"]), int(s["skipped"])
            logging.warning("Step %d: non-finite loss or gradient (%s); update skipped (%d in a "
                            "row, %d in total)", k, what, in_a_row, skipped)  # fmt: skip
            if in_a_row > max_skips:
                raise FloatingPointError(
                    f"step {k}: {in_a_row} updates in a row skipped for non-finite loss or "
                    f"gradient, more than max_nonfinite_skips={max_skips} ({what}; {where})."
                )

    def save(step, eval_result=None):
        nonlocal saved_step
        check_finite()
        start = time.perf_counter()
        checkpoint.save(
            manager, step, params=state.params, state=ckpt_state(state, dropout_key),
            data_state=train_loader.get_state(),
            metrics={k: v for k, v in (eval_result or {}).items() if math.isfinite(v)} or None,
        )  # fmt: skip
        saved_step = step
        logging.info("Checkpoint %d: the loop waited %.3fs", step, time.perf_counter() - start)

    # A progress bar in a terminal (process 0); logs and notebooks get the periodic lines only.
    progress = tqdm.tqdm(
        total=last_step, initial=start_step, unit="step", dynamic_ncols=True, leave=False,
        disable=jax.process_index() != 0 or not sys.stderr.isatty(),
    )  # fmt: skip
    cleanup.callback(progress.close)

    def log_train(step):
        """Sums the pending step stats (a host sync), writes and prints the train metrics."""
        nonlocal pending, train_metrics
        skipped = pending[-1]["skipped"]
        summed = _sum(pending)  # the only host sync of the loop
        pending = []
        check_finite()
        train_metrics = task.summarize(summed)
        train_metrics.update(
            grad_norm=summed["grad_norm"] / max(summed["steps"], 1.0),
            learning_rate=float(schedule(step - 1)),
        )
        if nonfinite == "skip":
            train_metrics["skipped_updates"] = float(skipped)
        eta = None
        if step > timer_step:  # else only the (compiling) first step ran since reset
            steps_per_s = (step - timer_step) / (time.perf_counter() - timer)
            eta = (total - step) / steps_per_s
            train_metrics.update(
                steps_per_sec=steps_per_s,
                mfu=flops_per_step * steps_per_s / peak_flops,
                **{f"{task.UNIT}_per_sec": units * steps_per_s},
            )
        writer.write(step, "train", train_metrics)
        if jax.process_index() == 0:
            line = metrics.format_line(step, total, "train", train_metrics, eta_s=eta)
            progress.write(line)

    stopped_by = None
    while step < last_step:
        batch = sharding.shard_batch(next(train_loader), mesh, rules)
        state, stats = train_step(state, batch, dropout_key)
        pending.append(stats)
        step += 1
        unchecked.append((step, {k: stats[k] for k in NONFINITE_STATS}))
        progress.update()
        if step == start_step + 1:  # keep compilation out of the throughput
            jax.block_until_ready(stats)
            logging.info("First step (compilation included): %.1fs", time.perf_counter() - timer)
            timer_step, timer = step, time.perf_counter()
        log_step = step % config.log_every == 0 or step == last_step
        if log_step:
            log_train(step)
        eval_now = (config.eval_every and step % config.eval_every == 0) or step == total
        eval_result = None
        if eval_now:
            check_finite()
            eval_result = evaluate(state.ema_params if ema else state.params, step)
            eval_metrics = eval_result
            writer.write(step, "eval", eval_result)
            if jax.process_index() == 0:
                progress.write(metrics.format_line(step, total, "eval", eval_result))
        every = config.checkpoint.every
        # Preemption and Ctrl-C: every process learns it at the same step (see StopSignals);
        # a signal during evaluation or set-up is seen here too, after the step it interrupted.
        preempted = stop.reached(manager, step, log_step)
        if preempted and pending:  # the steps since the last log line are not lost
            log_train(step)
        if (
            (every and step % every == 0)
            or step == last_step
            or (eval_now and config.checkpoint.best_metric)
            or preempted
        ):
            save(step, eval_result)
        if preempted:
            stopped_by = stop.signal or "preemption"
            logging.warning("Stopped by %s at step %d: checkpoint saved; run the same command "
                            "again to resume.", stopped_by, step)  # fmt: skip
            break
        if eval_now or step == saved_step:  # do not count evaluation and saving as training
            timer_step, timer = step, time.perf_counter()
    progress.close()
    if saved_step != step:
        save(step)
    check_finite()  # a step after the newest save (none: already checked by save)
    curves = None
    if jax.process_index() == 0 and os.path.exists(writer.path):
        from tfjax import plots

        curves, _ = plots.plot_metrics(workdir)
    return {"state": state, "model": model, "tokenizer": tokenizer, "step": step,
            "train": train_metrics, "eval": eval_metrics, "workdir": workdir,
            "checkpoints": os.path.join(workdir, "checkpoints"), "curves": curves,
            "stopped_by": stopped_by}  # fmt: skip
