"""The config sections every experiment shares, each field documented once, here.

A config file (configs/*.py) calls these with the values that differ and reads top to bottom:

    config = defaults.run(task="lm", batch_size=32, eval_batch_size=32, num_train_steps=600,
                          eval_every=200)
    config.model = ...                          # the family's own section
    config.dataset = ...
    config.optim = defaults.optim(learning_rate=2e-3, warmup_steps=60, b2=0.95, ...)
    config.loss = defaults.loss(z_loss=1e-4)
    config.checkpoint = defaults.checkpoint(every=200)
    return defaults.apply_presets(config, arg, PRESETS, default="pydoc", file="configs/lm.py")

These are plain functions returning plain ConfigDicts: no inheritance, nothing hidden. What each
section means at run time is documented with the code that reads it: `tfjax.runner.optim`
(optim), `tfjax.runner.checkpoint` (checkpoint), `tfjax.runner.profiling` (profile), the tasks
(loss, decode).

Beside each section, what each of its fields allows (`tfjax.allowed`): `ALLOWED` maps a section
to its table, and `tfjax.runner.checks.check_config` checks every field against it before any
work starts. The model's fields are its family's (`tfjax.models.common.ALLOWED`), the dataset's
the catalog's (`tfjax.data.catalog.ALLOWED`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

import ml_collections
from ml_collections import config_dict

from tfjax import allowed, sharding, tasks
from tfjax import decode as decoding
from tfjax.allowed import BOOLEAN, FRACTION, TEXT, integer, number, one_of, optional
from tfjax.runner import optim as optimizers

COMPUTE_DTYPES = ("float32", "bfloat16")  # config.dtype
APIS = ("linen", "nnx")  # config.model.api
NONFINITE = ("error", "skip")  # config.nonfinite: what a NaN/Inf loss or gradient does
POSITIVE = integer(1)  # a count that must be at least one (steps, rows, seconds)
COUNT = integer(0)  # a count where 0 means none (or: off, all, the default)


def run(
    *,
    task: str,
    batch_size: int,
    eval_batch_size: int,
    num_train_steps: int,
    eval_every: int,
    log_every: int = 100,
) -> ml_collections.ConfigDict:
    """A config with the fields of the run itself; the caller adds model and dataset."""
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout, masking and data order all follow from it
    config.task = task  # tfjax.tasks module: loss and metrics
    config.data_dir = ""  # prepared datasets; "": $TFJAX_DATA_DIR or ~/tensorflow_datasets
    config.init_from = ""  # another run's workdir: start from its parameters ("": no)
    # The programs a run starts with (init, train and eval steps) saved by compile.py --save=DIR,
    # loaded when what they were compiled for matches ("": compile; tfjax.runner.executables)
    config.compiled_dir = ""

    config.batch_size = batch_size  # global rows: split over the data and fsdp mesh axes
    config.eval_batch_size = eval_batch_size  # global
    config.num_microbatches = 1  # gradient accumulation: the batch in this many parts
    config.num_train_steps = num_train_steps  # optimizer updates
    config.log_every = log_every  # steps between train metric logs (the only host syncs)
    config.eval_every = eval_every  # steps between evaluations (0: only at the end)
    config.eval_steps = 0  # eval batches per evaluation (0: the whole eval split)
    config.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (params stay float32)
    config.nonfinite = "error"  # NaN/Inf loss or gradient: "error" stops, "skip" drops the update
    config.max_nonfinite_skips = 10  # with "skip": updates skipped in a row before stopping

    # Sizes within a slice (-1: the rest); dcn_data: slices the data axis spans (-1: all).
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, dcn_data=-1))
    config.logical_axis_rules = sharding.DEFAULT_RULES  # logical axis -> mesh axes
    config.profile = profile()
    return config


RUN = {
    "seed": integer(0, 2**63 - 1),  # what JAX's keys and NumPy's generators both take
    "task": one_of(*tasks.TASKS),
    "data_dir": TEXT,
    "init_from": optional(TEXT),  # None: the config file leaves it to the command line
    "compiled_dir": TEXT,
    "batch_size": POSITIVE,
    "eval_batch_size": POSITIVE,
    "num_microbatches": POSITIVE,
    "num_train_steps": POSITIVE,
    "log_every": POSITIVE,
    "eval_every": COUNT,
    "eval_steps": COUNT,
    "dtype": one_of(*COMPUTE_DTYPES),
    "nonfinite": one_of(*NONFINITE),
    "max_nonfinite_skips": POSITIVE,
}
MESH = dict.fromkeys(
    ("data", "fsdp", "tensor", "dcn_data"),
    allowed.Allowed(
        "-1 (the devices the others leave) or an integer >= 1",
        lambda v: integer(1)(v) or one_of(-1)(v),
    ),
)


def model(name: str, variant: str) -> ml_collections.ConfigDict:
    """The model fields every family has; the caller adds the family's own. Sizes are None
    placeholders: the preset's, unless set (--config.model.num_layers=8)."""
    m = ml_collections.ConfigDict()
    m.name = name  # tfjax.models.<name>
    m.variant = variant  # preset of sizes in tfjax.models.<name>.VARIANTS
    m.width = config_dict.placeholder(int)  # D
    m.num_layers = config_dict.placeholder(int)  # L
    m.num_heads = config_dict.placeholder(int)  # N
    m.mlp_dim = config_dict.placeholder(int)  # F
    m.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    m.remat_policy = "none"  # recompute activations in the backward pass
    # Attention backend: "xla", "cudnn", "chunked", "splash"; None: the best for the target.
    m.implementation = config_dict.placeholder(str)
    # Which of tfjax's APIs computes the model: "linen" (tfjax.models) or "nnx" (tfjax.nnx, run
    # through tfjax.nnx.functional): the same parameters and checkpoints, so a run may resume in
    # either.
    m.api = "linen"
    return m


# The family's fields (sizes and the rest) are checked by the family when the model is built
# (tfjax.models.common.ALLOWED); these choose it and the API that runs it.
MODEL = {"name": TEXT, "variant": optional(TEXT), "api": one_of(*APIS)}


def optim(
    *,
    learning_rate: float,
    warmup_steps: int,
    schedule: str = "warmup_cosine",
    end_learning_rate_fraction: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip_norm: float = 1.0,
) -> ml_collections.ConfigDict:
    """config.optim (fields: tfjax.runner.optim)."""
    o = ml_collections.ConfigDict()
    o.name = "adamw"  # "adamw" or "sgd"
    o.learning_rate = learning_rate  # peak; with schedule "rsqrt" a factor on the paper's rate
    o.schedule = schedule  # "rsqrt", "warmup_cosine" or "constant"
    o.warmup_steps = warmup_steps  # linear warmup
    o.end_learning_rate_fraction = end_learning_rate_fraction  # cosine ends at this x the peak
    o.b1 = b1  # Adam beta1 (SGD momentum)
    o.b2 = b2  # Adam beta2
    o.eps = eps  # Adam epsilon
    o.weight_decay = weight_decay  # decoupled, kernels and embeddings only
    o.grad_clip_norm = grad_clip_norm  # global norm clipping (0: off)
    o.ema_decay = 0.0  # EMA of the parameters for eval (0: off)
    o.freeze = ""  # regex of parameter paths that do not train ("": all train)
    return o


OPTIM = {
    "name": one_of(*optimizers.OPTIMIZERS),
    "learning_rate": number(0),  # 0: a run that only evaluates
    "schedule": one_of(*optimizers.SCHEDULES),
    "warmup_steps": COUNT,
    "end_learning_rate_fraction": number(0),
    "b1": FRACTION,  # Adam divides by 1 - b^t; momentum 1 never forgets
    "b2": FRACTION,
    "eps": number(0),
    "weight_decay": number(0),  # a negative one grows the weights
    "grad_clip_norm": number(0),  # a negative one flips the gradients
    "ema_decay": FRACTION,
    "freeze": TEXT,  # a regex: compiled by tfjax.runner.optim.trainable
}


def lora() -> ml_collections.ConfigDict:
    """config.lora: low-rank adapters on a frozen base (tfjax.lora); rank 0 is off."""
    c = ml_collections.ConfigDict()
    c.rank = 0  # r of each adapter pair (0: no LoRA, every parameter trains)
    c.alpha = 16.0  # the adapters' output is scaled by alpha / rank
    c.dropout = 0.0  # on the adapters' input, in training
    c.targets = ""  # regex of the kernels that get adapters ("": attention and MLP kernels)
    c.base_dtype = ""  # QLoRA: the frozen base stored as "int8" or "nf4" ("": as trained)
    # QLoRA: one scale per this many inputs of each output channel; 0: one per output channel;
    # None: base_dtype's (nf4: 64, QLoRA's blocks; int8: 0). A workdir records it as set.
    c.tile_size = config_dict.placeholder(int)
    return c


LORA = {  # tfjax.lora.LoraConfig checks them again, with the regex
    "rank": COUNT,
    "alpha": number(above=0),
    "dropout": FRACTION,
    "targets": TEXT,
    "base_dtype": one_of("", "int8", "nf4"),
    "tile_size": optional(COUNT),
}


def loss(
    *, label_smoothing: float = 0.0, z_loss: float = 0.0, vocabulary: bool = True
) -> ml_collections.ConfigDict:
    """config.loss; `vocabulary`: the task has a vocabulary head (then loss.chunks exists)."""
    c = ml_collections.ConfigDict()
    c.label_smoothing = label_smoothing  # eps of the smoothed targets
    c.z_loss = z_loss  # coefficient of log(Z)^2, as in PaLM (0: off)
    if vocabulary:
        c.chunks = 1  # >1: logits and loss in this many slices of T, never all [B, T, V]
    return c


LOSS = {"label_smoothing": FRACTION, "z_loss": number(0), "chunks": POSITIVE}


def decode(
    *,
    method: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    prompt_length: int = 0,
) -> ml_collections.ConfigDict:
    """config.decode: what evaluation decodes (translation's BLEU, a language model's samples)
    and experiments/decode.py's defaults."""
    d = ml_collections.ConfigDict()
    d.method = method  # "greedy", "sample" or "beam"
    d.beam_size = 4
    d.alpha = 0.6  # beam length penalty ((5 + len) / 6)^alpha
    d.max_new_tokens = max_new_tokens  # tokens generated per input (0: the default length)
    d.temperature = temperature  # sampling only
    d.top_k = 0  # sampling only (0: off)
    d.top_p = top_p  # nucleus sampling (1: off)
    # The parameters' layout for the token loop, once per call (tfjax.decode.decode_layout):
    # "auto", "replicated" (data parallel), "tensor" or "as-given" (the training layout).
    d.layout = "auto"
    d.num_samples = 3  # decoded outputs written to samples.jsonl per evaluation
    d.prompt_length = prompt_length  # tokens of each eval row used as its prompt (LM only)
    d.average_last = 1  # decode.py: average the newest N checkpoints
    return d


DECODE = {
    "method": one_of(*decoding.METHODS),
    "beam_size": COUNT,  # beam search needs 1 or more (checks.check_config)
    "alpha": number(),  # negative favours short outputs, as transformers' length_penalty
    "max_new_tokens": COUNT,
    "temperature": number(above=0),
    "top_k": COUNT,
    "top_p": number(above=0, high=1),
    "layout": one_of(*decoding.LAYOUTS),
    "num_samples": COUNT,
    "prompt_length": COUNT,
    "average_last": POSITIVE,
}


def checkpoint(
    *, every: int, best_metric: str = "", best_mode: str = "min"
) -> ml_collections.ConfigDict:
    """config.checkpoint (fields: tfjax.runner.checkpoint)."""
    c = ml_collections.ConfigDict()
    c.every = every  # steps between checkpoints (0: only at the end)
    c.keep = 2  # newest checkpoints kept
    c.best_metric = best_metric  # also keep the best by this eval metric ("": no)
    c.best_mode = best_mode  # "max" or "min"
    c.async_save = True  # write in the background while training goes on
    c.replica_parallel = True  # replicas share writing (faster on many devices)
    c.timeout_s = 1200  # most seconds a save waits for the other processes
    c.restore_step = config_dict.placeholder(int)  # once (None: newest that verifies)
    return c


CHECKPOINT = {
    "every": COUNT,
    "keep": POSITIVE,
    "best_metric": TEXT,
    "best_mode": one_of("max", "min"),
    "async_save": BOOLEAN,
    "replica_parallel": BOOLEAN,
    "timeout_s": POSITIVE,
    "restore_step": optional(COUNT),
}


def profile() -> ml_collections.ConfigDict:
    """config.profile: a jax.profiler trace in WORKDIR/profile (tfjax.runner.profiling)."""
    p = ml_collections.ConfigDict()
    p.start_step = 10  # first step traced (after compilation and warm-up)
    p.num_steps = 0  # steps traced (0: off)
    p.dump_hlo = False  # also write the compiled train step's HLO there
    return p


PROFILE = {"start_step": POSITIVE, "num_steps": COUNT, "dump_hlo": BOOLEAN}  # steps count from 1

# Each section of a config ("": its top level) -> what its fields allow. The dataset's and the
# model's own fields are checked where they are defined (see the module docstring).
ALLOWED = {
    "": RUN,
    "mesh": MESH,
    "model": MODEL,
    "optim": OPTIM,
    "lora": LORA,
    "loss": LOSS,
    "decode": DECODE,
    "checkpoint": CHECKPOINT,
    "profile": PROFILE,
}


def tiny(config) -> None:
    """The 2-step smoke run of every config's "tiny" preset (tests run it)."""
    config.update(
        batch_size=16,
        eval_batch_size=16,
        num_train_steps=2,
        log_every=1,
        eval_every=2,
        eval_steps=1,
    )
    config.optim.warmup_steps = 1
    config.checkpoint.update(every=2, replica_parallel=False)  # no slicing programs to compile


def at_scale(
    config, *, batch_size: int, num_train_steps: int, eval_every: int, eval_steps: int | None = None
):
    """The run fields of a paper-scale preset (for accelerators): bfloat16 compute, `batch_size`
    rows in training and evaluation, a log line every 100 steps, a checkpoint at every
    evaluation; eval_steps None keeps the config's."""
    config.update(
        batch_size=batch_size,
        eval_batch_size=batch_size,
        num_train_steps=num_train_steps,
        log_every=100,
        eval_every=eval_every,
        dtype="bfloat16",
    )
    if eval_steps is not None:
        config.eval_steps = eval_steps
    config.checkpoint.every = eval_every


def unchanged(config) -> None:
    """The preset of the experiment a config file's defaults already are."""
    del config


def apply_presets(
    config,
    arg: str | None,
    presets: Mapping[str, Callable],
    *,
    default: str,
    file: str,
) -> ml_collections.ConfigDict:
    """Applies the comma-separated presets of `arg` (`default` when None) in order, makes every
    dataset field settable from the command line, and locks the config (a misspelt override
    is then an error naming the key)."""
    from tfjax.data import catalog

    for preset in (arg or default).split(","):
        if preset not in presets:
            raise ValueError(f"{file}: unknown preset {preset!r}; presets: {list(presets)}")
        presets[preset](config)
    catalog.with_placeholders(config.dataset)  # any dataset field settable from the CLI
    return config.lock()


def model_module(name: str):
    """The module tfjax.models.<name> (its Model factory and VARIANTS)."""
    try:
        module = importlib.import_module(f"tfjax.models.{name}")
    except ModuleNotFoundError:
        module = None
    if not hasattr(module, "Model"):
        raise ValueError(
            f"model.name={name!r}: tfjax.models has no such model family; allowed: "
            "transformer, encoder, decoder, vit"
        )
    return module
