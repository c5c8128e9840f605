"""Converters between PyTorch / Hugging Face checkpoints and tfjax parameter trees.

    from tfjax import interop
    model, params = interop.load("path/to/checkpoint")   # config.json + safetensors / .bin
    logits, aux = model.apply({"params": params}, tokens)
    interop.save(model, params, "path/to/out")           # model.safetensors + config.json

    model = interop.load("path/to/checkpoint", nnx=True)  # a Flax NNX model (tfjax.nnx)
    logits, aux = model(tokens)
    interop.save(model, "path/to/out")                   # its nnx.Param state is the params

One module per Hugging Face family converts its architectures both ways (`families/`: gpt2,
llama, moe, gemma, bert, vit, dinov2, clip, marian, t5, torch_nn), each also from a state dict
plus a config (`from_gpt2(state, cfg)`). Each architecture is a `core.tables.Family` (GPT2,
LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, GPT_OSS, GEMMA2, GEMMA3, BERT_MLM,
BERT_CLASSIFIER, HF_VIT, DINOV2, DINOV2_REGISTERS, DINOV2_CLASSIFIER,
DINOV2_REGISTERS_CLASSIFIER, CLIP_VISION, SIGLIP_VISION, CLIP_VISION_PROJECTION, CLIP, SIGLIP,
MARIAN, T5): one table of config.json keys
<-> model fields and one function of key rules, which import and export both read. Each family
module declares what it loads (architecture -> loader) and exports (tfjax model class and a
predicate on its fields -> exporter); `load` picks the loader from the config's "architectures"
(the keys of ARCHITECTURES) and `export` the one exporter that takes the model
(`core.registry`). Every converter checks every key and shape before returning: nothing is
loaded half-way. Parameters come back as the plain "params" collection, stacked when the model
has `scan_layers=True`.

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
  Mixtral (MixtralForCausalLM)            from_mixtral       models.decoder (num_experts,
                                                             experts_per_token; sliding_window)
  Qwen3-MoE (Qwen3MoeForCausalLM)         from_qwen3_moe     models.decoder (Qwen 3's attention,
                                                             expert_mlp_dim, router_renormalize,
                                                             first_dense_layers)
  GPT-OSS (GptOssForCausalLM; float       from_gpt_oss       models.decoder (attention_sinks,
    weights, not the Hub's MXFP4)                            attention_pattern, biases,
                                                             swiglu_clamped, router_bias)
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
  DINOv2 + classifier                     from_dinov2_classifier  models.vit, pool="cls_gap"
    (Dinov2ForImageClassification; with   (from_dinov2_registers_classifier) and a head (the
    registers: Dinov2WithRegisters...)                       class token and the mean of the
                                                             patch tokens, as its classifier)
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

import os

import flax
import jax
import numpy as np
from flax import nnx as _nnx

from tfjax.interop import core, families
from tfjax.interop.core import convert, tables, towers
from tfjax.interop.core.files import CONFIG, read_config, read_state_dict, write_safetensors
from tfjax.interop.core.posemb import image_size_pair, resample_posemb
from tfjax.interop.core.registry import Registry
from tfjax.interop.families.bert import from_bert, to_bert
from tfjax.interop.families.clip import (
    from_clip,
    from_clip_vision,
    from_clip_vision_projection,
    from_siglip,
    from_siglip_vision,
    to_clip_vision,
    to_clip_vision_projection,
    to_siglip_vision,
)
from tfjax.interop.families.dinov2 import (
    from_dinov2,
    from_dinov2_classifier,
    from_dinov2_registers,
    from_dinov2_registers_classifier,
    to_dinov2,
    to_dinov2_classifier,
)
from tfjax.interop.families.gemma import from_gemma2, from_gemma3, to_gemma2, to_gemma3
from tfjax.interop.families.gpt2 import from_gpt2, to_gpt2
from tfjax.interop.families.llama import (
    from_llama,
    from_mistral,
    from_qwen2,
    from_qwen3,
    to_llama,
    to_mistral,
    to_qwen2,
    to_qwen3,
)
from tfjax.interop.families.marian import (
    from_marian,
    marian_id_map,
    marian_to_tfjax_ids,
    tfjax_to_marian_ids,
    to_marian,
)
from tfjax.interop.families.moe import (
    from_gpt_oss,
    from_mixtral,
    from_qwen3_moe,
    to_gpt_oss,
    to_mixtral,
    to_qwen3_moe,
)
from tfjax.interop.families.t5 import from_t5, to_t5
from tfjax.interop.families.torch_nn import (
    from_torch_mha,
    from_torch_transformer,
    to_torch_mha,
    to_torch_transformer,
)
from tfjax.interop.families.vit import from_hf_vit, from_timm_vit, to_hf_vit

REGISTRY = Registry(family.CONVERTS for family in families.ALL)
ARCHITECTURES = REGISTRY.loaders  # Hugging Face architecture -> loader(directory, config, **kw)


def load(directory, *, nnx: bool = False, rngs: _nnx.Rngs | None = None, **overrides):
    """(model, params) from a local Hugging Face checkpoint directory (no hub access).

    `overrides` go to the converter (e.g. scan_layers=True, dtype, image_size for ViT).

    nnx=True: the Flax NNX model instead (`tfjax.nnx.models.from_linen` of the same model,
    which holds the params as its nnx.Param state; see `as_nnx`); `rngs` seeds its own
    streams (dropout when training), nnx.Rngs(0) when None.
    """
    if rngs is not None and not nnx:
        raise ValueError("load: rngs= is for the NNX model (nnx=True)")
    config = read_config(directory)
    where = os.path.join(os.fspath(directory), CONFIG)
    model, params = REGISTRY.loader(config, where)(directory, config, **overrides)
    if not nnx:
        return model, params
    return as_nnx(model, params, *_example_images(model, config, overrides), rngs=rngs)


def _example_images(model, config, overrides) -> tuple:
    """A vision tower's example images (their shape, [1, H, W, C]) at the size its params are
    for (image_size= when resampled, else the checkpoint's), which size its NNX model."""
    if type(model).__name__ != "VisionTransformer":
        return ()
    vision = config.get("vision_config", config)
    height, width = image_size_pair(overrides.get("image_size") or vision.get("image_size", 224))
    channels = vision.get("num_channels", 3)
    return (jax.ShapeDtypeStruct((1, height, width, channels), np.float32),)


def as_nnx(model, params, *example_args, rngs: _nnx.Rngs | None = None):
    """The Flax NNX model (tfjax.nnx) of the Linen `model` (its `spec`) holding `params` (that
    model's params tree, boxed or not), built without drawing its parameters at random: its
    layout comes from `nnx.eval_shape`, and only its non-parameter state (RNG streams, from
    `rngs`, nnx.Rngs(0) when None) is computed. Any family `tfjax.nnx.models.FAMILIES` has;
    `example_args`: inputs as the model will take them, for a family that is sized by its
    inputs (a ViT's images, [B, H, W, C] arrays or shapes; else its default size)."""
    from tfjax.nnx import models as nnx_models  # NNX only when asked for

    rngs = _nnx.Rngs(0) if rngs is None else rngs

    def build(rngs):
        return nnx_models.from_linen(model, *example_args, rngs=rngs)

    abstract = _nnx.eval_shape(lambda: build(_nnx.Rngs(0)))
    graphdef, layout, _ = _nnx.split(abstract, _nnx.Param, ...)

    # The parameter initialisers are traced but not run: XLA drops what is not returned.
    @_nnx.jit
    def rest(rngs):
        return _nnx.state(build(rngs), _nnx.Not(_nnx.Param))

    def describe(x):
        return "none" if x is None else f"{x.dtype}{list(x.shape)}"

    example_hint = not example_args and hasattr(abstract, "num_patches")  # a ViT's size
    want = flax.traverse_util.flatten_dict(_nnx.to_pure_dict(layout), sep="/")
    got = flax.traverse_util.flatten_dict(flax.linen.meta.unbox(params), sep="/")
    for path in sorted(want.keys() | got.keys()):
        w, g = want.get(path), got.get(path)
        if w is None or g is None or (w.shape, w.dtype) != (g.shape, g.dtype):
            raise ValueError(
                f"as_nnx: params[{path!r}] is {describe(g)}; the NNX {type(abstract).__name__} "
                f"has {describe(w)}"
                + (" (pass example images of the checkpoint's size)" if example_hint else "")
            )
    out = _nnx.merge(graphdef, layout, rest(rngs))
    nnx_models.load_params(out, params)
    return out


def _linen(model, params):
    """(Linen model, params) of the arguments of export/save: an NNX model gives its `spec`
    and its nnx.Param state (the Linen params tree)."""
    if not isinstance(model, _nnx.Module):
        if params is None:
            raise TypeError(f"a Linen {type(model).__name__} needs its params")
        return model, params
    if params is not None:
        raise TypeError(f"an NNX {type(model).__name__} holds its params; pass none")
    if _nnx.state(model, _nnx.LoRAParam):
        raise ValueError(
            f"the NNX {type(model).__name__} holds LoRA adapters (nnx.LoRAParam); export the "
            "merged params: lora.merge(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config) "
            "with the model's `spec`"
        )
    spec = getattr(model, "spec", None)
    if not isinstance(spec, flax.linen.Module):
        raise TypeError(f"{type(model).__name__} is not a tfjax.nnx family model (no Linen `spec`)")
    return spec, _nnx.to_pure_dict(_nnx.state(model, _nnx.Param))


def _run_loader(directory):
    """(family, vision tower or None, config dict) a run starts from: a table-driven family, or
    a vision tower's backbone (the bare tower, without the checkpoint's own head)."""
    config = read_config(directory)
    where = os.path.join(os.fspath(directory), CONFIG)
    loader = REGISTRY.loader(config, where)
    tower = getattr(loader, "backbone", None)
    family = tower.family if tower is not None else getattr(loader, "family", None)
    if family is None:
        raise ValueError(
            f"{where}: {config.get('architectures')} loads with interop.load, but a run cannot "
            "start from it yet; loadable by a run: "
            + ", ".join(a for a, f in ARCHITECTURES.items() if _runnable(f))
        )
    return family, tower, config


def _runnable(loader) -> bool:
    return hasattr(loader, "family") or hasattr(loader, "backbone")


def family_of(directory):
    """(the `core.tables.Family`, config dict) a checkpoint directory's config.json names (read
    alone, no weights), for starting a run from it: for a vision checkpoint the bare tower's
    (DINOv2, CLIP, SigLIP: a run gives it its own head); a ValueError names an architecture
    that has no converter or that a run cannot start from (ViTForImageClassification)."""
    family, _, config = _run_loader(directory)
    return family, config


def pretrained_model(directory, **overrides):
    """The tfjax model a checkpoint directory's config.json means, without reading weights;
    `overrides` set fields that do not change the maths (scan_layers, dtype, ...)."""
    family, config = family_of(directory)
    return tables.build(family, config, **overrides)


def pretrained_params(directory, model, *, image_size=None):
    """The weights of a checkpoint directory as `model`'s params (its layout: stacked when
    scan_layers), every key and shape checked; `model` as `pretrained_model` gives it (other
    fields that do not change the parameters may differ). A vision tower's position embeddings
    are resampled to `image_size` (int or (H, W); None: the config's image_size)."""
    family, tower, config = _run_loader(directory)
    state = read_state_dict(directory)
    if tower is not None:
        return towers.import_params(tower, model, state, config, image_size)
    return convert.import_params(family, model, state)


def check_pretrained(directory) -> None:
    """Every key and shape of a checkpoint directory's safetensors weights against the model
    its config.json builds (`pretrained_model`), from the files' headers: no tensor is read, no
    device used. A config.json whose sizes are not its weights' is a ValueError naming the key,
    the file and both shapes, before a run does any work. Vision towers (read whole) and torch
    files (no header to read) are checked as they load."""
    family, tower, _ = _run_loader(directory)
    state = read_state_dict(directory, lazy=True)
    if tower is not None or not isinstance(state, core.files.LazyStateDict):
        return
    model = pretrained_model(directory)
    if hasattr(model, "implementation"):  # the same parameters; its choice needs no device
        model = model.clone(implementation="xla")
    convert.check_params(family, model, state)


def stream_pretrained_params(directory, model, *, image_size=None, digest=None):
    """`pretrained_params` one parameter at a time, for placing each on its devices as it is
    read: (path in `model`'s layout, numpy array), every key and shape checked first, the
    safetensors files read tensor by tensor (memory-mapped); see `convert.stream_params`. A
    vision tower (at most a few GB; its position embeddings resampled as a whole) is read
    whole, then given a parameter at a time. `digest` (a `core.files.ContentDigest`) is given
    each checkpoint tensor as it is read: the weights' identity, at no second read."""
    family, tower, config = _run_loader(directory)
    if tower is not None:
        state = read_state_dict(directory, digest=digest)
        params = towers.import_params(tower, model, state, config, image_size)
        flat = flax.traverse_util.flatten_dict(jax.device_get(params))
        return ((path, np.asarray(array)) for path, array in flat.items())
    return convert.stream_params(
        family, model, read_state_dict(directory, lazy=True, digest=digest)
    )


def export(model, params=None):
    """({Hugging Face key: numpy array}, config dict) for a tfjax model: a Linen model and its
    params, or a tfjax.nnx model alone (its params are its nnx.Param state)."""
    model, params = _linen(model, params)
    return REGISTRY.exporter(model).export(model, params)


def save(model, *args) -> str:
    """save(model, params, directory) for a Linen model, save(model, directory) for a
    tfjax.nnx model: writes model.safetensors and config.json (Hugging Face layout); returns
    the weights path.

    `load(directory)` (`nnx=True`) gives the same params back bit for bit, and transformers'
    `from_pretrained(directory)` reads it.
    """
    nnx = isinstance(model, _nnx.Module)
    if len(args) != (1 if nnx else 2):
        raise TypeError(
            "save takes (model, directory) for an NNX model, (model, params, directory) for a "
            f"Linen one; got {1 + len(args)} arguments for a {type(model).__name__}"
        )
    state, config = export(model, *args[:-1])
    return write_safetensors(state, args[-1], config)


__all__ = [
    "ARCHITECTURES",
    "REGISTRY",
    "as_nnx",
    "core",
    "export",
    "families",
    "family_of",
    "from_bert",
    "from_clip",
    "from_clip_vision",
    "from_clip_vision_projection",
    "from_dinov2",
    "from_dinov2_classifier",
    "from_dinov2_registers",
    "from_dinov2_registers_classifier",
    "from_gemma2",
    "from_gemma3",
    "from_gpt2",
    "from_gpt_oss",
    "from_hf_vit",
    "from_llama",
    "from_marian",
    "from_mistral",
    "from_mixtral",
    "from_qwen2",
    "from_qwen3",
    "from_qwen3_moe",
    "from_siglip",
    "from_siglip_vision",
    "from_t5",
    "from_timm_vit",
    "from_torch_mha",
    "from_torch_transformer",
    "load",
    "marian_id_map",
    "marian_to_tfjax_ids",
    "pretrained_model",
    "pretrained_params",
    "read_config",
    "read_state_dict",
    "stream_pretrained_params",
    "resample_posemb",
    "save",
    "tfjax_to_marian_ids",
    "to_bert",
    "to_clip_vision",
    "to_clip_vision_projection",
    "to_dinov2",
    "to_dinov2_classifier",
    "to_gemma2",
    "to_gemma3",
    "to_gpt2",
    "to_gpt_oss",
    "to_hf_vit",
    "to_llama",
    "to_marian",
    "to_mistral",
    "to_mixtral",
    "to_qwen2",
    "to_qwen3",
    "to_qwen3_moe",
    "to_siglip_vision",
    "to_t5",
    "to_torch_mha",
    "to_torch_transformer",
    "write_safetensors",
]
