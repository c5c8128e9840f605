"""The optimizer and its learning-rate schedule, from `config.optim`.

    tx = optim.make_optimizer(config.optim, d_model=512)
    lr = optim.make_schedule(config.optim, d_model=512)(step)

Fields of `config.optim` (every config file sets them all):

  name             "adamw" (Loshchilov & Hutter) or "sgd" (with momentum b1)
  learning_rate    peak rate; for schedule="rsqrt" a factor on the paper's formula (1.0: as is)
  schedule         "rsqrt": d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), s = step + 1 (Vaswani
                   et al. 2017, eq. 3); "warmup_cosine": linear warmup then cosine decay to
                   end_learning_rate_fraction * learning_rate at num_train_steps; "constant":
                   linear warmup then constant
  warmup_steps     steps of the warmup
  end_learning_rate_fraction   where the cosine ends, relative to the peak
  b1, b2, eps      Adam moments (paper: 0.9, 0.98, 1e-9); b1 is the SGD momentum
  weight_decay     decoupled weight decay (AdamW), applied to kernels and embeddings only:
                   biases, norm scales, class tokens and ViT position tables are not decayed
  grad_clip_norm   clip the global gradient norm to this (0: no clipping)
  ema_decay        exponential moving average of the parameters, used for evaluation (0: off);
                   kept by `tfjax.runner.train`, not by the optimizer
  freeze           a regex: the parameters whose '/'-joined path it matches (re.search) do not
                   train; no gradient or optimizer state is made for them ("": all train)

What each field allows is declared beside its default (`tfjax.runner.defaults.OPTIM`) and
checked before any work (`tfjax.runner.checks.check_config`); this module checks only what
relates them (a schedule's warmup to its length).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from tfjax import lora

OPTIMIZERS = ("adamw", "sgd")  # optim.name
SCHEDULES = ("rsqrt", "warmup_cosine", "constant")  # optim.schedule


def make_schedule(optim_config, *, d_model: int, num_train_steps: int) -> optax.Schedule:
    """step (0-based count of updates done) -> learning rate."""
    c = optim_config
    peak, warmup = float(c.learning_rate), int(c.warmup_steps)
    if c.schedule == "rsqrt":
        if warmup < 1:
            raise ValueError("optim.schedule='rsqrt' needs optim.warmup_steps >= 1")

        def rsqrt(step):
            s = jnp.asarray(step, jnp.float32) + 1.0  # the paper counts steps from 1
            return peak * d_model**-0.5 * jnp.minimum(s**-0.5, s * warmup**-1.5)

        return rsqrt
    if c.schedule == "warmup_cosine":
        if num_train_steps <= warmup:
            raise ValueError(
                f"optim.schedule='warmup_cosine' needs num_train_steps ({num_train_steps}) > "
                f"optim.warmup_steps ({warmup})"
            )
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=num_train_steps,
            end_value=peak * float(c.end_learning_rate_fraction),
        )
    if c.schedule != "constant":
        raise ValueError(f"optim.schedule={c.schedule!r} is unknown; allowed: {SCHEDULES}")
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


def decay_mask(params):
    """True for the parameters weight decay applies to: kernels and embedding tables.

    Names, not ranks, decide: attention biases are 2-D and scanned layers add an axis.
    """

    def decays(path, _):
        # The last dict key; boxed (nn.LogicallyPartitioned) leaves add a ".value" after it.
        name = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        return name.endswith("kernel") or name == "embedding"

    return jax.tree_util.tree_map_with_path(decays, params)


def trainable(optim_config, *, lora: bool = False):
    """'/'-joined parameter path -> whether it trains, from optim.freeze (a regex: the
    parameters it matches anywhere in their path stay as they are) and, with `lora`, only the
    LoRA adapters (`tfjax.lora.is_adapter`); None: all train."""
    pattern = optim_config.get("freeze") or ""
    if not pattern and not lora:
        return None
    try:
        frozen = re.compile(pattern) if pattern else None
    except re.error as e:
        raise ValueError(f"optim.freeze={pattern!r} is not a regular expression: {e}") from None

    def trains(path: str) -> bool:
        if lora and not _is_adapter(path):
            return False
        return frozen is None or frozen.search(path) is None

    return trains


def _is_adapter(path: str) -> bool:
    return lora.is_adapter(path)


def check_trainable(optim_config, params, trainable) -> tuple[int, int]:
    """optim.freeze must leave something to train and freeze something: either way a typo
    would silently train all or nothing. The error lists some of the parameters' paths.
    Returns (the parameter arrays that train, all of them)."""
    paths = ["/".join(k) for k in traverse_util.flatten_dict(params)]
    train = [p for p in paths if trainable(p)]
    pattern = optim_config.get("freeze") or ""
    if pattern and (not train or len(train) == len(paths)):
        what = "every parameter" if not train else "no parameter"
        raise ValueError(
            f"optim.freeze={pattern!r} freezes {what} that would train; it is a regex searched "
            f"in the parameter paths, such as {', '.join(paths[:3])}, ..., {paths[-1]}"
        )
    return len(train), len(paths)


def lora_config(config):
    """The `tfjax.lora.LoraConfig` of config.lora, None when absent or rank 0 (no LoRA)."""
    c = config.get("lora")
    if c is None or not c.rank:
        return None
    try:
        return lora.LoraConfig(
            rank=c.rank,
            alpha=float(c.alpha),
            dropout=float(c.dropout),
            targets=c.targets or lora.DEFAULT_TARGETS,
            base_dtype=c.base_dtype or None,
            tile_size=c.get("tile_size"),  # None: base_dtype's; 0: per channel
        )
    except ValueError as e:  # LoraConfig names its own field; the config's is lora.<field>
        raise ValueError(str(e).replace("LoraConfig.", "lora.")) from None


def make_optimizer(
    optim_config, *, d_model: int, num_train_steps: int
) -> optax.GradientTransformation:
    """Gradient clipping (optional) followed by AdamW or SGD with the configured schedule."""
    c = optim_config
    schedule = make_schedule(c, d_model=d_model, num_train_steps=num_train_steps)
    if c.name == "adamw":
        tx = optax.adamw(
            schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask
        )
    elif c.name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(c.weight_decay, mask=decay_mask),
            optax.sgd(schedule, momentum=c.b1 or None),
        )
    else:
        raise ValueError(f"optim.name={c.name!r} is unknown; allowed: {OPTIMIZERS}")
    if c.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(c.grad_clip_norm), tx)
    return tx
