"""What differs per task: which batch keys feed the model, the loss, and the metrics.

A task is a module here, chosen by `config.task` with importlib (`tfjax.tasks.lm`); there is
no registry. Each module provides:

  UNIT                      what throughput counts: "examples" or "tokens"
  model_inputs(batch)       -> (args, kwargs) for `model.apply(variables, *args, **kwargs)`
  loss_and_stats(logits, batch, *, label_smoothing, z_loss)
                            -> (loss_sum, stats): the summed loss whose gradient is taken
                               (normalised by stats["weight"] over the whole global batch, so
                               gradient accumulation equals one big batch) and a dict of
                               scalar sums that add up over micro-batches, steps and eval batches
  summarize(stats)          -> {metric name: float} from summed stats (host side)
  units_per_batch(batch)    -> examples or tokens in a batch, for throughput
  DATA_TASKS                the `tfjax.data` tasks whose batches this task accepts

Token id 0 is padding everywhere; padding rows and tokens get weight 0.
"""

import importlib

TASKS = ("classification", "lm", "mlm", "translation")


def get(name: str):
    """The task module `tfjax.tasks.<name>`."""
    if name not in TASKS:
        raise ValueError(f"task={name!r} is unknown; allowed: {TASKS}")
    return importlib.import_module(f"tfjax.tasks.{name}")
