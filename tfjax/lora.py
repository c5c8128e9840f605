"""LoRA (Hu et al., 2021) and QLoRA (Dettmers et al., 2023) adapters for tfjax models, by Qwix.

Letters: D model width, N heads, H head dim, F mlp width, L layers, r rank.

    config = lora.LoraConfig(rank=8, alpha=16.0)
    model = lora.apply_lora(decoder.Model("llama-3.1-8b"), config)   # same inputs and methods
    params = lora.init_params(model, base_params, rng, tokens)    # base params + fresh adapters
    base, adapters = lora.split(params)                            # train `adapters` only
    logits, _ = model.apply({"params": lora.combine(base, adapters)}, tokens)
    merged = lora.merge(params, config)   # plain base params, W + A B alpha / r: the base model

A Flax NNX model (tfjax.nnx) or one of its submodules gets the same adapters, as nnx.LoRAParam
beside the kernels, in a copy made from one abstract call on example inputs (see the NNX
section at the end):

    model = lora.apply_lora(nnx_model, config, tokens, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.LoRAParam)  # adapters only
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the Linen LoRA params tree

Each kernel W whose parameter path ("decoder/layers_0/self_attention/query_kernel") matches
`config.targets` gets two adapters beside it in its module, `{W}_lora_a` and `{W}_lora_b`,
and each matmul x W of the model becomes x W + (x A) B alpha / r. A and B are laid out as the
matmul sees W: tfjax's attention kernels [D, N, H] and [N, H, D] are multiplied as [D, N H]
and [N H, D], so

    query_kernel_lora_a [D, r]     ("embed", None)     query_kernel_lora_b [r, N H]  (None, "heads")
    out_kernel_lora_a   [N H, r]   ("heads", None)     out_kernel_lora_b   [r, D]    (None, "embed")
    mlp/wi/kernel_lora_a [D, r]    ("embed", None)     mlp/wi/kernel_lora_b [r, F]   (None, "mlp")

with a leading [L] ("layers") in a scanned stack. The adapters carry the logical axis names of
the kernel's axes (a merged axis: its first one's), so tfjax's sharding rules place them with
no new rule. A starts He-uniform, B at zero: a fresh LoRA model computes the base model.

A mixture of experts (tfjax.nn.moe): its attention, its router (mlp/router/kernel) and its
dense layers' MLPs (first_dense_layers) are kernels like the others; by default its attention
and dense MLPs are adapted. Its experts' stacked kernels [E, D, F] are multiplied by a grouped
matmul (tfjax.ops.moe.grouped_matmul: XLA's ragged_dot, Megablox or Tokamax), which Qwix 0.1.8's
LoRA does not intercept (its LoraProvider takes einsum, dot_general and conv; only its
quantized-training provider takes jax.lax.ragged_dot, and none a Pallas kernel): a target that
matches one is refused by name at init, rather than left without adapters.

With `base_dtype` ("int8" or "nf4") the targeted kernels are stored quantized (QLoRA):
`init_params` quantizes the float base once, and the model dequantizes them in its matmuls.
A quantized kernel is stored in the matmul's layout (query_kernel as [D, N H]) as a Qwix
`WithAux(QArray(qvalue, scale))` with logical names; train the adapters on it, and `merge` them
into the float base dequantized (`dequantized`): the kernels the adapters were trained on.
Each output channel's inputs (the matmul's contracting axis: D of query_kernel, N H of
out_kernel) are scaled in blocks of `tile_size` (Qwix's tile_size: one absmax scale per
block), by default base_dtype's own: nf4 in QLoRA's blocks of 64 (NF4_TILE_SIZE), int8 with
one scale per output channel (tile_size 0); a kernel whose inputs do not split into whole
blocks is refused by name (`check_tile_size` checks them all before any work).

How: `apply_lora` hands the model to Qwix (`qwix.apply_lora_to_model` with a `LoraProvider`),
which intercepts jax.numpy.einsum, jax.lax.dot_general and jax.lax.conv_general_dilated while
the model's methods run (unrolled, inside nn.scan and nn.remat alike) and adds the adapters
there. The maths is Qwix's: the adapters' shapes for an einsum or dot_general, the delta
(x A) B, the quantized matmuls of QLoRA (tfjax calls Qwix's private helpers for them, hence the
pin qwix<0.2). tfjax's provider (`_Provider`) replaces what Qwix 0.1.8 gets wrong on tfjax's
decoders, each measured (tests/test_lora.py pins the result):
  1. Linen modules that call jnp.einsum on a parameter fail: LoraProvider.einsum sets an
     attribute on the module (`setattr(module, name + "_lora_einsum_str", ...)`), which a bound
     Linen module refuses outside setup: flax.errors.SetAttributeFrozenModuleError "Can't set
     query_kernel_lora_einsum_str=btd,dr,re->bte for Module of type MultiHeadAttention" (and
     "embedding_lora_einsum_str=btd,dr,rv->btv ... Embed" for a tied output head).
  2. Qwix finds which parameter a matmul operand is by tracing a jit tracer back through unary
     ops, else by a shape unique among the module's parameters. tfjax's attention multiplies a
     reshaped kernel (kernel.reshape(D, N H)): outside jit (model.init, model.apply) Qwix found
     no parameter and silently gave attention no adapters (14 adapters of 30 on "modern-tiny":
     the MLPs' and the head's), and a key and a value kernel of one shape, cast to bfloat16,
     cannot be told apart by shape. Here the parameter is followed by object, from
     `Module.param` through `promote_dtype` and `jax.lax.reshape` (both intercepted), in and
     out of jit.
  3. Qwix's rules match module paths, and tfjax's attention module holds four kernels;
     `targets` matches parameter paths, so any subset of them can be adapted.
  4. The adapters' logical names: Qwix indexes the reshaped operand's axes into the stored
     kernel's names, which named out_kernel_lora_b [r, D] "head_dim" (unsharded), not "embed";
     QLoRA boxed the quantized [D, N H] kernel with the [D, N, H] kernel's three names
     (AssertionError "shape=(32, 32) spec=('embed', 'heads', 'head_dim')" in
     flax_util.update_sharding, at init). The names are mapped through the reshape here.
  5. Under a mesh (the runner's init: nn.logical_axis_rules and an abstract mesh in context)
     Qwix's boxes fail: update_boxed unboxes the kernel's box holding the new [D, r] value,
     applying the [D, N, H] kernel's sharding constraint to it: ValueError "One of
     with_sharding_constraint arguments is incompatible with its sharding annotation ...
     spec=P('fsdp', 'tensor', None)) is only valid for values of rank at least 3, but was
     applied to a value of rank 2". `_rebox` boxes without unboxing.
  6. Adapters drew keys from the module's "params" stream, so the kernels declared after them
     got other keys: init with one key gave other base values than the base model's.
  7. (QLoRA) qwix.quantize_params quantizes a scanned [L, ...] kernel as one array with the
     per-layer HowToQuantize (channelwise axis 1: the input axis of the stacked kernel): the
     scale of mlp/wo/kernel came out (1, 96, 1), not (2, 1, 32). init_params quantizes through
     the model instead, layer by layer.
Also by reading Qwix's source: its adapter dropout runs on every call (train or not); here
only with train=True. And adapters are computed in the matmul's compute dtype (A, B cast to
it, as tfjax's modules cast kernels), where Qwix promoted a bfloat16 model's projections to
the adapters' float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src import model as _qmodel
from qwix._src.core import dot_general as _qdot_general
from qwix._src.core import einsum as _qeinsum
from qwix._src.core import qarray as _qarray
from qwix._src.providers import lora as _qlora
from qwix._src.providers import ptq as _ptq
from qwix._src.utils import flax_util as _flax_util

from tfjax.nn import axes as _axes
from tfjax.nn import moe as _moe

__all__ = [
    "ADAPTER_SUFFIXES",
    "BASE_DTYPES",
    "DEFAULT_TARGETS",
    "LoraConfig",
    "NF4_TILE_SIZE",
    "adapter_mask",
    "apply_lora",
    "check_quantization_kept",
    "check_tile_size",
    "combine",
    "dequantized",
    "init_params",
    "is_adapter",
    "merge",
    "split",
]

# The attention projections (self- and cross-attention: query, key, value, output) and the MLP
# kernels (wi, or wi_0 and wi_1 when gated; wo) of tfjax's blocks, unrolled or scanned. Not the
# embeddings, the output head, the norms, nor a mixture's router or experts (mlp/router/kernel;
# mlp/experts/wi_0, which cannot be adapted).
DEFAULT_TARGETS = (
    r".*/(self_attention|cross_attention)/(query|key|value|out)_kernel"
    r"|.*/mlp/(wi|wi_0|wi_1|wo)/kernel"
)
BASE_DTYPES = (None, "int8", "nf4")  # LoraConfig.base_dtype's values
NF4_TILE_SIZE = 64  # QLoRA's NF4 block (Dettmers et al., 2023): one scale per 64 inputs
# base_dtype -> its tile_size when LoraConfig.tile_size is None (0: one scale per output channel)
DEFAULT_TILE_SIZES = {"int8": 0, "nf4": NF4_TILE_SIZE}
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")  # Qwix's names: kernel `W` -> `W_lora_a`, `W_lora_b`
METHODS = ("__call__", "logits", "encode", "decode")  # the model methods that get adapters


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What `apply_lora` adds; each field is checked on creation, the error naming it."""

    rank: int = 8  # r
    alpha: float = 16.0  # the update is (x A) B alpha / rank
    dropout: float = 0.0  # on the adapters' input x, with train=True (rng stream "dropout")
    targets: str = DEFAULT_TARGETS  # a regex, fully matched against "/"-joined parameter paths
    base_dtype: str | None = None  # QLoRA: "int8" or "nf4" stores the targeted kernels quantized
    tile_size: int | None = None  # QLoRA: one scale per this many inputs of each output
    # channel; 0: one scale per output channel; None: base_dtype's (DEFAULT_TILE_SIZES: nf4 64)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        try:
            re.compile(self.targets)
        except (re.error, TypeError) as e:
            raise ValueError(f"LoraConfig.targets={self.targets!r} is not a regex: {e}") from None
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LoraConfig.base_dtype={self.base_dtype!r} is unknown; allowed: {BASE_DTYPES}"
            )
        if self.tile_size is not None and (
            isinstance(self.tile_size, bool)
            or not isinstance(self.tile_size, int)
            or self.tile_size < 0
        ):
            raise ValueError(
                f"LoraConfig.tile_size must be an int >= 0 (0: one scale per output channel) "
                f"or None (base_dtype's default), got {self.tile_size!r}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def block_size(self) -> int | None:
        """The inputs per scale of the quantized kernels (Qwix's tile_size): tile_size, or
        base_dtype's default when None; None: one scale per output channel, or no quantization."""
        if self.base_dtype is None:
            return None
        size = self.tile_size if self.tile_size is not None else DEFAULT_TILE_SIZES[self.base_dtype]
        return size or None


def apply_lora(model, config: LoraConfig, *example_args, rngs=None, **example_kwargs):
    """`model` with adapters on its `config.targets` kernels.

    A Linen module (e.g. any tfjax model): the same fields, inputs, outputs and methods
    (`init`, `apply`, `method="logits"`, `decode=True` with `cache=`, `init_cache`), its params
    the base's plus the adapters (`init_params` makes them). A targets regex that matches none
    of the model's kernels is an error at `init` (or `init_params`), which lists some of the
    kernels' paths.

    A Flax NNX module (a tfjax.nnx model, or one of its submodules such as
    `model.decoder.layers_3.self_attention`): a copy of it holding the adapters, each an
    nnx.LoRAParam beside its kernel (`query_kernel_lora_a`, ... as in the Linen params), made
    from one abstract call (nnx.eval_shape) on `example_args` / `example_kwargs` (their values
    do not matter), A drawn from `rngs` (an nnx.Rngs, required); `targets` are matched against
    the paths from `model`. Training, merging and exporting: this module's NNX section.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"apply_lora takes a LoraConfig, got {type(config).__name__}")
    if isinstance(model, nnx.Module):
        return _apply_lora_nnx(model, config, example_args, example_kwargs, rngs)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply_lora takes a flax.linen or flax.nnx Module, got {type(model).__name__}"
        )
    if example_args or example_kwargs or rngs is not None:
        raise TypeError(
            "apply_lora: example inputs and rngs are for an NNX model; a Linen model's adapters "
            "are made by lora.init_params"
        )
    methods = [m for m in METHODS if callable(getattr(type(model), m, None))]
    return qwix.apply_lora_to_model(model, _Provider(config), methods=methods)


def init_params(model: nn.Module, params, rng, *args, **kwargs):
    """The params of the LoRA `model` (apply_lora's) from its base model's `params`: the same
    params with fresh adapters (the targeted kernels quantized when base_dtype is set), from one
    call of the model on example inputs `args`/`kwargs` (their values do not matter; jit or
    eval_shape this). Boxed (logical names) when `params` is, else plain arrays."""
    _, variables = model.apply(
        {"params": params}, *args, rngs={"params": rng}, mutable=["params"], **kwargs
    )
    out = variables["params"]
    boxed = any(
        isinstance(x, nn.meta.AxisMetadata)
        for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    )
    return out if boxed else nn.unbox(out)


# ----------------------------------------------------------------------------------------------
# Params: which are adapters, splitting and combining them, merging them into the kernels.


def is_adapter(path) -> bool:
    """Whether the parameter at `path` is an adapter: a "/"-joined string, a tuple of keys or a
    jax key path (tree_map_with_path's)."""
    if isinstance(path, str):
        last = path.rsplit("/", 1)[-1]
    else:
        keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
        last = str(keys[-1]) if keys else ""
    return last.endswith(ADAPTER_SUFFIXES)


def _flat(params) -> dict:
    return flax.traverse_util.flatten_dict(flax.core.unfreeze(params))


def adapter_mask(params):
    """A tree of bools over `params` (a prefix of its pytree: one per parameter), True at the
    adapters: the trainable ones (optax.masked; optax.multi_transform's labels by a map)."""
    return flax.traverse_util.unflatten_dict({k: is_adapter(k) for k in _flat(params)})


def split(params) -> tuple[dict, dict]:
    """(the base params, the adapters): two nested dicts of the parameters of `params`."""
    flat = _flat(params)
    base = {k: v for k, v in flat.items() if not is_adapter(k)}
    adapters = {k: v for k, v in flat.items() if is_adapter(k)}
    unflatten = flax.traverse_util.unflatten_dict
    return unflatten(base), unflatten(adapters)


def combine(base, adapters) -> dict:
    """The inverse of `split`: one nested dict of both (they must not share a path)."""
    flat_base, flat_adapters = _flat(base), _flat(adapters)
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
    flat = _flat(params)
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
        delta = _delta(a, b, kernel.shape, config.rank, name)
        merged = (kernel.astype(jnp.float32) + config.scale * delta).astype(kernel.dtype)
        out[path] = leaf.replace_boxed(merged) if isinstance(leaf, nn.meta.AxisMetadata) else merged
    return flax.traverse_util.unflatten_dict(out)


def dequantized(params, like) -> dict:
    """QLoRA's params with each quantized kernel dequantized into the layout and dtype of its
    float kernel in `like` (the base model's params or their ShapeDtypeStructs): the base the
    adapters were trained on, which `merge` can fold them into. Other leaves pass through."""
    flat, shapes = _flat(params), _flat(like)
    out = {}
    for path, leaf in flat.items():
        kernel = nn.unbox(leaf)
        if isinstance(kernel, _ptq.WithAux):
            want = nn.unbox(shapes[path])
            leaf = _qarray.dequantize(kernel.array).reshape(want.shape).astype(want.dtype)
        out[path] = leaf
    return flax.traverse_util.unflatten_dict(out)


# ----------------------------------------------------------------------------------------------
# QLoRA's checks: before any work, and on every later load of a run's base.


def check_tile_size(config: LoraConfig, params, name: str = "LoraConfig") -> None:
    """QLoRA: each adapted kernel's inputs (its matmul's contracting width: D of query_kernel,
    N H of out_kernel, F of mlp/wo) must split into whole blocks of `config.block_size`.
    `params`: the LoRA model's params or their ShapeDtypeStructs, boxed or not (from an
    abstract init, which may run without base_dtype: no device needed), whose adapters A
    [*L, in, r] give each kernel's width (tfjax's matmuls contract one axis). One ValueError
    naming `name`.tile_size, every kernel that does not fit with its width, and the values
    that fit them all."""
    size = config.block_size
    if size is None:
        return
    suffix = ADAPTER_SUFFIXES[0]
    widths = {
        "/".join(map(str, (*path[:-1], path[-1][: -len(suffix)]))): int(leaf.shape[-2])
        for path, leaf in _flat(nn.unbox(params)).items()
        if str(path[-1]).endswith(suffix)
    }
    if any(width % size for width in widths.values()):
        raise ValueError(_tile_size_error(config, widths, name))


def _tile_size_error(config: LoraConfig, widths: dict[str, int], name="LoraConfig") -> str:
    """The line refusing `config.block_size` for the kernels `widths` {path: inputs}."""
    size, field = config.block_size, f"{name}.tile_size"
    given = (
        f"{field}={config.tile_size}"
        if config.tile_size is not None
        else f"{field} unset ({config.base_dtype}'s default: {size}, QLoRA's block)"
    )
    bad = sorted(path for path, width in widths.items() if width % size)
    listed = ", ".join(f"{path} ({widths[path]})" for path in bad[:4])
    if len(bad) > 4:
        listed += f", and {len(bad) - 4} more"
    common = math.gcd(*widths.values())
    divisors = [d for d in range(common, 0, -1) if common % d == 0][:4]
    return (
        f"{given}: {len(bad)} adapted kernel(s) of base_dtype={config.base_dtype!r} have a "
        f"number of inputs that is not a multiple of {size} (each output channel's inputs are "
        f"quantized in blocks of tile_size, one scale each): {listed}; set {field} to 0 (one "
        f"scale per output channel) or to a divisor of {common}, what every adapted kernel's "
        f"inputs divide by ({', '.join(map(str, divisors))}{', ...' if common > 4 else ''})"
    )


def _quantized_as(config: LoraConfig) -> str:
    """How `config` stores its base: "float (lora.base_dtype='')", "quantized as nf4 in
    blocks of 64 inputs (lora.base_dtype='nf4', lora.tile_size unset)", ..."""
    if config.base_dtype is None:
        return "float (lora.base_dtype='')"
    blocks = (
        f"in blocks of {config.block_size} inputs"
        if config.block_size
        else "with one scale per output channel"
    )
    tile = "unset" if config.tile_size is None else config.tile_size
    return (
        f"quantized as {config.base_dtype} {blocks} (lora.base_dtype={config.base_dtype!r}, "
        f"lora.tile_size {tile})"
    )


def check_quantization_kept(trained: LoraConfig | None, now: LoraConfig | None, where: str):
    """A run's adapters belong to its base quantized as it was when they were trained: a
    resumed or decoded run (config `now`) must quantize it as `trained` did (the config the
    workdir recorded, in the file `where`): the same base_dtype and block size. Else one
    ValueError naming lora.base_dtype and lora.tile_size, both quantizations, and the flags that
    give the trained one; this is also how a workdir from before nf4's default became QLoRA's
    blocks of 64 (it recorded lora.tile_size=0: one scale per output channel) is told apart."""
    if trained is None or now is None:
        return
    if (trained.base_dtype, trained.block_size) == (now.base_dtype, now.block_size):
        return
    raise ValueError(
        f"lora.base_dtype / lora.tile_size: this run's adapters were trained on its base "
        f"{_quantized_as(trained)} ({where}), but this config makes it "
        f"{_quantized_as(now)}; give --config.lora.base_dtype={trained.base_dtype or ''} "
        f"--config.lora.tile_size={trained.block_size or 0}, the base the adapters belong to"
    )


def _delta(a, b, shape, rank, name):
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


# ----------------------------------------------------------------------------------------------
# The Qwix provider.


def _merged_axes(src: Sequence[int], dst: Sequence[int]) -> tuple[int | None, ...]:
    """For each axis of `dst`, a reshape of `src` that merges neighbouring axes, the `src` axis
    whose logical name it takes: the first of those merged into it of size > 1 (None where
    there is none, or where `dst` is not such a reshape of `src`)."""
    out, i = [], 0
    for size in dst:
        group, prod = [], 1
        while i < len(src) and (prod < size or (size == 1 and not group and src[i] == 1)):
            group.append(i)
            prod *= src[i]
            i += 1
        if prod != size:
            return (None,) * len(dst)
        big = [j for j in group if src[j] > 1]
        out.append(big[0] if big else None)
    if any(src[j] != 1 for j in range(i, len(src))):
        return (None,) * len(dst)
    return tuple(out)


def _folded(initializer, salt: int):
    """`initializer` with its key folded with `salt` (Qwix's defaults: He-uniform A, zero B)."""

    def init(key, shape, dtype=jnp.float32):
        return initializer(jax.random.fold_in(key, salt), shape, dtype)

    return init


class _Provider(qwix.LoraProvider):
    """Qwix's LoraProvider as tfjax's models need it: see the module docstring's list."""

    def __init__(self, config: LoraConfig):
        rule = qwix.LoraRule(
            module_path=".*",  # which kernels: `targets`, matched in _target
            rank=config.rank,
            alpha=config.alpha,
            dropout=config.dropout,
            weight_qtype=config.base_dtype,
            tile_size=config.block_size,
            lora_a_initializer=_folded(jax.nn.initializers.he_uniform(), 1),
            lora_b_initializer=_folded(jax.nn.initializers.zeros, 2),
        )
        super().__init__([rule])
        self.config = config
        self._targets = re.compile(config.targets)
        # id(array) -> (array, (module path, parameter name)): each parameter the running
        # modules read, and its casts and reshapes; cleared at each top-level call's ends.
        self._origins: dict[int, tuple[Any, tuple]] = {}
        self._seen: set[str] = set()  # the paths of the kernels the call multiplied with
        self._matched: set[str] = set()  # those matching targets
        self._creating = False  # the call could create parameters (init)
        self._train = False

    # -- the call's ends -------------------------------------------------------------------

    def process_model_inputs(self, model, model_args, model_kwargs):
        self._origins.clear()
        self._seen, self._matched, self._creating = set(), set(), False
        self._train = model_kwargs.get("train", False) is True
        return super().process_model_inputs(model, model_args, model_kwargs)

    def process_model_output(self, method_name, model_output):
        self._origins.clear()
        if self._creating and not self._matched:
            seen = sorted(self._seen)
            some = ", ".join(repr(p) for p in seen[:8]) + (
                f", ... ({len(seen)} in all)" if len(seen) > 8 else ""
            )
            raise ValueError(
                f"LoraConfig.targets={self.config.targets!r} matches none of the model's "
                f"kernels (regex fully matched against parameter paths); its kernels: "
                f"{some or 'none seen'}"
            )
        return super().process_model_output(method_name, model_output)

    # -- following parameters ----------------------------------------------------------------

    def get_intercept_map(self):
        return super().get_intercept_map() | {"jax.lax.reshape": self._reshape}

    def _record(self, value, origin):
        self._origins[id(value)] = (value, origin)

    def _origin(self, value):
        entry = self._origins.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def nn_param(self, module, name, *args, **kwargs):
        value = super().nn_param(module, name, *args, **kwargs)
        if isinstance(module, _moe.Experts) and not name.endswith("_bias"):
            self._refuse_experts("/".join((*module.path, name)))
        self._record(value, (tuple(module.path), name))
        return value

    def _refuse_experts(self, path):
        """A mixture of experts' stacked kernels [E, ...] are multiplied by a grouped matmul
        (tfjax.ops.moe.grouped_matmul: XLA's ragged_dot, Megablox or Tokamax), which Qwix's
        LoRA does not intercept: a target naming one is refused, not left without adapters."""
        if self._targets.fullmatch(path):
            raise ValueError(
                f"LoraConfig.targets={self.config.targets!r} matches {path}, a mixture of "
                "experts' stacked expert kernel: LoRA adapts the kernels of einsum, dot_general "
                "and convolutions (attention, dense MLPs, the router .*/mlp/router/kernel), not "
                "the experts' grouped matmul; leave .*/mlp/experts/ out of targets (the default "
                "targets do)"
            )

    def promote_dtype(self, *args, **kwargs):
        out = super().promote_dtype(*args, **kwargs)
        ins = args[0] if len(args) == 1 and isinstance(args[0], Sequence) else args
        for x, y in zip(ins, out, strict=False):
            origin = self._origin(x) if x is not None else None
            if origin is not None:
                self._record(y, origin)
        return out

    def _reshape(self, operand, *args, **kwargs):
        out = jax.lax.reshape(operand, *args, **kwargs)
        origin = self._origin(operand)
        if origin is not None:
            self._record(out, origin)
        return out

    def _module_path(self, module) -> tuple:
        return tuple(module.path)

    def _creates(self, module) -> bool:
        """Whether this call may create the adapters (init)."""
        return module.is_mutable_collection("params")

    def _target(self, rhs) -> str | None:
        """The name of the parameter that `rhs` is (or a cast or reshape of), when the running
        module owns it and its path matches targets; else None."""
        origin = self._origin(rhs)
        if origin is None:
            return None
        module = _flax_util.get_current_module()
        path, name = origin
        if self._module_path(module) != path:
            return None
        full = "/".join((*path, name))
        self._seen.add(full)
        self._creating |= self._creates(module)
        if not self._targets.fullmatch(full):
            return None
        self._matched.add(full)
        return name

    # -- the matmuls -----------------------------------------------------------------------------

    def einsum(self, einsum_str, *operands, **kwargs):
        name = self._target(operands[1]) if len(operands) == 2 else None
        if name is None:
            return jnp.einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        how = functools.partial(
            _qeinsum.get_how_to_quantize, einsum_str=einsum_str, ndims=(lhs.ndim, rhs.ndim)
        )
        rhs = self._maybe_quantized(name, rhs, how, lhs.dtype)
        out = super(qwix.LoraProvider, self).einsum(einsum_str, lhs, rhs, **kwargs)
        rank = self.config.rank
        a_shape, b_shape, lora_str, a_axes, b_axes = _qlora._parse_einsum_str_for_lora(
            lhs.shape, rhs.shape, einsum_str, rank
        )
        a, b = self._adapters(name, rhs.shape, a_shape, b_shape, a_axes, b_axes)
        dtype = self._dtype(lhs, rhs, out)
        x = self._dropout(lhs)
        # (x A) B: opt_einsum contracts x with A first, never forming A B
        delta = jnp.einsum(lora_str, x, a.astype(dtype), b.astype(dtype), **kwargs)
        return out.astype(dtype) + delta * jnp.asarray(self.config.scale, dtype)

    def dot_general(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        name = self._target(rhs)
        if name is None:
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )
        how = functools.partial(
            _qdot_general.get_how_to_quantize,
            dimension_numbers=dimension_numbers,
            ndims=(lhs.ndim, rhs.ndim),
        )
        rhs = self._maybe_quantized(name, rhs, how, lhs.dtype)
        out = super(qwix.LoraProvider, self).dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
        (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
        rhs_ra = tuple(i for i in range(rhs.ndim) if i not in rhs_ca and i not in rhs_ba)

        def sizes(axes):
            return tuple(rhs.shape[i] for i in axes)

        rank = self.config.rank
        a_shape, a_axes, b_shape, b_axes = _qlora._create_lora_layer_shapes(
            rhs_ca, rhs_ba, rhs_ra, sizes(rhs_ca), sizes(rhs_ba), sizes(rhs_ra), rank
        )
        a, b = self._adapters(name, rhs.shape, a_shape, b_shape, a_axes, b_axes)
        dtype = self._dtype(lhs, rhs, out)
        delta = _qlora._compute_lora_delta(
            self._dropout(lhs),
            a.astype(dtype),
            b.astype(dtype),
            lhs_ca,
            lhs_ba,
            sizes(rhs_ca),
            sizes(rhs_ba),
            sizes(rhs_ra),
            rank,
            precision=precision,
        )
        return out.astype(dtype) + delta * jnp.asarray(self.config.scale, dtype)

    def conv_general_dilated(
        self,
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=None,
        rhs_dilation=None,
        dimension_numbers=None,
        feature_group_count=1,
        batch_group_count=1,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        """A convolution (nn.Conv) whose kernel [..., C, D] is a target: conv(x, A) B with A
        [..., C, r] and B [r, D], as Qwix's LoraProvider computes it."""

        def conv(x, kernel):
            return jax.lax.conv_general_dilated(
                x,
                kernel,
                window_strides,
                padding,
                lhs_dilation=lhs_dilation,
                rhs_dilation=rhs_dilation,
                dimension_numbers=dimension_numbers,
                feature_group_count=feature_group_count,
                batch_group_count=batch_group_count,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )

        name = self._target(rhs)
        out = conv(lhs, rhs)
        if name is None:
            return out
        path = "/".join((*self._module_path(_flax_util.get_current_module()), name))
        if self.config.base_dtype is not None:
            raise ValueError(
                f"LoraConfig.base_dtype={self.config.base_dtype!r}: quantized convolution "
                f"kernels are not supported; leave {path} out of targets"
            )
        numbers = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        n = rhs.ndim
        if numbers.rhs_spec[0] != n - 1 or numbers.out_spec[1] != lhs.ndim - 1:
            raise ValueError(f"LoRA of the convolution {path} needs its features last")
        rank = self.config.rank
        a, b = self._adapters(
            name,
            rhs.shape,
            (*rhs.shape[:-1], rank),
            (rank, rhs.shape[-1]),
            (*range(n - 1), None),
            (None, n - 1),
        )
        dtype = out.dtype
        delta = conv(self._dropout(lhs), a.astype(dtype)) @ b.astype(dtype)
        return out + delta * jnp.asarray(self.config.scale, dtype)

    def _dtype(self, lhs, rhs, out):
        """The matmul's result dtype without quantization: lhs's and the kernel's (as tfjax's
        modules promote both to the compute dtype, lhs's) for a quantized kernel."""
        return lhs.dtype if isinstance(rhs, _ptq.WithAux) else out.dtype

    def _dropout(self, x):
        rate = self.config.dropout
        if rate == 0.0 or not self._train:
            return x
        keep = jax.random.bernoulli(_flax_util.make_rng("dropout"), 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))

    def _adapters(self, name, shape, a_shape, b_shape, a_axes, b_axes):
        """The kernel `name`'s (A, B), created at init. `a_axes`/`b_axes` say, per adapter
        axis, which axis of the matmul's operand (of `shape`) gives its logical name; here
        mapped onto the stored kernel's axes (Qwix's _get_or_create_lora_params does the rest
        as this does, but its boxes fail under a mesh: see the module docstring)."""
        module = _flax_util.get_current_module()
        boxed = module.get_variable("params", name)
        stored = _flax_util.unbox(boxed)
        if isinstance(stored, _ptq.WithAux):  # QLoRA: the float values' dtype, qvalue's names
            dtype, box = stored.array.scale.dtype, boxed.array.qvalue
        else:
            dtype, box = stored.dtype, boxed
        axes = _merged_axes(tuple(stored.shape), tuple(shape))
        rule = self._rules[0]

        def init(initializer, adapter_shape, adapter_axes):
            mapped = tuple(None if i is None else axes[i] for i in adapter_axes)
            return lambda key: _rebox(box, initializer(key, adapter_shape, dtype), mapped)

        # Creating them draws keys from the module's "params" stream (Flax's scope.param); the
        # stream's counter is put back afterwards, so that the base kernels declared after
        # this one get the keys they get without LoRA: init with one key gives the base model's
        # values. The adapters' initialisers fold their keys (see _Provider.__init__), so they
        # differ from those kernels' keys.
        counters = getattr(module.scope, "rng_counters", None)
        saved = dict(counters) if counters is not None else None
        a = module.scope.param(
            name + ADAPTER_SUFFIXES[0], init(rule.lora_a_initializer, a_shape, a_axes)
        )
        b = module.scope.param(
            name + ADAPTER_SUFFIXES[1], init(rule.lora_b_initializer, b_shape, b_axes)
        )
        if saved is not None:
            counters.update(saved)
        return a, b

    def _maybe_quantized(self, name, rhs, how, dtype):
        """QLoRA: the kernel `name` (whose matmul operand is `rhs`) as a quantized WithAux;
        quantized and stored in place of the float kernel when params are being made. Its
        scale in the compute `dtype` (the matmul's input's), so the kernel dequantizes to it."""
        qtype = self.config.base_dtype
        if qtype is None:
            return rhs
        if not isinstance(rhs, _ptq.WithAux):
            rhs = self._quantize(name, rhs, how, qtype)
        scale = rhs.array.scale
        if scale.dtype != dtype:
            rhs = rhs.replace(array=rhs.array.replace(scale=scale.astype(dtype)))
        return rhs

    def _quantize(self, name, rhs, how, qtype):
        """The kernel `name` quantized from its stored values, in the matmul's layout (that of
        `rhs`), and stored in its place with its names mapped (while params are being made)."""
        module = _flax_util.get_current_module()
        path = "/".join((*module.path, name))
        if not module.is_mutable_collection("params"):
            raise ValueError(
                f"LoraConfig.base_dtype={qtype!r}, but the kernel {path} holds float values: "
                "make the params with lora.init_params(model, base_params, rng, ...), which "
                "quantizes them"
            )
        boxed = module.get_variable("params", name)
        stored = _flax_util.unbox(boxed)
        rule = self._rules[0]
        how = how(
            for_lhs=False,
            qtype=qtype,
            tile_size=rule.tile_size,
            calibration_method=rule.weight_calibration_method,
        )
        for axis, size in how.tiled_axes.items():  # Qwix: "(32, 32) cannot be tiled as {0: 64}"
            if rhs.shape[axis] % size:
                raise ValueError(_tile_size_error(self.config, {path: rhs.shape[axis]}))
        # From the stored (param_dtype) values, in the matmul's layout.
        value = _ptq.WithAux(_qarray.quantize(stored.reshape(rhs.shape), how), how)
        axes = _merged_axes(tuple(stored.shape), tuple(rhs.shape))
        module.put_variable("params", name, jax.tree.map(lambda v: _rebox(boxed, v, axes), value))
        return value


def _rebox(box, value, axes):
    """`value` boxed as `box` (a kernel's nn.Partitioned / LogicallyPartitioned, or a plain
    array: then `value` as is), each of its axes named as the kernel's axis `axes[i]` (None:
    no name; so too axes of size 1). Without unboxing `box`, which would apply the kernel's
    sharding constraint to `value` (what Qwix's flax_util.update_boxed does)."""
    if not isinstance(box, nn.Partitioned):
        return value
    names = tuple(
        None if i is None or size == 1 else box.names[i]
        for i, size in zip(axes, value.shape, strict=True)
    )
    return dataclasses.replace(box, value=value, names=names)


# ----------------------------------------------------------------------------------------------
# Flax NNX (tfjax.nnx): the same adapters, as nnx.LoRAParam.
#
#     model = lora.apply_lora(model, config, tokens, rngs=nnx.Rngs(0))   # a copy, with adapters
#     optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)  # adapters only
#     grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
#     params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # base + adapters: the Linen tree
#     plain = interop.as_nnx(model.spec, lora.merge(params, config))  # merged, no adapters
#     state, targets = tfjax.runner.export.adapter_state(model.spec, params, family)  # peft's
#
# One submodule, its targets matched against its own paths:
#     model.decoder.layers_3.self_attention = lora.apply_lora(
#         model.decoder.layers_3.self_attention, LoraConfig(targets="(query|value)_kernel"),
#         x, rngs=nnx.Rngs(0))
# A scanned stack's layer is one module holding every layer's parameters, run only inside the
# stack's scan: it is refused; a targets regex on the whole model names it instead
# ("decoder/layers/self_attention/(query|value)_kernel").
#
# Qwix's NNX path creates adapters on the module that runs the matmul, during a first call.
# tfjax.nnx's stacks run each layer as nnx.merge(graphdef, state) (unrolled) or inside
# jax.lax.scan (scanned): a copy, whose new attributes are lost, and inside scan a traced one.
# So here the first call only records each targeted kernel's adapter shapes and logical names
# (an abstract call, nnx.eval_shape: nothing is computed), and the adapters are then created
# on the model's own modules: stacked [L, ...] under a scanned stack's `layers` (one A per
# layer, as Linen's nn.scan makes them), which the scan slices as it slices the kernels. The
# matmuls are then the Linen provider's (the same maths), the kernel identified by object
# among the running module's nnx.Params (`module.query_kernel[...]` is the stored array itself;
# numpy-held ones are converted in promote_dtype) and followed through promote_dtype and
# reshape as in Linen. Qwix intercepts one method of an NNX model (__call__); the others of
# METHODS (the head's `logits`, which the chunked loss calls alone) are intercepted here.
# Not yet on NNX: adapter dropout (LoraConfig.dropout; tfjax.nnx takes explicit dropout keys,
# which the provider does not see) and QLoRA (base_dtype; tfjax.nnx's attention reads the
# kernel's [D, N, H] shape, which a kernel stored quantized as [D, N H] does not have).


@dataclasses.dataclass(frozen=True)
class _Want:
    """One kernel's adapters, as the abstract call saw its matmul."""

    kernel_shape: tuple  # the kernel's stored shape in the call (one layer's, when stacked)
    shape: tuple  # the matmul's operand shape (a reshape of kernel_shape)
    a_shape: tuple
    b_shape: tuple
    a_axes: tuple  # per adapter axis, the operand axis whose logical name it takes
    b_axes: tuple


class _NnxProvider(_Provider):
    """_Provider on NNX modules: kernels found among the module's nnx.Params by object, and
    adapters read from nnx.LoRAParam attributes (or, in the first call, recorded as wanted)."""

    def __init__(self, config: LoraConfig):
        super().__init__(config)
        self.wants: dict[tuple, _Want] | None = None  # a dict while the first call records

    def _origin(self, value):
        origin = super()._origin(value)
        if origin is not None:
            return origin
        try:
            module = _flax_util.get_current_module()
        except ValueError:
            return None
        for name, node in vars(module).items():
            if (
                isinstance(node, nnx.Param)
                and not isinstance(node, nnx.LoRAParam)
                and _is_read_of(value, node.get_raw_value())
            ):
                return (_nnx_path(module), name)
        return None

    def promote_dtype(self, *args, **kwargs):
        # A kernel held as a numpy array (params from jax.device_get) would pass Qwix's
        # promote_dtype unconverted and then be reshaped by numpy, out of sight: converted
        # here (as Flax's promote_dtype converts it), its origin kept.
        nested = len(args) == 1 and isinstance(args[0], Sequence)
        ins = list(args[0] if nested else args)
        for i, x in enumerate(ins):
            if isinstance(x, np.ndarray):
                ins[i] = jnp.asarray(x)
                origin = self._origin(x)
                if origin is not None:
                    self._record(ins[i], origin)
        return super().promote_dtype(*((ins,) if nested else ins), **kwargs)

    def _module_path(self, module) -> tuple:
        return _nnx_path(module)

    def _creates(self, module) -> bool:
        return self.wants is not None

    def _adapters(self, name, shape, a_shape, b_shape, a_axes, b_axes):
        module = _flax_util.get_current_module()
        a = getattr(module, name + ADAPTER_SUFFIXES[0], None)
        b = getattr(module, name + ADAPTER_SUFFIXES[1], None)
        if a is not None and b is not None:
            return a[...], b[...]
        path = "/".join((*map(str, _nnx_path(module)), name))
        if self.wants is None:
            raise ValueError(
                f"{path} is a LoRA target without adapters: apply_lora made them for the "
                "matmuls its example call ran; call apply_lora on inputs that run this one"
            )
        kernel = getattr(module, name)
        self.wants[(_nnx_path(module), name)] = _Want(
            tuple(kernel.shape), tuple(shape), a_shape, b_shape, tuple(a_axes), tuple(b_axes)
        )
        return jnp.zeros(a_shape, kernel.dtype), jnp.zeros(b_shape, kernel.dtype)


def _is_read_of(value, stored) -> bool:
    """Whether `value` is what `variable[...]` gives of a variable holding `stored`: `stored`
    itself (a jax array or tracer), or a view of it (numpy's, e.g. from jax.device_get)."""
    if value is stored:
        return True
    return (
        isinstance(value, np.ndarray)
        and isinstance(stored, np.ndarray)
        and value.shape == stored.shape
        and value.dtype == stored.dtype
        and np.may_share_memory(value, stored)
    )


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _nnx_path(module) -> tuple:
    """The path Qwix gave an NNX module (from the module apply_lora was given)."""
    return tuple(map(str, getattr(module, "qwix_path", ())))


def _apply_lora_nnx(model, config, args, kwargs, rngs):
    """apply_lora of an NNX module: see there and this section's comment."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(
            f"apply_lora of an NNX {type(model).__name__} needs rngs=nnx.Rngs(...) (for the "
            f"adapters' A), got {rngs!r}"
        )
    if not args and not kwargs:
        raise TypeError(
            f"apply_lora of an NNX {type(model).__name__} needs example inputs (e.g. tokens): "
            "one abstract call finds the targeted matmuls"
        )
    if config.dropout:
        raise NotImplementedError(
            f"LoraConfig.dropout={config.dropout}: adapter dropout is Linen's only so far "
            "(tfjax.nnx's models take explicit dropout keys, which Qwix's provider does not see)"
        )
    if config.base_dtype is not None:
        raise NotImplementedError(
            f"LoraConfig.base_dtype={config.base_dtype!r}: QLoRA is Linen's only so far "
            "(tfjax.nnx's attention reads its kernels' [D, N, H] shape; QLoRA stores them "
            "quantized as [D, N H])"
        )
    if nnx.state(model, nnx.LoRAParam):
        raise ValueError(f"apply_lora: the {type(model).__name__} has adapters already")
    names = [
        (p.get_metadata().get("out_sharding") or (None,))[0]
        for p in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=_is_variable)
    ]
    if names and all(n == _axes.LAYERS for n in names):
        raise ValueError(
            f"apply_lora: the {type(model).__name__}'s parameters are a scanned stack's (every "
            "layer's, stacked [L, ...]), which runs only inside the stack's scan; apply LoRA to "
            "the model with LoraConfig.targets naming its path, e.g. "
            "'decoder/layers/self_attention/(query|value)_kernel'"
        )
    provider = _NnxProvider(config)
    # A copy whose __call__ Qwix intercepts, each module given its path (qwix_path); Qwix's
    # own first call is skipped (see this section's comment).
    out = qwix.apply_lora_to_model(model, provider, rngs=rngs, skip_nnx_init=True)
    # Qwix's NNX path intercepts __call__ only; the other methods (the head's `logits`, which
    # the chunked loss calls alone) are intercepted here the same way, on the class Qwix made
    # for this copy. A method called from an intercepted one runs inside its interception.
    cls = type(out)
    for method in METHODS[1:]:
        if callable(getattr(cls, method, None)):
            setattr(
                cls,
                method,
                _qmodel._apply_interceptors(
                    getattr(cls._unquantized_type, method),
                    provider,
                    output_transform=functools.partial(
                        _qmodel._output_transform_nnx, provider, method
                    ),
                ),
            )
    provider.wants = {}
    try:
        nnx.eval_shape(lambda m: m(*args, **kwargs), out)
        wants = provider.wants
    finally:
        provider.wants = None
    rule = provider._rules[0]
    for (path, name), want in sorted(wants.items()):
        module = _flax_util.get_value_from_path(out, path)
        kernel = getattr(module, name)
        for suffix, initializer, shape, adapter_axes in (
            (ADAPTER_SUFFIXES[0], rule.lora_a_initializer, want.a_shape, want.a_axes),
            (ADAPTER_SUFFIXES[1], rule.lora_b_initializer, want.b_shape, want.b_axes),
        ):
            where = "/".join((*path, name + suffix))
            adapter = _nnx_adapter(
                where, kernel, want, initializer, shape, adapter_axes, rngs.params()
            )
            setattr(module, name + suffix, adapter)
    return out


def _nnx_adapter(where, kernel, want, initializer, shape, adapter_axes, key) -> nnx.LoRAParam:
    """The adapter (A or B, of `shape`) of the nnx.Param `kernel`, which the call saw as
    `want.kernel_shape` (one layer's: `kernel` has a leading [L] in a scanned stack); each
    axis named as the kernel's axis it comes from (see _Provider._adapters)."""
    lead = tuple(kernel.shape[: kernel.ndim - len(want.kernel_shape)])  # (L,) when stacked
    if tuple(kernel.shape[len(lead) :]) != want.kernel_shape:
        raise ValueError(
            f"{where}: its kernel is {tuple(kernel.shape)}, called as {want.kernel_shape}"
        )
    names = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
    axes = _merged_axes(want.kernel_shape, want.shape)
    mapped = tuple(
        None if i is None or axes[i] is None or size == 1 else names[len(lead) + axes[i]]
        for i, size in zip(adapter_axes, shape, strict=True)
    )
    if lead:  # one per layer, as nn.scan splits the params key
        keys = jax.random.split(key, math.prod(lead))
        value = jax.vmap(lambda k: initializer(k, shape, kernel.dtype))(keys)
        value, mapped = value.reshape(*lead, *shape), (*names[: len(lead)], *mapped)
    else:
        value = initializer(key, shape, kernel.dtype)
    blocks = _nnx_blocks()  # placed on the mesh in context as the model's parameters are
    return nnx.LoRAParam(blocks.place(value, mapped), **blocks.metadata(mapped))


def _nnx_blocks():
    from tfjax.nnx import blocks  # imported with NNX use only

    return blocks
