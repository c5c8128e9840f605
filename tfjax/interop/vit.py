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

`resample_posemb` interpolates the patch grid bicubically exactly as
`torch.nn.functional.interpolate(mode="bicubic", align_corners=False)` does (Keys' kernel with
a = -0.75, clamped borders), which is what Hugging Face's `interpolate_pos_encoding=True`
and timm's `resample_abs_pos_embed` use; the class token's embedding is kept as it is.
"""

import math

import jax.numpy as jnp
import numpy as np

from tfjax.interop import core
from tfjax.interop.core import Field, Fixed
from tfjax.models import vit

_A = -0.75  # PyTorch's bicubic kernel parameter


def _cubic(x):
    """Keys' cubic convolution kernel with a = -0.75, for |x| < 2."""
    x = np.abs(x)
    near = ((_A + 2) * x - (_A + 3)) * x * x + 1
    far = ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _cubic_aa(x):
    """Keys' cubic convolution kernel with a = -0.5 (PIL's; torch's antialiased bicubic)."""
    x = np.abs(x)
    near = (1.5 * x - 2.5) * x * x + 1
    far = ((-0.5 * x + 2.5) * x - 4) * x + 2
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _bicubic_aa_matrix(size_in: int, size_out: int) -> np.ndarray:
    """torch's bicubic resize with antialias=True (align_corners=False): the kernel widened by
    the scale when shrinking, taps outside the image left out, each row's weights normalised."""
    m = np.zeros((size_out, size_in), np.float64)
    scale = size_in / size_out
    support = 2.0 * max(scale, 1.0)
    inv = 1.0 / max(scale, 1.0)
    for i in range(size_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        j = np.arange(lo, hi)
        w = _cubic_aa((j - center + 0.5) * inv)
        m[i, lo:hi] = w / w.sum()
    return m


def bicubic_matrix(size_in: int, size_out: int, *, antialias: bool = False) -> np.ndarray:
    """[size_out, size_in] weights of torch's bicubic resize (align_corners=False) on one axis;
    `antialias` as torch's interpolate (DINOv2 with registers resamples with it)."""
    if antialias:
        return _bicubic_aa_matrix(size_in, size_out)
    m = np.zeros((size_out, size_in), np.float64)
    scale = size_in / size_out
    for i in range(size_out):
        src = scale * (i + 0.5) - 0.5
        base = math.floor(src)
        t = src - base
        for offset in (-1, 0, 1, 2):
            w = _cubic(np.float64(t - offset))
            m[i, min(max(base + offset, 0), size_in - 1)] += w
    return m


def resample_posemb(
    posemb, new_grid: tuple[int, int], *, num_prefix_tokens: int = 1, antialias: bool = False
):
    """Position embeddings [1, prefix + h * w, D] of a square grid -> [1, prefix + H * W, D].

    Args:
      posemb: learned embeddings; the first `num_prefix_tokens` (the class token) are kept.
      new_grid: (H, W) patches of the new image size.
      antialias: torch's antialiased bicubic (a = -0.5, normalised taps) instead of the plain one.
    """
    posemb = np.asarray(posemb)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"resample_posemb: posemb must be [1, N, D], got {posemb.shape}")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    side = math.isqrt(grid.shape[0])
    if side * side != grid.shape[0]:
        raise ValueError(
            f"resample_posemb: {grid.shape[0]} patch embeddings do not form a square grid"
        )
    h, w = new_grid
    if (h, w) == (side, side):
        return posemb
    d = grid.shape[-1]
    # [side, side, D] -> [H, W, D]
    grid = grid.reshape(side, side, d).astype(np.float64)
    rows, cols = (bicubic_matrix(side, n, antialias=antialias) for n in (h, w))
    # [H, W, D]
    out = np.einsum("Hh,hwd,Ww->HWd", rows, grid, cols)
    out = out.reshape(1, h * w, d).astype(posemb.dtype)
    return np.concatenate([prefix, out], axis=1)


def image_size_pair(value) -> tuple[int, int]:
    if isinstance(value, int | np.integer):
        return int(value), int(value)
    h, w = value
    return int(h), int(w)


def hf_vit_rules(model: vit.VisionTransformer, prefix: str = "vit.") -> list[core.Rule]:
    e = f"{prefix}embeddings."
    rules = [
        core.conv(f"{e}patch_embeddings.projection.weight", ("patch_embed", "kernel")),
        core.identity(f"{e}patch_embeddings.projection.bias", ("patch_embed", "bias")),
        core.identity(f"{e}cls_token", ("cls",)),
        core.identity(f"{e}position_embeddings", ("pos_embed",)),
        *core.norm(f"{prefix}layernorm", ("encoder", "final_norm")),
        *core.dense("classifier", ("head",)),
    ]
    for i in range(model.num_layers):
        h, layer = f"{prefix}encoder.layer.{i}.", ("encoder", f"layers_{i}")
        att = (*layer, "self_attention")
        for name in ("query", "key", "value"):
            rules += [
                core.linear(f"{h}attention.attention.{name}.weight", (*att, f"{name}_kernel")),
                core.reshaped(f"{h}attention.attention.{name}.bias", (*att, f"{name}_bias")),
            ]
        rules += [
            core.linear_out(f"{h}attention.output.dense.weight", (*att, "out_kernel")),
            core.identity(f"{h}attention.output.dense.bias", (*att, "out_bias")),
            *core.norm(f"{h}layernorm_before", (*layer, "self_attention_norm")),
            *core.norm(f"{h}layernorm_after", (*layer, "mlp_norm")),
            *core.dense(f"{h}intermediate.dense", (*layer, "mlp", "wi")),
            *core.dense(f"{h}output.dense", (*layer, "mlp", "wo")),
        ]
    return rules


def timm_vit_rules(model: vit.VisionTransformer) -> list[core.Rule]:
    """timm's VisionTransformer keys (class token, learned posemb, fused qkv, no pre-norm)."""
    rules = [
        core.conv("patch_embed.proj.weight", ("patch_embed", "kernel")),
        core.identity("patch_embed.proj.bias", ("patch_embed", "bias")),
        core.identity("cls_token", ("cls",)),
        core.identity("pos_embed", ("pos_embed",)),
        *core.norm("norm", ("encoder", "final_norm")),
        *core.dense("head", ("head",)),
    ]
    for i in range(model.num_layers):
        h, layer = f"blocks.{i}.", ("encoder", f"layers_{i}")
        att = (*layer, "self_attention")
        rules += [
            core.stacked_linear(
                f"{h}attn.qkv.weight", [(*att, f"{n}_kernel") for n in ("query", "key", "value")]
            ),
            core.stacked_linear(
                f"{h}attn.qkv.bias", [(*att, f"{n}_bias") for n in ("query", "key", "value")]
            ),
            core.linear_out(f"{h}attn.proj.weight", (*att, "out_kernel")),
            core.identity(f"{h}attn.proj.bias", (*att, "out_bias")),
            *core.norm(f"{h}norm1", (*layer, "self_attention_norm")),
            *core.norm(f"{h}norm2", (*layer, "mlp_norm")),
            *core.dense(f"{h}mlp.fc1", (*layer, "mlp", "wi")),
            *core.dense(f"{h}mlp.fc2", (*layer, "mlp", "wo")),
        ]
    return rules


HF_VIT = core.Family(
    architecture="ViTForImageClassification",
    model_type="vit",
    model=vit.Model,
    config=(
        *core.LABELS,
        Field("patch_size", "patch_size", 16),
        Field("hidden_size", "width"),
        Field("num_hidden_layers", "num_layers"),
        Field("intermediate_size", "mlp_dim"),
        Field("num_attention_heads", "num_heads"),
        Field("hidden_dropout_prob", "dropout_rate", 0.0),
        Field("attention_probs_dropout_prob", "attention_dropout_rate", 0.0),
        Field("layer_norm_eps", "norm_eps", 1e-12),
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
        resampled = core.StateDict(state, state.files, state.origin)
        grid = (image_size[0] // patch, image_size[1] // patch)
        resampled[key] = resample_posemb(state[key], grid)
        state = resampled
    return state, image_size


def from_hf_vit(source, config=None, *, image_size=None, **overrides):
    """(tfjax ViT, params) from a ViTForImageClassification directory or (state dict, config).

    image_size: int or (H, W) the model will see; the position embeddings are resampled from
    the config's image_size when it differs.
    """
    state, c = core.load_source(source, config)
    model = core.build(HF_VIT, c, **overrides)
    state, size = _resampled(
        state,
        "vit.embeddings.position_embeddings",
        c.get("image_size") or 224,
        image_size,
        model.patch_size,
        HF_VIT.architecture,
    )
    images = jnp.zeros((1, *size, c.get("num_channels") or 3), jnp.float32)
    return model, core.import_params(HF_VIT, model, state, inputs=(images,))


def from_timm_vit(state, *, image_size, trained_image_size=None, **fields):
    """(tfjax ViT, params) from a timm VisionTransformer state dict (class token, learned
    posemb); `fields` give the tfjax sizes and options not in the weights (norm_eps=1e-6 for
    timm, patch_size, num_heads, ...). The trained grid is read from pos_embed."""
    state = core.as_state_dict(state)
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
    params = core.import_state(
        state, timm_vit_rules(model), core.param_shapes(model, images), what=what
    )
    return model, core.finish(model, params)


def to_hf_vit(model: vit.VisionTransformer, params):
    """({Hugging Face key: numpy array}, config dict); the config's image_size is the square
    image the position embeddings were made for (grid side * patch size)."""
    if model.num_classes is None:
        raise ValueError(f"{HF_VIT.architecture} needs a head; the model has num_classes=None")
    state, config = core.to_hf(HF_VIT, model, params)
    grid = math.isqrt(state["vit.embeddings.position_embeddings"].shape[1] - 1)
    return state, {**config, "image_size": grid * model.patch_size}
