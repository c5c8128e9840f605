"""DINOv2 (`Dinov2Model`) and DINOv2 with registers (`Dinov2WithRegistersModel`) <->
`tfjax.models.vit` without a classification head (num_classes=None), and both with their
linear classifier (`Dinov2ForImageClassification`, `Dinov2WithRegistersForImageClassification`)
<-> the same ViT with pool="cls_gap" and a head.

    model, params = from_dinov2("path/to/dinov2")                  # as trained (518 px)
    model, params = from_dinov2("path/to/dinov2", image_size=224)  # posemb resampled to 224 px
    pooled, aux = model.apply({"params": params}, images)          # [B, H, W, C] -> [B, D]
    state, config = to_dinov2(model, params)

What the tower gives, as Hugging Face names it: last_hidden_state is aux["encoded"] and
pooler_output the model's output (aux["pre_logits"]): a class token, registers (with
registers), layer scale, a final LayerNorm on every token; pooler_output = the class token.
SwiGLU FFN for giant (use_swiglu_ffn).

Key mapping, layer i (no prefix):
  embeddings.{cls_token, register_tokens, mask_token [1, D], position_embeddings}
      -> cls, registers, mask_token [D], pos_embed
  embeddings.patch_embeddings.projection -> patch_embed
  encoder.layer.i.norm1, norm2 -> encoder/layers_i/self_attention_norm, mlp_norm
  encoder.layer.i.attention.attention.{query,key,value}, attention.output.dense
      -> self_attention/{query,key,value,out}_*
  encoder.layer.i.layer_scale1, 2 .lambda1 -> self_attention_layer_scale, mlp_layer_scale
  encoder.layer.i.mlp.fc1, fc2 -> mlp/wi, wo; (SwiGLU) mlp.weights_in [2F, D] (gate rows, then
      up rows), weights_out -> mlp/wi_0, wi_1, wo
  layernorm -> encoder/final_norm
  (with a classifier: the keys above under "dinov2." or "dinov2_with_registers.")
  classifier [C, 2 D] -> head: it reads the final-normed class token and the mean of the patch
      tokens (registers left out) side by side, which is the ViT's pool="cls_gap"
config.json spreads the FFN's width over mlp_ratio and use_swiglu_ffn (SwiGLU: 2/3 of
width * mlp_ratio, rounded up to a multiple of 8), which the family's read and write hooks turn
into mlp_dim and back. Position embeddings are resampled to another `image_size` at load
(`core.towers`; with registers antialiased, as that model does).
"""

import dataclasses

from tfjax.interop.core import tables, towers
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import (
    Rule,
    attention,
    conv,
    dense,
    halves,
    identity,
    mlp,
    norm,
    reshaped_as,
)
from tfjax.interop.core.tables import LABELS, Family, Field, Fixed, bert_like
from tfjax.models import vit

__all__ = [
    "from_dinov2",
    "from_dinov2_classifier",
    "from_dinov2_registers",
    "from_dinov2_registers_classifier",
    "to_dinov2",
    "to_dinov2_classifier",
]


def dinov2_rules(model: vit.VisionTransformer, prefix: str = "") -> list[Rule]:
    e = f"{prefix}embeddings."
    rules = [
        conv(f"{e}patch_embeddings.projection.weight", ("patch_embed", "kernel")),
        identity(f"{e}patch_embeddings.projection.bias", ("patch_embed", "bias")),
        identity(f"{e}cls_token", ("cls",)),
        identity(f"{e}position_embeddings", ("pos_embed",)),
        *norm(f"{prefix}layernorm", ("encoder", "final_norm")),
    ]
    if model.mask_token:
        rules.append(reshaped_as(f"{e}mask_token", ("mask_token",), lambda y: (1, -1)))
    if model.num_registers:
        rules.append(identity(f"{e}register_tokens", ("registers",)))
    names = ("attention.query", "attention.key", "attention.value", "output.dense")
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layer.{i}.", ("encoder", f"layers_{i}")
        rules += [
            *attention((*layer, "self_attention"), f"{h}attention.", names),
            *norm(f"{h}norm1", (*layer, "self_attention_norm")),
            *norm(f"{h}norm2", (*layer, "mlp_norm")),
            identity(f"{h}layer_scale1.lambda1", (*layer, "self_attention_layer_scale")),
            identity(f"{h}layer_scale2.lambda1", (*layer, "mlp_layer_scale")),
        ]
        if model.activation == "swiglu":
            gate, up = (*layer, "mlp", "wi_0"), (*layer, "mlp", "wi_1")
            rules += [
                halves(f"{h}mlp.weights_in.weight", [(*gate, "kernel"), (*up, "kernel")]),
                halves(f"{h}mlp.weights_in.bias", [(*gate, "bias"), (*up, "bias")]),
                *dense(f"{h}mlp.weights_out", (*layer, "mlp", "wo")),
            ]
        else:
            rules += mlp((*layer, "mlp"), f"{h}mlp.fc1", f"{h}mlp.fc2")
    return rules


def _swiglu_dim(width: int, ratio) -> int:
    """DINOv2's SwiGLU hidden width: 2/3 of width * mlp_ratio, rounded up to a multiple of 8."""
    return (int(int(width * ratio) * 2 / 3) + 7) // 8 * 8


def _read(family: Family, c: dict) -> dict:
    """The table's fields plus what DINOv2 spreads over several keys: use_swiglu_ffn and
    mlp_ratio."""
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
    fields = tables.table_fields(family, c)
    ratio = c.get("mlp_ratio") or 4
    width = fields["width"]
    fields["mlp_dim"] = _swiglu_dim(width, ratio) if swiglu else int(width * ratio)
    return fields


def _write(family: Family, model: vit.VisionTransformer) -> dict:
    """The table's config plus use_swiglu_ffn and mlp_ratio (refused when no integer ratio
    gives the model's mlp_dim); without image_size and num_channels, which the weights decide."""
    swiglu = model.activation == "swiglu"
    for ratio in range(1, 17):
        if (_swiglu_dim(model.width, ratio) if swiglu else model.width * ratio) == model.mlp_dim:
            break
    else:
        raise ValueError(
            f"{family.architecture} has no mlp_ratio for the model's mlp_dim={model.mlp_dim} "
            f"(width={model.width}): mlp_dim must be width * mlp_ratio"
            + (" (SwiGLU: 2/3 of it, rounded up to a multiple of 8)" if swiglu else "")
            + " for an integer mlp_ratio"
        )
    if swiglu:  # hidden_act is unused by DINOv2's SwiGLU FFN
        model = model.clone(activation="gelu")
    return tables.table_config(family, model) | {"use_swiglu_ffn": swiglu, "mlp_ratio": ratio}


def classifier_rules(model: vit.VisionTransformer, prefix: str) -> list[Rule]:
    """The tower's rules under `prefix` and the classifier [C, 2 D] -> head."""
    return [*dinov2_rules(model, prefix), *dense("classifier", ("head",))]


def _dinov2(
    architecture: str, model_type: str, registers: bool, requires: dict, classifier: str = ""
) -> Family:
    """The two DINOv2 families differ in registers, and in the mask token only the plain one
    has a key for; `classifier`: the tower's attribute in the ...ForImageClassification model
    ("dinov2"), whose linear classifier reads pool="cls_gap" ("": the bare tower)."""
    optional = (
        Field("num_register_tokens", "num_registers", 4)
        if registers
        else Field("use_mask_token", "mask_token", True)
    )
    head = {"num_classes": None, "pool": "cls"}  # the tower: no head
    labels, rules, prefix, defaults = (), dinov2_rules, "", {}
    if classifier:
        head = {"pool": "cls_gap", "head_bias": True}
        labels, rules, prefix = LABELS, classifier_rules, f"{classifier}."
        defaults = {"num_classes": 2, "head_zero_init": False}  # transformers' num_labels
    return Family(
        architecture=architecture,
        model_type=model_type,
        model=vit.Model,
        config=(
            *labels,
            Field("patch_size", "patch_size", 14),
            *bert_like(dropout=0.0, eps=1e-6),
            Field("layerscale_value", "layer_scale", 1.0),
            # use_swiglu_ffn=True replaces it by "swiglu" (its FFN uses SiLU, not hidden_act)
            Field(
                "hidden_act",
                "activation",
                "gelu",
                values={**towers.ACTIVATIONS, "swiglu": "swiglu"},
            ),
            optional,
            Fixed("qkv_bias", True),
            Fixed("drop_path_rate", 0.0, why="tfjax's ViT has no stochastic depth"),
        ),
        rules=rules,
        prefix=prefix,
        requires={
            "posemb": "learned",
            **head,
            "final_norm": "tokens",
            "pre_norm": False,
            "patch_bias": True,
            **requires,
        },
        defaults={"drop_remainder": True, **defaults},  # as the stride-p convolution
        read=_read,
        write=_write,
    )


DINOV2 = _dinov2("Dinov2Model", "dinov2", False, {"num_registers": 0})
DINOV2_REGISTERS = _dinov2(
    "Dinov2WithRegistersModel", "dinov2_with_registers", True, {"mask_token": True}
)
DINOV2_CLASSIFIER = _dinov2(
    "Dinov2ForImageClassification", "dinov2", False, {"num_registers": 0}, "dinov2"
)
DINOV2_REGISTERS_CLASSIFIER = _dinov2(
    "Dinov2WithRegistersForImageClassification",
    "dinov2_with_registers",
    True,
    {"mask_token": True},
    "dinov2_with_registers",
)
_POSEMB = ("embeddings.position_embeddings", "embeddings.patch_embeddings.projection.weight", 1)
TOWER = towers.Tower(DINOV2, *_POSEMB)
REGISTERS_TOWER = towers.Tower(DINOV2_REGISTERS, *_POSEMB, antialias=True)
CLASSIFIER_TOWER = towers.Tower(DINOV2_CLASSIFIER, *_POSEMB)
REGISTERS_CLASSIFIER_TOWER = towers.Tower(DINOV2_REGISTERS_CLASSIFIER, *_POSEMB, antialias=True)


def from_dinov2(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a Dinov2Model directory or (state dict, config); image_size: int
    or (H, W) the model will see (the position embeddings resampled from config's image_size)."""
    return towers.load(TOWER, source, config, image_size, overrides)


def from_dinov2_registers(source, config=None, *, image_size=None, **overrides):
    """As from_dinov2, for Dinov2WithRegistersModel (antialiased resampling, as it does)."""
    return towers.load(REGISTERS_TOWER, source, config, image_size, overrides)


def from_dinov2_classifier(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT with pool="cls_gap" and a head of num_labels, params) from a
    Dinov2ForImageClassification directory or (state dict, config)."""
    return towers.load(CLASSIFIER_TOWER, source, config, image_size, overrides)


def from_dinov2_registers_classifier(source, config=None, *, image_size=None, **overrides):
    """As from_dinov2_classifier, for Dinov2WithRegistersForImageClassification."""
    return towers.load(REGISTERS_CLASSIFIER_TOWER, source, config, image_size, overrides)


def to_dinov2(model, params):
    """({key: array}, config): Dinov2Model, or Dinov2WithRegistersModel with registers."""
    return towers.save(REGISTERS_TOWER if model.num_registers else TOWER, model, params)


def to_dinov2_classifier(model, params):
    """({key: array}, config): Dinov2ForImageClassification (with registers:
    Dinov2WithRegistersForImageClassification) for a DINOv2 ViT with pool="cls_gap" and a
    biased head."""
    tower = REGISTERS_CLASSIFIER_TOWER if model.num_registers else CLASSIFIER_TOWER
    return towers.save(tower, model, params)


def _backbone(tower: towers.Tower, classifier: towers.Tower) -> towers.Tower:
    """The bare tower read from a ...ForImageClassification checkpoint: its keys under the
    classifier's prefix, the classifier itself skipped (a run gives the tower a new head)."""
    family = dataclasses.replace(
        tower.family,
        architecture=classifier.family.architecture,
        prefix=classifier.family.prefix,
        ignore=(*tower.family.ignore, "classifier.*"),
    )
    return dataclasses.replace(tower, family=family)


# What a run starting from each architecture loads (`tfjax.runner.pretrained`): the bare tower,
# to which the run adds its own head.
from_dinov2.backbone = TOWER
from_dinov2_registers.backbone = REGISTERS_TOWER
from_dinov2_classifier.backbone = _backbone(TOWER, CLASSIFIER_TOWER)
from_dinov2_registers_classifier.backbone = _backbone(REGISTERS_TOWER, REGISTERS_CLASSIFIER_TOWER)


def _is_dinov2(m: vit.VisionTransformer) -> bool:
    """DINOv2's layer scale, neither CLIP's norms nor SigLIP's pooling."""
    return (
        m.layer_scale is not None
        and m.pool != "map"
        and not m.pre_norm
        and m.final_norm != "pooled"
    )


CONVERTS = Converts(
    rows=(
        Row(
            "DINOv2",
            "`from_dinov2`, `from_dinov2_registers` / `to_dinov2` (either, by `num_registers`)",
            "vit",
            "with `num_classes=None` (`layer_scale`, `num_registers`, `mask_token`; SwiGLU for "
            "g/14)",
            loads={
                DINOV2.architecture: from_dinov2,
                DINOV2_REGISTERS.architecture: from_dinov2_registers,
            },
        ),
        Row(
            "DINOv2 with its linear classifier",
            "`from_dinov2_classifier`, `from_dinov2_registers_classifier` / `to_dinov2_classifier`",
            "vit",
            'with `pool="cls_gap"` (the class token and the mean of the patch tokens) and a head',
            loads={
                DINOV2_CLASSIFIER.architecture: from_dinov2_classifier,
                DINOV2_REGISTERS_CLASSIFIER.architecture: from_dinov2_registers_classifier,
            },
        ),
    ),
    exports=(
        Exporter(
            vit.VisionTransformer,
            when=lambda m: m.num_classes is None and _is_dinov2(m),
            export=to_dinov2,
            family=lambda m: DINOV2_REGISTERS if m.num_registers else DINOV2,
            needs="a ViT without a head exports as a vision tower: Dinov2Model with layer_scale "
            "(Dinov2WithRegistersModel with num_registers), neither CLIP's pre_norm or "
            "final_norm='pooled' nor SigLIP's pool='map'",
        ),
        Exporter(
            vit.VisionTransformer,
            when=lambda m: m.num_classes is not None and _is_dinov2(m),
            export=to_dinov2_classifier,
            family=lambda m: DINOV2_REGISTERS_CLASSIFIER if m.num_registers else DINOV2_CLASSIFIER,
            needs="a ViT with layer_scale and a head exports as Dinov2ForImageClassification "
            "(...WithRegisters... with num_registers), whose classifier reads pool='cls_gap' "
            "(the class token and the mean of the patch tokens) through a biased head",
        ),
    ),
)
