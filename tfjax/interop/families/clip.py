"""CLIP's and SigLIP's vision towers <-> `tfjax.models.vit`: `CLIPVisionModel`,
`CLIPVisionModelWithProjection` and `SiglipVisionModel`, and the vision towers of whole
`CLIPModel` and `SiglipModel` checkpoints (read only; their export is the vision-only
architecture).

    model, params = from_clip_vision("path/to/clip-vision")        # as trained
    pooled, aux = model.apply({"params": params}, images)          # [B, H, W, C] -> [B, D]
    model, params = from_clip("path/to/clip")                      # a whole CLIPModel
    features, aux = model.apply({"params": params}, images)        # [B, projection_dim]
    state, config = to_clip_vision_projection(model, params)

What the towers give, as Hugging Face names them: last_hidden_state is aux["encoded"] and
pooler_output the model's output (aux["pre_logits"]):
  CLIP     class token, LayerNorm before the blocks (pre_layrnorm), quick_gelu; the tokens
           leave the last block un-normed, pooler_output = post_layernorm(class token).
  SigLIP   no class token, gelu_tanh, final LayerNorm on every token (post_layernorm),
           pooler_output = the attention pooling head (probe, MultiheadAttention, MLP).

Key mapping, layer i (under "vision_model.", bare keys read too):
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
refused, naming both. Position embeddings are resampled to another `image_size` at load
(`core.towers`), so the model equals the reference's `interpolate_pos_encoding`.
"""

import dataclasses

from tfjax.interop.core import towers
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import (
    Rule,
    attention,
    conv,
    identity,
    linear,
    mlp,
    norm,
    reshaped_as,
    torch_mha,
)
from tfjax.interop.core.tables import Family, Field, Fixed
from tfjax.models import vit

__all__ = [
    "from_clip",
    "from_clip_vision",
    "from_clip_vision_projection",
    "from_siglip",
    "from_siglip_vision",
    "to_clip_vision",
    "to_clip_vision_projection",
    "to_siglip_vision",
]


def _encoder_layers(model, prefix) -> list[Rule]:
    """The blocks CLIP and SigLIP share."""
    rules = []
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layers.{i}.", ("encoder", f"layers_{i}")
        rules += [
            *attention((*layer, "self_attention"), f"{h}self_attn."),
            *norm(f"{h}layer_norm1", (*layer, "self_attention_norm")),
            *norm(f"{h}layer_norm2", (*layer, "mlp_norm")),
            *mlp((*layer, "mlp"), f"{h}mlp.fc1", f"{h}mlp.fc2"),
        ]
    return rules


def _position_embedding(prefix) -> Rule:
    """nn.Embedding's table [P, D] <-> pos_embed [1, P, D]."""
    key = f"{prefix}embeddings.position_embedding.weight"
    return reshaped_as(key, ("pos_embed",), lambda y: y.shape[1:])


def clip_vision_rules(model: vit.VisionTransformer, prefix: str = "vision_model.") -> list[Rule]:
    return [
        conv(f"{prefix}embeddings.patch_embedding.weight", ("patch_embed", "kernel")),
        reshaped_as(f"{prefix}embeddings.class_embedding", ("cls",), lambda y: (-1,)),
        _position_embedding(prefix),
        *norm(f"{prefix}pre_layrnorm", ("pre_norm",)),
        *norm(f"{prefix}post_layernorm", ("pooled_norm",)),
        *_encoder_layers(model, prefix),
    ]


def siglip_vision_rules(model: vit.VisionTransformer, prefix: str = "vision_model.") -> list[Rule]:
    h, head = f"{prefix}head.", ("map_head",)
    return [
        conv(f"{prefix}embeddings.patch_embedding.weight", ("patch_embed", "kernel")),
        identity(f"{prefix}embeddings.patch_embedding.bias", ("patch_embed", "bias")),
        _position_embedding(prefix),
        *norm(f"{prefix}post_layernorm", ("encoder", "final_norm")),
        *_encoder_layers(model, prefix),
        identity(f"{h}probe", (*head, "probe")),
        *torch_mha((*head, "attention"), f"{h}attention."),
        *norm(f"{h}layernorm", (*head, "norm")),
        *mlp((*head, "mlp"), f"{h}mlp.fc1", f"{h}mlp.fc2"),
    ]


def _vision_config(patch: int, eps: float, act: str) -> tuple:
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
        Field("hidden_act", "activation", act, values=towers.ACTIVATIONS),
    )


_CLIP_LIKE = {"num_registers": 0, "layer_scale": None, "mask_token": False, "patch_bias": True}
CLIP_VISION = Family(
    architecture="CLIPVisionModel",
    model_type="clip_vision_model",
    model=vit.Model,
    config=_vision_config(32, 1e-5, "quick_gelu"),
    rules=clip_vision_rules,
    prefix="vision_model.",
    bare="embeddings.",
    requires={
        **towers.HEADLESS,
        **_CLIP_LIKE,
        "pool": "cls",
        "pre_norm": True,
        "final_norm": "pooled",
        "patch_bias": False,
    },
    defaults={"drop_remainder": True},
    ignore=("*position_ids",),  # a buffer (0..P) in older files
)
SIGLIP_VISION = Family(
    architecture="SiglipVisionModel",
    model_type="siglip_vision_model",
    model=vit.Model,
    config=(
        *_vision_config(16, 1e-6, "gelu_pytorch_tanh"),
        Fixed("vision_use_head", True, why="the pooled output is the attention pooling head's"),
    ),
    rules=siglip_vision_rules,
    prefix="vision_model.",
    bare="embeddings.",
    requires={
        **towers.HEADLESS,
        **_CLIP_LIKE,
        "pool": "map",
        "pre_norm": False,
        "final_norm": "tokens",
    },
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
        linear("visual_projection.weight", ("head", "kernel")),
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


def _whole(tower: Family, architecture, model_type, ignore, extra=(), **changes) -> Family:
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


def _unprojected(family: Family) -> Family:
    """A projected CLIP family read as the bare tower (pooler_output): visual_projection.weight
    (and the projection_dim key) skipped."""
    return dataclasses.replace(
        family,
        config=tuple(e for e in family.config if e is not _PROJECTION),
        rules=clip_vision_rules,
        requires=CLIP_VISION.requires,
        ignore=(*family.ignore, "visual_projection.weight"),
    )


# Where each tower's position embeddings are: CLIP's hold the class token's too, SigLIP's not.
_CLIP_POSEMB = ("embeddings.position_embedding.weight", "embeddings.patch_embedding.weight", 1)
_SIGLIP_POSEMB = (*_CLIP_POSEMB[:2], 0)
CLIP_VISION_TOWER = towers.Tower(CLIP_VISION, *_CLIP_POSEMB)
CLIP_VISION_PROJECTION_TOWER = towers.Tower(CLIP_VISION_PROJECTION, *_CLIP_POSEMB)
CLIP_TOWER = towers.Tower(CLIP, *_CLIP_POSEMB, nested=True)
SIGLIP_VISION_TOWER = towers.Tower(SIGLIP_VISION, *_SIGLIP_POSEMB)
SIGLIP_TOWER = towers.Tower(SIGLIP, *_SIGLIP_POSEMB, nested=True)


def from_clip_vision(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a CLIPVisionModel directory or (state dict, config)."""
    return towers.load(CLIP_VISION_TOWER, source, config, image_size, overrides)


def from_siglip_vision(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a SiglipVisionModel directory or (state dict, config)."""
    return towers.load(SIGLIP_VISION_TOWER, source, config, image_size, overrides)


def _projection_choice(tower: towers.Tower, projection) -> towers.Tower:
    if projection not in (True, False):
        raise ValueError(
            f"{tower.family.architecture}: projection={projection!r}; allowed: True, False"
        )
    return tower if projection else dataclasses.replace(tower, family=_unprojected(tower.family))


def from_clip_vision_projection(
    source, config=None, *, projection=True, image_size=None, **overrides
):
    """(tfjax ViT, params) from a CLIPVisionModelWithProjection: the image embeddings
    (image_embeds, visual_projection as a bias-free head of projection_dim outputs); with
    projection=False the tower's pooler_output (num_classes=None, visual_projection skipped)."""
    tower = _projection_choice(CLIP_VISION_PROJECTION_TOWER, projection)
    return towers.load(tower, source, config, image_size, overrides)


def from_clip(source, config=None, *, projection=True, image_size=None, **overrides):
    """(tfjax ViT, params) of a whole CLIPModel's vision tower: what get_image_features gives
    (the projected pooled output; projection=False: the tower's pooler_output). The text tower,
    text_projection and logit_scale are skipped; the export is CLIPVisionModelWithProjection (or
    CLIPVisionModel), which holds the same numbers."""
    tower = _projection_choice(CLIP_TOWER, projection)
    return towers.load(tower, source, config, image_size, overrides)


def from_siglip(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) of a whole SiglipModel's vision tower: what get_image_features gives
    (the attention pooling head's output). The text tower, logit_scale and logit_bias are
    skipped; the export is SiglipVisionModel, which holds the same numbers."""
    return towers.load(SIGLIP_TOWER, source, config, image_size, overrides)


def to_clip_vision(model, params):
    return towers.save(CLIP_VISION_TOWER, model, params)


def to_clip_vision_projection(model, params):
    """({key: array}, config): CLIPVisionModelWithProjection (a CLIP tower with head_bias=False,
    as from_clip and from_clip_vision_projection load it)."""
    return towers.save(CLIP_VISION_PROJECTION_TOWER, model, params)


def to_siglip_vision(model, params):
    return towers.save(SIGLIP_VISION_TOWER, model, params)


# What a run starting from each architecture loads (`tfjax.runner.pretrained`): the bare tower
# (CLIP's without its projection), to which the run adds its own head.
from_clip_vision.backbone = CLIP_VISION_TOWER
from_siglip_vision.backbone = SIGLIP_VISION_TOWER
from_clip_vision_projection.backbone = _projection_choice(CLIP_VISION_PROJECTION_TOWER, False)
from_clip.backbone = _projection_choice(CLIP_TOWER, False)
from_siglip.backbone = SIGLIP_TOWER


def _clip_tower(model: vit.VisionTransformer) -> towers.Tower:
    """With a head (a bias-free one) CLIP's projection, without one the bare tower."""
    return CLIP_VISION_TOWER if model.num_classes is None else CLIP_VISION_PROJECTION_TOWER


def _is_clip(m: vit.VisionTransformer) -> bool:
    """CLIP's pre-norm or pooled norm, without a head (and not SigLIP's pooling) or with a
    bias-free one (the projection)."""
    clip_like = m.pre_norm or m.final_norm == "pooled"
    return clip_like and (m.pool != "map" if m.num_classes is None else not m.head_bias)


CONVERTS = Converts(
    rows=(
        Row(
            "CLIP vision tower",
            "`from_clip_vision` / `to_clip_vision`",
            "vit",
            '(`quick_gelu`, `pre_norm`, `final_norm="pooled"`)',
            loads={CLIP_VISION.architecture: from_clip_vision},
        ),
        Row(
            "CLIP vision tower with projection",
            "`from_clip_vision_projection` / `to_clip_vision_projection`",
            "vit",
            "(CLIP's tower; `visual_projection` as a bias-free head: `head_bias=False`, "
            "`num_classes=projection_dim`)",
            loads={CLIP_VISION_PROJECTION.architecture: from_clip_vision_projection},
        ),
        Row(
            "SigLIP vision tower",
            "`from_siglip_vision` / `to_siglip_vision`",
            "vit",
            '(no class token, `pool="map"`: attention-pooling head)',
            loads={SIGLIP_VISION.architecture: from_siglip_vision},
        ),
        Row(
            "Image towers of whole CLIP / SigLIP models",
            "`from_clip`, `from_siglip` / exported as `CLIPVisionModelWithProjection` or "
            "`SiglipVisionModel`",
            "vit",
            "giving `get_image_features` (CLIP projected; `projection=False`: the tower's "
            "`pooler_output`)",
            loads={CLIP.architecture: from_clip, SIGLIP.architecture: from_siglip},
        ),
    ),
    exports=(
        Exporter(
            vit.VisionTransformer,
            when=_is_clip,
            export=lambda model, params: towers.save(_clip_tower(model), model, params),
            family=lambda model: _clip_tower(model).family,
            needs="CLIPVisionModel: pre_norm or final_norm='pooled', without a head, or as "
            "CLIPVisionModelWithProjection with a bias-free head (head_bias=False)",
        ),
        Exporter(
            vit.VisionTransformer,
            when=lambda m: m.num_classes is None and m.pool == "map",
            export=to_siglip_vision,
            family=lambda model: SIGLIP_VISION,
            needs="SiglipVisionModel: attention pooling (pool='map') without a head",
        ),
    ),
)
