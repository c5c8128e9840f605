"""What every model file shares: building a module from a preset, translating a family's flat
fields into the layers' configs, the explicit KV cache, and input checks."""

import dataclasses

import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax import ops
from tfjax.ops.config import AttentionConfig, BlockConfig, MlpConfig, MoeConfig

# Where a family's flat field goes in its layers' configs: the families name their fields alike
# and each has a subset; a field it lacks takes the config's default. One field may feed two.
ATTENTION_FIELDS = {  # family field -> AttentionConfig field
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "use_bias": "use_bias",
    "qkv_bias": "qkv_bias",
    "qk_norm": "qk_norm",
    "norm_eps": "norm_eps",
    "attention_scale": "scale",
    "attention_softcap": "softcap",
    "attention_dropout_rate": "dropout_rate",
    "implementation": "implementation",
}
MLP_FIELDS = {  # -> MlpConfig
    "mlp_dim": "hidden_dim",
    "activation": "activation",
    "mlp_dropout_rate": "dropout_rate",
    "use_bias": "use_bias",
}
MOE_FIELDS = {  # -> MoeConfig, the FFN of a family's mixture-of-experts layers
    "num_experts": "num_experts",
    "experts_per_token": "top_k",
    "activation": "activation",
    "use_bias": "use_bias",
    "router_score": "router_score",
    "router_renormalize": "renormalize",
    "router_bias": "router_bias",
    "shared_expert_dim": "shared_dim",
    "shared_expert_gate": "shared_gate",
    "load_balance_loss_weight": "load_balance_weight",
    "router_z_loss_weight": "router_z_weight",
}
BLOCK_FIELDS = {  # -> BlockConfig
    "norm": "norm",
    "norm_eps": "norm_eps",
    "norm_position": "norm_position",
    "dropout_rate": "dropout_rate",
    "layer_scale": "layer_scale",
}


def block_config(model, *, attention=(), mlp=(), moe=None, **block) -> BlockConfig:
    """The BlockConfig of a family `model`'s flat fields, by ATTENTION_FIELDS, MLP_FIELDS and
    BLOCK_FIELDS; `attention`, `mlp` (dicts) and `block` set what the family translates itself.
    With `moe` (a dict, maybe empty) the FFN is a mixture of experts, by MOE_FIELDS. The per-head
    norm (qk_norm) is the block norm's RMS kind."""
    fields = {f.name for f in dataclasses.fields(model)}

    def pick(table, extra):
        return {dst: getattr(model, src) for src, dst in table.items() if src in fields} | dict(
            extra
        )

    block = pick(BLOCK_FIELDS, block)
    kind = "rms_plus_one" if block.get("norm") == "rms_plus_one" else "rms"
    attention = AttentionConfig(**{"qk_norm_kind": kind, **pick(ATTENTION_FIELDS, attention)})
    ffn = MlpConfig(**pick(MLP_FIELDS, mlp)) if moe is None else MoeConfig(**pick(MOE_FIELDS, moe))
    return BlockConfig(attention, ffn, **block)


def stack(model, config: BlockConfig, name: str, num_layers=None, **options) -> tnn.Stack:
    """A family's layer stack of `config` blocks: its num_layers (unless given), scan_layers,
    remat_policy and dtypes; `options`: the Stack's others (kernel_init, final_norm, variants)."""
    return tnn.Stack(
        config,
        model.num_layers if num_layers is None else num_layers,
        scan_layers=model.scan_layers,
        remat_policy=model.remat_policy,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        name=name,
        **options,
    )


def init_cache(
    model,
    config: AttentionConfig,
    batch_size,
    length,
    *,
    dtype=None,
    sharding=None,
    num_layers=None,
):
    """The explicit KV cache of a family's (decoder) stack of num_layers (the model's when None),
    whose self-attention is `config`; see the models' `init_cache`."""
    return ops.init_cache(
        config,
        batch_size,
        length,
        model.width,
        num_layers=model.num_layers if num_layers is None else num_layers,
        scanned=model.scan_layers,
        dtype=dtype or model.dtype or jnp.float32,
        sharding=sharding,
    )


def from_variant(cls, variants: dict, variant: str | None, overrides: dict):
    """cls(**variants[variant], **overrides), with errors that name the variant or field."""
    if variant is not None and variant not in variants:
        raise ValueError(
            f"{cls.__name__}: variant={variant!r} is unknown; allowed: {', '.join(variants)}"
        )
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"parent", "name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown field(s) {unknown}; allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {**(variants[variant] if variant else {}), **overrides}
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in ("parent", "name")
    )
    if missing:
        raise ValueError(f"{cls.__name__}: missing required field(s) {missing}")
    return cls(**kwargs)


def check_tokens(x, name: str):
    """Token ids must be a [B, T] integer array."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be [B, T] integer token ids, got shape {x.shape} {x.dtype}")


def shift_right(targets, segment_ids=None):
    """Decoder inputs: targets moved one step right with 0 (the start token) in front.

    With packed rows, each segment starts with 0 instead of the previous segment's last token.
    [B, T] -> [B, T].
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    if segment_ids is not None:
        prev = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(segment_ids == prev, shifted, 0)
    return shifted
