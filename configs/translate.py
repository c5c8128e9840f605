r"""Translation with the encoder-decoder Transformer of Vaswani et al. (2017).

Presets (comma-separated, applied in order): "demo" (the default), "tiny", "base", "big".

demo: a small Transformer learning to write numbers in English words on the embedded
numbers_translate task ("4021" -> "four thousand twenty-one"; SentencePiece, offline):

    python experiments/run.py --config=configs/translate.py:demo --workdir=/tmp/translate_demo

  Expected (measured on a 2-core CPU, 1 device, shared machine; dataset and tokenizer
  already prepared, which the first run does in about 2 minutes): corpus BLEU 92.4 on the
  1,000 held-out numbers after 400 steps and 99.4 after 800 (beam search as configured below:
  4 beams, alpha 0.6; teacher-forced
  token accuracy 0.985 / 0.998); 5 min 27 s wall clock including start-up and compilation.
  Then `experiments/decode.py --config=configs/translate.py:demo --workdir=/tmp/translate_demo
  --input=17 --input=4021` writes "seventeen" and "four thousand twenty-one".

tiny: a 2-step smoke run on numbers_translate for tests.
base / big: the paper's Transformer base / big on WMT'14 English-German (shared 37k
SentencePiece vocabulary, packed rows of 256, ~25k source + 25k target tokens per batch as
batch_size=128 rows (base) / 192 rows (big), Adam (0.9, 0.98, 1e-9), lrate = d_model^-0.5 *
min(step^-0.5, step * 4000^-1.5), label smoothing 0.1, dropout 0.1 / 0.3, 100k / 300k steps,
EMA of the parameters in place of the paper's checkpoint averaging; needs wmt14 prepared).
"""

import ml_collections
from ml_collections import config_dict

from tfjax import sharding
from tfjax.data import catalog


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameters, dropout and data order all follow from it
    config.task = "translation"  # tfjax.tasks module: loss and metrics

    config.model = ml_collections.ConfigDict()
    config.model.name = "transformer"  # tfjax.models.transformer
    config.model.variant = "demo"  # preset of sizes in transformer.VARIANTS
    config.model.vocab_size = config_dict.placeholder(int)  # None: tokenizer's, rounded up (x128)
    # None: the preset's; a value overrides it (--config.model.num_layers=8).
    config.model.width = config_dict.placeholder(int)  # D = d_model
    config.model.num_layers = config_dict.placeholder(int)  # N, in the encoder and the decoder
    config.model.num_heads = config_dict.placeholder(int)  # h
    config.model.mlp_dim = config_dict.placeholder(int)  # d_ff
    config.model.dropout_rate = config_dict.placeholder(float)  # P_drop
    config.model.share_embeddings = True  # one matrix for source, target and output
    config.model.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    config.model.remat_policy = "none"  # recompute activations in the backward pass
    # Attention backend: "xla", "cudnn", "chunked", "splash"; None: the best for the target.
    config.model.implementation = config_dict.placeholder(str)

    config.dataset = ml_collections.ConfigDict()  # a tfjax.data dataset config (its defaults
    config.dataset.name = "numbers_translate"  # fill every field not set here)
    config.dataset.seq_len = 24  # S = T
    config.dataset.packing = False  # several sentence pairs per row, with segment ids
    config.dataset.tokenizer = "sentencepiece"  # trained on the train split once, or "bytes"
    config.data_dir = ""  # prepared datasets; "": $TFJAX_DATA_DIR or ~/tensorflow_datasets

    config.batch_size = 64  # global rows: split over the data and fsdp mesh axes
    config.eval_batch_size = 200  # global
    config.num_microbatches = 1  # gradient accumulation: the batch in this many parts
    config.num_train_steps = 800  # optimizer updates
    config.log_every = 100  # steps between train metric logs (the only host syncs)
    config.eval_every = 400  # steps between evaluations (0: only at the end)
    config.eval_steps = 0  # eval batches per evaluation (0: the whole eval split)
    config.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (params stay float32)
    config.nonfinite = "error"  # NaN/Inf loss or gradient: "error" stops, "skip" drops the update
    config.max_nonfinite_skips = 10  # with "skip": updates skipped in a row before stopping

    # Sizes within a slice (-1: the rest); dcn_data: slices the data axis spans (-1: all).
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, dcn_data=-1))
    config.logical_axis_rules = sharding.DEFAULT_RULES  # logical axis -> mesh axes

    config.optim = ml_collections.ConfigDict()  # fields: tfjax.runner.optim
    config.optim.name = "adamw"  # "adamw" or "sgd"
    config.optim.learning_rate = 0.5  # factor on the paper's rate (rsqrt), else the peak
    config.optim.schedule = "rsqrt"  # the paper's warmup then inverse square root decay
    config.optim.warmup_steps = 400  # paper: 4000
    config.optim.end_learning_rate_fraction = 0.0  # unused by "rsqrt"
    config.optim.b1 = 0.9  # Adam beta1 (paper)
    config.optim.b2 = 0.98  # Adam beta2 (paper)
    config.optim.eps = 1e-9  # Adam epsilon (paper)
    config.optim.weight_decay = 0.0  # the paper uses none
    config.optim.grad_clip_norm = 0.0  # global norm clipping (0: off, as in the paper)
    config.optim.ema_decay = 0.0  # EMA of the parameters for eval (0: off)

    config.loss = ml_collections.ConfigDict()
    config.loss.label_smoothing = 0.1  # paper: 0.1
    config.loss.z_loss = 0.0  # coefficient of log(Z)^2 (0: off)
    config.loss.chunks = 1  # >1: logits and loss in this many slices of T, never all [B, T, V]

    config.decode = ml_collections.ConfigDict()  # eval BLEU and experiments/decode.py
    config.decode.method = "beam"  # "greedy" or "beam" in eval; decode.py also "sample"
    config.decode.beam_size = 4  # paper: 4
    config.decode.alpha = 0.6  # length penalty ((5 + len) / 6)^alpha; paper: 0.6
    config.decode.max_new_tokens = 0  # 0: dataset.seq_len (paper: input length + 50)
    config.decode.temperature = 1.0  # sampling only
    config.decode.top_k = 0  # sampling only (0: off)
    config.decode.top_p = 1.0  # sampling only (1: off)
    config.decode.num_samples = 3  # translations written to samples.jsonl at each eval
    config.decode.prompt_length = 0  # unused (LM only)
    config.decode.average_last = 1  # decode.py: average the newest N checkpoints (paper: 5)

    config.checkpoint = ml_collections.ConfigDict()  # fields: tfjax.runner.checkpoint
    config.checkpoint.every = 400  # steps between checkpoints (0: only at the end)
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

    for preset in (arg or "demo").split(","):
        if preset not in _PRESETS:
            raise ValueError(
                f"configs/translate.py: unknown preset {preset!r}; presets: {list(_PRESETS)}"
            )
        _PRESETS[preset](config)
    catalog.with_placeholders(config.dataset)  # any dataset field settable from the CLI
    return config.lock()


def _demo(config):
    del config  # the defaults above are the demo


def _tiny(config):
    config.model.variant = "tiny"
    config.dataset.tokenizer = "bytes"  # no SentencePiece training in a smoke run
    config.update(
        batch_size=16,
        eval_batch_size=16,
        num_train_steps=2,
        log_every=1,
        eval_every=2,
        eval_steps=1,
    )
    config.optim.warmup_steps = 1
    config.decode.max_new_tokens = 8
    config.checkpoint.update(every=2, replica_parallel=False)  # no slicing programs to compile


def _paper(config, variant, rows, steps):
    """Vaswani et al.'s base or big (sizes and dropout from transformer.VARIANTS) on WMT'14
    en-de, bf16."""
    config.model.update(variant=variant, scan_layers=True)
    config.dataset.update(name="wmt14_translate/de-en", seq_len=256, packing=True)
    config.update(
        batch_size=rows,
        eval_batch_size=rows,
        num_train_steps=steps,
        log_every=100,
        eval_every=5000,
        dtype="bfloat16",
    )
    config.optim.update(learning_rate=1.0, warmup_steps=4000, ema_decay=0.9999)
    config.checkpoint.update(every=5000, best_metric="")


def _base(config):  # v5e:2x2, data parallel
    _paper(config, "base", 128, 100_000)


def _big(config):  # v5e:2x4, data parallel
    _paper(config, "big", 192, 300_000)
    # v5e:2x4 with remat dots: 8.2 of 16 GiB (51%); without remat it does not fit (16.5 GiB).
    config.model.remat_policy = "dots"


_PRESETS = {"demo": _demo, "tiny": _tiny, "base": _base, "big": _big}
