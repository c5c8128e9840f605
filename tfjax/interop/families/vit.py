"""Vision Transformers: Hugging Face `ViTForImageClassification` and timm's key layout
<-> `tfjax.models.vit`, with position embeddings resampled to another image size.

    model, params = from_hf_vit("path/to/vit")                 # as trained
    model, params = from_hf_vit("path/to/vit", image_size=384)  # posemb resampled for 384 px
    logits, _ = model.apply({"params": params}, images)        # [B, H, W, C], channels last
    state, config = to_hf_vit(model, params)

Key mapping (Hugging Face, under "vit."; timm in brackets), layer i:
  embeddings.patch_embeddings.projection [D, C, p, p] (patch_embed.proj)
      -> patch_embed [p, p, C, D]
  embeddings.cls_token (cls_token)                    -> cls [1, 1, D]
  embeddings.position_embeddings (pos_embed)          -> pos_embed [1, 1 + P, D]
  encoder.layer.i.layernorm_before, _after (blocks.i.norm1, norm2)
      -> encoder/layers_i/self_attention_norm, mlp_norm
  encoder.layer.i.attention.attention.{query,key,value} (blocks.i.attn.qkv, fused [3D, D])
      -> encoder/layers_i/self_attention/{query,key,value}_kernel [D, N, H]
  encoder.layer.i.attention.output.dense (blocks.i.attn.proj) -> self_attention/out_*
  encoder.layer.i.intermediate.dense, output.dense (blocks.i.mlp.fc1, fc2) -> mlp/wi, mlp/wo
  layernorm (norm), classifier (head) -> encoder/final_norm, head

Position embeddings are resampled with `core.posemb.resample_posemb` (exactly torch's bicubic
interpolate, as Hugging Face's `interpolate_pos_encoding=True` and timm's
`resample_abs_pos_embed` do); the class token's embedding is kept as it is.
"""

import math

import jax.numpy as jnp

from tfjax.interop.core import convert, files, tables
from tfjax.interop.core.posemb import image_size_pair, resample_posemb
from tfjax.interop.core.registry import Converts, Exporter
from tfjax.interop.core.rules import (
    Rule,
    attention,
    conv,
    dense,
    finish,
    fused_attention,
    identity,
    import_state,
    mlp,
    norm,
    param_shapes,
)
from tfjax.interop.core.tables import LABELS, Family, Field, Fixed, bert_like
from tfjax.models import vit


def _embeddings_and_head(patch, cls, posemb, final_norm, head) -> list[Rule]:
    """The patch embedding (a stride-p Conv2d with bias), class token, learned position
    embeddings, final norm and classifier of a ViT, keyed as given."""
    return [
        conv(f"{patch}.weight", ("patch_embed", "kernel")),
        identity(f"{patch}.bias", ("patch_embed", "bias")),
        identity(cls, ("cls",)),
        identity(posemb, ("pos_embed",)),
        *norm(final_norm, ("encoder", "final_norm")),
        *dense(head, ("head",)),
    ]


def hf_vit_rules(model: vit.VisionTransformer, prefix: str = "vit.") -> list[Rule]:
    e = f"{prefix}embeddings."
    rules = _embeddings_and_head(
        f"{e}patch_embeddings.projection",
        f"{e}cls_token",
        f"{e}position_embeddings",
        f"{prefix}layernorm",
        "classifier",
    )
    names = ("attention.query", "attention.key", "attention.value", "output.dense")
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layer.{i}.", ("encoder", f"layers_{i}")
        rules += [
            *attention((*layer, "self_attention"), f"{h}attention.", names),
            *norm(f"{h}layernorm_before", (*layer, "self_attention_norm")),
            *norm(f"{h}layernorm_after", (*layer, "mlp_norm")),
            *mlp((*layer, "mlp"), f"{h}intermediate.dense", f"{h}output.dense"),
        ]
    return rules


def timm_vit_rules(model: vit.VisionTransformer) -> list[Rule]:
    """timm's VisionTransformer keys (class token, learned posemb, fused qkv, no pre-norm)."""
    rules = _embeddings_and_head("patch_embed.proj", "cls_token", "pos_embed", "norm", "head")
    for i in range(model.num_layers):
        h, layer = f"blocks.{i}.", ("encoder", f"layers_{i}")
        rules += [
            *fused_attention(
                (*layer, "self_attention"),
                f"{h}attn.qkv.weight",
                f"{h}attn.qkv.bias",
                f"{h}attn.proj",
            ),
            *norm(f"{h}norm1", (*layer, "self_attention_norm")),
            *norm(f"{h}norm2", (*layer, "mlp_norm")),
            *mlp((*layer, "mlp"), f"{h}mlp.fc1", f"{h}mlp.fc2"),
        ]
    return rules


HF_VIT = Family(
    architecture="ViTForImageClassification",
    model_type="vit",
    model=vit.Model,
    config=(
        *LABELS,
        Field("patch_size", "patch_size", 16),
        *bert_like(dropout=0.0, eps=1e-12),
        Field("intermediate_size", "mlp_dim"),
        Fixed("hidden_act", "gelu"),
        Fixed("qkv_bias", True),
    ),
    rules=hf_vit_rules,
    prefix="vit.",
    # what ViTForImageClassification has no key for (the vision towers' options) is refused
    requires={
        "pool": "cls",
        "posemb": "learned",
        "head_bias": True,
        "pre_norm": False,
        "final_norm": "tokens",
        "layer_scale": None,
        "num_registers": 0,
        "patch_bias": True,
        "mask_token": False,
    },
    defaults={"num_classes": 2, "head_zero_init": False},
)


def _resampled(state, key, trained_size, image_size, patch, what):
    """(state with the posemb tensor `key` resampled to image_size, image_size as (H, W))."""
    image_size = image_size_pair(image_size or trained_size)
    if image_size[0] % patch or image_size[1] % patch:
        raise ValueError(f"{what}: image size {image_size} is not divisible by patch {patch}")
    if key in state:
        resampled = files.StateDict(state, state.files, state.origin)
        grid = (image_size[0] // patch, image_size[1] // patch)
        resampled[key] = resample_posemb(state[key], grid)
        state = resampled
    return state, image_size


def from_hf_vit(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a ViTForImageClassification directory or (state dict, config).

    image_size: int or (H, W) the model will see; the position embeddings are resampled from
    the config's image_size when it differs.
    """
    state, c = files.load_source(source, config)
    model = tables.build(HF_VIT, c, **overrides)
    state, size = _resampled(
        state,
        "vit.embeddings.position_embeddings",
        c.get("image_size") or 224,
        image_size,
        model.patch_size,
        HF_VIT.architecture,
    )
    images = jnp.zeros((1, *size, c.get("num_channels") or 3), jnp.float32)
    return model, convert.import_params(HF_VIT, model, state, inputs=(images,))


def from_timm_vit(state, *, image_size, trained_image_size=None, **fields):
    """(tfjax ViT, params) from a timm VisionTransformer state dict (class token, learned
    posemb); `fields` give the tfjax sizes and options not in the weights (norm_eps=1e-6 for
    timm, patch_size, num_heads, ...). The trained grid is read from pos_embed."""
    state = files.as_state_dict(state)
    what = "timm VisionTransformer"
    for key in ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight"):
        if key not in state:
            raise ValueError(f"{what}: {key!r} is missing from {state.origin}")
    width, channels, p, _ = state["patch_embed.proj.weight"].shape
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    fc1 = state.get("blocks.0.mlp.fc1.weight")
    defaults = dict(
        patch_size=p,
        width=width,
        num_layers=layers,
        mlp_dim=4 * width if fc1 is None else fc1.shape[0],
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else None,
        norm_eps=1e-6,
        head_zero_init=False,
    )
    model = vit.Model(**{**defaults, **fields})
    side = math.isqrt(state["pos_embed"].shape[1] - 1) * p
    state, size = _resampled(
        state, "pos_embed", trained_image_size or side, image_size, model.patch_size, what
    )
    images = jnp.zeros((1, *size, channels), jnp.float32)
    params = import_state(state, timm_vit_rules(model), param_shapes(model, images), what=what)
    return model, finish(model, params)


def to_hf_vit(model: vit.VisionTransformer, params):
    """({Hugging Face key: numpy array}, config dict); the config's image_size is the square
    image the position embeddings were made for (grid side * patch size)."""
    if model.num_classes is None:
        raise ValueError(f"{HF_VIT.architecture} needs a head; the model has num_classes=None")
    state, config = convert.to_hf(HF_VIT, model, params)
    grid = math.isqrt(state["vit.embeddings.position_embeddings"].shape[1] - 1)
    return state, {**config, "image_size": grid * model.patch_size}


CONVERTS = Converts(
    loads={HF_VIT.architecture: from_hf_vit},
    exports=(
        Exporter(
            vit.VisionTransformer,
            when=lambda m: m.num_classes is not None and m.head_bias and m.layer_scale is None,
            export=to_hf_vit,
            family=lambda model: HF_VIT,
            needs="ViTForImageClassification: a classification head with a bias (num_classes, "
            "head_bias=True), no layer_scale",
        ),
    ),
)
