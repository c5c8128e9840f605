"""Evaluation of a run: eval-split metrics, and for generating tasks BLEU or sample outputs.

`make_evaluator(exp, eval_loader, tokenizer, workdir)` gives evaluate(params, step) -> metrics,
which the loop calls at eval steps: the task's summarised eval stats over the eval split (or
its first config.eval_steps batches); translation adds corpus BLEU of decoded outputs
(config.decode: greedy or beam), language models sample continuations of eval prompts; the
decoded outputs go to WORKDIR/samples.jsonl.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from tfjax import metrics, sharding
from tfjax.experiment import DECODE_METHODS


def evaluate_split(eval_step, params, loader, mesh, rules, max_batches, on_batch=None, *,
                   progress=None):  # fmt: skip
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


# ----------------------------------------------------------------------------- decoding in eval
def gather(x) -> np.ndarray:
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
        tokens, targets = gather(tokens), gather(batch["targets"])
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
    rows = gather(batch["tokens"])[: d.num_samples, : d.prompt_length]
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
    tokens = gather(tokens)
    return [(tokenizer.decode(r), tokenizer.decode(t)) for r, t in zip(rows, tokens, strict=True)]


def decoding(config) -> str | None:
    """What an evaluation of `config` decodes: "bleu" (translation: every eval batch),
    "samples" (LM: continuations of decode.num_samples prompts) or None."""
    d = config.get("decode")
    if d is None:
        return None
    if config.task == "translation":
        return "bleu"
    return "samples" if config.task == "lm" and d.num_samples else None


def make_evaluator(exp, eval_loader, tokenizer, workdir: str):
    """evaluate(params, step) -> eval metrics of `exp` (a tfjax.experiment.Experiment); BLEU
    and samples when the task decodes (see the module docstring)."""
    config, mesh, rules, model = exp.config, exp.mesh, exp.rules, exp.model
    decode_config = config.get("decode")
    bleu_fn = None
    if decoding(config) == "bleu":
        target_len = eval_loader.element_spec["targets"].shape[1]
        bleu_fn = make_bleu_fn(
            model, tokenizer, decode_config, mesh=mesh, rules=rules,
            max_new_tokens=decode_config.max_new_tokens or target_len,
        )  # fmt: skip
    samples_path = os.path.join(workdir, "samples.jsonl")

    def evaluate(params, step):
        hyps, refs, first = [], [], []

        def on_batch(params, batch):
            if not first:
                first.append(batch)
            if bleu_fn is not None:
                h, r = bleu_fn(params, batch)
                hyps.extend(h)
                refs.extend(r)

        task, start = exp.task, time.perf_counter()
        batches = config.eval_steps or eval_loader.num_batches
        units = 0
        per_batch = task.units_per_batch(exp.inputs.eval)
        bar = metrics.progress(total=batches and batches * per_batch, unit=task.UNIT,
                               desc=f"eval step {step}", unit_scale=True)  # fmt: skip

        def count(batch):
            nonlocal units
            units += per_batch
            bar.update(per_batch)

        try:
            stats = evaluate_split(exp.eval_step, params, eval_loader, mesh, rules,
                                   config.eval_steps, on_batch, progress=count)  # fmt: skip
        finally:
            bar.close()
        logging.info("Evaluation at step %d: %s", step,
                     metrics.throughput(units, task.UNIT, time.perf_counter() - start))  # fmt: skip
        result = task.summarize(stats)
        samples = []
        if bleu_fn is not None:
            result["bleu"] = corpus_bleu(hyps, refs)
            samples = [{"output": h, "reference": r} for h, r in zip(hyps, refs, strict=True)]
            samples = samples[: decode_config.num_samples]
        elif decoding(config) == "samples":
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

    return evaluate
