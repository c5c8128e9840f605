"""The training loop: config -> sharded jit training and evaluation, checkpoints, metrics.

    from tfjax.runner import train
    config = train.load_config("configs/vit.py:digits")      # as --config= on the command line
    result = train.train_and_evaluate(config, "/tmp/vit_digits")

Data flows one way: `tfjax.runner.setup.prepare` checks the config and paths once and makes the
mesh (`tfjax.sharding`); then the input (`tfjax.data`), the model, optimizer, sharded state and
jitted steps (`setup.build`); `tfjax.runner.checkpoint` restores; the loop runs `train_step`,
and `tfjax.runner.metrics` reports. Everything of a run lives in the workdir:

  run.lock          held by the run that owns the workdir (see `tfjax.runner.workdirs`)
  config.json       the run's config, file and overrides applied, as it is: fields left None
                    stay None (model sizes: the preset's; dataset fields: the catalog's); a
                    resume with a changed one keeps the earlier one as config.<step>.json and
                    logs what changed
  tokenizer.model   the run's SentencePiece model (text datasets not tokenized as bytes), so
                    that decoding needs only the workdir
  checkpoints/      Orbax checkpoints (parameters, optimizer state, step, rng, data position)
  metrics.jsonl     one JSON object per logged step and split
  tensorboard/      TensorBoard events of the same scalars
  profile/          a jax.profiler trace of config.profile's window of steps, and the train
                    step's compiled HLO (profile.dump_hlo); see `tfjax.runner.profiling`

Running again with the same workdir resumes from the newest checkpoint that verifies, data
position included, and continues exactly as if never stopped (see `tfjax.runner.checkpoint`
for what happens to a damaged step). A second run on a workdir that a live run owns refuses to
start.

Stopping and failing safely:
  * SIGTERM or SIGINT (preemption, Ctrl-C) finishes the current step, saves a checkpoint and
    returns with result["stopped_by"] set (see `tfjax.runner.preemption`).
  * A NaN or Inf loss or gradient never updates the state: the update of that step is dropped
    inside train_step. config.nonfinite="error" (the default) then stops the run naming the
    step, before any checkpoint of later state is written; "skip" goes on, logging each skip
    and stopping after config.max_nonfinite_skips skips in a row. The host learns of it at the
    next log step, evaluation or save (no extra host sync).

The model, the sharded state and the jitted steps come from `tfjax.runner.setup` (shared with
`experiments/compile.py`, the benchmarks and the tests); evaluation is `tfjax.runner.evaluation`;
this module only restores, loops, logs and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from tfjax import lora, progress, sharding
from tfjax.interop.core.files import ContentDigest
from tfjax.runner import (
    checkpoint,
    checks,
    chips,
    evaluation,
    executables,
    metrics,
    preemption,
    pretrained,
    profiling,
    setup,
    steps,
    workdirs,
)
from tfjax.runner.setup import load_config  # noqa: F401 (tfjax.runner.train.load_config, documented)
from tfjax.tasks import losses

NONFINITE_STATS = ("nonfinite", "bad_loss", "bad_grad_norm", "skipped", "skipped_in_a_row")
TOKENIZER_FILE = "tokenizer.model"  # in the workdir: the run's SentencePiece model


def restore_model(
    config,
    workdir: str,
    *,
    average_last: int = 1,
    devices=None,
    step: int | None = None,
    merge_lora: bool = False,
    float_base: bool = False,
):
    """(model, params, tokenizer) of a run's newest checkpoint (or `step`), for decoding,
    exporting and analysis.

    The run's set-up (`setup.build`, as training makes it, on the tokenizer training kept) and
    its parameters restored: the model is the Linen model, or with model.api="nnx" its NNX
    model as `setup.for_api` gives it, with its LoRA adapters when config.lora has a rank;
    `merge_lora` folds them into the base kernels and gives the model without them;
    `float_base`: a QLoRA run's quantized kernels dequantized into their float layout, as
    `merge_lora` does before merging. params land on the config's mesh (over `devices`, all by
    default); average_last=N > 1 averages the newest N checkpoints. tokenizer is None for image
    datasets.
    """
    run = setup.prepare(config, workdir, devices, restore=True)
    tokenizer = _restored_tokenizer(run)
    planned = setup.planned_inputs(config, run.data)
    if tokenizer is not None:
        planned = dataclasses.replace(planned, vocab_size=tokenizer.vocab_size)
    exp = setup.build(run, planned)
    target = exp.abstract_state.params
    adapters_only = _adapters_only(exp)
    if adapters_only:  # the checkpoints hold the adapters; the base is config.init_from's
        pretrained.check_base(run.pretrained, run.workdir, config)
        target = lora.split(target)[1]
    params = checkpoint.restore_params(
        workdir, target, average_last=average_last, what="workdir", step=step
    )
    if adapters_only:
        params = lora.combine(lora.split(_base_params(exp, run.workdir))[0], params)
    if exp.lora is None or not merge_lora:
        if exp.lora is not None and exp.lora.base_dtype and float_base:
            params = _dequantized(exp, params)
        return exp.model, params, tokenizer
    if exp.lora.base_dtype:  # QLoRA: the kernels the adapters were trained on, as floats
        params = _dequantized(exp, params)
    merged = lora.merge(params, exp.lora)  # W + A B alpha / r: the model without LoRA
    return setup.for_api(config, exp.base_model, run.task, planned.train), merged, tokenizer


def _restored_tokenizer(run: setup.Prepared):
    """The tokenizer a run trained with: its SentencePiece model kept in the workdir, else the
    dataset's (bytes, a checkpoint's; a workdir from before the copy); None for images."""
    import tfjax.data

    stored = os.path.join(run.workdir, TOKENIZER_FILE)
    if os.path.exists(stored):
        return tfjax.data.SentencePieceTokenizer.load(stored)
    if run.data.images:
        return None
    return tfjax.data.get_tokenizer(run.data, run.config.data_dir or None)


def _dequantized(exp, params):
    """A QLoRA run's params with the quantized base kernels in their float layout."""
    like, _ = setup.quantize_base_fn(exp)
    return lora.dequantized(params, like)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    stop_after_step: int | None = None,
    devices=None,
    checked: setup.Run | None = None,
) -> dict:
    """Trains and evaluates as configured; resumes from the workdir's newest checkpoint.

    Args:
      config: a config as from configs/*.py (fields documented there).
      workdir: where everything of the run is kept (see the module docstring).
      stop_after_step: return after this step, checkpoint saved, as a preempted job would;
        running again continues from there (notebooks train in pieces this way).
      devices: the devices of the mesh; all of them (of every process) when None.
      checked: the config and workdir as `setup.check_run` resolved them (experiments/run.py
        checks before JAX starts), so that nothing is worked out twice; resolved here when None.
    Returns:
      {"state": the final TrainState, "model": the module, "tokenizer": the data's tokenizer
       (None for images), "step": int, "train": last train metrics, "eval": last eval metrics,
       "workdir", "checkpoints": absolute paths, "curves": the PNG of the curves (process 0),
       "stopped_by": None, or the signal ("SIGTERM", "SIGINT") that stopped the run early
       after saving a checkpoint ("preemption" on a process that received none itself)}.
    Raises:
      FloatingPointError: a non-finite loss or gradient (config.nonfinite, max_nonfinite_skips).
    """
    # From the start: a signal during set-up stops after step 1.
    with preemption.StopSignals() as stop:
        # Every check, before the workdir exists.
        run = setup.prepare(config, workdir, devices, run=checked)
        with contextlib.ExitStack() as cleanup:  # closes loaders and writers on errors too
            # One run per workdir, from before anything is written (released last).
            claim = cleanup.enter_context(workdirs.claim(run.workdir))
            data, train_loader, eval_loader = _loaders(run, cleanup)
            inputs = setup.Inputs.from_loaders(config, data, train_loader, eval_loader)
            exp = setup.build(run, inputs)
            if config.get("compiled_dir"):  # the programs compile.py --save wrote, if they match
                exp = executables.use_saved(exp, config.compiled_dir)
            return _run(
                exp,
                run.workdir,
                data,
                train_loader=train_loader,
                eval_loader=eval_loader,
                last_step=config.num_train_steps
                if stop_after_step is None
                else min(config.num_train_steps, stop_after_step),
                cleanup=cleanup,
                stop=stop,
                claim=claim,
            )


def _loaders(run: setup.Prepared, cleanup: contextlib.ExitStack):
    """(the dataset's DatasetSpec, the train and eval loaders of this process's part of the
    global batches), process 0 preparing the data first; the loaders close with `cleanup`."""
    import tfjax.data  # the input pipeline's dependencies are only needed to train

    config, data = run.config, run.data
    shard, shards = sharding.data_shard(run.mesh, run.rules)
    data_dir = config.data_dir or None

    def make():
        if tfjax.data.is_embedded(data.name):  # offline, seconds: build on demand
            tfjax.data.prepare(data.name, data_dir)
        common = dict(process_index=shard, process_count=shards, data_dir=data_dir)
        train_loader = tfjax.data.make_loader(
            data,
            split=data.train_split,
            batch_size=config.batch_size // shards,
            seed=config.seed,
            shuffle=True,
            num_epochs=None,
            **common,
        )
        eval_loader = tfjax.data.make_loader(
            evaluation.eval_dataset(config, data),
            split=data.eval_split,
            batch_size=config.eval_batch_size // shards,
            seed=config.seed,
            shuffle=False,
            num_epochs=1,
            **common,
        )
        return train_loader, eval_loader

    train_loader, eval_loader = preemption.primary_first(make)
    cleanup.callback(eval_loader.close)
    cleanup.callback(train_loader.close)
    return data, train_loader, eval_loader


def _trained_sentencepiece(tokenizer) -> bool:
    from tfjax.data.tokenizers import SentencePieceTokenizer

    return isinstance(tokenizer, SentencePieceTokenizer)


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


class NonFiniteGuard:
    """What a NaN or Inf loss or gradient does (config.nonfinite): the step's update is already
    dropped inside train_step; here the host learns of it, at the loop's existing host syncs
    (log steps, evaluations, saves), and raises for "error" or too many skips in a row."""

    def __init__(self, config):
        self.mode = config.get("nonfinite", "error")
        self.max_skips = config.get("max_nonfinite_skips", 1)
        self._unchecked = []  # (step, the NONFINITE_STATS of its stats), on the devices

    def record(self, step: int, stats: dict) -> None:
        self._unchecked.append((step, {k: stats[k] for k in NONFINITE_STATS}))

    def check(self, saved_step: int | None) -> None:
        """Raises FloatingPointError for a recorded non-finite step that must stop the run; the
        message says which checkpoint is the newest (`saved_step`). A host sync."""
        if not self._unchecked:
            return
        recorded, self._unchecked = self._unchecked, []
        host = jax.device_get([s for _, s in recorded])
        for (step, _), s in zip(recorded, host, strict=True):
            if s["nonfinite"]:
                self._refuse(step, s, saved_step)

    def _refuse(self, step, s, saved_step) -> None:
        what = f"loss {float(s['bad_loss'])}, gradient norm {float(s['bad_grad_norm'])}"
        where = (
            f"the newest checkpoint is step {saved_step}"
            if saved_step is not None
            else "no checkpoint was written"
        )
        if self.mode == "error":
            raise FloatingPointError(
                f"step {step}: non-finite loss or gradient ({what}). The update was not "
                f"applied and no checkpoint of later state was written ({where}). Lower "
                "the learning rate or set nonfinite='skip' to drop such updates."
            )
        in_a_row, skipped = int(s["skipped_in_a_row"]), int(s["skipped"])
        logging.warning(
            "Step %d: non-finite loss or gradient (%s); update skipped (%d in a row, %d in total)",
            step,
            what,
            in_a_row,
            skipped,
        )
        if in_a_row > self.max_skips:
            raise FloatingPointError(
                f"step {step}: {in_a_row} updates in a row skipped for non-finite loss or "
                f"gradient, more than max_nonfinite_skips={self.max_skips} ({what}; {where})."
            )


class TrainMeter:
    """The step stats since the last log line, and what the log line says of them: the task's
    metrics, gradient norm, learning rate, skipped updates, and the throughput since the clock
    was last restarted (compilation, evaluation and saving are not training time)."""

    def __init__(self, exp, *, start_step: int):
        self.exp = exp
        config = exp.config
        peak = chips.peak_flops(exp.mesh, checks.COMPUTE_DTYPES[config.dtype])
        self.peak_flops = peak.flops
        logging.info(
            "Model %s: %s parameters; mesh %s; %.3g model FLOPs per step; peak %.3g FLOP/s (%s)",
            config.model.name,
            f"{exp.num_params:,}",
            dict(exp.mesh.shape),
            exp.flops_per_step,
            peak.flops,
            peak.source,
        )
        self.units_per_step = exp.task.units_per_batch(exp.inputs.train)
        self.report_skips = exp.config.get("nonfinite", "error") == "skip"
        self.pending = []
        self.restart_clock(start_step)

    def add(self, stats: dict) -> None:
        self.pending.append(stats)

    def restart_clock(self, step: int) -> None:
        self.clock_step, self.clock = step, time.perf_counter()

    def summarize(self, step: int) -> tuple[dict, float | None]:
        """(train metrics of the pending steps, seconds to the end); a host sync."""
        task, total = self.exp.task, self.exp.config.num_train_steps
        host = jax.device_get(self.pending)  # the only host sync of the loop
        self.pending = []
        summed = {k: float(np.sum([s[k] for s in host], dtype=np.float64)) for k in host[0]}
        result = task.summarize(summed)
        # The model's auxiliary losses (a mixture of experts'), per weighted token.
        aux = [k for k in summed if k.startswith(steps.AUX_PREFIX)]
        result.update({k: losses.ratio(summed, k) for k in aux})
        result.update(
            grad_norm=summed["grad_norm"] / max(summed["steps"], 1.0),
            learning_rate=float(self.exp.schedule(step - 1)),
        )
        if self.report_skips:
            result["skipped_updates"] = float(host[-1]["skipped"])
        if step <= self.clock_step:  # only the (compiling) first step ran since the restart
            return result, None
        steps_per_s = (step - self.clock_step) / (time.perf_counter() - self.clock)
        result.update(
            steps_per_sec=steps_per_s,
            mfu=self.exp.flops_per_step * steps_per_s / self.peak_flops,
            **{f"{task.UNIT}_per_sec": self.units_per_step * steps_per_s},
        )
        return result, (total - step) / steps_per_s


class Saver:
    """The loop's checkpoints: never one after a step that must stop the run (the non-finite
    guard is checked first). `saved_step` is the newest step saved (or resumed from)."""

    def __init__(
        self,
        manager,
        train_loader,
        guard: NonFiniteGuard,
        saved_step: int | None,
        adapters_only: bool = False,
    ):
        self.manager, self.train_loader, self.guard = manager, train_loader, guard
        self.saved_step, self.adapters_only = saved_step, adapters_only

    def save(self, step: int, state, rng, eval_result: dict | None = None) -> None:
        self.guard.check(self.saved_step)
        start = time.perf_counter()
        finite = {k: v for k, v in (eval_result or {}).items() if math.isfinite(v)}
        checkpoint.save_train_state(
            self.manager,
            step,
            _checkpointed(state, self.adapters_only),
            rng,
            data_state=self.train_loader.get_state(),
            metrics=finite or None,
        )
        self.saved_step = step
        logging.info("Checkpoint %d: the loop waited %.3fs", step, time.perf_counter() - start)


def _restore(exp, workdir: str, data, train_loader, cleanup):
    """(checkpoint manager, state, dropout key, the resumed step or None): the newest usable
    checkpoint, else a new state (with config.init_from's parameters when set). Every check
    comes before anything in the workdir is written."""
    config, tokenizer = exp.config, train_loader.tokenizer
    _check_workdir_tokenizer(workdir, tokenizer)
    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), config.checkpoint)
    cleanup.push(_closing(manager))  # pending writes end, TRASH is emptied
    # Keys are made inside jit: in a multi-process run every array the loop touches must be a
    # global array, replicated over the mesh.
    init_key, dropout_key = jax.jit(
        lambda: tuple(jax.random.split(jax.random.key(config.seed))),
        out_shardings=(exp.replicated, exp.replicated),
    )()
    adapters_only = _adapters_only(exp)
    restore_step = checkpoint.restore_step_to_apply(config, workdir)
    if restore_step != config.checkpoint.get("restore_step"):
        logging.info(
            "checkpoint.restore_step=%d took effect in an earlier run of %s (its config.json): "
            "resuming from the newest step",
            config.checkpoint.restore_step,
            workdir,
        )
    resumed = checkpoint.restore_train_state(
        manager,
        _checkpointed(exp.abstract_state, adapters_only),
        exp.abstract_rng,
        restore_step=restore_step,
    )
    content = None  # the loaded base's ContentDigest (recorded by `pretrained.keep`)
    if resumed is None:  # config.init_from's parameters, the rest initialised
        known = None
        if config.init_from:
            content = ContentDigest() if exp.pretrained is not None else None
            known = _initial_params(exp, content)
        state, step = exp.init(init_key, known), None
    else:
        state, dropout_key, step = resumed.state, resumed.rng, resumed.step
        if adapters_only:  # the adapters on their base, loaded again from config.init_from
            pretrained.check_base(exp.pretrained, workdir, config)
            state = _with_base(state, _base_params(exp, workdir))
        if resumed.data_state is not None:
            _set_data_position(train_loader, resumed.data_state, manager, step)
        else:
            logging.warning(
                "Checkpoint %d has no data position for %d processes; the data starts over.",
                step,
                jax.process_count(),
            )
        # Everything fits: newer steps (unusable, or passed over by restore_step) would collide
        # with this run's next saves, so they are moved aside, files unchanged.
        checkpoint.set_aside_after(manager, step)
        logging.info("Resumed from %s/checkpoints/%d", workdir, step)
    workdirs.record_config(workdir, config, step)
    if exp.pretrained is not None:  # resuming, decoding and exporting then need the workdir only
        pretrained.keep(exp.pretrained, workdir, content.hexdigest() if content else None)
    pretrained.keep_classes(data, workdir)
    stored = os.path.join(workdir, TOKENIZER_FILE)
    # SentencePiece only (bytes need no file, a checkpoint's tokenizer is kept in pretrained/);
    # a stored one was checked equal above.
    if (
        jax.process_index() == 0
        and _trained_sentencepiece(tokenizer)
        and not os.path.exists(stored)
    ):
        tokenizer.save(stored)
    return manager, state, dropout_key, step


def _closing(manager):
    """The exit callback that closes the checkpoints (`checkpoint.close`): when the run is
    already failing, an error of the last write is logged, never raised over the first one."""

    def close(exc_type, exc, tb) -> bool:
        try:
            checkpoint.close(manager)
        except Exception as e:
            if exc is None:
                raise
            logging.error("The last checkpoint write failed too: %s", e)
        return False

    return close


def _set_data_position(train_loader, data_state: dict, manager, step: int) -> None:
    """The loader continues from a checkpoint's data position, which must be this loader's."""
    try:
        train_loader.set_state(data_state)
    except (ValueError, KeyError, TypeError) as e:
        raise checkpoint.CheckpointMismatchError(
            f"checkpoint {manager.directory}/{step}: its data position does not fit this run's "
            f"data loader: {e if isinstance(e, ValueError) else repr(e)}. The settings of the "
            "workdir's last run are in its config.json; use them, or another workdir. Nothing "
            "was moved or deleted."
        ) from None


def _adapters_only(exp) -> bool:
    """Whether the run's checkpoints hold only its LoRA adapters: a LoRA run from a Hugging Face
    checkpoint, whose base is that checkpoint's (named in workdir/pretrained, see
    `pretrained.check_base`), loaded again on resume, decoding and export."""
    return exp.base_model is not None and exp.pretrained is not None


def _checkpointed(state, adapters_only: bool):
    """What a checkpoint holds of a TrainState (or its abstract): with `adapters_only`, the
    params and their EMA without the frozen base."""
    if not adapters_only:
        return state

    def adapters(params):
        return None if params is None else lora.split(params)[1]

    return state.replace(params=adapters(state.params), ema_params=adapters(state.ema_params))


def _with_base(state, known):
    """A restored adapters-only TrainState with the base parameters of `known` (`_initial_params`:
    None at the adapters) under its params and EMA (a copy: the step donates both)."""
    base = lora.split(known)[0]
    params = lora.combine(base, state.params)
    ema = state.ema_params
    if ema is not None:
        ema = lora.combine(jax.tree.map(jnp.copy, base), ema)
    return state.replace(params=params, ema_params=ema)


def _base_params(exp, workdir: str):
    """An adapters-only run's base (`_initial_params`), loaded again from config.init_from,
    whose content must be what the adapters were trained on (`pretrained.check_base_content`)."""
    content = ContentDigest()
    params = _initial_params(exp, content)
    pretrained.check_base_content(workdir, exp.config, content.hexdigest())
    return params


def _initial_params(exp, content=None):
    """config.init_from's parameters, placed on the run's shardings, for `exp.init`: a Hugging
    Face checkpoint's weights (None where the run's model has more: LoRA adapters, a new head;
    each tensor given to `content`, a ContentDigest, as it is read) or another run's newest
    parameters."""
    config = exp.config
    if exp.pretrained is None:
        return checkpoint.restore_params(config.init_from, exp.abstract_state.params)
    lora_config = exp.lora
    if lora_config is not None and lora_config.base_dtype:  # QLoRA: loaded, then quantized
        abstract, quantize = setup.quantize_base_fn(exp)
        floats = pretrained.load_params(exp.pretrained, exp.base_model, abstract, content)
        logging.info(
            "Loaded the %s weights of %s; the targeted kernels are stored as %s",
            exp.pretrained.architecture,
            config.init_from,
            lora_config.base_dtype,
        )
        base, adapters = lora.split(quantize(floats, jax.random.key(config.seed)))
        return lora.combine(base, jax.tree.map(lambda _: None, adapters))  # initialised by init
    loaded = pretrained.load_params(exp.pretrained, exp.model, exp.abstract_state.params, content)
    logging.info("Loaded the %s weights of %s", exp.pretrained.architecture, config.init_from)
    if exp.pretrained.vision and getattr(exp.model, "num_classes", None) is not None:
        logging.info(
            "A new head for %d classes (pool=%r) initialised; everything else loaded from %s",
            exp.model.num_classes,
            exp.model.pool,
            config.init_from,
        )
    return loaded


def _run(exp, workdir, data, *, train_loader, eval_loader, last_step, cleanup, stop, claim):
    """train_and_evaluate from the point where the data loaders and the set-up exist (`data`:
    the run's DatasetSpec); `claim` (the workdir's, `workdirs.Claim`) learns when training
    starts."""
    config, total = exp.config, exp.config.num_train_steps
    tokenizer = train_loader.tokenizer
    primary = jax.process_index() == 0

    # ----------------------------------------------------------------------------- restore
    manager, state, dropout_key, resumed_step = _restore(exp, workdir, data, train_loader, cleanup)
    start_step = int(state.step)
    writer = metrics.MetricWriter(workdir, resume_step=start_step)
    cleanup.callback(writer.close)
    evaluate = evaluation.make_evaluator(exp, eval_loader, tokenizer, workdir)
    guard = NonFiniteGuard(config)
    saver = Saver(manager, train_loader, guard, resumed_step, _adapters_only(exp))
    meter = TrainMeter(exp, start_step=start_step)
    # The profiler window (config.profile): a trace of whole steps and the step's HLO.
    window = profiling.Window(config, workdir, first_step=start_step + 1, last_step=last_step)
    cleanup.callback(window.close)  # a trace still running when the run stops early ends
    # A progress bar in a terminal (process 0); logs and notebooks get the periodic lines only.
    bar = progress.bar(total=last_step, initial=start_step, unit="step")
    cleanup.callback(bar.close)

    def log_train(step):
        guard.check(saver.saved_step)
        result, eta = meter.summarize(step)
        writer.write(step, "train", result)
        if primary:
            bar.write(metrics.format_line(step, total, "train", result, eta_s=eta))
        return result

    # -------------------------------------------------------------------------------- loop
    train_metrics, eval_metrics, stopped_by, step = {}, {}, None, start_step
    if resumed_step is None and config.init_from:  # where fine-tuning starts from, as step 0
        eval_metrics = evaluate(state.params, 0)
        writer.write(0, "eval", eval_metrics)
        if primary:
            bar.write(metrics.format_line(0, total, "eval", eval_metrics))
        meter.restart_clock(start_step)
    claim.started()  # from here a failure keeps the workdir (its logs, metrics, checkpoints)
    while step < last_step:
        batch = sharding.shard_batch(next(train_loader), exp.mesh, exp.rules)
        if step == start_step:
            window.maybe_compile(exp.train_step, (state, batch, dropout_key))
        window.begin(step + 1, state)
        state, stats = exp.train_step(state, batch, dropout_key)
        step += 1
        meter.add(stats)
        guard.record(step, stats)
        bar.update()
        if step == start_step + 1:  # keep compilation out of the throughput
            jax.block_until_ready(stats)
            logging.info(
                "First step (compilation included): %.1fs", time.perf_counter() - meter.clock
            )
            meter.restart_clock(step)
        if window.end(step, (state, stats)):  # the trace's export is not training time
            meter.restart_clock(step)
        log_step = step % config.log_every == 0 or step == last_step
        if log_step:
            train_metrics = log_train(step)
        eval_now = (config.eval_every and step % config.eval_every == 0) or step == total
        eval_result = None
        if eval_now:
            guard.check(saver.saved_step)
            params = state.params if state.ema_params is None else state.ema_params
            eval_result = eval_metrics = evaluate(params, step)
            writer.write(step, "eval", eval_result)
            if primary:
                bar.write(metrics.format_line(step, total, "eval", eval_result))
        # Preemption and Ctrl-C: every process learns it at the same step (see StopSignals); a
        # signal during evaluation or set-up is seen here too, after the step it interrupted.
        preempted = stop.reached(manager, step, log_step)
        if preempted and meter.pending:  # the steps since the last log line are not lost
            train_metrics = log_train(step)
        every = config.checkpoint.every
        if (
            (every and step % every == 0)
            or step == last_step
            or (eval_now and config.checkpoint.best_metric)
            or preempted
        ):
            saver.save(step, state, dropout_key, eval_result)
        if preempted:
            stopped_by = stop.signal or "preemption"
            logging.warning(
                "Stopped by %s at step %d: checkpoint saved; run the same command again to resume.",
                stopped_by,
                step,
            )
            break
        if eval_now or step == saver.saved_step:  # evaluation and saving are not training time
            meter.restart_clock(step)

    # ------------------------------------------------------------------------------ finish
    bar.close()
    window.close()  # a window cut short by a stop signal
    if saver.saved_step != step:
        saver.save(step, state, dropout_key)
    guard.check(saver.saved_step)  # a step after the newest save (none: already checked by save)
    curves = None
    if primary and os.path.exists(writer.path):
        from tfjax.runner import plots

        curves, _ = plots.plot_metrics(workdir)
    return {
        "state": state,
        "model": exp.model,
        "tokenizer": tokenizer,
        "step": step,
        "train": train_metrics,
        "eval": eval_metrics,
        "workdir": workdir,
        "checkpoints": os.path.join(workdir, "checkpoints"),
        "curves": curves,
        "stopped_by": stopped_by,
    }
