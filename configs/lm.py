r"""Causal language modelling with GPT-like decoders (tfjax.models.decoder).

Presets (comma-separated, applied in order): "pydoc" (the default), "tiny", and the paper
sizes "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "modern-small".

pydoc: a small GPT on the embedded CPython reference text, bytes, packed rows of 128 (offline):

    python experiments/run.py --config=configs/lm.py:pydoc --workdir=/tmp/lm_pydoc

  Expected (measured on a 2-core CPU, 1 device, shared machine): after 600 steps eval
  perplexity 5.03 per byte (loss 1.61 nats), next-byte accuracy 0.547; 4 min 57 s wall clock
  including start-up; ~2.2 steps/s, ~9,000 tokens/s.

tiny: a 2-step smoke run on pydoc for tests.
moe-tiny: "tiny" with a mixture of 8 experts (2 per token) in each layer (decoder preset
"moe-tiny"), their load-balancing and router z losses weighted 0.01 and 0.001, and the experts
split over the fsdp mesh axis (expert parallelism: --config.mesh.fsdp=4 puts 2 on each device).
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
  vocabularies see docs/performance.md, "Attention backends" and "Memory levers": loss.chunks,
  remat_policy="offload_layer_inputs".)
"""

import ml_collections
from ml_collections import config_dict

from tfjax import sharding
from tfjax.runner import defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults.run(
        task="lm", batch_size=32, eval_batch_size=32, num_train_steps=600, eval_every=200
    )
    config.model = defaults.model("decoder", "demo")
    config.model.vocab_size = config_dict.placeholder(int)  # None: tokenizer's, rounded up (x128)
    config.model.max_len = config_dict.placeholder(int)  # context length (learned position table)
    config.model.dropout_rate = config_dict.placeholder(float)  # embeddings, residual sub-layers

    config.dataset = ml_collections.ConfigDict()  # a tfjax.data dataset config (its defaults
    config.dataset.name = "pydoc"  # fill every field not set here; see tfjax.data.catalog)
    config.dataset.seq_len = 128  # T
    config.dataset.packing = True  # several documents per row, with segment ids

    config.optim = defaults.optim(learning_rate=2e-3, warmup_steps=60, b2=0.95, weight_decay=0.1)
    config.loss = defaults.loss(z_loss=1e-4)
    config.decode = defaults.decode(  # eval samples and experiments/decode.py
        method="sample", max_new_tokens=64, temperature=0.8, top_p=0.95, prompt_length=32
    )
    config.checkpoint = defaults.checkpoint(every=200)
    return defaults.apply_presets(config, arg, _PRESETS, default="pydoc", file="configs/lm.py")


def _tiny(config):
    config.model.update(variant="tiny", mlp_dim=64)
    config.dataset.seq_len = 32
    defaults.tiny(config)  # 2 steps of 16 rows, a checkpoint, an evaluation
    config.decode.update(num_samples=2, prompt_length=8, max_new_tokens=8)


def _moe_tiny(config):
    _tiny(config)
    config.model.update(variant="moe-tiny", mlp_dim=None)
    config.model.num_experts = config_dict.placeholder(int)  # E (the variant's when None)
    config.model.experts_per_token = config_dict.placeholder(int)  # k
    config.model.expert_mlp_dim = config_dict.placeholder(int)  # each expert's F
    config.model.load_balance_loss_weight = 0.01  # Switch Transformers' weight
    config.model.router_z_loss_weight = 0.001  # ST-MoE's
    config.logical_axis_rules = sharding.expert_parallel(config.logical_axis_rules, "fsdp")


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
    defaults.at_scale(
        config, batch_size=batch_size, num_train_steps=100_000, eval_every=5000, eval_steps=50
    )
    config.mesh.update(mesh)
    config.optim.update(learning_rate=learning_rate, warmup_steps=2000)


# Each preset's comment names the slice it is meant for; it compiles and fits there
# (experiments/compile.py, figures in docs/scaling.md).
_PRESETS = {
    "pydoc": defaults.unchanged,
    "tiny": _tiny,
    "moe-tiny": _moe_tiny,
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
