"""Llama 4 (`Llama4ForCausalLM`, the text model of Scout 17B-16E and Maverick 17B-128E) <->
`tfjax.models.decoder` with its attention kinds and its mixture of experts.

    model, params = from_llama4("path/to/checkpoint")   # config.json + weights
    state, config = to_llama4(model, params)            # back to Hugging Face keys

The published image-text checkpoints (`Llama4ForConditionalGeneration`) load as this text model
through tfjax.interop.core's wrapper table (the vision tower skipped by name).

The layers: RoPE layers attend within chunks of attention_chunk_size positions ("local" layers
of `attention_pattern`, `attention_chunk_size`) with their queries and keys divided by their
RMS (use_qk_norm -> `qk_unit_norm`, no weight); every no_rope_layer_interval-th layer ("global",
`global_rope=False`) has no positions, attends to the whole context and scales its queries by
1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (`attention_temperature_floor`,
`attention_temperature_scale`). The RoPE layers' rope_parameters are then the "local" layers'
(`local_rope_scaling`, with `rope_scaling` the same). Every interleave_moe_layer_step-th
layer's FFN (`moe_layer_step`) is a mixture: a router picks num_experts_per_tok experts by
their logits, each chosen expert takes the token times sigmoid(its logit)
(`router_weighs_inputs`: the score scales the input of the expert, not its output) and a shared
expert of the same width adds its output; the other layers' FFN is a dense MLP of
intermediate_size_mlp. Each run of layers with one FFN kind is a stack of its own ("decoder_0",
"decoder_1", ...; one "decoder" when every layer has experts).

Key mapping, layer i (under "model."; embeddings, final norm (the last stack's), head and the
two layer norms as Llama's):
  self_attn.{q,k}_proj [N*H, D]           -> self_attention/{query,key}_kernel [D, N, H], each
                                             head's rows permuted (below)
  self_attn.v_proj, o_proj                -> self_attention/value_kernel, out_kernel
  feed_forward.{gate,up,down}_proj        -> mlp/wi_0, wi_1, wo (a dense layer)
  feed_forward.router [E, D]              -> mlp/router/kernel [D, E]
  feed_forward.experts.gate_up_proj [E, D, 2F] -> mlp/experts/wi_0, wi_1 [E, D, F] (the gate's
                                             F columns first)
  feed_forward.experts.down_proj [E, F, D] -> mlp/experts/wo [E, F, D]
  feed_forward.shared_expert.{gate,up,down}_proj -> mlp/shared/wi_0, wi_1, wo
Llama 4 rotates interleaved channel pairs (as complex numbers); the query and key rows of each
head are permuted on load to tfjax's rotate-half layout (the even channels, then the odd ones)
and back on export, so round trips are bitwise. Every layer's are (a NoPE layer's too: the same
permutation of its query and key channels leaves its attention as it was; the RMS norm and the
temperature do not see the order).

Config: Llama's sizes, head_dim, intermediate_size -> expert_mlp_dim and shared_expert_dim,
intermediate_size_mlp -> mlp_dim, num_local_experts, num_experts_per_tok, rope_parameters (or
rope_theta and rope_scaling: llama3 for Scout), no_rope_layers (or no_rope_layer_interval) ->
attention_pattern. Refused by key before any tensor is read: attention_bias, a null
attention_chunk_size (the RoPE layers attending to the whole context), moe_layers or
layer_types other than the ones interleave_moe_layer_step and no_rope_layers give.

Decoding: transformers scales a NoPE layer's queries by the cache's length, where tfjax uses the
token's position; they differ for left-padded prompts only (tfjax decodes each row as that
prompt alone), and only past floor_scale tokens.
"""

import jax.numpy as jnp
import numpy as np

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import (
    LAYER_NORMS,
    LLAMA_ROPE,
    NO_GEMMA_OPTIONS,
    PLAIN_LAYERS,
    SIZES,
    decoder_family,
    ends_rules,
    gated_mlp,
    layer_keys,
    layer_paths,
    spelled_out,
    training_fields,
)
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Rule, identity, interleaved_rope, linear, linear_out
from tfjax.interop.core.tables import Family, Field, Fixed, table_config, table_fields
from tfjax.models import decoder
from tfjax.specs.decoder import LLAMA4_ONLY, non_default

__all__ = ["from_llama4", "to_llama4"]

_FLOOR_SCALE = 8192  # Llama4TextConfig's floor_scale, written when the temperature is off


def _gate_up(key: str, paths) -> Rule:
    """experts.gate_up_proj [E, D, 2F] (the gate's F columns, then the up projection's) <->
    two stacked kernels [E, D, F]."""
    return Rule(
        (key,),
        tuple(paths),
        lambda x, shapes: tuple(np.split(x, 2, axis=-1)),
        lambda gate, up: (jnp.concatenate([gate, up], axis=-1),),
    )


def _experts(f: str, path: tuple) -> list[Rule]:
    """A mixture's FFN (keys under `f`, params under `path`): router, fused experts, shared."""
    experts = (*path, "experts")
    return [
        linear(f"{f}router.weight", (*path, "router", "kernel")),
        _gate_up(f"{f}experts.gate_up_proj", [(*experts, "wi_0"), (*experts, "wi_1")]),
        identity(f"{f}experts.down_proj", (*experts, "wo")),
        *gated_mlp(f"{f}shared_expert.", (*path, "shared")),
    ]


def llama4_rules(model: decoder.Decoder, prefix="model.") -> list[Rule]:
    """Llama 4's state-dict keys (see the module docstring)."""
    rules = ends_rules(model, prefix, model.stacks()[-1][0])
    h = model.head_dim or model.width // model.num_heads
    for i, layer in enumerate(layer_paths(model)):
        at, att, mlp = f"{prefix}layers.{i}.", (*layer, "self_attention"), (*layer, "mlp")
        rules += [
            identity(f"{at}{k}.weight", (*layer, v, "scale")) for k, v in LAYER_NORMS["pre"].items()
        ]
        a = f"{at}self_attn."
        rules += [
            interleaved_rope(f"{a}q_proj.weight", (*att, "query_kernel"), h, h),
            interleaved_rope(f"{a}k_proj.weight", (*att, "key_kernel"), h, h),
            linear(f"{a}v_proj.weight", (*att, "value_kernel")),
            linear_out(f"{a}o_proj.weight", (*att, "out_kernel")),
        ]
        f = f"{at}feed_forward."
        rules += _experts(f, mlp) if model.spec.moe_layer(i) else gated_mlp(f, mlp)
    return rules


def _rope_layers(c: dict, n: int, what: str) -> list[bool]:
    """Which of the n layers rotate: no_rope_layers (1: RoPE, 0: NoPE), else every
    no_rope_layer_interval-th layer NoPE (transformers' default; an empty list means it too)."""
    listed = c.get("no_rope_layers")
    if listed:
        if not isinstance(listed, list | tuple) or len(listed) < n or set(listed) - {0, 1}:
            raise ValueError(
                f"{what}: no_rope_layers={listed!r} is not supported (needs a 0 or 1 per layer, "
                f"{n})"
            )
        return [bool(r) for r in listed[:n]]
    every = c.get("no_rope_layer_interval", 4)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"{what}: no_rope_layer_interval={every!r} is not supported (needs an int >= 1)"
        )
    return [(i + 1) % every != 0 for i in range(n)]


def _layer_types(rope: list[bool]) -> list[str]:
    """transformers' layer_types of these layers: the RoPE ones chunked."""
    return ["chunked_attention" if r else "full_attention" for r in rope]


def _check_listed(c: dict, key: str, want: list, what: str, means: str) -> None:
    """A config list transformers derives (moe_layers, layer_types) may only say what tfjax
    derives: `want`."""
    given = c.get(key)
    if given is not None and list(given) != want:
        raise ValueError(f"{what}: {key}={given!r} is not supported (needs {want}: {means})")


def _read(family: Family, c: dict) -> dict:
    """The table's fields, the layers' kinds from no_rope_layers (the RoPE ones "local", the
    NoPE ones "global", as the shortest pattern that repeats to them) and the temperature of
    the NoPE layers (attn_temperature_tuning: off leaves them unscaled)."""
    what = family.architecture
    if "attention_chunk_size" in c and c["attention_chunk_size"] is None:
        raise ValueError(
            f"{what}: attention_chunk_size=None is not supported (needs an int: tfjax's Llama 4 "
            "RoPE layers attend within chunks)"
        )
    fields = table_fields(family, c)
    n, step = fields["num_layers"], fields["moe_layer_step"]
    rope = _rope_layers(c, n, what)
    kinds = ["local" if r else "global" for r in rope]
    period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
    if kinds[:period] != ["local"]:  # some NoPE layers (else every layer as one kind)
        pattern = tuple(kinds[:period])
        # the RoPE layers are the pattern's "local" ones, whose scaling is local_rope_scaling
        scaling = fields.get("rope_scaling")
        fields.update(attention_pattern=pattern, global_rope=False, local_rope_scaling=scaling)
    if "local" not in kinds:  # no chunked layer
        fields["attention_chunk_size"] = None
    if not c.get("attn_temperature_tuning", True):  # Scout's config says 4: true
        fields.update(attention_temperature_floor=None, attention_temperature_scale=0.1)
    _check_listed(
        c,
        "moe_layers",
        list(range(step - 1, n, step)),
        what,
        "every interleave_moe_layer_step-th layer",
    )
    _check_listed(c, "layer_types", _layer_types(rope), what, "the RoPE layers chunked")
    return fields


def _write(family: Family, model: decoder.Decoder) -> dict:
    """The table's config, with the per-layer lists transformers reads (no_rope_layers,
    layer_types, moe_layers) and attn_temperature_tuning."""
    what = family.architecture
    pattern = model.attention_pattern or ("local",)
    if model.global_rope and "global" in pattern:
        raise ValueError(
            f"{what} holds no global layers with RoPE: its RoPE layers attend within chunks "
            "(set global_rope=False)"
        )
    if not model.num_experts:
        raise ValueError(f"{what} needs a mixture of experts (num_experts > 0)")
    if model.attention_pattern is not None and model.local_rope_scaling != model.rope_scaling:
        raise ValueError(
            f"{what} has one rope_parameters for its RoPE layers: local_rope_scaling="
            f"{model.local_rope_scaling!r} must be rope_scaling={model.rope_scaling!r}"
        )
    n, step = model.num_layers, model.moe_layer_step
    rope = [pattern[i % len(pattern)] == "local" for i in range(n)]
    config = table_config(family, model)
    config.update(
        no_rope_layers=[int(r) for r in rope],
        layer_types=_layer_types(rope),
        moe_layers=list(range(step - 1, n, step)),
        attn_temperature_tuning=model.attention_temperature_floor is not None,
    )
    return config


LLAMA4 = decoder_family(
    "Llama4ForCausalLM",
    "llama4_text",
    (
        *SIZES,
        Field("head_dim", "head_dim", 128),
        Field("intermediate_size_mlp", "mlp_dim", 16384),
        Field("intermediate_size", "expert_mlp_dim", 8192),
        Field("intermediate_size", "shared_expert_dim", 8192),
        Field("num_local_experts", "num_experts", 16),
        Field("num_experts_per_tok", "experts_per_token", 1),
        Field("interleave_moe_layer_step", "moe_layer_step", 1),
        *layer_keys(131072, 1e-5),
        *LLAMA_ROPE,  # the published files: rope_theta and rope_scaling (Scout's llama3)
        Field("attention_chunk_size", "attention_chunk_size", 8192, to_config=lambda c: c or 8192),
        Field("use_qk_norm", "qk_unit_norm", True, values={True: True, False: False}),
        Field(
            "floor_scale",
            "attention_temperature_floor",
            _FLOOR_SCALE,
            to_config=lambda floor: floor or _FLOOR_SCALE,
        ),
        Field("attn_scale", "attention_temperature_scale", 0.1),
        *training_fields(),
        Fixed("attention_bias", False, why="tfjax's Llama 4 layers have no biases"),
    ),
    rules=llama4_rules,
    requires={
        **PLAIN_LAYERS,
        "attention_output_gate": False,
        "sliding_window": None,
        "kv_lora_rank": None,
        "layer_types": None,
        "router_score": "sigmoid",
        "router_renormalize": False,
        "router_weighs_inputs": True,
        "router_bias": False,
        "router_score_bias": False,
        "router_groups": 1,
        "router_groups_kept": None,
        "router_scale": 1.0,
        "shared_expert_gate": False,
        "first_dense_layers": 0,
        **NO_GEMMA_OPTIONS,
    },
    defaults={"rope_base": 500_000.0},
    read=_read,
    write=_write,
)

from_llama4, to_llama4 = convert.converters(LLAMA4, "llama4", spelled_out)


def is_llama4(model) -> bool:
    """A model with Llama 4's layers (a field of LLAMA4_ONLY set): this family exports it, and
    the other families' exporters leave it."""
    return bool(non_default(model, LLAMA4_ONLY))


CONVERTS = Converts(
    rows=(
        Row(
            "Llama 4 (text)",
            "`from_llama4` / `to_llama4`",
            "decoder",
            "with chunked attention on its RoPE layers (`attention_chunk_size`, `qk_unit_norm`), "
            "NoPE `global` layers (`global_rope=False`, `attention_temperature_floor`), experts "
            "every `moe_layer_step`-th layer whose sigmoid scores scale their inputs "
            "(`router_weighs_inputs`) beside a shared expert; interleaved RoPE rows permuted to "
            "rotate-half; logits 3.0e-6 from float64 transformers",
            loads={LLAMA4.architecture: from_llama4},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=is_llama4,
            export=convert.exporter(lambda model: LLAMA4, spelled_out),
            family=lambda model: LLAMA4,
            needs="Llama 4: one of its layers' fields set (" + ", ".join(LLAMA4_ONLY) + ")",
        ),
    ),
)
