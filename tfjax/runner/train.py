"""The training loop: config -> sharded jit training and evaluation, checkpoints, metrics.

    from tfjax.runner import train
    config = train.load_config("configs/vit.py:digits")      # as --config= on the command line
    result = train.train_and_evaluate(config, "/tmp/vit_digits")

Data flows one way: the config gives the mesh (`tfjax.sharding`), the input (`tfjax.data`),
the model (`tfjax.models.<config.model.name>`, by importlib), the loss (`tfjax.tasks`), the
optimizer (`tfjax.runner.optim`); `tfjax.runner.checkpoint` restores; then the loop runs
`train_step`, and `tfjax.runner.metrics` reports. Everything of a run lives in the workdir:

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
position included, and continues exactly as if never stopped (see `tfjax.runner.checkpoint` for what
happens to a damaged step). A second run on a workdir that a live run owns refuses to start.

Stopping and failing safely:
  * SIGTERM or SIGINT (preemption, Ctrl-C) finishes the current step, saves a checkpoint and
    returns with result["stopped_by"] set (see `tfjax.runner.preemption`).
  * A NaN or Inf loss or gradient never updates the state: the update of that step is dropped
    inside train_step. config.nonfinite="error" (the default) then stops the run naming the
    step, before any checkpoint of later state is written; "skip" goes on, logging each skip
    and stopping after config.max_nonfinite_skips skips in a row. The host learns of it at the
    next log step, evaluation or save (no extra host sync).

The model, the sharded state and the jitted steps come from `tfjax.runner.setup.set_up`
(shared with `experiments/compile.py`, the benchmarks and the tests); evaluation is
`tfjax.runner.evaluation`; this module only restores, loops, logs and saves.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from tfjax import progress, sharding, tasks
from tfjax.runner import (
    checkpoint,
    checks,
    chips,
    evaluation,
    metrics,
    preemption,
    profiling,
    setup,
    steps,
    workdirs,
)
from tfjax.runner.setup import load_config  # noqa: F401 (tfjax.runner.train.load_config, documented)

NONFINITE_STATS = ("nonfinite", "bad_loss", "bad_grad_norm", "skipped", "skipped_in_a_row")
TOKENIZER_FILE = "tokenizer.model"  # in the workdir: the run's SentencePiece model


def restore_model(config, workdir: str, *, average_last: int = 1, devices=None):
    """(model, params, tokenizer) of a run's newest checkpoint, for decoding and analysis.

    The model is built from `config` as training built it; params land on the config's mesh
    (over `devices`, all by default); average_last=N > 1 averages the newest N checkpoints.
    tokenizer is None for image datasets.
    """
    import tfjax.data

    checks.check_config(config)
    checks.check_paths(config, workdir, restore=True)
    task = tasks.get(config.task)
    rules = sharding.check_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, devices)
    data = tfjax.data.dataset_spec(config)
    workdir = os.path.expanduser(workdir)
    tokenizer = None
    stored = os.path.join(workdir, TOKENIZER_FILE)
    if os.path.exists(stored):
        tokenizer = tfjax.data.SentencePieceTokenizer.load(stored)
    elif not data.images:  # bytes, or a workdir from before the copy
        tokenizer = tfjax.data.get_tokenizer(data, config.data_dir or None)
    model = setup.build_model(
        config,
        vocab_size=tokenizer.vocab_size if tokenizer is not None else None,
        num_classes=data.num_classes,
    )
    spec = tfjax.data.element_spec(data, 1)
    target, _ = setup.abstract_params(model, task, spec, mesh=mesh, rules=rules)
    params = checkpoint.restore_params(workdir, target, average_last=average_last, what="workdir")
    return model, params, tokenizer


def _sum(stats_list):
    host = jax.device_get(stats_list)
    return {k: float(np.sum([s[k] for s in host], dtype=np.float64)) for k in host[0]}


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    stop_after_step: int | None = None,
    devices=None,
) -> dict:
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
    # From the start: a signal during set-up stops after step 1.
    with preemption.StopSignals() as stop:
        return _train_and_evaluate(
            config, workdir, stop_after_step=stop_after_step, devices=devices, stop=stop
        )


def _train_and_evaluate(config, workdir, *, stop_after_step, devices, stop):
    import tfjax.data  # the input pipeline's dependencies are only needed to train

    checks.check_config(config)
    checks.check_paths(config, workdir)  # before the lock (which creates the workdir)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    rules = sharding.check_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, devices)
    # set_up checks these again; here they fail before any dataset or tokenizer is built.
    checks.check_batch("batch_size", config.batch_size, mesh, rules, config.num_microbatches)
    checks.check_batch("eval_batch_size", config.eval_batch_size, mesh, rules)

    # ---- data: each process loads its distinct part of the global batch
    data = tfjax.data.dataset_spec(config)  # the loaders, their element specs and eval rows
    shard, shards = sharding.data_shard(mesh, rules)
    data_dir = config.data_dir or None

    def loaders():
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

    with contextlib.ExitStack() as cleanup:  # closes loaders and checkpoint writers on errors too
        # One run per workdir, from before anything is written (released last).
        cleanup.enter_context(workdirs.claim(workdir))
        train_loader, eval_loader = preemption.primary_first(loaders)
        cleanup.callback(eval_loader.close)
        cleanup.callback(train_loader.close)
        inputs = setup.Inputs.from_loaders(config, data, train_loader, eval_loader)
        exp = setup.set_up(config, mesh, inputs=inputs)
        return _run(
            exp,
            workdir,
            train_loader=train_loader,
            eval_loader=eval_loader,
            stop_after_step=stop_after_step,
            cleanup=cleanup,
            stop=stop,
        )


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


def _run(exp, workdir, *, train_loader, eval_loader, stop_after_step, cleanup, stop):
    """train_and_evaluate from the point where the data loaders and the set-up exist."""
    config, mesh, model, task = exp.config, exp.mesh, exp.model, exp.task
    tokenizer = train_loader.tokenizer
    rules, abstract_state = exp.rules, exp.abstract_state
    train_step, schedule, repl = exp.train_step, exp.schedule, exp.replicated
    ema = config.optim.ema_decay > 0

    # ---- restore (every check before anything in the workdir is written)
    _check_workdir_tokenizer(workdir, tokenizer)
    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), config.checkpoint)
    cleanup.callback(checkpoint.close, manager)  # pending writes end, TRASH is emptied
    # Keys are made and converted inside jit: in a multi-process run every array the loop
    # touches must be a global array, replicated over the mesh.
    init_key, dropout_key = jax.jit(
        lambda: tuple(jax.random.split(jax.random.key(config.seed))), out_shardings=(repl, repl)
    )()
    key_data = jax.jit(jax.random.key_data, out_shardings=repl)

    def ckpt_state(state, key):
        d = dict(
            step=state.step,
            opt_state=state.opt_state,
            rng=key_data(key),
            skipped=state.skipped,
            skipped_in_a_row=state.skipped_in_a_row,
        )
        if ema:
            d["ema_params"] = state.ema_params
        return d

    rng_shape = jax.eval_shape(jax.random.key_data, dropout_key)
    abstract_ckpt_state = dict(
        step=abstract_state.step,
        opt_state=abstract_state.opt_state,
        rng=jax.ShapeDtypeStruct(rng_shape.shape, rng_shape.dtype, sharding=repl),
        skipped=abstract_state.skipped,
        skipped_in_a_row=abstract_state.skipped_in_a_row,
    )
    if ema:
        abstract_ckpt_state["ema_params"] = abstract_state.ema_params
    # The newest step that reads and verifies (or checkpoint.restore_step); checkpoints written
    # before the skip counters existed have none: they start at 0.
    latest, restored = checkpoint.restore_newest(
        manager,
        restore_step=config.checkpoint.get("restore_step"),
        abstract_params=abstract_state.params,
        abstract_state=abstract_ckpt_state,
        optional_state=("skipped", "skipped_in_a_row"),
    )
    if latest is not None:
        # Newer steps (unusable, or passed over by restore_step) would collide with this
        # run's next saves: moved aside, files unchanged.
        checkpoint.set_aside(manager, [k for k in manager.all_steps() if k > latest])
        s = restored["state"]
        zero = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=repl)
        state = steps.TrainState(
            step=s["step"],
            params=restored["params"],
            opt_state=s["opt_state"],
            ema_params=s.get("ema_params"),
            skipped=s["skipped"] if "skipped" in s else zero(),
            skipped_in_a_row=s["skipped_in_a_row"] if "skipped_in_a_row" in s else zero(),
        )
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
        state = exp.init(init_key)
        if config.init_from:
            params = checkpoint.restore_params(config.init_from, abstract_state.params)
            state = state.replace(params=params, ema_params=params if ema else None)

    start_step = int(state.step)
    workdirs.record_config(workdir, config, start_step if latest is not None else None)
    if jax.process_index() == 0:
        stored = os.path.join(workdir, TOKENIZER_FILE)
        # SentencePiece only (bytes need no file); a stored one was checked equal above.
        if hasattr(tokenizer, "save") and not os.path.exists(stored):
            tokenizer.save(stored)
    writer = metrics.MetricWriter(workdir, resume_step=start_step)
    cleanup.callback(writer.close)

    evaluate = evaluation.make_evaluator(exp, eval_loader, tokenizer, workdir)

    # ---- throughput accounting
    units = task.units_per_batch(exp.inputs.train)
    flops_per_step = exp.flops_per_step
    peak_flops = chips.peak_flops(mesh, checks.COMPUTE_DTYPES[config.dtype])
    logging.info(
        "Model %s: %s parameters; mesh %s; %.3g model FLOPs per step; peak %.3g FLOP/s (%s)",
        config.model.name,
        f"{exp.num_params:,}",
        dict(mesh.shape),
        flops_per_step,
        peak_flops.flops,
        peak_flops.source,
    )

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
            where = (
                f"the newest checkpoint is step {saved_step}"
                if saved_step is not None
                else "no checkpoint was written"
            )
            if nonfinite == "error":
                raise FloatingPointError(
                    f"step {k}: non-finite loss or gradient ({what}). The update was not "
                    f"applied and no checkpoint of later state was written ({where}). Lower "
                    "the learning rate or set nonfinite='skip' to drop such updates."
                )
            in_a_row, skipped = int(s["skipped_in_a_row"]), int(s["skipped"])
            logging.warning(
                "Step %d: non-finite loss or gradient (%s); update skipped (%d in a "
                "row, %d in total)",
                k,
                what,
                in_a_row,
                skipped,
            )
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
            manager,
            step,
            params=state.params,
            state=ckpt_state(state, dropout_key),
            data_state=train_loader.get_state(),
            metrics={k: v for k, v in (eval_result or {}).items() if math.isfinite(v)} or None,
        )
        saved_step = step
        logging.info("Checkpoint %d: the loop waited %.3fs", step, time.perf_counter() - start)

    # The profiler window (config.profile): a trace of whole steps and the step's HLO.
    window = profiling.Window(config, workdir, first_step=start_step + 1, last_step=last_step)
    cleanup.callback(window.close)  # a trace still running when the run stops early ends
    # A progress bar in a terminal (process 0); logs and notebooks get the periodic lines only.
    bar = progress.bar(total=last_step, initial=start_step, unit="step")
    cleanup.callback(bar.close)

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
                mfu=flops_per_step * steps_per_s / peak_flops.flops,
                **{f"{task.UNIT}_per_sec": units * steps_per_s},
            )
        writer.write(step, "train", train_metrics)
        if jax.process_index() == 0:
            line = metrics.format_line(step, total, "train", train_metrics, eta_s=eta)
            bar.write(line)

    stopped_by = None
    while step < last_step:
        batch = sharding.shard_batch(next(train_loader), mesh, rules)
        if step == start_step:
            window.maybe_compile(train_step, (state, batch, dropout_key))
        window.begin(step + 1, state)
        state, stats = train_step(state, batch, dropout_key)
        pending.append(stats)
        step += 1
        unchecked.append((step, {k: stats[k] for k in NONFINITE_STATS}))
        bar.update()
        if step == start_step + 1:  # keep compilation out of the throughput
            jax.block_until_ready(stats)
            logging.info("First step (compilation included): %.1fs", time.perf_counter() - timer)
            timer_step, timer = step, time.perf_counter()
        if window.end(step, (state, stats)):  # the trace's export is not training time
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
                bar.write(metrics.format_line(step, total, "eval", eval_result))
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
            logging.warning(
                "Stopped by %s at step %d: checkpoint saved; run the same command again to resume.",
                stopped_by,
                step,
            )
            break
        if eval_now or step == saved_step:  # do not count evaluation and saving as training
            timer_step, timer = step, time.perf_counter()
    bar.close()
    window.close()  # a window cut short by a stop signal
    if saved_step != step:
        save(step)
    check_finite()  # a step after the newest save (none: already checked by save)
    curves = None
    if jax.process_index() == 0 and os.path.exists(writer.path):
        from tfjax.runner import plots

        curves, _ = plots.plot_metrics(workdir)
    return {
        "state": state,
        "model": model,
        "tokenizer": tokenizer,
        "step": step,
        "train": train_metrics,
        "eval": eval_metrics,
        "workdir": workdir,
        "checkpoints": os.path.join(workdir, "checkpoints"),
        "curves": curves,
        "stopped_by": stopped_by,
    }
