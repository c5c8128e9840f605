"""What differs per task: which batch keys feed the model, the loss, and the metrics.

A task is a module here, chosen by `config.task` with importlib (`tfjax.tasks.lm`); there is
no registry. Each module provides:

  UNIT                      what throughput counts: "examples" or "tokens"
  model_inputs(batch)       -> (args, kwargs) for `model.apply(variables, *args, **kwargs)`
  labels_and_weights(batch) -> (labels, weights): what each output position predicts ([B] or
                               [B, T] ints) and how much it counts (0: nothing to predict)
  loss_and_stats(logits, batch, *, label_smoothing, z_loss)
                            -> (loss_sum, stats): the summed loss whose gradient is taken
                               (normalised by stats["weight"] over the whole global batch, so
                               gradient accumulation equals one big batch) and a dict of
                               scalar sums that add up over micro-batches, steps and eval batches:
                               `losses.cross_entropy_sums` of the logits against
                               labels_and_weights(batch)
  summarize(stats)          -> {metric name: float} from summed stats (host side)
  units_per_batch(batch)    -> examples or tokens in a batch, for throughput

and optionally, when its evaluation also generates text (translation: BLEU; lm: samples):

  DECODE_EVAL               a `decoding.DecodeEval` subclass: what an evaluation decodes, how
                               it is scored and logged, and whether eval rows are unpacked;
                               see `decode_eval` and `decode_eval_hook` below

The task names are also the dataset's (`tfjax.data`): a dataset lists the tasks it serves and
makes the batches of the task it is resolved for. Token id 0 is padding everywhere; padding
rows and tokens get weight 0.

With config.loss.chunks > 1 (TOKEN_TASKS only) the train and eval steps (`tfjax.runner.steps`) take
the model's final hidden states (`apply_head=False`) and its output head (the `logits` method)
and make the same sums with `losses.chunked_cross_entropy_sums` against
labels_and_weights(batch): labels and weights are defined once, for both paths.
"""

import importlib

TASKS = ("classification", "lm", "mlm", "translation")
# Tasks that predict a token at every position through a model's vocabulary head: their loss
# can be made in slices of T (config.loss.chunks, `losses.chunked_cross_entropy_sums`).
TOKEN_TASKS = ("lm", "mlm", "translation")


def get(name: str):
    """The task module `tfjax.tasks.<name>`."""
    if name not in TASKS:
        raise ValueError(f"task={name!r} is unknown; allowed: {TASKS}")
    return importlib.import_module(f"tfjax.tasks.{name}")


def decode_eval_hook(name: str):
    """The decode-eval hook of task `name` (its DECODE_EVAL, a `decoding.DecodeEval` subclass),
    or None: what the task decodes in eval whenever a config asks it to."""
    return getattr(get(name), "DECODE_EVAL", None)


def decode_eval(config):
    """What an evaluation of `config` decodes beside its metrics (a `decoding.DecodeEval` made
    by the task's hook from the config), or None."""
    hook = decode_eval_hook(config.task)
    return hook.from_config(config) if hook is not None else None
