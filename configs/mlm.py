r"""Masked language modelling with BERT-like encoders (tfjax.models.encoder, head="mlm").

Presets (comma-separated, applied in order): "pydoc" (the default), "tiny", "bert-base".

pydoc: a small BERT on the embedded CPython reference text, bytes, 15% of tokens picked
(80% [MASK], 10% random, 10% kept), packed rows of 128 (offline):

    python experiments/run.py --config=configs/mlm.py:pydoc --workdir=/tmp/mlm_pydoc

  Expected (measured on a 2-core CPU, 1 device, shared machine): after 600 steps masked-byte
  accuracy 0.300 on the eval split (perplexity 14.8; the unigram baseline is ~0.20), 5 min 11 s
  wall clock including start-up; ~2.1 steps/s, ~8,500 tokens/s. A short demo: masked-LM
  accuracy keeps climbing with longer training.

tiny: a 2-step smoke run on pydoc for tests.
bert-base: BERT-base on lm1b with a 32k SentencePiece vocabulary, batch 256 x 128, AdamW
(0.9, 0.999, wd 0.01), 10k warmup, 1M steps as in Devlin et al. (needs lm1b prepared).
"""

import ml_collections
from ml_collections import config_dict

from tfjax import sharding
from tfjax.data import catalog


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout, masking and data order all follow from it
    config.task = "mlm"  # tfjax.tasks module: loss and metrics

    config.model = ml_collections.ConfigDict()
    config.model.name = "encoder"  # tfjax.models.encoder
    config.model.variant = "demo"  # preset of sizes in encoder.VARIANTS
    config.model.vocab_size = config_dict.placeholder(int)  # None: tokenizer's, rounded up (x128)
    config.model.head = "mlm"  # masked-LM logits over the vocabulary
    # None: the preset's; a value overrides it (--config.model.num_layers=8).
    config.model.width = config_dict.placeholder(int)  # D
    config.model.num_layers = config_dict.placeholder(int)  # L
    config.model.num_heads = config_dict.placeholder(int)  # N
    config.model.mlp_dim = config_dict.placeholder(int)  # F
    config.model.max_len = config_dict.placeholder(int)  # learned position table
    config.model.norm_position = "post"  # "post" (BERT) or "pre" (stabler at high rates)
    config.model.dropout_rate = 0.0  # embeddings and residual sub-layers (BERT: 0.1)
    config.model.attention_dropout_rate = 0.0  # attention weights (BERT: 0.1)
    config.model.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    config.model.remat_policy = "none"  # recompute activations in the backward pass
    # Attention backend: "xla", "cudnn", "chunked", "splash"; None: the best for the target.
    config.model.implementation = config_dict.placeholder(str)

    config.dataset = ml_collections.ConfigDict()  # a tfjax.data dataset config (its defaults
    config.dataset.name = "pydoc"  # fill every field not set here; see tfjax.data.catalog)
    config.dataset.seq_len = 128  # T
    config.dataset.packing = True  # several documents per row, with segment ids
    config.dataset.mlm_probability = 0.15  # fraction of tokens picked for prediction
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
    config.optim.learning_rate = 1e-3  # peak
    config.optim.schedule = "warmup_cosine"  # "rsqrt", "warmup_cosine" or "constant"
    config.optim.warmup_steps = 60  # linear warmup
    config.optim.end_learning_rate_fraction = 0.1  # cosine ends at this fraction of the peak
    config.optim.b1 = 0.9  # Adam beta1 (SGD momentum)
    config.optim.b2 = 0.999  # Adam beta2
    config.optim.eps = 1e-6  # Adam epsilon (BERT)
    config.optim.weight_decay = 0.01  # decoupled, kernels and embeddings only (BERT)
    config.optim.grad_clip_norm = 1.0  # global norm clipping (0: off)
    config.optim.ema_decay = 0.0  # EMA of the parameters for eval (0: off)

    config.loss = ml_collections.ConfigDict()
    config.loss.label_smoothing = 0.0  # eps of the smoothed targets
    config.loss.z_loss = 0.0  # coefficient of log(Z)^2 (0: off)
    config.loss.chunks = 1  # >1: logits and loss in this many slices of T, never all [B, T, V]

    config.checkpoint = ml_collections.ConfigDict()  # fields: tfjax.runner.checkpoint
    config.checkpoint.every = 200  # steps between checkpoints (0: only at the end)
    config.checkpoint.keep = 2  # newest checkpoints kept
    config.checkpoint.best_metric = "accuracy"  # also keep the best by this eval metric
    config.checkpoint.best_mode = "max"  # "max" or "min"
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
            raise ValueError(
                f"configs/mlm.py: unknown preset {preset!r}; presets: {list(_PRESETS)}"
            )
        _PRESETS[preset](config)
    catalog.with_placeholders(config.dataset)  # any dataset field settable from the CLI
    return config.lock()


def _pydoc(config):
    del config  # the defaults above are the pydoc experiment


def _tiny(config):
    config.model.variant = "tiny"
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
    config.checkpoint.update(every=2, replica_parallel=False)  # no slicing programs to compile


def _paper(config, variant, *, batch_size, mesh):
    """A published BERT size (its sizes from encoder.VARIANTS), masked LM on lm1b in bf16."""
    config.model.update(
        variant=variant, dropout_rate=0.1, attention_dropout_rate=0.1, scan_layers=True
    )
    config.dataset.update(name="lm1b", seq_len=128)
    config.update(
        batch_size=batch_size,
        eval_batch_size=batch_size,
        num_train_steps=1_000_000,
        log_every=100,
        eval_every=10_000,
        eval_steps=50,
        dtype="bfloat16",
    )
    config.mesh.update(mesh)
    config.optim.update(learning_rate=1e-4, warmup_steps=10_000, end_learning_rate_fraction=0.0)
    config.checkpoint.every = 10_000


def _bert_base(config):  # v5e:2x2, data parallel
    _paper(config, "bert-base", batch_size=256, mesh=dict(data=-1, fsdp=1))


def _bert_large(config):  # v5e:2x4, FSDP over the 8 chips
    _paper(config, "bert-large", batch_size=256, mesh=dict(data=1, fsdp=-1))


_PRESETS = {"pydoc": _pydoc, "tiny": _tiny, "bert-base": _bert_base, "bert-large": _bert_large}
