"""Converters between PyTorch / Hugging Face checkpoints and tfjax parameter trees.

    from tfjax import interop
    model, params = interop.load("path/to/checkpoint")   # config.json + safetensors / .bin
    logits, aux = model.apply({"params": params}, tokens)
    interop.save(model, params, "path/to/out")           # model.safetensors + config.json

`load` picks the converter from the config's "architectures" (the keys of ARCHITECTURES).
Each family module also converts a state dict plus a config (`decoder.from_gpt2(state,
cfg)`). Each Hugging Face architecture is a `core.Family` (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3,
GEMMA2, GEMMA3,
BERT_MLM, BERT_CLASSIFIER, HF_VIT, DINOV2, DINOV2_REGISTERS, CLIP_VISION, SIGLIP_VISION,
CLIP_VISION_PROJECTION, CLIP, SIGLIP, MARIAN, T5): one table of config.json keys <-> model fields
and one function of key rules, which import and export both read. Every converter checks
every key and shape before returning: nothing is loaded half-way. Parameters come back as
the plain "params" collection, stacked when the model has `scan_layers=True`.

What loads (every row also exports, `to_*`, and round trips bit for bit; a whole CLIPModel or
SiglipModel exports its vision tower as the vision-only architecture):

  source                                  import             tfjax model
  GPT-2 (GPT2LMHeadModel)                 from_gpt2          models.decoder (learned pos.)
  Llama 1-3.x (LlamaForCausalLM)          from_llama         models.decoder (RoPE, SwiGLU;
                                                             rope_scaling: llama3, linear,
                                                             dynamic, yarn)
  Mistral (MistralForCausalLM)            from_mistral       models.decoder (sliding_window)
  Qwen 2 / 2.5 (Qwen2ForCausalLM)         from_qwen2         models.decoder (qkv_bias)
  Qwen 3 (Qwen3ForCausalLM)               from_qwen3         models.decoder (qk_norm, head_dim)
  Gemma 2 (Gemma2ForCausalLM)             from_gemma2        models.decoder (sandwich norms,
                                                             soft caps, attention_pattern)
  Gemma 3 text (Gemma3ForCausalLM)        from_gemma3        models.decoder (+ qk_norm, local
                                                             and global RoPE)
  BERT (BertForMaskedLM, ...Classif.)     from_bert          models.encoder (mlm / classifier)
  ViT (HF ViTForImageClassification)      from_hf_vit        models.vit
  ViT (timm state dict; export: none)     from_timm_vit      models.vit
  DINOv2 (Dinov2Model)                    from_dinov2        models.vit, num_classes=None
                                                             (layer_scale, mask_token,
                                                             swiglu for giant)
  DINOv2 + registers                      from_dinov2_registers  models.vit (num_registers)
  CLIP vision (CLIPVisionModel)           from_clip_vision   models.vit (quick_gelu, pre_norm,
                                                             final_norm="pooled")
  SigLIP vision (SiglipVisionModel)       from_siglip_vision models.vit (pool="map")
  CLIP vision + projection                from_clip_vision_projection  models.vit (head:
    (CLIPVisionModelWithProjection)                          visual_projection, head_bias=False)
  CLIP image tower (CLIPModel)            from_clip          as above: get_image_features
                                                             (projection=False: pooler_output);
                                                             text tower skipped; export: the
                                                             row above (to_clip_vision_projection)
  SigLIP image tower (SiglipModel)        from_siglip        models.vit (pool="map"); text tower
                                                             skipped; export: SiglipVisionModel
  Marian / Opus-MT (MarianMTModel)        from_marian        models.transformer; pad != 0
                                                             needs remap_ids=True (ids swapped,
                                                             see marian_id_map)
  T5 v1.1, Flan-T5                        from_t5            models.transformer (relative
  (T5ForConditionalGeneration)                               position bias, RMSNorm, gated
                                                             GELU, no biases)
  torch.nn.Transformer + embeddings       from_torch_transformer  models.transformer
  torch.nn.MultiheadAttention             from_torch_mha     nn.MultiHeadAttention

Needs `safetensors` (and `torch` only for pytorch_model.bin files); never `transformers`.
"""

import functools
import os

from tfjax.interop import attention, core, decoder, encoder, gemma, t5, transformer, vision, vit
from tfjax.interop.attention import from_torch_mha, to_torch_mha
from tfjax.interop.core import read_config, read_state_dict, write_safetensors
from tfjax.interop.decoder import (
    from_gpt2,
    from_llama,
    from_mistral,
    from_qwen2,
    from_qwen3,
    to_gpt2,
    to_llama,
    to_mistral,
    to_qwen2,
    to_qwen3,
)
from tfjax.interop.encoder import from_bert, to_bert
from tfjax.interop.gemma import from_gemma2, from_gemma3, to_gemma2, to_gemma3
from tfjax.interop.t5 import from_t5, to_t5
from tfjax.interop.transformer import (
    from_marian,
    from_torch_transformer,
    marian_id_map,
    marian_to_tfjax_ids,
    tfjax_to_marian_ids,
    to_marian,
    to_torch_transformer,
)
from tfjax.interop.vision import (
    from_clip,
    from_clip_vision,
    from_clip_vision_projection,
    from_dinov2,
    from_dinov2_registers,
    from_siglip,
    from_siglip_vision,
    to_clip_vision,
    to_clip_vision_projection,
    to_dinov2,
    to_siglip_vision,
)
from tfjax.interop.vit import from_hf_vit, from_timm_vit, resample_posemb, to_hf_vit
from tfjax.models import decoder as _decoder
from tfjax.models import encoder as _encoder
from tfjax.models import transformer as _transformer
from tfjax.models import vit as _vit

ARCHITECTURES = {
    "GPT2LMHeadModel": from_gpt2,
    "LlamaForCausalLM": from_llama,
    "MistralForCausalLM": from_mistral,
    "Qwen2ForCausalLM": from_qwen2,
    "Qwen3ForCausalLM": from_qwen3,
    "Gemma2ForCausalLM": from_gemma2,
    "Gemma3ForCausalLM": from_gemma3,
    "BertForMaskedLM": functools.partial(from_bert, head="mlm"),
    "BertForSequenceClassification": functools.partial(from_bert, head="classifier"),
    "ViTForImageClassification": from_hf_vit,
    "Dinov2Model": from_dinov2,
    "Dinov2WithRegistersModel": from_dinov2_registers,
    "CLIPVisionModel": from_clip_vision,
    "SiglipVisionModel": from_siglip_vision,
    "CLIPVisionModelWithProjection": from_clip_vision_projection,
    "CLIPModel": from_clip,
    "SiglipModel": from_siglip,
    "MarianMTModel": from_marian,
    "T5ForConditionalGeneration": from_t5,
}


def load(directory, **overrides):
    """(model, params) from a local Hugging Face checkpoint directory (no hub access).

    `overrides` go to the converter (e.g. scan_layers=True, dtype, image_size for ViT).
    """
    config = read_config(directory)
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch](directory, config, **overrides)
    raise ValueError(
        f"{os.path.join(os.fspath(directory), core.CONFIG)}: architectures={archs} has no "
        f"converter; supported: {', '.join(ARCHITECTURES)}"
    )


def export(model, params):
    """({Hugging Face key: numpy array}, config dict) for a tfjax model."""
    if isinstance(model, _decoder.Decoder):
        return core.to_hf(decoder.export_family(model), decoder.spelled_out(model), params)
    if isinstance(model, _encoder.Encoder):
        return to_bert(model, params)
    if isinstance(model, _vit.VisionTransformer):
        if model.num_classes is None or not model.head_bias:  # a tower (DINOv2, CLIP, SigLIP)
            return vision.export(model, params)
        return to_hf_vit(model, params)
    if isinstance(model, _transformer.Transformer):
        if model.position == "relative":  # T5's relative position bias
            return to_t5(model, params)
        return to_marian(model, params)
    raise ValueError(f"no exporter for {type(model).__name__}")


def save(model, params, directory) -> str:
    """Writes model.safetensors and config.json (Hugging Face layout); returns the weights path.

    `load(directory)` gives the same params back bit for bit, and transformers'
    `from_pretrained(directory)` reads it.
    """
    state, config = export(model, params)
    return write_safetensors(state, directory, config)


__all__ = [
    "ARCHITECTURES",
    "attention",
    "core",
    "decoder",
    "encoder",
    "export",
    "gemma",
    "from_bert",
    "from_gemma2",
    "from_gemma3",
    "from_clip",
    "from_clip_vision",
    "from_clip_vision_projection",
    "from_dinov2",
    "from_dinov2_registers",
    "from_gpt2",
    "from_hf_vit",
    "from_llama",
    "from_mistral",
    "from_qwen2",
    "from_qwen3",
    "from_siglip",
    "from_siglip_vision",
    "from_marian",
    "from_t5",
    "from_timm_vit",
    "from_torch_mha",
    "from_torch_transformer",
    "load",
    "marian_id_map",
    "marian_to_tfjax_ids",
    "read_config",
    "read_state_dict",
    "resample_posemb",
    "save",
    "tfjax_to_marian_ids",
    "to_bert",
    "to_gemma2",
    "to_gemma3",
    "to_clip_vision",
    "to_clip_vision_projection",
    "to_dinov2",
    "to_gpt2",
    "to_hf_vit",
    "to_llama",
    "to_mistral",
    "to_qwen2",
    "to_qwen3",
    "to_siglip_vision",
    "to_marian",
    "to_t5",
    "t5",
    "to_torch_mha",
    "to_torch_transformer",
    "transformer",
    "vision",
    "vit",
    "write_safetensors",
]
