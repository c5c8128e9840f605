"""A Gated DeltaNet layer's weights between transformers' Qwen3.5 layer (Qwen3_5GatedDeltaNet,
keys relative to it: "in_proj_qkv.weight", ...) and tfjax.ops.linear_attention's parameters, in
NumPy: the family converter maps each linear layer's keys through these.

transformers' q, k, v projection and its depthwise convolution hold the channels [q | k | v],
each head's channels consecutive (K Hk, K Hk, N Hv); its Linear weights are [out, in] and the
convolution's [C, 1, W]. tfjax's kernels are [in, heads..., out] and its convolutions [W, heads,
head dim] per part (tfjax.ops.linear_attention's docstring lists them)."""

import numpy as np

# transformers' keys whose tensors map one to one (up to a reshape) onto tfjax's.
_VECTORS = {"dt_bias": "dt_bias", "A_log": "a_log", "norm.weight": "out_norm"}
_LINEARS = {
    "in_proj_z.weight": "gate_kernel",
    "in_proj_b.weight": "beta_kernel",
    "in_proj_a.weight": "dt_kernel",
}
TRANSFORMERS_KEYS = ("in_proj_qkv.weight", "conv1d.weight", "out_proj.weight", *_LINEARS, *_VECTORS)


def _split_sizes(config) -> list[int]:
    return [config.key_width, 2 * config.key_width]


def _head_shapes(config) -> dict:
    """{part: (heads, head dim)} of the query, key, value (and gate) channels."""
    keys = (config.num_key_heads, config.key_head_dim)
    values = (config.num_value_heads, config.value_head_dim)
    return {"query": keys, "key": keys, "value": values, "gate": values}


def from_transformers(state: dict, config) -> dict:
    """tfjax's parameters {name: array} of one layer from transformers' `state` {key: array}
    (exactly TRANSFORMERS_KEYS) for `config` (a tfjax.ops.LinearAttentionConfig)."""
    if set(state) != set(TRANSFORMERS_KEYS):
        raise ValueError(f"state: keys {sorted(state)}, want exactly {sorted(TRANSFORMERS_KEYS)}")
    heads = _head_shapes(config)
    qkv = np.asarray(state["in_proj_qkv.weight"])
    conv = np.asarray(state["conv1d.weight"])
    if conv.shape != (config.conv_channels, 1, config.conv_kernel_size):
        raise ValueError(
            f"conv1d.weight: shape {conv.shape}, want [C, 1, W] = "
            f"{(config.conv_channels, 1, config.conv_kernel_size)}"
        )
    params = {}
    parts = zip(("query", "key", "value"), np.split(qkv, _split_sizes(config), axis=0), strict=True)
    for name, w in parts:
        params[f"{name}_kernel"] = w.T.reshape(w.shape[1], *heads[name])
    convs = np.split(conv[:, 0, :].T, _split_sizes(config), axis=1)
    for name, w in zip(("query", "key", "value"), convs, strict=True):
        params[f"{name}_conv"] = w.reshape(w.shape[0], *heads[name])
    z = np.asarray(state["in_proj_z.weight"])
    params["gate_kernel"] = z.T.reshape(z.shape[1], *heads["gate"])
    params["beta_kernel"] = np.asarray(state["in_proj_b.weight"]).T
    params["dt_kernel"] = np.asarray(state["in_proj_a.weight"]).T
    for key, name in _VECTORS.items():
        params[name] = np.asarray(state[key])
    out = np.asarray(state["out_proj.weight"])  # [D, N Hv]
    params["out_kernel"] = out.T.reshape(*heads["value"], out.shape[0])
    return params


def to_transformers(params: dict, config) -> dict:
    """transformers' `state` {key: array} of one layer from tfjax's `params` (the inverse of
    from_transformers)."""
    # The kernels and convolutions [in or W, heads..] with their heads' axes flattened.
    flat = {
        name: np.asarray(w).reshape(w.shape[0], -1)
        for name, w in params.items()
        if name.endswith(("_kernel", "_conv")) and name != "out_kernel"
    }
    qkv = [flat[f"{name}_kernel"] for name in ("query", "key", "value")]
    conv = np.concatenate([flat[f"{name}_conv"] for name in ("query", "key", "value")], axis=1)
    state = {
        "in_proj_qkv.weight": np.concatenate(qkv, axis=1).T,
        "conv1d.weight": conv.T[:, None, :],
        "out_proj.weight": np.asarray(params["out_kernel"]).reshape(config.value_width, -1).T,
    }
    for key, name in _LINEARS.items():
        state[key] = flat[name].T
    for key, name in _VECTORS.items():
        state[key] = np.asarray(params[name])
    return state


def gated_query_from_transformers(weight, num_heads: int, head_dim: int):
    """(query, gate) of Qwen3.5's gated full attention from its q_proj `weight` [N 2H, D]
    (each head's H query rows, then its H gate rows) or bias [N 2H]: kernels [D, N, H] (or
    biases [N, H]) for the decoder's attention, which multiplies its output by sigmoid(gate)."""
    weight = np.asarray(weight)
    w = weight.reshape(num_heads, 2, head_dim, *weight.shape[1:])
    query, gate = w[:, 0], w[:, 1]  # [N, H, (D)]
    if weight.ndim == 2:
        query, gate = np.moveaxis(query, -1, 0), np.moveaxis(gate, -1, 0)
    return query, gate


def gated_query_to_transformers(query, gate):
    """q_proj's weight [N 2H, D] (or bias [N 2H]) from the query and gate kernels [D, N, H]
    (or biases [N, H]): the inverse of gated_query_from_transformers."""
    query, gate = np.asarray(query), np.asarray(gate)
    if query.ndim == 3:
        query, gate = np.moveaxis(query, 0, -1), np.moveaxis(gate, 0, -1)  # [N, H, D]
    both = np.stack([query, gate], axis=1)  # [N, 2, H, (D)]
    return both.reshape(-1, *both.shape[3:])
