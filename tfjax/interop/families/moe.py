"""Mixtral (`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`), Llama-shaped decoders
whose FFN is a mixture of experts <-> `tfjax.models.decoder` with num_experts.

    model, params = from_mixtral("path/to/Mixtral-8x7B-v0.1")   # config.json + weights
    model, params = from_qwen3_moe(state_dict, config)           # or a state dict and a config
    state, config = to_qwen3_moe(model, params)                  # back to Hugging Face keys

Key mapping, layer i (under "model."): attention, norms, embeddings and head as Llama's
(`core.decoders.llama_rules`; Qwen3-MoE with Qwen 3's self_attn.q_norm / k_norm), and the FFN
of a mixture-of-experts layer, E experts j of width F, as the Hub's files and transformers'
save_pretrained hold it:
  Mixtral    block_sparse_moe.gate [E, D]                 -> mlp/router/kernel [D, E]
             block_sparse_moe.experts.j.{w1,w3,w2}         -> mlp/experts/{wi_0,wi_1,wo}[j]
  Qwen3-MoE  mlp.gate [E, D]                              -> mlp/router/kernel [D, E]
             mlp.experts.j.{gate,up,down}_proj             -> mlp/experts/{wi_0,wi_1,wo}[j]
(each expert's torch Linear [out, in] is its slice [in, out] of the stacked kernel). Or fused,
as transformers 5 holds them in memory (save_pretrained(save_original_format=False)):
             mlp.gate [E, D]                              -> mlp/router/kernel [D, E]
             mlp.experts.gate_up_proj [E, 2F, D]           -> mlp/experts/wi_0, wi_1 [E, D, F]
                                                             (the first F rows the gate's)
             mlp.experts.down_proj [E, D, F]               -> mlp/experts/wo [E, F, D]
Load reads either layout (the keys decide); export writes the Hub's, which transformers 4 and 5
both read. A dense layer of Qwen3-MoE (mlp_only_layers, the first n: dense_decoder/layers_i) is
Llama's mlp.{gate,up,down}_proj.

The router is the same function on both sides: softmax over the E logits in float32 (tfjax: the
compute dtype or float32, the wider), top-k, the k scores divided by their sum (Mixtral always;
Qwen3-MoE with norm_topk_prob, else as they are); both dispatch dropless (no capacity).

Config: num_local_experts (Qwen3-MoE: num_experts) -> num_experts, num_experts_per_tok ->
experts_per_token, Mixtral's intermediate_size -> expert_mlp_dim (and mlp_dim: it has no dense
layer), Qwen3-MoE's moe_intermediate_size -> expert_mlp_dim, intermediate_size -> mlp_dim (its
dense layers), norm_topk_prob -> router_renormalize, mlp_only_layers [0, .., n-1] ->
first_dense_layers n. router_aux_loss_coef is load_balance_loss_weight when
output_router_logits is true (transformers adds the loss only then), else the weight is 0; the
two losses are the same when routing is balanced, but transformers pools the experts' loads over
all layers' tokens where tfjax averages each layer's loss. tfjax's router_z_loss_weight (a
training option transformers lacks) is not written. Refused by key: decoder_sparse_step other
than 1 and mlp_only_layers that are not the first layers (tfjax's dense layers come first),
router_jitter_noise, Qwen3-MoE's attention_bias and sliding window.
"""

from tfjax.interop.core import convert
from tfjax.interop.core.decoders import llama_family, llama_rules, spelled_out
from tfjax.interop.core.registry import Converts, Exporter
from tfjax.interop.core.rules import fused_expert_halves, fused_experts, linear, per_expert
from tfjax.interop.core.tables import Family, Field, Fixed, table_config, table_fields
from tfjax.models import decoder

# What both families fix: softmax routing without a bias, no shared experts, no biases, every
# layer the same attention.
_ROUTER = {
    "use_bias": False,
    "qkv_bias": None,
    "router_score": "softmax",
    "router_bias": False,
    "shared_expert_dim": 0,
    "shared_expert_gate": False,
    "attention_pattern": None,
}
_EXPERT_KERNELS = ("wi_0", "wi_1", "wo")  # the gate, up and down projections


def _experts(module: str, names: tuple[str, str, str], num_experts: int, fused: bool):
    """(layer i's key prefix, its FFN's path) -> the router's and experts' rules: the Hub's
    layout (`module`.gate, `module`.experts.j.<names>), or transformers 5's fused one."""

    def rules(h, path):
        kernels = [(*path, "experts", k) for k in _EXPERT_KERNELS]
        if fused:
            return [
                linear(f"{h}mlp.gate.weight", (*path, "router", "kernel")),
                fused_expert_halves(f"{h}mlp.experts.gate_up_proj", kernels[:2]),
                fused_experts(f"{h}mlp.experts.down_proj", kernels[2]),
            ]
        m = f"{h}{module}."
        out = [linear(f"{m}gate.weight", (*path, "router", "kernel"))]
        for name, kernel in zip(names, kernels, strict=True):
            keys = [f"{m}experts.{j}.{name}.weight" for j in range(num_experts)]
            out.append(per_expert(keys, kernel))
        return out

    return rules


def mixtral_rules(model: decoder.Decoder, prefix="model.", *, fused=False):
    """Mixtral's keys: Llama's, and block_sparse_moe's gate and experts w1, w3, w2."""
    experts = _experts("block_sparse_moe", ("w1", "w3", "w2"), model.num_experts, fused)
    return llama_rules(model, prefix, experts=experts)


def qwen3_moe_rules(model: decoder.Decoder, prefix="model.", *, fused=False):
    """Qwen3-MoE's keys: Qwen 3's, and mlp's gate and experts' gate, up and down projections."""
    names = ("gate_proj", "up_proj", "down_proj")
    return llama_rules(model, prefix, experts=_experts("mlp", names, model.num_experts, fused))


def _layout(state) -> dict:
    """transformers 5's fused experts when the checkpoint holds them, else the Hub's."""
    return {"fused": any(k.endswith(".experts.gate_up_proj") for k in state)}


def _some_experts(key: str):
    def check(n, fields):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{key}={n!r} is not supported (needs >= 1 experts)")
        return n

    return check


def _top_k(k, fields):
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= fields["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok={k!r} is not supported (needs 1 to the "
            f"{fields['num_experts']} experts)"
        )
    return k


def _first_layers(layers, fields) -> int:
    """mlp_only_layers -> first_dense_layers: they must be the first n layers, and not all."""
    n = fields["num_layers"]
    valid = isinstance(layers, list | tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    )
    if not valid or sorted(layers) != list(range(len(layers))):
        raise ValueError(
            f"mlp_only_layers={layers!r} is not supported: tfjax's dense layers are the first "
            "ones (first_dense_layers), so it must be [] or [0, 1, ..., n - 1]"
        )
    if len(layers) >= n:
        raise ValueError(
            f"mlp_only_layers={layers!r} makes all {n} layers dense (no mixture of experts); "
            "load it as a Qwen3ForCausalLM"
        )
    return len(layers)


def _top_k_field(default: int) -> Field:
    return Field("num_experts_per_tok", "experts_per_token", default, to_model=_top_k)


def _read(family: Family, c: dict) -> dict:
    """The table's fields plus the load-balancing loss's weight: router_aux_loss_coef when
    output_router_logits is true, else 0 (transformers adds the loss only then)."""
    fields = table_fields(family, c)
    on, coef = c.get("output_router_logits"), c.get("router_aux_loss_coef")
    if on not in (None, False, True):
        raise ValueError(
            f"{family.architecture}: output_router_logits={on!r} is not supported; allowed: "
            "(False, True)"
        )
    if on:
        coef = 0.001 if coef is None else coef  # transformers' default
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef >= 0:
            raise ValueError(
                f"{family.architecture}: router_aux_loss_coef={coef!r} is not supported "
                "(needs a number >= 0)"
            )
        fields["load_balance_loss_weight"] = float(coef)
    return fields


def _write(family: Family, model: decoder.Decoder) -> dict:
    """The table's config plus output_router_logits (and router_aux_loss_coef) from the
    load-balancing loss's weight; tfjax's router z-loss has no key."""
    config = table_config(family, model)
    weight = model.load_balance_loss_weight
    config["output_router_logits"] = weight > 0
    if weight > 0:
        config["router_aux_loss_coef"] = weight
    return config


# Mixtral: Mistral's attention (sliding window), every layer a mixture of experts of width
# intermediate_size, renormalised softmax routing.
MIXTRAL = llama_family(
    "MixtralForCausalLM",
    "mixtral",
    Field("sliding_window", "sliding_window", None),
    Field("intermediate_size", "expert_mlp_dim"),
    Field("num_local_experts", "num_experts", 8, to_model=_some_experts("num_local_experts")),
    _top_k_field(2),
    Fixed("router_jitter_noise", 0.0, why="tfjax's router does not jitter its input"),
    requires={**_ROUTER, "qk_norm": False, "first_dense_layers": 0, "router_renormalize": True},
    rules=mixtral_rules,
    layout=_layout,
    read=_read,
    write=_write,
    eps=1e-5,
    max_len=4096 * 32,
    rope_base=1_000_000.0,
)
# Qwen3-MoE: Qwen 3's attention (q/k norms, head_dim), experts of moe_intermediate_size, the
# first layers optionally dense (intermediate_size).
QWEN3_MOE = llama_family(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    Fixed("attention_bias", False, why="tfjax's use_bias puts biases on the experts too"),
    Fixed("use_sliding_window", False, why="tfjax's decoder attends to the whole context"),
    Fixed("sliding_window", None, read=False),  # transformers ignores it without the above
    Field("moe_intermediate_size", "expert_mlp_dim", 768),
    # transformers 5 writes num_local_experts, the Hub's files and transformers 4 num_experts
    Field(
        "num_local_experts",
        "num_experts",
        None,
        to_model=_some_experts("num_local_experts"),
        write=False,
    ),
    Field(
        "num_experts",
        "num_experts",
        lambda f: f.get("num_experts", 128),
        to_model=_some_experts("num_experts"),
    ),
    _top_k_field(8),
    Field("norm_topk_prob", "router_renormalize", False, values={False: False, True: True}),
    Fixed(
        "decoder_sparse_step",
        1,
        why="tfjax's dense layers are the first ones (mlp_only_layers); a step puts them "
        "between the mixture-of-experts layers",
    ),
    Field(
        "mlp_only_layers",
        "first_dense_layers",
        (),
        to_model=_first_layers,
        to_config=lambda n: list(range(n)),
    ),
    requires={**_ROUTER, "qk_norm": True, "sliding_window": None},
    rules=qwen3_moe_rules,
    layout=_layout,
    read=_read,
    write=_write,
    max_len=32768,
)


def export_family(model: decoder.Decoder) -> Family:
    """The family a tfjax mixture of experts exports as, by its fields: Qwen3-MoE with q/k
    norms, else Mixtral (whose table refuses what it cannot hold, by name)."""
    return QWEN3_MOE if model.qk_norm else MIXTRAL


def _written(model: decoder.Decoder) -> decoder.Decoder:
    """The model as its config writes it: sizes spelled out; for Mixtral, which has one FFN
    width, mlp_dim the experts' (no layer is dense, so mlp_dim changes nothing)."""
    model = spelled_out(model)
    if export_family(model) is MIXTRAL and not model.first_dense_layers:
        model = model.clone(mlp_dim=model.expert_mlp_dim)
    return model


from_mixtral, to_mixtral = convert.converters(MIXTRAL, "mixtral", _written)
from_qwen3_moe, to_qwen3_moe = convert.converters(QWEN3_MOE, "qwen3_moe", _written)


def _export(model: decoder.Decoder, params):
    return convert.to_hf(export_family(model), _written(model), params)


def _is_moe(m) -> bool:
    return bool(
        m.num_experts
        and m.position != "learned"
        and m.norm_position != "sandwich"
        and m.router_score == "softmax"
        and not m.router_bias
        and not m.shared_expert_dim
        and not m.use_bias
    )


CONVERTS = Converts(
    loads={MIXTRAL.architecture: from_mixtral, QWEN3_MOE.architecture: from_qwen3_moe},
    exports=(
        Exporter(
            decoder.Decoder,
            when=_is_moe,
            export=_export,
            family=export_family,
            needs="Mixtral, Qwen3-MoE: a mixture of experts (num_experts) with softmax routing, "
            "no router bias, no shared experts, no biases, positions other than learned ones "
            "and one norm before each sub-layer",
        ),
    ),
)
