"""Qwen3.5 (`Qwen3_5ForCausalLM`, the text model; `Qwen3_5MoeForCausalLM` with experts) <->
`tfjax.models.decoder` with `layer_types`: Gated DeltaNet linear-attention layers
(tfjax.ops.linear_attention) among gated full-attention layers (attention_output_gate,
partial_rotary_factor), (1 + w) RMSNorms (norm="rms_plus_one", the per-head q/k norms too).

    model, params = from_qwen3_5("path/to/checkpoint")   # config.json + weights
    state, config = to_qwen3_5(model, params)            # back to Hugging Face keys

The decoder holds each run of consecutive layers of one type as its own stack ("decoder_0",
"decoder_1", ...; `model.stacks()`), so layer i's params are under that run's `layers_j`.
Key mapping, layer i (under "model."; embeddings, final norm (the last stack's), head, the two
layer norms and the FFN as Llama's):
  self_attn.q_proj [N*2H, D]   -> self_attention/query_kernel and gate_kernel [D, N, H] (each
                                  head's H query rows, then its H gate rows)
  self_attn.{k,v}_proj, o_proj -> self_attention/{key,value}_kernel, out_kernel
  self_attn.{q,k}_norm         -> self_attention/{query,key}_norm/scale (1 + w)
  linear_attn.*                -> self_attention/* of a Gated DeltaNet layer
                                  (tfjax.interop.core.linear_attention: in_proj_qkv and conv1d
                                  split into query/key/value parts, in_proj_z -> gate_kernel,
                                  in_proj_b -> beta_kernel, in_proj_a -> dt_kernel, ...)

Config: Llama's sizes, head_dim, layer_types (or full_attention_interval: every n-th layer full),
linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
linear_conv_kernel_dim, rope_parameters (rope_theta, partial_rotary_factor; mrope_section and
mrope_interleaved are read and dropped: a text model's positions are the same on the three
streams, which gives plain RoPE). Refused by key before any tensor is read: attention_bias, a
rope_type other than "default", a layer type other than full_attention / linear_attention.
Qwen3.5-MoE's FFN (every layer): mlp.gate [E, D] -> mlp/router/kernel, the experts fused
(mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]) or one tensor each (mlp.experts.j.
{gate,up,down}_proj) -> mlp/experts/wi_0, wi_1, wo, mlp.shared_expert.* -> mlp/shared/*, and
mlp.shared_expert_gate [1, D] -> mlp/shared_gate/kernel; moe_intermediate_size ->
expert_mlp_dim, shared_expert_intermediate_size -> shared_expert_dim, num_experts,
num_experts_per_tok. Multimodal checkpoints (Qwen3_5ForConditionalGeneration) load through
tfjax.interop.core's wrapper table, not here.
"""

import jax.numpy as jnp

from tfjax.interop.core import convert
from tfjax.interop.core import linear_attention as la_convert
from tfjax.interop.core.decoders import (
    LAYER_NORMS,
    NO_GEMMA_OPTIONS,
    SIZES,
    decoder_family,
    ends_rules,
    expert_rules,
    fused_layout,
    gated_mlp,
    layer_keys,
    layer_paths,
    rope_scaling_of,
    spelled_out,
    training_fields,
)
from tfjax.interop.core.registry import Converts, Exporter, Row
from tfjax.interop.core.rules import Rule, identity, linear, linear_out
from tfjax.interop.core.tables import Family, Field, Fixed, table_fields
from tfjax.models import decoder
from tfjax.ops import linear_attention as la
from tfjax.specs.decoder import LAYER_TYPES, LINEAR_ONLY

__all__ = ["from_qwen3_5", "from_qwen3_5_moe", "to_qwen3_5", "to_qwen3_5_moe"]

_MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # the same positions on each text stream


def _gated_query(key: str, paths, num_heads: int, head_dim: int) -> Rule:
    """q_proj [N*2H, D] <-> query_kernel and gate_kernel [D, N, H]."""

    def to_jax(x, shapes):
        return la_convert.gated_query_from_transformers(x, num_heads, head_dim)

    def to_torch(query, gate):  # gated_query_to_transformers in jax.numpy (traced)
        both = jnp.stack([jnp.moveaxis(query, 0, -1), jnp.moveaxis(gate, 0, -1)], axis=1)
        return (both.reshape(-1, both.shape[-1]),)  # [N, 2, H, D] -> [N 2H, D]

    return Rule((key,), tuple(paths), to_jax, to_torch)


def _linear_attention(a: str, att: tuple, config: la.LinearAttentionConfig) -> Rule:
    """One Gated DeltaNet layer's keys (under `a`) <-> its params (under `att`)."""
    keys = la_convert.TRANSFORMERS_KEYS
    names = tuple(la.parameter_shapes(config, 1))

    def to_jax(*arrays):
        params = la_convert.from_transformers(dict(zip(keys, arrays[:-1], strict=True)), config)
        return tuple(params[n] for n in names)

    def to_torch(*ys):  # to_transformers in jax.numpy (traced for the shape checks)
        p = dict(zip(names, ys, strict=True))
        flat = {
            n: w.reshape(w.shape[0], -1) for n, w in p.items() if n.endswith(("kernel", "conv"))
        }
        qkv = ("query", "key", "value")
        conv = jnp.concatenate([flat[f"{n}_conv"] for n in qkv], axis=1)
        state = {
            "in_proj_qkv.weight": jnp.concatenate([flat[f"{n}_kernel"] for n in qkv], axis=1).T,
            "conv1d.weight": conv.T[:, None, :],
            "out_proj.weight": p["out_kernel"].reshape(config.value_width, -1).T,
            "in_proj_z.weight": flat["gate_kernel"].T,
            "in_proj_b.weight": p["beta_kernel"].T,
            "in_proj_a.weight": p["dt_kernel"].T,
            "dt_bias": p["dt_bias"],
            "A_log": p["a_log"],
            "norm.weight": p["out_norm"],
        }
        return tuple(state[k] for k in keys)

    return Rule(tuple(f"{a}{k}" for k in keys), tuple((*att, n) for n in names), to_jax, to_torch)


def _experts(h: str, path: tuple, num_experts: int, fused: bool) -> list[Rule]:
    """Qwen3.5-MoE's FFN of layer i (keys under `h`, params under `path`): the router, the
    experts (transformers' fused tensors or one per expert), the gated shared expert."""
    m = f"{h}mlp."
    return [
        linear(f"{m}gate.weight", (*path, "router", "kernel")),
        *expert_rules(f"{m}experts.", path, num_experts, fused=fused),
        *gated_mlp(f"{m}shared_expert.", (*path, "shared")),
        linear(f"{m}shared_expert_gate.weight", (*path, "shared_gate", "kernel")),
    ]


def qwen3_5_rules(model: decoder.Decoder, prefix="model.", *, fused=False) -> list[Rule]:
    """Qwen3.5's state-dict keys (see the module docstring); with experts, Qwen3.5-MoE's (the
    export writes one tensor per expert, as transformers' save_pretrained and the Hub do)."""
    last = model.stacks()[-1][0]
    rules = ends_rules(model, prefix, last)
    types = model.layer_types or ("full_attention",) * model.num_layers
    for i, layer in enumerate(layer_paths(model)):
        h, att = f"{prefix}layers.{i}.", (*layer, "self_attention")
        norms = LAYER_NORMS["pre"].items()
        rules += [identity(f"{h}{k}.weight", (*layer, v, "scale")) for k, v in norms]
        if types[i] == "linear_attention":
            rules.append(
                _linear_attention(f"{h}linear_attn.", att, model.spec.linear_attention_config())
            )
        else:
            a = f"{h}self_attn."
            query = [(*att, "query_kernel"), (*att, "gate_kernel")]
            rules += [
                _gated_query(f"{a}q_proj.weight", query, model.num_heads, model.head_dim),
                linear(f"{a}k_proj.weight", (*att, "key_kernel")),
                linear(f"{a}v_proj.weight", (*att, "value_kernel")),
                linear_out(f"{a}o_proj.weight", (*att, "out_kernel")),
                identity(f"{a}q_norm.weight", (*att, "query_norm", "scale")),
                identity(f"{a}k_norm.weight", (*att, "key_norm", "scale")),
            ]
        if model.num_experts:
            rules += _experts(h, (*layer, "mlp"), model.num_experts, fused)
        else:
            rules += gated_mlp(f"{h}mlp.", (*layer, "mlp"))
    return rules


def _rope(params, fields):
    """rope_parameters -> RopeScaling (None: plain RoPE), partial_rotary_factor read apart and
    mrope's keys dropped (text positions are alike on its three streams)."""
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters={params!r} must be a dict")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported (needs 'default')")
    drop = ("partial_rotary_factor", *_MROPE_KEYS)
    return rope_scaling_of({k: v for k, v in params.items() if k not in drop}, fields)


def _layer_types(types, fields):
    """layer_types (a list) -> the decoder's tuple, each type checked by name."""
    n = fields["num_layers"]
    if not isinstance(types, list | tuple) or len(types) != n:
        raise ValueError(f"layer_types={types!r} must list one type per layer ({n})")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"layer_types has {unknown}, not supported; allowed: {LAYER_TYPES}")
    return tuple(types)


def _read(family: Family, c: dict) -> dict:
    """The table's fields; without layer_types, every full_attention_interval-th layer full
    (Qwen3_5TextConfig's default, 4)."""
    if c.get("layer_types") is None:
        every, n = c.get("full_attention_interval", 4), c.get("num_hidden_layers")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"{family.architecture}: full_attention_interval={every!r} is not "
                "supported (needs an int >= 1)"
            )
        if isinstance(n, int):
            full = [(i + 1) % every == 0 for i in range(n)]
            c = {**c, "layer_types": ["full_attention" if f else "linear_attention" for f in full]}
    fields = table_fields(family, c)
    if c.get("output_router_logits") and "num_experts" in fields:  # transformers adds the loss
        fields["load_balance_loss_weight"] = float(c.get("router_aux_loss_coef", 0.001))
    if "linear_attention" not in fields["layer_types"]:  # the linear sizes shape nothing
        fields.update(dict.fromkeys(LINEAR_ONLY))
    return fields


_ATTENTION = dict(  # the model fields Qwen3.5's layers fix
    position="rope",
    norm="rms_plus_one",
    norm_position="pre",
    use_bias=False,
    qkv_bias=None,
    qk_norm=True,
    attention_output_gate=True,
    rope_scaling=None,
    attention_sinks=False,
    attention_pattern=None,
    sliding_window=None,
    **NO_GEMMA_OPTIONS,
)


def _family(architecture: str, model_type: str, *ffn, requires: dict) -> Family:
    """Qwen3.5's table with the FFN's entries `ffn` (a dense MLP's or the experts')."""
    return decoder_family(
        architecture,
        model_type,
        (*_CONFIG, *ffn),
        rules=qwen3_5_rules,
        requires={**_ATTENTION, **requires},
        # The published files hold a multi-token-prediction head (mtp.*), which transformers'
        # model does not load either: skipped by name, counted in the log.
        skip=("mtp.*",),
        layout=fused_layout,
        read=_read,
    )


_CONFIG = (
    *SIZES,
    Field("head_dim", "head_dim", 256),
    *layer_keys(32768, 1e-6),
    Field("layer_types", "layer_types", to_model=_layer_types, to_config=list),
    Field("linear_num_key_heads", "linear_num_key_heads", 16),
    Field("linear_num_value_heads", "linear_num_value_heads", 32),
    Field("linear_key_head_dim", "linear_key_head_dim", 128),
    Field("linear_value_head_dim", "linear_value_head_dim", 128),
    Field("linear_conv_kernel_dim", "linear_conv_kernel_dim", 4),
    Field(
        "rope_parameters",
        "rope_scaling",
        None,
        to_model=_rope,
        to_config=lambda scaling: {"rope_type": "default"},
    ),
    Field("rope_parameters.rope_theta", "rope_base", 10_000.0),
    Field("rope_parameters.partial_rotary_factor", "partial_rotary_factor", 0.25),
    *training_fields(),
    Fixed("attention_bias", False, why="tfjax's Qwen3.5 layers have no biases"),
)
QWEN3_5 = _family(
    "Qwen3_5ForCausalLM",
    "qwen3_5_text",
    Field("intermediate_size", "mlp_dim"),
    requires={"num_experts": 0},
)
# Qwen3.5-MoE: every layer's FFN experts of moe_intermediate_size (renormalised softmax
# routing) and a shared expert of shared_expert_intermediate_size gated by sigmoid(x w).
QWEN3_5_MOE = _family(
    "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text",
    Field("num_experts", "num_experts", 256),
    Field("num_experts_per_tok", "experts_per_token", 8),
    Field("moe_intermediate_size", "expert_mlp_dim", 512),
    Field("shared_expert_intermediate_size", "shared_expert_dim", 512),
    requires={
        "router_score": "softmax",
        "router_renormalize": True,
        "router_bias": False,
        "router_score_bias": False,
        "router_groups": 1,
        "router_groups_kept": None,
        "router_scale": 1.0,
        "shared_expert_gate": True,
        "first_dense_layers": 0,
    },
)


def _written(model: decoder.Decoder) -> decoder.Decoder:
    """The model as its config writes it: sizes spelled out, every layer's type (full when
    None); the linear layers' sizes only with linear layers (the config's defaults else)."""
    model = spelled_out(model)
    types = model.layer_types or ("full_attention",) * model.num_layers
    conv = model.linear_conv_kernel_dim or (4 if model.spec.linear_layers else None)
    return model.clone(layer_types=types, linear_conv_kernel_dim=conv)


from_qwen3_5, to_qwen3_5 = convert.converters(QWEN3_5, "qwen3_5", _written)
from_qwen3_5_moe, to_qwen3_5_moe = convert.converters(QWEN3_5_MOE, "qwen3_5_moe", _written)


def is_qwen3_5(model) -> bool:
    """Qwen3.5's layers: layer_types or gated full attention (other exporters leave these)."""
    return model.layer_types is not None or model.attention_output_gate


CONVERTS = Converts(
    rows=(
        Row(
            "Qwen3.5 (text)",
            "`from_qwen3_5` / `to_qwen3_5`",
            "decoder",
            "with `layer_types` (Gated DeltaNet linear attention among gated full attention, "
            "`partial_rotary_factor`, (1 + w) norms); decoding keeps a fixed-size "
            "`tfjax.ops.RecurrentState` per linear layer",
            loads={QWEN3_5.architecture: from_qwen3_5},
        ),
        Row(
            "Qwen3.5-MoE (text)",
            "`from_qwen3_5_moe` / `to_qwen3_5_moe`",
            "decoder",
            "Qwen3.5's layers with `num_experts` (renormalised softmax routing, fused or "
            "per-expert tensors) and a shared expert gated by `shared_expert_gate`",
            loads={QWEN3_5_MOE.architecture: from_qwen3_5_moe},
        ),
    ),
    exports=(
        Exporter(
            decoder.Decoder,
            when=lambda m: is_qwen3_5(m) and not m.num_experts,
            export=to_qwen3_5,
            family=lambda model: QWEN3_5,
            needs="Qwen3.5: layer_types or attention_output_gate, a dense FFN",
        ),
        Exporter(
            decoder.Decoder,
            when=lambda m: bool(is_qwen3_5(m) and m.num_experts and m.shared_expert_dim),
            export=to_qwen3_5_moe,
            family=lambda model: QWEN3_5_MOE,
            needs="Qwen3.5-MoE: layer_types or attention_output_gate, experts and a shared one",
        ),
    ),
)
