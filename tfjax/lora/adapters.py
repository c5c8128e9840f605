"""The LoRA model's params: which are adapters, splitting and combining them, merging them into
the kernels (W + A B alpha / r) or into a QLoRA run's dequantized base."""

from __future__ import annotations

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from qwix._src.core import qarray as _qarray
from qwix._src.providers import ptq as _ptq

from tfjax.lora.config import ADAPTER_SUFFIXES, LoraConfig, flat_params


def is_adapter(path) -> bool:
    """Whether the parameter at `path` is an adapter: a "/"-joined string, a tuple of keys or a
    jax key path (tree_map_with_path's)."""
    if isinstance(path, str):
        last = path.rsplit("/", 1)[-1]
    else:
        keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
        last = str(keys[-1]) if keys else ""
    return last.endswith(ADAPTER_SUFFIXES)


def adapter_mask(params):
    """A tree of bools over `params` (a prefix of its pytree: one per parameter), True at the
    adapters: the trainable ones (optax.masked; optax.multi_transform's labels by a map)."""
    return flax.traverse_util.unflatten_dict({k: is_adapter(k) for k in flat_params(params)})


def split(params) -> tuple[dict, dict]:
    """(the base params, the adapters): two nested dicts of the parameters of `params`."""
    flat = flat_params(params)
    base = {k: v for k, v in flat.items() if not is_adapter(k)}
    adapters = {k: v for k, v in flat.items() if is_adapter(k)}
    unflatten = flax.traverse_util.unflatten_dict
    return unflatten(base), unflatten(adapters)


def combine(base, adapters) -> dict:
    """The inverse of `split`: one nested dict of both (they must not share a path)."""
    flat_base, flat_adapters = flat_params(base), flat_params(adapters)
    both = sorted(set(flat_base) & set(flat_adapters))
    if both:
        raise ValueError(f"combine: base and adapters both hold {'/'.join(both[0])}")
    return flax.traverse_util.unflatten_dict({**flat_base, **flat_adapters})


def merge(params, config: LoraConfig) -> dict:
    """The base params with each kernel's adapters folded in, W + (A B) alpha / rank in W's
    layout and dtype (computed in float32): the params of the model without LoRA, which
    computes what the LoRA model computes. Every other parameter is passed through as it is.
    Boxed parameters stay boxed. QLoRA: merge into a float base (`dequantized(params, like)`,
    or `combine(float_base, adapters)`), the quantized kernels are refused."""
    flat = flat_params(params)
    out = {}
    for path, leaf in flat.items():
        if is_adapter(path):
            continue
        a_path = (*path[:-1], path[-1] + ADAPTER_SUFFIXES[0])
        b_path = (*path[:-1], path[-1] + ADAPTER_SUFFIXES[1])
        if a_path not in flat or b_path not in flat:
            out[path] = leaf
            continue
        name = "/".join(map(str, path))
        kernel = nn.unbox(leaf)
        if isinstance(kernel, _ptq.WithAux):
            raise ValueError(
                f"merge: {name} is quantized (QLoRA); merge the adapters into the float base "
                "kernels: merge(combine(float_base, split(params)[1]), config)"
            )
        a, b = nn.unbox(flat[a_path]), nn.unbox(flat[b_path])
        delta = kernel_delta(a, b, kernel.shape, config.rank, name)
        merged = (kernel.astype(jnp.float32) + config.scale * delta).astype(kernel.dtype)
        out[path] = leaf.replace_boxed(merged) if isinstance(leaf, nn.meta.AxisMetadata) else merged
    return flax.traverse_util.unflatten_dict(out)


def dequantized(params, like) -> dict:
    """QLoRA's params with each quantized kernel dequantized into the layout and dtype of its
    float kernel in `like` (the base model's params or their ShapeDtypeStructs): the base the
    adapters were trained on, which `merge` can fold them into. Other leaves pass through."""
    flat, shapes = flat_params(params), flat_params(like)
    out = {}
    for path, leaf in flat.items():
        kernel = nn.unbox(leaf)
        if isinstance(kernel, _ptq.WithAux):
            want = nn.unbox(shapes[path])
            leaf = _qarray.dequantize(kernel.array).reshape(want.shape).astype(want.dtype)
        out[path] = leaf
    return flax.traverse_util.unflatten_dict(out)


def kernel_delta(a, b, shape, rank, name):
    """A B in the kernel's `shape`: A [*L, in..., r] and B [*L, r, out...] (L: the stacked
    layer axes, shared with the kernel) for a kernel [*L, in..., out...]."""
    for s in range(len(shape) + 1):
        lead = tuple(shape[:s])
        if a.shape[:s] != lead or b.shape[:s] != lead or a.ndim < s + 2 or b.ndim < s + 2:
            continue
        if a.shape[-1] != rank or b.shape[s] != rank:
            continue
        fan_in, fan_out = math.prod(a.shape[s:-1]), math.prod(b.shape[s + 1 :])
        inner = shape[s:]
        prefixes = [math.prod(inner[:i]) for i in range(len(inner) + 1)]
        if fan_in * fan_out == math.prod(inner) and fan_in in prefixes:
            # [*L, in, out]
            d = jnp.einsum(
                "...ir,...ro->...io",
                a.reshape(*lead, fan_in, rank).astype(jnp.float32),
                b.reshape(*lead, rank, fan_out).astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
            )
            return d.reshape(shape)
    raise ValueError(
        f"merge: the adapters of {name}, A {tuple(a.shape)} and B {tuple(b.shape)}, do not fit "
        f"its kernel {tuple(shape)} with rank {rank} (is LoraConfig.rank the one they were made "
        "with?)"
    )
