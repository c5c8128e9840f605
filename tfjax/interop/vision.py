"""Vision towers: Hugging Face `Dinov2Model`, `Dinov2WithRegistersModel`, `CLIPVisionModel` and
`SiglipVisionModel` <-> `tfjax.models.vit` without a classification head (num_classes=None);
`CLIPVisionModelWithProjection` and the vision towers of whole `CLIPModel` and `SiglipModel`
checkpoints (read only; their export is the vision-only architecture).

    model, params = from_dinov2("path/to/dinov2")                  # as trained (518 px)
    model, params = from_dinov2("path/to/dinov2", image_size=224)  # posemb resampled to 224 px
    pooled, aux = model.apply({"params": params}, images)          # [B, H, W, C] -> [B, D]
    state, config = to_dinov2(model, params)
    model, params = from_clip("path/to/clip")                      # a whole CLIPModel
    features, aux = model.apply({"params": params}, images)        # [B, projection_dim]

What the towers give, as Hugging Face names them: last_hidden_state is aux["encoded"] and
pooler_output the model's output (aux["pre_logits"]):
  DINOv2   class token, registers (with registers), layer scale, final LayerNorm on every
           token; pooler_output = the class token. SwiGLU FFN for giant (use_swiglu_ffn).
  CLIP     class token, LayerNorm before the blocks (pre_layrnorm), quick_gelu; the tokens
           leave the last block un-normed, pooler_output = post_layernorm(class token).
  SigLIP   no class token, gelu_tanh, final LayerNorm on every token (post_layernorm),
           pooler_output = the attention pooling head (probe, MultiheadAttention, MLP).

Key mapping, layer i (DINOv2 bare; CLIP and SigLIP under "vision_model.", bare keys read too):
  DINOv2 embeddings.{cls_token, register_tokens, mask_token [1, D], position_embeddings}
             -> cls, registers, mask_token [D], pos_embed
         embeddings.patch_embeddings.projection -> patch_embed
         encoder.layer.i.norm1, norm2 -> encoder/layers_i/self_attention_norm, mlp_norm
         encoder.layer.i.attention.attention.{query,key,value}, attention.output.dense
             -> self_attention/{query,key,value,out}_*
         encoder.layer.i.layer_scale1, 2 .lambda1 -> self_attention_layer_scale, mlp_layer_scale
         encoder.layer.i.mlp.fc1, fc2 -> mlp/wi, wo; (SwiGLU) mlp.weights_in [2F, D] (gate rows,
             then up rows), weights_out -> mlp/wi_0, wi_1, wo
         layernorm -> encoder/final_norm
  CLIP   embeddings.class_embedding [D] -> cls [1, 1, D]; embeddings.patch_embedding (no bias)
         embeddings.position_embedding.weight [1 + P, D] -> pos_embed [1, 1 + P, D]
         pre_layrnorm -> pre_norm; post_layernorm -> pooled_norm
         encoder.layers.i.layer_norm1, 2 -> self_attention_norm, mlp_norm
         encoder.layers.i.self_attn.{q,k,v,out}_proj -> self_attention/{query,key,value,out}_*
         encoder.layers.i.mlp.fc1, fc2 -> mlp/wi, wo
  SigLIP as CLIP's layers; embeddings.patch_embedding (with bias); position_embedding [P, D];
         post_layernorm -> encoder/final_norm; head.probe, head.attention (torch
         MultiheadAttention, in_proj [3D, D]), head.layernorm, head.mlp -> map_head/probe,
         attention, norm, mlp

Whole image-text models load as what their `get_image_features` gives; the sizes are read from
config.json's vision_config (image_size and num_channels too), the text tower's keys
("text_model.*") and the named joint keys are skipped, and any other key is refused as usual:
  CLIPVisionModelWithProjection, CLIPModel  the tower plus visual_projection.weight [E, D] (no
           bias) -> head [D, E] with head_bias=False, num_classes = projection_dim (CLIPModel:
           the outer config's); from_clip(..., projection=False) (or load(dir,
           projection=False)) gives the tower's pooler_output instead (num_classes=None).
           CLIPModel skips text_projection and logit_scale. Export: CLIPVisionModelWithProjection
           (without the projection: CLIPVisionModel).
  SiglipModel  the SigLIP tower (pooler_output: the attention pooling head); skips logit_scale
           and logit_bias. Export: SiglipVisionModel.
A config whose image_size does not give the checkpoint's number of position embeddings is
refused, naming both.

Position embeddings are resampled to another `image_size` at load, with the bicubic resize the
Hugging Face model uses at that size (DINOv2 with registers: antialiased), so the model equals
the reference's `interpolate_pos_encoding`; the export's image_size is then the new one
(a square size: config.json has one number, so a non-square grid is refused at export).
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from tfjax.interop import core
from tfjax.interop.core import Field, Fixed
from tfjax.interop.vit import image_size_pair, resample_posemb
from tfjax.models import vit

# Hugging Face hidden_act -> tfjax activation (the tanh GELU has two names there).
ACTIVATIONS = {
    "gelu": "gelu",
    "quick_gelu": "quick_gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}
_TOWER = {  # what every tower fixes: no classification head, learned position embeddings
    "num_classes": None,
    "posemb": "learned",
}


def _as(key, path, torch_shape) -> core.Rule:
    """A tensor stored as `torch_shape` <-> a param of another shape with the same elements
    (CLIP's class_embedding [D] <-> cls [1, 1, D])."""
    return core.Rule(
        (key,),
        (path,),
        lambda x, shapes: (x.reshape(shapes[0]),),
        lambda y: (y.reshape(torch_shape(y)),),
    )


def _halves(key, paths) -> core.Rule:
    """One torch tensor [2F, ...] <-> two params, its first and second half along axis 0 (a
    Linear's weight transposed to [D, F] kernels; a bias [2F] to two [F] biases)."""

    def to_jax(x, shapes):
        parts = np.split(x, 2, axis=0)
        return tuple(p.T if p.ndim == 2 else p for p in parts)

    def to_torch(*ys):
        return (jnp.concatenate([y.T if y.ndim == 2 else y for y in ys], axis=0),)

    return core.Rule((key,), tuple(paths), to_jax, to_torch)


def _attention(h, att, names) -> list[core.Rule]:
    """q, k, v, out projections with biases, as torch Linear layers named `names`."""
    rules = []
    for ours, theirs in zip(("query", "key", "value"), names[:3], strict=True):
        rules += [
            core.linear(f"{h}{theirs}.weight", (*att, f"{ours}_kernel")),
            core.reshaped(f"{h}{theirs}.bias", (*att, f"{ours}_bias")),
        ]
    return [
        *rules,
        core.linear_out(f"{h}{names[3]}.weight", (*att, "out_kernel")),
        core.identity(f"{h}{names[3]}.bias", (*att, "out_bias")),
    ]


# ----------------------------------------------------------------------------------------------
# DINOv2.


def dinov2_rules(model: vit.VisionTransformer, prefix: str = "") -> list[core.Rule]:
    e = f"{prefix}embeddings."
    rules = [
        core.conv(f"{e}patch_embeddings.projection.weight", ("patch_embed", "kernel")),
        core.identity(f"{e}patch_embeddings.projection.bias", ("patch_embed", "bias")),
        core.identity(f"{e}cls_token", ("cls",)),
        core.identity(f"{e}position_embeddings", ("pos_embed",)),
        *core.norm(f"{prefix}layernorm", ("encoder", "final_norm")),
    ]
    if model.mask_token:
        rules.append(_as(f"{e}mask_token", ("mask_token",), lambda y: (1, -1)))
    if model.num_registers:
        rules.append(core.identity(f"{e}register_tokens", ("registers",)))
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layer.{i}.", ("encoder", f"layers_{i}")
        att = (*layer, "self_attention")
        names = ("attention.attention.query", "attention.attention.key")
        names += ("attention.attention.value", "attention.output.dense")
        rules += [
            *_attention(h, att, names),
            *core.norm(f"{h}norm1", (*layer, "self_attention_norm")),
            *core.norm(f"{h}norm2", (*layer, "mlp_norm")),
            core.identity(f"{h}layer_scale1.lambda1", (*layer, "self_attention_layer_scale")),
            core.identity(f"{h}layer_scale2.lambda1", (*layer, "mlp_layer_scale")),
        ]
        mlp = (*layer, "mlp")
        if model.activation == "swiglu":
            gate, up = (*mlp, "wi_0"), (*mlp, "wi_1")
            rules += [
                _halves(f"{h}mlp.weights_in.weight", [(*gate, "kernel"), (*up, "kernel")]),
                _halves(f"{h}mlp.weights_in.bias", [(*gate, "bias"), (*up, "bias")]),
                *core.dense(f"{h}mlp.weights_out", (*mlp, "wo")),
            ]
        else:
            rules += [*core.dense(f"{h}mlp.fc1", (*mlp, "wi"))]
            rules += [*core.dense(f"{h}mlp.fc2", (*mlp, "wo"))]
    return rules


def _dinov2_config(registers: bool) -> tuple:
    return (
        Field("patch_size", "patch_size", 14),
        Field("hidden_size", "width"),
        Field("num_hidden_layers", "num_layers"),
        Field("num_attention_heads", "num_heads"),
        Field("hidden_dropout_prob", "dropout_rate", 0.0),
        Field("attention_probs_dropout_prob", "attention_dropout_rate", 0.0),
        Field("layer_norm_eps", "norm_eps", 1e-6),
        Field("layerscale_value", "layer_scale", 1.0),
        # use_swiglu_ffn=True replaces it by "swiglu" (its FFN uses SiLU, not hidden_act)
        Field("hidden_act", "activation", "gelu", values={**ACTIVATIONS, "swiglu": "swiglu"}),
        *(
            (Field("num_register_tokens", "num_registers", 4),)
            if registers
            else (Field("use_mask_token", "mask_token", True),)
        ),
        Fixed("qkv_bias", True),
        Fixed("drop_path_rate", 0.0, why="tfjax's ViT has no stochastic depth"),
    )


_DINOV2_FIXED = {"pool": "cls", "final_norm": "tokens", "pre_norm": False, "patch_bias": True}
DINOV2 = core.Family(
    architecture="Dinov2Model",
    model_type="dinov2",
    model=vit.Model,
    config=_dinov2_config(registers=False),
    rules=dinov2_rules,
    requires={**_TOWER, **_DINOV2_FIXED, "num_registers": 0},
    defaults={"drop_remainder": True},  # as the stride-p convolution
)
DINOV2_REGISTERS = core.Family(
    architecture="Dinov2WithRegistersModel",
    model_type="dinov2_with_registers",
    model=vit.Model,
    config=_dinov2_config(registers=True),
    rules=dinov2_rules,
    requires={**_TOWER, **_DINOV2_FIXED, "mask_token": True},
    defaults={"drop_remainder": True},
)


def _swiglu_dim(width: int, ratio) -> int:
    """DINOv2's SwiGLU hidden width: 2/3 of width * mlp_ratio, rounded up to a multiple of 8."""
    return (int(int(width * ratio) * 2 / 3) + 7) // 8 * 8


def _dinov2_fields(family, c: dict) -> dict:
    """model_fields plus what DINOv2 spreads over several keys: use_swiglu_ffn and mlp_ratio."""
    swiglu = c.get("use_swiglu_ffn")
    if swiglu not in (None, False, True):
        raise ValueError(
            f"{family.architecture}: use_swiglu_ffn={swiglu!r} is not supported; "
            "allowed: (False, True)"
        )
    if swiglu:
        c = {**c, "hidden_act": "swiglu"}
    elif c.get("hidden_act") == "swiglu":
        raise ValueError(f"{family.architecture}: hidden_act='swiglu' is not a Hugging Face name")
    fields = core.model_fields(family, c)
    ratio = c.get("mlp_ratio") or 4
    width = fields["width"]
    fields["mlp_dim"] = _swiglu_dim(width, ratio) if swiglu else int(width * ratio)
    return fields


def _dinov2_extra(family, model) -> dict:
    """use_swiglu_ffn, hidden_act and mlp_ratio of the model (refused when no integer ratio
    gives its mlp_dim)."""
    swiglu = model.activation == "swiglu"
    for ratio in range(1, 17):
        if (_swiglu_dim(model.width, ratio) if swiglu else model.width * ratio) == model.mlp_dim:
            return {"use_swiglu_ffn": swiglu, "mlp_ratio": ratio}
    raise ValueError(
        f"{family.architecture} has no mlp_ratio for the model's mlp_dim={model.mlp_dim} "
        f"(width={model.width}): mlp_dim must be width * mlp_ratio"
        + (" (SwiGLU: 2/3 of it, rounded up to a multiple of 8)" if swiglu else "")
        + " for an integer mlp_ratio"
    )


# ----------------------------------------------------------------------------------------------
# CLIP and SigLIP.


def _clip_like_layers(model, prefix) -> list[core.Rule]:
    rules = []
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layers.{i}.", ("encoder", f"layers_{i}")
        names = tuple(f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
        rules += [
            *_attention(h, (*layer, "self_attention"), names),
            *core.norm(f"{h}layer_norm1", (*layer, "self_attention_norm")),
            *core.norm(f"{h}layer_norm2", (*layer, "mlp_norm")),
            *core.dense(f"{h}mlp.fc1", (*layer, "mlp", "wi")),
            *core.dense(f"{h}mlp.fc2", (*layer, "mlp", "wo")),
        ]
    return rules


def clip_vision_rules(model: vit.VisionTransformer, prefix: str = "vision_model.") -> list:
    e = f"{prefix}embeddings."
    return [
        core.conv(f"{e}patch_embedding.weight", ("patch_embed", "kernel")),
        _as(f"{e}class_embedding", ("cls",), lambda y: (-1,)),
        _as(f"{e}position_embedding.weight", ("pos_embed",), lambda y: y.shape[1:]),
        *core.norm(f"{prefix}pre_layrnorm", ("pre_norm",)),
        *core.norm(f"{prefix}post_layernorm", ("pooled_norm",)),
        *_clip_like_layers(model, prefix),
    ]


def siglip_vision_rules(model: vit.VisionTransformer, prefix: str = "vision_model.") -> list:
    e, head = f"{prefix}embeddings.", ("map_head",)
    att = (*head, "attention")
    qkv = ("query", "key", "value")
    return [
        core.conv(f"{e}patch_embedding.weight", ("patch_embed", "kernel")),
        core.identity(f"{e}patch_embedding.bias", ("patch_embed", "bias")),
        _as(f"{e}position_embedding.weight", ("pos_embed",), lambda y: y.shape[1:]),
        *core.norm(f"{prefix}post_layernorm", ("encoder", "final_norm")),
        *_clip_like_layers(model, prefix),
        core.identity(f"{prefix}head.probe", (*head, "probe")),
        core.stacked_linear(
            f"{prefix}head.attention.in_proj_weight", [(*att, f"{n}_kernel") for n in qkv]
        ),
        core.stacked_linear(
            f"{prefix}head.attention.in_proj_bias", [(*att, f"{n}_bias") for n in qkv]
        ),
        core.linear_out(f"{prefix}head.attention.out_proj.weight", (*att, "out_kernel")),
        core.identity(f"{prefix}head.attention.out_proj.bias", (*att, "out_bias")),
        *core.norm(f"{prefix}head.layernorm", (*head, "norm")),
        *core.dense(f"{prefix}head.mlp.fc1", (*head, "mlp", "wi")),
        *core.dense(f"{prefix}head.mlp.fc2", (*head, "mlp", "wo")),
    ]


def _clip_like_config(patch: int, eps: float, act: str) -> tuple:
    """CLIPVisionConfig's and SiglipVisionConfig's keys, a missing one meaning what it means to
    transformers (published SiglipModel configs leave most out of their vision_config)."""
    return (
        Field("patch_size", "patch_size", patch),
        Field("hidden_size", "width", 768),
        Field("intermediate_size", "mlp_dim", 3072),
        Field("num_hidden_layers", "num_layers", 12),
        Field("num_attention_heads", "num_heads", 12),
        Field("attention_dropout", "attention_dropout_rate", 0.0),
        Field("layer_norm_eps", "norm_eps", eps),
        Field("hidden_act", "activation", act, values=ACTIVATIONS),
    )


_CLIP_LIKE = {"num_registers": 0, "layer_scale": None, "mask_token": False, "patch_bias": True}
CLIP_VISION = core.Family(
    architecture="CLIPVisionModel",
    model_type="clip_vision_model",
    model=vit.Model,
    config=_clip_like_config(32, 1e-5, "quick_gelu"),
    rules=clip_vision_rules,
    prefix="vision_model.",
    bare="embeddings.",
    requires={
        **_TOWER,
        **_CLIP_LIKE,
        "pool": "cls",
        "pre_norm": True,
        "final_norm": "pooled",
        "patch_bias": False,
    },
    defaults={"drop_remainder": True},
    ignore=("*position_ids",),  # a buffer (0..P) in older files
)
SIGLIP_VISION = core.Family(
    architecture="SiglipVisionModel",
    model_type="siglip_vision_model",
    model=vit.Model,
    config=(
        *_clip_like_config(16, 1e-6, "gelu_pytorch_tanh"),
        Fixed("vision_use_head", True, why="the pooled output is the attention pooling head's"),
    ),
    rules=siglip_vision_rules,
    prefix="vision_model.",
    bare="embeddings.",
    requires={**_TOWER, **_CLIP_LIKE, "pool": "map", "pre_norm": False, "final_norm": "tokens"},
    defaults={"drop_remainder": True},
    ignore=("*position_ids",),
)

# ----------------------------------------------------------------------------------------------
# CLIP's visual projection, and the vision towers of whole CLIPModel and SiglipModel checkpoints.


def clip_projection_rules(model: vit.VisionTransformer, prefix: str = "vision_model.") -> list:
    """CLIPVisionModel's rules and visual_projection.weight [E, D] (no bias) -> head/kernel
    [D, E], E = projection_dim (outside the tower's prefix, as in both Hugging Face models)."""
    return [
        *clip_vision_rules(model, prefix),
        core.linear("visual_projection.weight", ("head", "kernel")),
    ]


_PROJECTION = Field("projection_dim", "num_classes", 512)  # both configs' default
# The tower's fields, with a bias-free head of projection_dim outputs instead of none.
_PROJECTED = {k: v for k, v in CLIP_VISION.requires.items() if k != "num_classes"}
_PROJECTED["head_bias"] = False
CLIP_VISION_PROJECTION = dataclasses.replace(
    CLIP_VISION,
    architecture="CLIPVisionModelWithProjection",
    config=(*CLIP_VISION.config, _PROJECTION),
    rules=clip_projection_rules,
    bare="",  # transformers writes this model's keys under "vision_model." only
    requires=_PROJECTED,
)


def _whole(tower: core.Family, architecture, model_type, ignore, extra=(), **changes):
    """A whole image-text model read as `tower`: the tower's config keys under "vision_config."
    (then `extra` keys of the outer config), the text tower ("text_model.*") and the named
    `ignore` keys skipped; any other key the rules do not read is still refused."""
    nested = tuple(dataclasses.replace(e, key=f"vision_config.{e.key}") for e in tower.config)
    return dataclasses.replace(
        tower,
        architecture=architecture,
        model_type=model_type,
        config=(*nested, *extra),
        bare="",
        ignore=(*tower.ignore, "text_model.*", *ignore),
        **changes,
    )


# get_image_features: visual_projection on the pooled output (CLIPModel's image embeddings).
CLIP = _whole(
    CLIP_VISION,
    "CLIPModel",
    "clip",
    ("text_projection.weight", "logit_scale"),
    extra=(_PROJECTION,),
    rules=clip_projection_rules,
    requires=_PROJECTED,
)
# get_image_features: the attention pooling head's output (SigLIP has no projection).
SIGLIP = _whole(SIGLIP_VISION, "SiglipModel", "siglip", ("logit_scale", "logit_bias"))
_NESTED = (CLIP.architecture, SIGLIP.architecture)  # image_size, num_channels in vision_config


def _unprojected(family: core.Family) -> core.Family:
    """A projected CLIP family read as the bare tower (pooler_output): visual_projection.weight
    (and the projection_dim key) skipped."""
    return dataclasses.replace(
        family,
        config=tuple(e for e in family.config if e is not _PROJECTION),
        rules=clip_vision_rules,
        requires=CLIP_VISION.requires,
        ignore=(*family.ignore, "visual_projection.weight"),
    )


# Each family's keys (after the prefix) of its position embeddings and patch kernel, whether
# the position embeddings hold the class token's, and whether it resamples them antialiased.
_DINO_KEYS = ("embeddings.position_embeddings", "embeddings.patch_embeddings.projection.weight")
_CLIP_KEYS = ("embeddings.position_embedding.weight", "embeddings.patch_embedding.weight")
_POSEMB = {
    "Dinov2Model": (*_DINO_KEYS, 1, False),
    "Dinov2WithRegistersModel": (*_DINO_KEYS, 1, True),
    "CLIPVisionModel": (*_CLIP_KEYS, 1, False),
    "CLIPVisionModelWithProjection": (*_CLIP_KEYS, 1, False),
    "CLIPModel": (*_CLIP_KEYS, 1, False),
    "SiglipVisionModel": (*_CLIP_KEYS, 0, False),
    "SiglipModel": (*_CLIP_KEYS, 0, False),
}


# ----------------------------------------------------------------------------------------------
# Load and save.


def model_fields(family: core.Family, config) -> dict:
    """The model fields of a tower's config (core.model_fields, and DINOv2's mlp_ratio and
    use_swiglu_ffn)."""
    c = core.as_config(config)
    if family.model_type.startswith("dinov2"):
        return _dinov2_fields(family, c)
    return core.model_fields(family, c)


def hf_config(family: core.Family, model) -> dict:
    """The config dict of a tower (core.hf_config, and DINOv2's mlp_ratio and use_swiglu_ffn);
    without image_size and num_channels, which the weights decide."""
    if not family.model_type.startswith("dinov2"):
        return core.hf_config(family, model)
    extra = _dinov2_extra(family, model)
    if model.activation == "swiglu":  # hidden_act is unused by DINOv2's SwiGLU FFN
        model = model.clone(activation="gelu")
    return core.hf_config(family, model) | extra


def _load(family, source, config, image_size, overrides):
    state, c = core.load_source(source, config)
    model = family.model(**{**model_fields(family, c), **overrides})
    what, nested = family.architecture, family.architecture in _NESTED
    vision = (c.get("vision_config") or {}) if nested else c
    size_key = "vision_config.image_size" if nested else "image_size"
    key, _, prefix_tokens, antialias = _POSEMB[what]
    key = core.key_prefix(family, state) + key
    p = model.patch_size
    trained = image_size_pair(vision.get("image_size") or 224)
    size = image_size_pair(image_size) if image_size else trained
    if min(size) < p:
        raise ValueError(f"{what}: image size {size} is smaller than patch {p}")
    if key in state:
        table = state[key]
        grid = (trained[0] // p, trained[1] // p)
        given = vision.get("image_size")
        said_size = f"{size_key}={given}" if given else f"no {size_key} (224)"
        if table.shape[-2] - prefix_tokens != grid[0] * grid[1]:
            raise ValueError(
                f"{what}: {said_size} means {grid[0]}x{grid[1]} "
                f"patches of {p} px ({grid[0] * grid[1] + prefix_tokens} position embeddings), "
                f"but {key!r} in {state.where(key)} holds {table.shape[-2]}; do the config and "
                "the weights belong together?"
            )
        resampled = resample_posemb(
            table.reshape(1, -1, table.shape[-1]),
            (size[0] // p, size[1] // p),
            num_prefix_tokens=prefix_tokens,
            antialias=antialias,
        )
        state = core.StateDict(state, state.files, state.origin)
        state[key] = resampled.reshape(*table.shape[:-2], -1, table.shape[-1])
    images = jnp.zeros((1, *size, vision.get("num_channels") or 3), jnp.float32)
    return model, core.import_params(family, model, state, inputs=(images,))


def _save(family, model, params):
    config = hf_config(family, model)
    state = core.export_state(core.unrolled(model, params), family.rules(model, family.prefix))
    posemb, kernel, prefix_tokens, _ = _POSEMB[family.architecture]
    posemb, kernel = state[family.prefix + posemb], state[family.prefix + kernel]
    patches = posemb.shape[-2] - prefix_tokens
    side = math.isqrt(patches)
    if side * side != patches:
        raise ValueError(
            f"{family.architecture}: the position embeddings hold {patches} patches, no square "
            "grid, and config.json's image_size is one number; load at a square image_size"
        )
    config |= {"image_size": side * model.patch_size, "num_channels": kernel.shape[1]}
    return state, config


def from_dinov2(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a Dinov2Model directory or (state dict, config); image_size: int
    or (H, W) the model will see (the position embeddings resampled from config's image_size)."""
    return _load(DINOV2, source, config, image_size, overrides)


def from_dinov2_registers(source, config=None, *, image_size=None, **overrides):
    """As from_dinov2, for Dinov2WithRegistersModel (antialiased resampling, as it does)."""
    return _load(DINOV2_REGISTERS, source, config, image_size, overrides)


def from_clip_vision(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a CLIPVisionModel directory or (state dict, config)."""
    return _load(CLIP_VISION, source, config, image_size, overrides)


def from_siglip_vision(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a SiglipVisionModel directory or (state dict, config)."""
    return _load(SIGLIP_VISION, source, config, image_size, overrides)


def _projection_choice(family, projection):
    if projection not in (True, False):
        raise ValueError(f"{family.architecture}: projection={projection!r}; allowed: True, False")
    return family if projection else _unprojected(family)


def from_clip_vision_projection(
    source, config=None, *, projection=True, image_size=None, **overrides
):
    """(tfjax ViT, params) from a CLIPVisionModelWithProjection: the image embeddings
    (image_embeds, visual_projection as a bias-free head of projection_dim outputs); with
    projection=False the tower's pooler_output (num_classes=None, visual_projection skipped)."""
    family = _projection_choice(CLIP_VISION_PROJECTION, projection)
    return _load(family, source, config, image_size, overrides)


def from_clip(source, config=None, *, projection=True, image_size=None, **overrides):
    """(tfjax ViT, params) of a whole CLIPModel's vision tower: what get_image_features gives
    (the projected pooled output; projection=False: the tower's pooler_output). The text tower,
    text_projection and logit_scale are skipped; the export is CLIPVisionModelWithProjection (or
    CLIPVisionModel), which holds the same numbers."""
    family = _projection_choice(CLIP, projection)
    return _load(family, source, config, image_size, overrides)


def from_siglip(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) of a whole SiglipModel's vision tower: what get_image_features gives
    (the attention pooling head's output). The text tower, logit_scale and logit_bias are
    skipped; the export is SiglipVisionModel, which holds the same numbers."""
    return _load(SIGLIP, source, config, image_size, overrides)


def to_dinov2(model, params):
    """({key: array}, config): Dinov2Model, or Dinov2WithRegistersModel with registers."""
    return _save(DINOV2_REGISTERS if model.num_registers else DINOV2, model, params)


def to_clip_vision(model, params):
    return _save(CLIP_VISION, model, params)


def to_clip_vision_projection(model, params):
    """({key: array}, config): CLIPVisionModelWithProjection (a CLIP tower with head_bias=False,
    as from_clip and from_clip_vision_projection load it)."""
    return _save(CLIP_VISION_PROJECTION, model, params)


def to_siglip_vision(model, params):
    return _save(SIGLIP_VISION, model, params)


def _clip_like(model) -> bool:
    return model.final_norm == "pooled" or model.pre_norm


def export_family(model: vit.VisionTransformer):
    """The vision-tower family of a ViT by its fields, or None (HF ViT's): without a head a
    tower; with a bias-free head on CLIP's tower, CLIPVisionModelWithProjection."""
    if model.num_classes is not None:
        return CLIP_VISION_PROJECTION if not model.head_bias and _clip_like(model) else None
    if model.pool == "map":
        return SIGLIP_VISION
    if _clip_like(model):
        return CLIP_VISION
    if model.layer_scale is not None:
        return DINOV2_REGISTERS if model.num_registers else DINOV2
    return None


def export(model, params):
    """The export of a ViT as the tower its fields say (see export_family)."""
    family = export_family(model)
    if family is None:
        raise ValueError(
            "a ViT without a head exports as a vision tower: DINOv2 (layer_scale), CLIP "
            "(pre_norm, final_norm='pooled') or SigLIP (pool='map'), and one with a bias-free "
            "head (head_bias=False) as CLIP's tower with its projection; this one is none of them"
        )
    return _save(family, model, params)
