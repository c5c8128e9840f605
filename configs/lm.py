r"""Causal language modelling with GPT-like decoders (tfjax.models.decoder).

Presets (comma-separated, applied in order): "pydoc" (the default), "tiny", and the paper
sizes "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "modern-small".

pydoc: a small GPT on the embedded CPython reference text, bytes, packed rows of 128 (offline):

    python experiments/run.py --config=configs/lm.py:pydoc --workdir=/tmp/lm_pydoc

  Expected (measured on a 2-core CPU, 1 device, shared machine): after 600 steps eval
  perplexity 5.03 per byte (loss 1.61 nats), next-byte accuracy 0.547; 4 min 57 s wall clock
  including start-up; ~2.2 steps/s, ~9,000 tokens/s.

tiny: a 2-step smoke run on pydoc for tests.
gpt2-*, modern-small: the decoder presets of those names on lm1b with a 32k SentencePiece
vocabulary, AdamW (0.9, 0.95), weight decay 0.1, warmup + cosine, bfloat16 compute, scanned
layers (needs lm1b prepared and accelerators; never trained here). Each is meant for a TPU slice
and compiles and fits there with libtpu's compiler (train step peak per device, of the chip's
HBM):

    python experiments/compile.py --config=configs/lm.py:gpt2-xl --topology=v5p:4x4x4

  gpt2-small   batch 256 x 128, data parallel on v5e:2x2: 11.7 of 16 GiB (73%)
  gpt2-medium  batch 512 x 1024, FSDP, remat full, v5p:2x2x2: 18.8 of 95 GiB (20%)
  gpt2-large   batch 512 x 1024, FSDP, remat full, v5p:4x4x2: 6.3 of 95 GiB (7%)
  gpt2-xl      batch 512 x 1024, FSDP, remat full, v5p:4x4x4: 4.5 of 95 GiB (5%)
  modern-small batch 128 x 2048, FSDP, remat full, v5p:2x2x1: 14.7 of 95 GiB (15%)

  (TPU attention from 1,024 tokens is the splash kernel. For long contexts and large
  vocabularies see the README's "Attention backends" and "Memory levers": loss.chunks,
  remat_policy="offload_layer_inputs".)
"""

import ml_collections
from ml_collections import config_dict

from tfjax import sharding
from tfjax.data import catalog


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout and data order all follow from it
    config.task = "lm"  # tfjax.tasks module: loss and metrics

    config.model = ml_collections.ConfigDict()
    config.model.name = "decoder"  # tfjax.models.decoder
    config.model.variant = "demo"  # preset of sizes in decoder.VARIANTS
    config.model.vocab_size = config_dict.placeholder(int)  # None: tokenizer's, rounded up (x128)
    # None: the preset's; a value overrides it (--config.model.num_layers=8).
    config.model.width = config_dict.placeholder(int)  # D
    config.model.num_layers = config_dict.placeholder(int)  # L
    config.model.num_heads = config_dict.placeholder(int)  # N
    config.model.mlp_dim = config_dict.placeholder(int)  # F
    config.model.max_len = config_dict.placeholder(int)  # context length (learned position table)
    config.model.dropout_rate = config_dict.placeholder(float)  # embeddings, residual sub-layers
    config.model.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    config.model.remat_policy = "none"  # recompute activations in the backward pass
    # Attention backend: "xla", "cudnn", "chunked", "splash"; None: the best for the target.
    config.model.implementation = config_dict.placeholder(str)

    config.dataset = ml_collections.ConfigDict()  # a tfjax.data dataset config (its defaults
    config.dataset.name = "pydoc"  # fill every field not set here; see tfjax.data.catalog)
    config.dataset.seq_len = 128  # T
    config.dataset.packing = True  # several documents per row, with segment ids
    config.data_dir = ""  # prepared datasets; "": $TFJAX_DATA_DIR or ~/tensorflow_datasets

    config.batch_size = 32  # global rows: split over the data and fsdp mesh axes
    config.eval_batch_size = 32  # global
    config.num_microbatches = 1  # gradient accumulation: the batch in this many parts
    config.num_train_steps = 600  # optimizer updates
    config.log_every = 100  # steps between train metric logs (the only host syncs)
    config.eval_every = 200  # steps between evaluations (0: only at the end)
    config.eval_steps = 0  # eval batches per evaluation (0: the whole eval split)
    config.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (params stay float32)
    config.nonfinite = "error"  # NaN/Inf loss or gradient: "error" stops, "skip" drops the update
    config.max_nonfinite_skips = 10  # with "skip": updates skipped in a row before stopping

    # Sizes within a slice (-1: the rest); dcn_data: slices the data axis spans (-1: all).
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, dcn_data=-1))
    config.logical_axis_rules = sharding.DEFAULT_RULES  # logical axis -> mesh axes

    config.optim = ml_collections.ConfigDict()  # fields: tfjax.runner.optim
    config.optim.name = "adamw"  # "adamw" or "sgd"
    config.optim.learning_rate = 2e-3  # peak
    config.optim.schedule = "warmup_cosine"  # "rsqrt", "warmup_cosine" or "constant"
    config.optim.warmup_steps = 60  # linear warmup
    config.optim.end_learning_rate_fraction = 0.1  # cosine ends at this fraction of the peak
    config.optim.b1 = 0.9  # Adam beta1 (SGD momentum)
    config.optim.b2 = 0.95  # Adam beta2
    config.optim.eps = 1e-8  # Adam epsilon
    config.optim.weight_decay = 0.1  # decoupled, kernels and embeddings only
    config.optim.grad_clip_norm = 1.0  # global norm clipping (0: off)
    config.optim.ema_decay = 0.0  # EMA of the parameters for eval (0: off)

    config.loss = ml_collections.ConfigDict()
    config.loss.label_smoothing = 0.0  # eps of the smoothed targets
    config.loss.z_loss = 1e-4  # coefficient of log(Z)^2, as in PaLM (0: off)
    config.loss.chunks = 1  # >1: logits and loss in this many slices of T, never all [B, T, V]

    config.decode = ml_collections.ConfigDict()  # eval samples and experiments/decode.py
    config.decode.method = "sample"  # "greedy", "sample" or "beam"
    config.decode.beam_size = 4
    config.decode.alpha = 0.6  # beam length penalty
    config.decode.max_new_tokens = 64  # tokens generated per prompt (0: 32)
    config.decode.temperature = 0.8
    config.decode.top_k = 0  # 0: off
    config.decode.top_p = 0.95  # nucleus sampling (1: off)
    config.decode.num_samples = 3  # continuations of eval prompts in samples.jsonl per eval
    config.decode.prompt_length = 32  # tokens of each eval row used as its prompt
    config.decode.average_last = 1  # decode.py: average the newest N checkpoints

    config.checkpoint = ml_collections.ConfigDict()  # fields: tfjax.runner.checkpoint
    config.checkpoint.every = 200  # steps between checkpoints (0: only at the end)
    config.checkpoint.keep = 2  # newest checkpoints kept
    config.checkpoint.best_metric = ""  # also keep the best by this eval metric ("": no)
    config.checkpoint.best_mode = "min"  # "max" or "min"
    config.checkpoint.async_save = True  # write in the background while training goes on
    config.checkpoint.replica_parallel = True  # replicas share writing (faster on many devices)
    config.checkpoint.timeout_s = 1200  # most seconds a save waits for the other processes
    config.checkpoint.restore_step = config_dict.placeholder(int)  # None: newest that verifies
    config.profile = ml_collections.ConfigDict()  # a jax.profiler trace in WORKDIR/profile
    config.profile.start_step = 10  # first step traced (after compilation and warm-up)
    config.profile.num_steps = 0  # steps traced (0: off)
    config.profile.dump_hlo = False  # also write the compiled train step's HLO there
    config.init_from = ""  # another run's workdir: start from its parameters ("": no)

    for preset in (arg or "pydoc").split(","):
        if preset not in _PRESETS:
            raise ValueError(f"configs/lm.py: unknown preset {preset!r}; presets: {list(_PRESETS)}")
        _PRESETS[preset](config)
    catalog.with_placeholders(config.dataset)  # any dataset field settable from the CLI
    return config.lock()


def _pydoc(config):
    del config  # the defaults above are the pydoc experiment


def _tiny(config):
    config.model.update(variant="tiny", mlp_dim=64)
    config.dataset.seq_len = 32
    config.update(
        batch_size=16,
        eval_batch_size=16,
        num_train_steps=2,
        log_every=1,
        eval_every=2,
        eval_steps=1,
    )
    config.optim.warmup_steps = 1
    config.decode.update(num_samples=2, prompt_length=8, max_new_tokens=8)
    config.checkpoint.update(every=2, replica_parallel=False)  # no slicing programs to compile


FSDP = dict(data=1, fsdp=-1)  # parameters and optimizer state sharded over every chip


def _paper(
    config,
    variant,
    *,
    seq_len=1024,
    batch_size=512,
    remat_policy="full",
    mesh=FSDP,
    learning_rate=6e-4,
):
    """A published decoder size (its sizes from decoder.VARIANTS) trained on lm1b in bf16."""
    # mlp_dim=None: the preset's, also after "tiny" (which sets its own) earlier in the list
    config.model.update(variant=variant, mlp_dim=None, scan_layers=True, remat_policy=remat_policy)
    config.dataset.update(name="lm1b", seq_len=seq_len)
    config.update(
        batch_size=batch_size,
        eval_batch_size=batch_size,
        num_train_steps=100_000,
        log_every=100,
        eval_every=5000,
        eval_steps=50,
        dtype="bfloat16",
    )
    config.mesh.update(mesh)
    config.optim.update(learning_rate=learning_rate, warmup_steps=2000)
    config.checkpoint.every = 5000


# Each preset's comment names the slice it is meant for; it compiles and fits there
# (experiments/compile.py, figures in the README).
_PRESETS = {
    "pydoc": _pydoc,
    "tiny": _tiny,
    # v5e:2x2, data parallel, GPT-2 small at 128 tokens
    "gpt2-small": lambda c: _paper(
        c,
        "gpt2-small",
        seq_len=128,
        batch_size=256,
        remat_policy="none",
        mesh=dict(data=-1, fsdp=1),
    ),
    "gpt2-medium": lambda c: _paper(c, "gpt2-medium", learning_rate=3e-4),  # v5p:2x2x2
    "gpt2-large": lambda c: _paper(c, "gpt2-large", learning_rate=2.5e-4),  # v5p:4x4x2
    "gpt2-xl": lambda c: _paper(c, "gpt2-xl", learning_rate=2e-4),  # v5p:4x4x4
    "modern-small": lambda c: _paper(c, "modern-small", seq_len=2048, batch_size=128),  # v5p:2x2x1
}
