"""What every family spec shares: what each flat field allows and its check, translating a
family's flat fields into the layers' configs, the explicit KV cache's layout, building a spec
from a preset, and input checks.

A family spec (tfjax.specs.<family>) is a frozen dataclass of the family's flat fields: it holds
and checks them and says what to build; tfjax.models (Linen) and tfjax.nnx (NNX) build their
modules from it. Nothing here imports Flax.
"""

import dataclasses
import typing

import jax.numpy as jnp

from tfjax import allowed, ops
from tfjax.allowed import FRACTION, integer, number, one_of
from tfjax.ops.activations import ALL_ACTIVATIONS
from tfjax.ops.attention import IMPLEMENTATIONS
from tfjax.ops.config import (
    NORM_POSITIONS,
    ROUTER_SCORES,
    AttentionConfig,
    BlockConfig,
    MlpConfig,
    MoeConfig,
)
from tfjax.ops.norms import NORMS
from tfjax.ops.remat import REMAT_POLICIES

# A spec's dataclass options: frozen (a static, hashable description) and keyword-only.
SPEC_OPTIONS = dict(frozen=True, kw_only=True)

# What a family's flat field allows besides its annotated type (an `int | None` field may also
# be None): the families name their fields alike, so one table serves them all; each family
# adds its own choices (`check_fields`).
ALLOWED = {
    "vocab_size": integer(1),
    "num_classes": integer(1),
    "width": integer(1),
    "num_layers": integer(1),
    "num_heads": integer(1),
    "num_kv_heads": integer(1),
    "head_dim": integer(1),
    "kv_lora_rank": integer(1),
    "q_lora_rank": integer(1),
    "qk_rope_head_dim": integer(2),
    "v_head_dim": integer(1),
    "linear_num_key_heads": integer(1),
    "linear_num_value_heads": integer(1),
    "linear_key_head_dim": integer(1),
    "linear_value_head_dim": integer(1),
    "linear_conv_kernel_dim": integer(1),
    "partial_rotary_factor": number(above=0),
    "mlp_dim": integer(1),
    "max_len": integer(1),
    "type_vocab_size": integer(0),
    "patch_size": integer(1),
    "image_size": integer(1),
    "channels": integer(1),
    "num_registers": integer(0),
    "relative_buckets": integer(1),
    "relative_max_distance": integer(1),
    "sliding_window": integer(1),
    "attention_chunk_size": integer(1),
    "attention_temperature_floor": integer(1),
    "attention_temperature_scale": number(0),
    "dropout_rate": FRACTION,
    "attention_dropout_rate": FRACTION,
    "mlp_dropout_rate": FRACTION,
    "norm_eps": number(above=0),
    "init_stddev": number(0),
    "layer_scale": number(),
    "rope_base": number(above=0),
    "local_rope_base": number(above=0),
    "attention_scalar": number(above=0),
    "attention_scale": number(above=0),
    "attention_softcap": number(above=0),
    "final_logit_softcap": number(above=0),
    "swiglu_alpha": number(above=0),
    "swiglu_limit": number(above=0),
    "activation": one_of(*ALL_ACTIVATIONS),
    "norm": one_of(*NORMS),
    "norm_position": one_of(*NORM_POSITIONS),
    "remat_policy": one_of(*REMAT_POLICIES),
    "implementation": one_of(*IMPLEMENTATIONS),
    # a mixture of experts (decoder)
    "num_experts": integer(0),
    "experts_per_token": integer(1),
    "expert_mlp_dim": integer(1),
    "router_score": one_of(*ROUTER_SCORES),
    "shared_expert_dim": integer(0),
    "router_groups": integer(1),
    "router_groups_kept": integer(1),
    "router_scale": number(above=0),
    "first_dense_layers": integer(0),
    "moe_layer_step": integer(1),
    "load_balance_loss_weight": number(0),
    "router_z_loss_weight": number(0),
}


def check_fields(model, **family: allowed.Allowed) -> None:
    """Every field of a family spec `model` against its type annotation and ALLOWED (with
    `family`, the family's own choices), then the heads against the width. The error names
    the field as "<Family>.<field>" (a run's config calls it "model.<field>")."""
    owner = type(model).__name__
    rules = ALLOWED | family
    names = set()
    for f in dataclasses.fields(model):
        names.add(f.name)
        value = getattr(model, f.name)
        rule = rules.get(f.name) if value is not None else None  # None: as its type allows
        if rule is None and f.type is not typing.Any:
            rule = allowed.of_type(f.type)
        if rule is not None:
            allowed.check({f.name: value}, {f.name: rule}, owner=f"{owner}.")
    heads, kv_heads = model.num_heads, getattr(model, "num_kv_heads", None)
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{owner}.num_kv_heads={kv_heads} must divide {owner}.num_heads={heads}")
    if getattr(model, "head_dim", None) is None and model.width % heads:
        other = f" (or set {owner}.head_dim)" if "head_dim" in names else ""
        raise ValueError(
            f"{owner}.num_heads={heads} must divide {owner}.width={model.width}{other}"
        )


class FamilySpec:
    """What every family spec checks when made (its __post_init__): each field against its type,
    ALLOWED and the family's CHOICES (`check_fields`), then the family's own checks across
    fields (`check_family`), then the layers' configs, which check the fields they take
    (`block_config`)."""

    CHOICES: dict = {}  # field -> allowed.Allowed: the family's own choices (one_of(...))

    def __post_init__(self):
        check_fields(self, **self.CHOICES)
        self.check_family()
        self.block_config()

    def check_family(self) -> None:
        """The family's checks across fields; none unless the family has some."""


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
    "attention_sinks": "sinks",
    "attention_output_gate": "output_gate",
    "partial_rotary_factor": "partial_rotary_factor",
    "attention_dropout_rate": "dropout_rate",
    "implementation": "implementation",
}
MLP_FIELDS = {  # -> MlpConfig
    "mlp_dim": "hidden_dim",
    "activation": "activation",
    "swiglu_alpha": "swiglu_alpha",
    "swiglu_limit": "swiglu_limit",
    "mlp_dropout_rate": "dropout_rate",
    "use_bias": "use_bias",
}
MOE_FIELDS = {  # -> MoeConfig, the FFN of a family's mixture-of-experts layers
    "num_experts": "num_experts",
    "experts_per_token": "top_k",
    "activation": "activation",
    "swiglu_alpha": "swiglu_alpha",
    "swiglu_limit": "swiglu_limit",
    "use_bias": "use_bias",
    "router_score": "router_score",
    "router_renormalize": "renormalize",
    "router_bias": "router_bias",
    "router_score_bias": "score_bias",
    "router_groups": "groups",
    "router_groups_kept": "groups_kept",
    "router_scale": "scale",
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
    """The BlockConfig of a family spec `model`'s flat fields, by ATTENTION_FIELDS, MLP_FIELDS and
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
    """cls(**variants[variant], **overrides) of a spec class `cls`, with errors that name the
    variant or field."""
    if variant is not None and variant not in variants:
        raise ValueError(
            f"{cls.__name__}: variant={variant!r} is unknown; allowed: {', '.join(variants)}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown field(s) {unknown}; allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {**(variants[variant] if variant else {}), **overrides}
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ValueError(f"{cls.__name__}: missing required field(s) {missing}")
    return cls(**kwargs)


def values(spec) -> dict:
    """A spec's flat fields as {name: value} (shallow: a RopeScaling stays one)."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


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
