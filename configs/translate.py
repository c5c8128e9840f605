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

from tfjax.runner import defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults.run(
        task="translation", batch_size=64, eval_batch_size=200, num_train_steps=800, eval_every=400
    )
    config.model = defaults.model("transformer", "demo")
    config.model.vocab_size = config_dict.placeholder(int)  # None: tokenizer's, rounded up (x128)
    config.model.dropout_rate = config_dict.placeholder(float)  # P_drop
    config.model.share_embeddings = True  # one matrix for source, target and output

    config.dataset = ml_collections.ConfigDict()  # a tfjax.data dataset config (its defaults
    config.dataset.name = "numbers_translate"  # fill every field not set here)
    config.dataset.seq_len = 24  # S = T
    config.dataset.packing = False  # several sentence pairs per row, with segment ids
    config.dataset.tokenizer = "sentencepiece"  # trained on the train split once, or "bytes"

    # The paper's: warmup then inverse square root decay (learning_rate is a factor on its rate;
    # its warmup is 4000), Adam (0.9, 0.98, 1e-9), no weight decay, no clipping, smoothing 0.1.
    config.optim = defaults.optim(
        learning_rate=0.5,
        schedule="rsqrt",
        warmup_steps=400,
        end_learning_rate_fraction=0.0,
        b2=0.98,
        eps=1e-9,
        grad_clip_norm=0.0,
    )
    config.loss = defaults.loss(label_smoothing=0.1)
    # Eval BLEU and experiments/decode.py: the paper's beam search (4 beams, alpha 0.6);
    # max_new_tokens 0 is dataset.seq_len (the paper: input length + 50).
    config.decode = defaults.decode(method="beam", max_new_tokens=0)
    config.checkpoint = defaults.checkpoint(every=400, best_metric="accuracy", best_mode="max")
    return defaults.apply_presets(
        config, arg, _PRESETS, default="demo", file="configs/translate.py"
    )


def _tiny(config):
    config.model.variant = "tiny"
    config.dataset.tokenizer = "bytes"  # no SentencePiece training in a smoke run
    defaults.tiny(config)  # 2 steps of 16 rows, a checkpoint, an evaluation
    config.decode.max_new_tokens = 8


def _paper(config, variant, rows, steps):
    """Vaswani et al.'s base or big (sizes and dropout from transformer.VARIANTS) on WMT'14
    en-de, bf16."""
    config.model.update(variant=variant, scan_layers=True)
    config.dataset.update(name="wmt14_translate/de-en", seq_len=256, packing=True)
    defaults.at_scale(config, batch_size=rows, num_train_steps=steps, eval_every=5000)
    config.optim.update(learning_rate=1.0, warmup_steps=4000, ema_decay=0.9999)
    config.checkpoint.best_metric = ""


def _base(config):  # v5e:2x2, data parallel
    _paper(config, "base", 128, 100_000)


def _big(config):  # v5e:2x4, data parallel
    _paper(config, "big", 192, 300_000)
    # v5e:2x4 with remat dots: 8.2 of 16 GiB (51%); without remat it does not fit (16.5 GiB).
    config.model.remat_policy = "dots"


_PRESETS = {"demo": defaults.unchanged, "tiny": _tiny, "base": _base, "big": _big}
