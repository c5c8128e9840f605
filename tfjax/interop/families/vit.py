"""Vision Transformers: Hugging Face `ViTForImageClassification` and timm's key layout
<-> `tfjax.models.vit`, with position embeddings resampled to another image size.

    model, params = from_hf_vit("path/to/vit")                 # as trained
    model, params = from_hf_vit("path/to/vit", image_size=384)  # posemb resampled for 384 px
    model, params = from_timm_vit(timm_model.state_dict(), image_size=224, num_heads=12)
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
timm only: reg_token -> registers (their position embeddings added: their inputs are
  constant), norm_pre -> pre_norm, fc_norm -> pooled_norm (final_norm="pooled"),
  blocks.i.ls1, ls2 .gamma -> self_attention_layer_scale, mlp_layer_scale; with
  no_embed_class the class token's position embedding is zeros.

Position embeddings are resampled with `core.posemb.resample_posemb`: exactly torch's bicubic
interpolate for Hugging Face (`interpolate_pos_encoding=True`), the antialiased one for timm
(`resample_abs_pos_embed`); the class token's embedding is kept as it is.
"""

import math

import jax.numpy as jnp
import numpy as np

from tfjax.interop.core import convert, files, tables
from tfjax.interop.core.posemb import image_size_pair, resample_posemb
from tfjax.interop.core.registry import Converts, Exporter, Row
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

__all__ = ["from_hf_vit", "from_timm_vit", "to_hf_vit"]


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
    """timm's VisionTransformer keys for the tfjax ViT `from_timm_vit` builds (fused qkv; the
    class token, registers, pre-norm, layer scale, final norm or fc_norm as the model has
    them); `pos_embed` and `reg_token` in tfjax's layout (`_timm_tokens`)."""
    rules = [
        conv("patch_embed.proj.weight", ("patch_embed", "kernel")),
        identity("pos_embed", ("pos_embed",)),
    ]
    if model.patch_bias:
        rules.append(identity("patch_embed.proj.bias", ("patch_embed", "bias")))
    if model.pool == "cls":
        rules.append(identity("cls_token", ("cls",)))
    if model.num_registers:
        rules.append(identity("reg_token", ("registers",)))
    if model.pre_norm:
        rules += norm("norm_pre", ("pre_norm",))
    if model.final_norm == "tokens":
        rules += norm("norm", ("encoder", "final_norm"))
    else:  # timm's fc_norm: after pooling
        rules += norm("fc_norm", ("pooled_norm",))
    if model.num_classes is not None:
        rules += dense("head", ("head",))
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
        if model.layer_scale is not None:
            rules += [
                identity(f"{h}ls1.gamma", (*layer, "self_attention_layer_scale")),
                identity(f"{h}ls2.gamma", (*layer, "mlp_layer_scale")),
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


_TIMM = "timm VisionTransformer"
_TIMM_SUPPORTED = (
    "supported: a class token with global_pool='token', none with 'avg'; reg_tokens, "
    "no_embed_class, pre_norm, fc_norm, init_values (layer scale), any img_size"
)
# timm options whose keys (in any block) tfjax's ViT has no place for: (key part, option)
_TIMM_REFUSED_KEYS = (
    ("attn_pool.", "global_pool='map' or 'prr' (an attention-pooling head)"),
    (".attn.q_norm.", "qk_norm=True"),
    (".attn.norm.", "scale_attn_norm=True"),
    (".mlp.norm.", "scale_mlp_norm=True"),
    (".mlp.fc1_g.", "a gated MLP (mlp_layer=SwiGLU)"),
    ("patch_embed.norm.", "embed_norm_layer"),
)
# ... and options whose keys it needs: (key, the option without it)
_TIMM_NEEDED_KEYS = (
    ("pos_embed", "pos_embed='none'"),
    ("blocks.0.attn.qkv.bias", "qkv_bias=False"),
    ("blocks.0.attn.proj.bias", "proj_bias=False"),
)
# What the state dict decides: not a field to give
_TIMM_DECIDED = (
    "patch_size",
    "width",
    "num_layers",
    "mlp_dim",
    "num_classes",
    "pool",
    "posemb",
    "num_registers",
    "layer_scale",
    "pre_norm",
    "final_norm",
    "patch_bias",
    "head_bias",
    "mask_token",
)


def _timm_refusals(state, global_pool, fields):
    """One line naming the first timm option of `state` (or argument) tfjax's ViT would not
    compute as timm does, and what it supports."""

    def refuse(option, why):
        return ValueError(f"{_TIMM}: {option} ({why}) is not supported; {_TIMM_SUPPORTED}")

    for key in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight"):
        if key not in state:
            raise ValueError(f"{_TIMM}: {key!r} is missing from {state.origin}")
    for part, option in _TIMM_REFUSED_KEYS:
        key = next((k for k in state if part in f".{k}"), None)
        if key is not None:
            raise refuse(option, f"{key!r} in {state.origin}")
    for key, option in _TIMM_NEEDED_KEYS:
        if key not in state:
            raise refuse(option, f"no {key!r} in {state.origin}")
    if "norm.weight" not in state and "fc_norm.weight" not in state:
        raise refuse("final_norm=False", f"neither 'norm' nor 'fc_norm' in {state.origin}")
    fc1, fc2 = state.shape("blocks.0.mlp.fc1.weight"), state.shape("blocks.0.mlp.fc2.weight")
    if fc1[0] != fc2[1]:
        raise refuse("a gated MLP (mlp_layer=GluMlp)", f"fc1 {fc1} feeds fc2 {fc2}")
    _, _, ph, pw = state.shape("patch_embed.proj.weight")
    if ph != pw:
        raise refuse(f"patch_size=({ph}, {pw})", "tfjax's patches are square")
    has_cls = "cls_token" in state
    if global_pool == "avg" and has_cls:
        raise refuse(
            "global_pool='avg' with class_token=True",
            "tfjax averages the patch tokens of a model without a class token",
        )
    if global_pool == "token" and not has_cls:
        raise ValueError(
            f"{_TIMM}: global_pool='token' needs a class token, and {state.origin} has no "
            "'cls_token' (class_token=False): pass the model's global_pool ('avg')"
        )
    if global_pool not in ("token", "avg"):
        raise refuse(f"global_pool={global_pool!r}", "pooling tfjax's ViT does not do")
    decided = sorted(set(fields) & set(_TIMM_DECIDED))
    if decided:
        raise ValueError(
            f"{_TIMM}: {', '.join(decided)} are read from the state dict; do not pass them"
        )


def _timm_grid(state, rows: int, p: int, trained_image_size) -> tuple[int, int]:
    """The patch grid pos_embed was made for, after its first `rows` (the class and register
    tokens' unless no_embed_class)."""
    patches = state.shape("pos_embed")[1] - rows
    if trained_image_size is None:
        side = math.isqrt(max(patches, 0))
        grid, given = (side, side), "a square grid"
    else:
        h, w = image_size_pair(trained_image_size)
        grid, given = (h // p, w // p), f"trained_image_size={trained_image_size} (patch {p})"
    if grid[0] * grid[1] != patches or patches <= 0:
        raise ValueError(
            f"{_TIMM}: pos_embed has {patches} patch rows after the {rows} class and register "
            f"tokens' rows, not {given}; pass trained_image_size=(H, W) (the model's img_size) "
            "and the model's no_embed_class"
        )
    return grid


def _timm_tokens(state, image_size, trained_image_size, no_embed_class):
    """(state with pos_embed in tfjax's layout [1, (1 +) H/p * W/p, D], resampled to
    image_size as timm's resample_abs_pos_embed does (antialiased bicubic), and reg_token with
    its position embeddings added; image_size as (H, W))."""
    p = state.shape("patch_embed.proj.weight")[2]
    has_cls = int("cls_token" in state)
    prefix = has_cls + (state.shape("reg_token")[1] if "reg_token" in state else 0)
    with_prefix = prefix > 0 and not no_embed_class
    grid = _timm_grid(state, prefix if with_prefix else 0, p, trained_image_size)
    size = image_size_pair(image_size)
    if size[0] % p or size[1] % p:
        raise ValueError(f"{_TIMM}: image size {size} is not divisible by patch {p}")
    pe = state["pos_embed"]
    # [1, prefix, D]: added to the class and register tokens (zeros with no_embed_class)
    head = pe[:, :prefix] if with_prefix else np.zeros((1, prefix, pe.shape[2]), pe.dtype)
    patches = resample_posemb(
        pe[:, prefix if with_prefix else 0 :],
        (size[0] // p, size[1] // p),
        num_prefix_tokens=0,
        antialias=True,
        grid=grid,
    )
    out = files.StateDict({k: state[k] for k in state}, state.files, state.origin)
    out["pos_embed"] = np.concatenate([head[:, :has_cls], patches], axis=1)
    if prefix > has_cls:  # registers have constant inputs: their embeddings fold in
        out["reg_token"] = state["reg_token"] + head[:, has_cls:]
    return out, size


def from_timm_vit(
    state,
    *,
    image_size,
    num_heads,
    global_pool="token",
    no_embed_class=False,
    trained_image_size=None,
    **fields,
):
    """(tfjax ViT, params) computing what timm's VisionTransformer with these weights computes
    at `image_size` (int or (H, W)), from its `state_dict()` (torch tensors or numpy arrays).

    The weights show the class token, registers, pre_norm, fc_norm, layer scale, the head and
    the sizes. What they do not show is given as timm names it: num_heads, global_pool
    ('token' or 'avg'), no_embed_class, and trained_image_size, the model's img_size (a square
    grid read from pos_embed when None). The position embeddings are resampled from it to
    image_size as timm's resample_abs_pos_embed does (another img_size, dynamic_img_size).
    `fields`: other tfjax options (norm_eps: timm's 1e-6 by default; activation: "gelu",
    timm's nn.GELU; dtype, scan_layers, ...). What tfjax's ViT cannot compute as timm does is
    refused by name (`_timm_refusals`): attention pooling, qk_norm, gated MLPs, attention
    without biases, no final norm, global_pool='avg' beside a class token, ...
    """
    state = files.as_state_dict(state)
    _timm_refusals(state, global_pool, fields)
    state, size = _timm_tokens(state, image_size, trained_image_size, no_embed_class)
    width, channels, p, _ = state.shape("patch_embed.proj.weight")
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    model = vit.Model(
        **{"norm_eps": 1e-6, "head_zero_init": False, **fields},
        patch_size=p,
        width=width,
        num_layers=layers,
        num_heads=num_heads,
        mlp_dim=state.shape("blocks.0.mlp.fc1.weight")[0],
        num_classes=state.shape("head.weight")[0] if "head.weight" in state else None,
        pool="cls" if global_pool == "token" else "gap",
        num_registers=state.shape("reg_token")[1] if "reg_token" in state else 0,
        layer_scale=1.0 if "blocks.0.ls1.gamma" in state else None,  # the weights hold gamma
        pre_norm="norm_pre.weight" in state,
        final_norm="pooled" if "fc_norm.weight" in state else "tokens",
        patch_bias="patch_embed.proj.bias" in state,
    )
    images = jnp.zeros((1, *size, channels), jnp.float32)
    params = import_state(state, timm_vit_rules(model), param_shapes(model, images), what=_TIMM)
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
    rows=(
        Row(
            "ViT (also timm state dicts)",
            "`from_hf_vit` / `to_hf_vit`, `from_timm_vit`",
            "vit",
            "(positions resampled bicubically for another image size, antialiased as timm does; "
            "timm's class token or `global_pool='avg'` without one, registers, `no_embed_class`, "
            "pre-norm, `fc_norm`, layer scale, non-square grids, checked against timm itself; its "
            "other options refused by name)",
            loads={HF_VIT.architecture: from_hf_vit},
        ),
    ),
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
