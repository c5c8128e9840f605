"""`torch.nn.MultiheadAttention` <-> `tfjax.nn.MultiHeadAttention`.

    mha, params = from_torch_mha(torch_module)               # or (state_dict, num_heads=...)
    y = mha.apply({"params": params}, x)                     # self-attention, x [B, T, D]
    y = mha.apply({"params": params}, x, context, mask=m)    # cross-attention, one context

Key mapping:
  in_proj_weight [3D, D] (rows q, k, v)          -> {query,key,value}_kernel [D, N, H]
  q_proj_weight, k_proj_weight, v_proj_weight     -> the same, when kdim = vdim != embed_dim
  in_proj_bias [3D]                               -> {query,key,value}_bias [N, H]
  out_proj.weight [D, D], out_proj.bias           -> out_kernel [N, H, D], out_bias
Masks: tfjax's `mask` is True where a query may attend; torch's key_padding_mask and boolean
attn_mask are True where it may not. add_bias_kv and add_zero_attn have no tfjax counterpart.
"""

import jax.numpy as jnp

from tfjax.interop import core
from tfjax.nn import MultiHeadAttention

_NAMES = ("query", "key", "value")


def mha_rules(separate: bool, use_bias: bool) -> list[core.Rule]:
    if separate:
        rules = [
            core.linear(f"{t}_proj_weight", (f"{n}_kernel",))
            for t, n in zip("qkv", _NAMES, strict=True)
        ]
    else:
        rules = [core.stacked_linear("in_proj_weight", [(f"{n}_kernel",) for n in _NAMES])]
    rules.append(core.linear_out("out_proj.weight", ("out_kernel",)))
    if use_bias:
        rules += [
            core.stacked_linear("in_proj_bias", [(f"{n}_bias",) for n in _NAMES]),
            core.identity("out_proj.bias", ("out_bias",)),
        ]
    return rules


def from_torch_mha(source, num_heads: int | None = None, **overrides):
    """(tfjax MultiHeadAttention, params) from a torch.nn.MultiheadAttention or its state dict.

    `num_heads` is required for a state dict (a module knows it); `overrides` set module fields
    (dtype, implementation, ...).
    """
    what = "torch.nn.MultiheadAttention"
    if isinstance(source, dict):
        state = core.as_state_dict(source)
        if num_heads is None:
            raise ValueError(f"{what}: a state dict needs num_heads")
    else:
        if getattr(source, "bias_k", None) is not None or getattr(source, "add_zero_attn", False):
            raise ValueError(f"{what}: add_bias_kv / add_zero_attn have no tfjax counterpart")
        if source.kdim != source.vdim:
            raise ValueError(
                f"{what}: kdim={source.kdim} != vdim={source.vdim}; tfjax's cross-attention "
                "takes one context for keys and values"
            )
        num_heads = source.num_heads if num_heads is None else num_heads
        state = core.as_state_dict(source.state_dict(), origin=what)
    for key in ("bias_k", "bias_v"):
        if key in state:
            raise ValueError(f"{what}: {key!r} (add_bias_kv) has no tfjax counterpart")
    separate = "in_proj_weight" not in state and "q_proj_weight" in state
    use_bias = "in_proj_bias" in state or "out_proj.bias" in state
    query = state["q_proj_weight" if separate else "in_proj_weight"]
    width = query.shape[1]
    context_width = state["k_proj_weight"].shape[1] if separate else width
    if separate and state["v_proj_weight"].shape[1] != context_width:
        raise ValueError(f"{what}: k_proj_weight and v_proj_weight differ in input width")
    if query.shape[1] % num_heads:
        raise ValueError(f"{what}: num_heads={num_heads} does not divide embed_dim={width}")
    model = MultiHeadAttention(**{"num_heads": num_heads, "use_bias": use_bias, **overrides})
    x = jnp.zeros((1, 1, width), jnp.float32)
    context = jnp.zeros((1, 1, context_width), jnp.float32) if separate else None
    params = core.import_state(
        state,
        mha_rules(separate, use_bias),
        core.param_shapes(model, x, context),
        what=what,
    )
    return model, core.finish(model, params)


def to_torch_mha(model: MultiHeadAttention, params) -> dict:
    """{torch key: numpy array}, loadable with `torch_mha.load_state_dict` (after
    torch.from_numpy); the separate q/k/v layout when key and query widths differ."""
    p = core.unrolled(model, params)
    separate = p["query_kernel"].shape[0] != p["key_kernel"].shape[0]
    return core.export_state(p, mha_rules(separate, model.use_bias))
