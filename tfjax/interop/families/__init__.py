"""One module per Hugging Face family (config.json's model_type), each converting its
architectures both ways and declaring them in `CONVERTS` (see `core.registry`):

  gpt2      GPT2LMHeadModel                                  <-> models.decoder
  llama     LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
                                                             <-> models.decoder
  moe       MixtralForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM
                                                             <-> models.decoder, num_experts
  gemma     Gemma2ForCausalLM, Gemma3ForCausalLM (text)      <-> models.decoder
  bert      BertForMaskedLM, BertForSequenceClassification   <-> models.encoder
  vit       ViTForImageClassification; timm's ViT (import)   <-> models.vit
  dinov2    Dinov2Model, Dinov2WithRegistersModel            <-> models.vit, no head
  clip      CLIPVisionModel(WithProjection), SiglipVisionModel; CLIPModel, SiglipModel's vision
            towers (import)                                  <-> models.vit
  marian    MarianMTModel                                    <-> models.transformer
  t5        T5ForConditionalGeneration (v1.1, Flan-T5)       <-> models.transformer
  torch_nn  torch.nn.Transformer with embeddings, torch.nn.MultiheadAttention (no config.json)
                                                             <-> models.transformer,
                                                                 nn.MultiHeadAttention

Families import `tfjax.interop.core`, never each other: what two of them share lives there.
"""

from tfjax.interop.families import (
    bert,
    clip,
    dinov2,
    gemma,
    gpt2,
    llama,
    marian,
    moe,
    t5,
    torch_nn,
    vit,
)

ALL = (gpt2, llama, moe, gemma, bert, vit, dinov2, clip, marian, t5, torch_nn)
