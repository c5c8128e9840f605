"""Evaluation of a run: eval-split metrics, and what the task's evaluation decodes.

`make_evaluator(exp, eval_loader, tokenizer, workdir)` gives evaluate(params, step) -> metrics,
which the loop calls at eval steps: the task's summarised eval stats over the eval split (or
its first config.eval_steps batches), plus the metrics of the task's optional decode-eval hook
(`tfjax.tasks.decode_eval`: translation adds corpus BLEU of decoded outputs, language models
continue eval prompts); the decoded samples go to WORKDIR/samples.jsonl. What a language
model's samples ask of the model (a prompt, room for decode.max_new_tokens) is checked before
any work by `check_decode` (`tfjax.runner.setup.check_model`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from tfjax import progress, sharding, tasks


def evaluate_split(
    eval_step, params, loader, mesh, rules, max_batches, on_batch=None, *, progress=None
):
    """Sums of eval stats over the eval split (or its first max_batches batches);
    on_batch(params, global batch), when given, sees every batch too (decoding).
    progress(batch) is called after each batch (a progress bar's update)."""
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
        if progress is not None:
            progress(batch)
    if total is None:
        raise ValueError("the eval split gave no batches")
    return jax.tree.map(float, jax.device_get(total))


def eval_dataset(config, data):
    """The DatasetSpec the eval loader reads: `data` (the run's), unpacked when the task's
    decode-eval hook decodes each eval row on its own (translation: one sentence pair per row).
    A property of the task, whether or not this config decodes: the eval metrics of a run are
    then made on the same rows with and without a decode section."""
    hook = tasks.decode_eval_hook(config.task)
    if hook is not None and hook.unpacked_eval_rows and data.packing:
        return dataclasses.replace(data, packing=False)
    return data


def metric_names(config) -> tuple[str, ...]:
    """The names of the metrics an evaluation of `config` gives: its task's summary (read from
    summarize itself, so that no list can drift from it) and those of the decode-eval hook
    when the config decodes."""
    from tfjax.tasks import losses

    task = tasks.get(config.task)
    names = tuple(task.summarize(dict.fromkeys(losses.SUMS, 1.0)))
    hook = tasks.decode_eval_hook(config.task)
    if hook is not None and hook.from_config(config) is not None:
        names += hook.metrics
    return names


def check_decode(config, model, eval_spec: dict) -> None:
    """A language model's eval samples (decode.num_samples > 0) against the model, before any
    work (`eval_spec`: the eval batches' {key: jax.ShapeDtypeStruct}, rows of T tokens): each
    continues a prompt of min(decode.prompt_length, T) tokens (`tfjax.tasks.lm.sample_prompts`),
    which must hold a token and leave room in the model's max_len for decode.max_new_tokens
    (when set; 0, the default, takes what is left up to 32). Else one ValueError naming the
    fields and what fits: found at the first evaluation, it was a traceback (or the wrong
    field named), or max_new_tokens silently cut."""
    d = config.get("decode")
    max_len = getattr(model, "max_len", None)
    if config.task != "lm" or d is None or not d.num_samples or max_len is None:
        return
    if d.prompt_length < 1:
        raise ValueError(
            f"decode.prompt_length={d.prompt_length}: each eval sample continues the first "
            "prompt_length tokens of an eval row; give at least 1, or decode.num_samples=0 "
            "for no samples"
        )
    seq_len = eval_spec["tokens"].shape[1]
    width = min(d.prompt_length, seq_len)
    prompt = f"decode.prompt_length={d.prompt_length}"
    if width < d.prompt_length:
        prompt += f" (cut to the eval rows' {seq_len} tokens)"
    new = d.max_new_tokens
    if not new and width >= max_len:  # the default takes what is left: nothing
        raise ValueError(
            f"{prompt} fills the model's max_len={max_len} (its context length), leaving no "
            f"room to generate; give decode.prompt_length={max_len - 1} or less"
        )
    if width + new > max_len:
        fits = [f"decode.max_new_tokens={max_len - width}"] if width < max_len else []
        fits += [f"decode.prompt_length={max_len - new}"] if new < max_len else []
        raise ValueError(
            f"{prompt} + decode.max_new_tokens={new} = {width + new} tokens exceed the "
            f"model's max_len={max_len} (its context length); make them sum to at most "
            f"{max_len}" + (f": {' or less, or '.join(fits)} or less" if fits else "")
        )


def make_evaluator(exp, eval_loader, tokenizer, workdir: str):
    """evaluate(params, step) -> eval metrics of `exp` (a tfjax.runner.setup.Experiment), with
    those of the task's decode-eval hook (see the module docstring)."""
    config, mesh, rules = exp.config, exp.mesh, exp.rules
    decoder = tasks.decode_eval(config)
    samples_path = os.path.join(workdir, "samples.jsonl")

    def evaluate(params, step):
        outputs, index = [], itertools.count()

        def decode(params, batch):
            outputs.extend(
                decoder.decode(exp, tokenizer, params, batch, step=step, index=next(index))
            )

        task, start = exp.task, time.perf_counter()
        batches = config.eval_steps or eval_loader.num_batches
        units = 0
        per_batch = task.units_per_batch(exp.inputs.eval)
        bar = progress.bar(
            total=batches and batches * per_batch,
            unit=task.UNIT,
            desc=f"eval step {step}",
            unit_scale=True,
        )

        def count(batch):
            nonlocal units
            units += per_batch
            bar.update(per_batch)

        try:
            stats = evaluate_split(
                exp.eval_step,
                params,
                eval_loader,
                mesh,
                rules,
                config.eval_steps,
                decode if decoder else None,
                progress=count,
            )
        finally:
            bar.close()
        logging.info(
            "Evaluation at step %d: %s",
            step,
            progress.throughput(units, task.UNIT, time.perf_counter() - start),
        )
        result = task.summarize(stats)
        samples = []
        if decoder is not None:
            decoded_metrics, samples = decoder.finish(outputs)
            result.update(decoded_metrics)
        if samples and jax.process_index() == 0:
            with open(samples_path, "a") as f:
                for s in samples:
                    f.write(json.dumps({"step": step, **s}) + "\n")
            for s in samples:
                logging.info("Step %d sample: %s", step, s)
        return result

    return evaluate
