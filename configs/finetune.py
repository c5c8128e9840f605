r"""Fine-tuning a published decoder checkpoint (Llama, Qwen, Gemma, Mistral, Qwen3.5 (the text
model of its image-text checkpoints too), and the mixtures of experts Qwen3-MoE, Mixtral and
DeepSeek-V3) on your own files.

    python experiments/run.py --config=configs/finetune.py --workdir=W \
        --config.init_from=CHECKPOINT_DIR \
        --config.dataset.train_files=train.jsonl --config.dataset.eval_files=eval.jsonl \
        [--config.lora.rank=8] [--config.optim.freeze=REGEX] [--config.num_train_steps=N]
    # several sources at weights, instead of train_files (tfjax.data.files):
    #   --config.dataset.mixture="3:data/chat/*.jsonl;1:gs://bucket/web.parquet"
    python experiments/run.py --config=configs/finetune.py:lora --workdir=W ...  # the preset
    python experiments/export.py --workdir=W --output=OUT_DIR [--adapters_only]  # peft adapters

CHECKPOINT_DIR is a Hugging Face directory (config.json, safetensors, tokenizer.json or
tokenizer.model): the model, its sizes and its tokenizer come from it (tfjax.runner.pretrained);
config.model may only choose how it runs (scan_layers, remat_policy, implementation, dropout).
Rows of the files (text, jsonl, parquet, Arrow; tfjax.data.files) are {"text"}, {"prompt",
"completion"} (trained on the completion and its eos) or {"messages"} (rendered with the
checkpoint's chat template, trained on the assistant turns). The eval rows' `loss` is the mean
over the trained tokens; the first evaluation is the checkpoint's own (step 0).

Presets (comma-separated, applied in order): "full" (the default: every parameter trains),
"lora" (adapters of rank 16 on the attention and MLP kernels, the base frozen; in a mixture of
experts the attention and any dense layers' and shared experts', not the routed experts';
DeepSeek's latent attention's five projections; Qwen3.5's Gated DeltaNet projections, not its
convolutions: tfjax.lora), "tiny" (tests),
and the sized ones below, each compiled for its target with experiments/compile.py (sizes only,
no weights needed; figures in docs/finetuning.md).

"vision": a vision checkpoint (DINOv2 with or without registers or its classifier, CLIP or
SigLIP vision towers; tfjax.runner.pretrained) with a new head for the classes of your images:

    python experiments/run.py --config=configs/finetune.py:vision --workdir=W \
        --config.init_from=CHECKPOINT_DIR \
        --config.dataset.train_files=train_dir --config.dataset.eval_files=eval_dir

train_dir holds one folder of images per class (the sorted folder names are the classes),
eval_dir folders among them (tfjax.data.image_folders); images are resized and normalised as
the checkpoint's preprocessor_config.json says. The run logs that the head was initialised for
N classes; the export of a DINOv2 run is a Dinov2ForImageClassification (id2label: the class
names); the other towers with a linear head have no Hugging Face class, and their export is
refused. "vision-tiny" is the test's (200 steps of a small checkpoint on CPU).
"""

import ml_collections
from ml_collections import config_dict

from tfjax.runner import defaults


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = defaults.run(
        task="lm", batch_size=16, eval_batch_size=16, num_train_steps=500, eval_every=100
    )
    config.init_from = config_dict.placeholder(str)  # the checkpoint directory (required)
    config.model = _model("decoder")
    config.dataset = _user_data("files")  # the user's files (tfjax.data.files)
    config.dataset.seq_len = 512  # T: rows are packed to this many tokens
    config.dataset.packing = True

    config.optim = defaults.optim(learning_rate=2e-5, warmup_steps=20, b2=0.95, weight_decay=0.0)
    config.lora = defaults.lora()
    config.loss = defaults.loss()
    config.decode = defaults.decode(method="greedy", max_new_tokens=64, prompt_length=64)
    config.checkpoint = defaults.checkpoint(every=100)
    return defaults.apply_presets(config, arg, _PRESETS, default="full", file="configs/finetune.py")


def _model(name: str) -> ml_collections.ConfigDict:
    """The checkpoint's model: only how it runs is set here (and a variant, for compiling a
    preset's size without the weights)."""
    model = ml_collections.ConfigDict()
    model.name = name
    model.variant = config_dict.placeholder(str)
    model.scan_layers = False
    model.remat_policy = "none"
    model.implementation = config_dict.placeholder(str)
    model.dropout_rate = config_dict.placeholder(float)
    model.api = "linen"  # or "nnx" (tfjax.runner.defaults.model)
    return model


def _user_data(name: str) -> ml_collections.ConfigDict:
    """The user's training and held-out files (tfjax.data.files, tfjax.data.image_folders)."""
    dataset = ml_collections.ConfigDict()
    dataset.name = name
    dataset.train_files = config_dict.placeholder(str)
    dataset.eval_files = config_dict.placeholder(str)
    return dataset


def _lora(config, rank=16, base_dtype=""):
    config.lora.update(rank=rank, alpha=2.0 * rank, base_dtype=base_dtype)
    if base_dtype == "nf4":
        config.lora.tile_size = 64  # QLoRA's NF4 block: one scale per 64 inputs
    config.optim.learning_rate = 2e-4  # adapters start at zero: a larger rate than full tuning
    return config


def _tiny(config):
    """A few steps on small files for tests (the test gives init_from and the files)."""
    config.update(
        batch_size=8,
        eval_batch_size=8,
        num_train_steps=12,
        log_every=4,
        eval_every=12,
        eval_steps=0,
    )
    config.dataset.seq_len = 64
    config.optim.update(learning_rate=3e-3, warmup_steps=2)
    config.checkpoint.update(every=6, replica_parallel=False)
    config.decode.update(num_samples=2, prompt_length=16, max_new_tokens=8)


def _vision(config):
    """Classification of images in class folders from a vision checkpoint (its bare tower and
    a new, zero-initialised head): every parameter trains, the best eval accuracy is kept."""
    config.task = "classification"
    config.update(batch_size=32, eval_batch_size=64, num_train_steps=2000, eval_every=500)
    config.model = _model("vit")
    config.dataset = _user_data("image_folders")  # one folder of images per class
    config.optim.update(learning_rate=1e-4, warmup_steps=100, weight_decay=0.05)
    config.loss = defaults.loss(vocabulary=False)
    del config.decode  # nothing to generate
    config.checkpoint.update(every=500, best_metric="accuracy", best_mode="max")


def _vision_tiny(config):
    """ "vision" for tests: a small checkpoint on small images, on CPU in seconds."""
    _vision(config)
    config.update(batch_size=32, eval_batch_size=64, log_every=50, eval_steps=0)
    config.update(num_train_steps=200, eval_every=200)
    config.optim.update(learning_rate=2e-3, warmup_steps=20)
    config.checkpoint.update(every=200, replica_parallel=False)


def _sized(config, variant, *, batch_size, seq_len, mesh, chunks, remat_policy="full"):
    """A published size in bf16 with scanned layers, for compiling its fit without weights
    (with the checkpoint in init_from the variant must match it: an error names a field that
    differs)."""
    config.model.update(variant=variant, scan_layers=True, remat_policy=remat_policy)
    config.dataset.seq_len = seq_len
    config.update(batch_size=batch_size, eval_batch_size=batch_size, dtype="bfloat16")
    config.loss.chunks = chunks
    config.mesh.update(mesh)
    return config


_PRESETS = {
    "full": defaults.unchanged,
    "lora": _lora,
    "tiny": _tiny,
    "vision": _vision,
    "vision-tiny": _vision_tiny,
    # Colab's TPU (v5e:1x1): every parameter of Qwen3-0.6B, its 151,936-token vocabulary's
    # logits in 8 slices
    "qwen3-0.6b-v5e": lambda c: _sized(
        c, "qwen3-0.6b", batch_size=8, seq_len=1024, mesh=dict(data=1, fsdp=1), chunks=8
    ),
    # v5e:1x1: LoRA on Gemma 3 1B (a 262,144-token vocabulary: the logits in 8 slices)
    "gemma-3-1b-lora-v5e": lambda c: _lora(
        _sized(c, "gemma-3-1b", batch_size=8, seq_len=1024, mesh=dict(data=1, fsdp=1), chunks=8)
    ),
    # v5e:2x2: LoRA on Llama 3.1 8B, the frozen base sharded over the 4 chips (FSDP)
    "llama-3.1-8b-lora-v5e": lambda c: _lora(
        _sized(c, "llama-3.1-8b", batch_size=8, seq_len=2048, mesh=dict(data=1, fsdp=-1), chunks=8)
    ),
    # one H100: LoRA on Llama 3.1 8B
    "llama-3.1-8b-lora-h100": lambda c: _lora(
        _sized(c, "llama-3.1-8b", batch_size=4, seq_len=2048, mesh=dict(data=1, fsdp=1), chunks=8)
    ),
    # one H100: QLoRA (the adapted kernels stored as NF4) on Llama 3.1 8B, the same rows
    "llama-3.1-8b-qlora-h100": lambda c: _lora(
        _sized(c, "llama-3.1-8b", batch_size=4, seq_len=2048, mesh=dict(data=1, fsdp=1), chunks=8),
        base_dtype="nf4",
    ),
    # v5p:4x4x8: LoRA on DeepSeek-V3 (671B): adapters on the latent attention and the dense
    # and shared MLPs (not the routed experts), the base sharded over the 128 chips (FSDP)
    "deepseek-v3-lora-v5p": lambda c: _lora(
        _sized(c, "deepseek-v3", batch_size=128, seq_len=2048, mesh=dict(data=1, fsdp=-1), chunks=8)
    ),
    # v5p:2x2x2: LoRA on Qwen3.5-35B-A3B's text model (its image-text checkpoint's too): adapters
    # on the Gated DeltaNet and gated attention projections and the shared experts (not the
    # routed experts nor the convolutions), the base sharded over the 8 chips (FSDP)
    "qwen3.5-35b-a3b-lora-v5p": lambda c: _lora(
        _sized(
            c, "qwen3.5-35b-a3b", batch_size=16, seq_len=2048, mesh=dict(data=1, fsdp=-1), chunks=8
        )
    ),
    # v5p:2x2x2: QLoRA on Llama 3.1 70B, the NF4 base sharded over the 8 chips (FSDP)
    "llama-3.1-70b-qlora-v5p": lambda c: _lora(
        _sized(
            c, "llama-3.1-70b", batch_size=8, seq_len=2048, mesh=dict(data=1, fsdp=-1), chunks=8
        ),
        base_dtype="nf4",
    ),
}
