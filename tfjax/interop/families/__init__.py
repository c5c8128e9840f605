"""One module per Hugging Face family (config.json's model_type), each converting its
architectures both ways and declaring them in `CONVERTS` (see `core.registry`): its rows of the
table of what converts (docs/interop.md) with their loaders, and its exporters. Its `__all__`
(the `from_*` / `to_*` converters) is what `tfjax.interop` re-exports.

  gpt2      GPT-2                            t5        T5 v1.1, Flan-T5
  llama     Llama, Mistral, Qwen 2 / 3       marian    Marian / Opus-MT
  moe       Mixtral, Qwen3-MoE, GPT-OSS      vit       Hugging Face's and timm's ViT
  deepseek  DeepSeek-V3 (latent attention)
  llama4    Llama 4 (chunked and NoPE attention, experts scaling their inputs)
  qwen3_5   Qwen3.5 (linear and gated attention)
  gemma     Gemma 2, Gemma 3 (text)          dinov2    DINOv2, with registers, classifiers
  bert      BERT (MLM, classifier)           clip      CLIP's and SigLIP's vision towers
  torch_nn  torch.nn.Transformer with embeddings, torch.nn.MultiheadAttention (no config.json)

Families import `tfjax.interop.core`, never each other: what two of them share lives there.
Multimodal `...ForConditionalGeneration` checkpoints load as their text model through the table
`core.multimodal.WRAPPERS`, whose rows join the family of each text architecture.
"""

from tfjax.interop.core.multimodal import with_wrappers
from tfjax.interop.core.registry import Registry
from tfjax.interop.families import (
    bert,
    clip,
    deepseek,
    dinov2,
    gemma,
    gpt2,
    llama,
    llama4,
    marian,
    moe,
    qwen3_5,
    t5,
    torch_nn,
    vit,
)

ALL = (
    gpt2,
    llama,
    moe,
    deepseek,
    llama4,
    qwen3_5,
    gemma,
    bert,
    vit,
    dinov2,
    clip,
    t5,
    marian,
    torch_nn,
)  # the table's order
REGISTRY = Registry(with_wrappers([family.CONVERTS for family in ALL]))
