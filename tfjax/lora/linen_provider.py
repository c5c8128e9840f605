"""The Qwix provider that adds the adapters to a tfjax model's matmuls, and a Linen model's
apply_lora and init_params.

How: `apply_lora` hands the model to Qwix (`qwix.apply_lora_to_model` with a `LoraProvider`),
which intercepts jax.numpy.einsum, jax.lax.dot_general and jax.lax.conv_general_dilated while
the model's methods run (unrolled, inside nn.scan and nn.remat alike) and adds the adapters
there. The maths is Qwix's: the adapters' shapes for an einsum or dot_general, the delta
(x A) B, the quantized matmuls of QLoRA (tfjax calls Qwix's private helpers for them, hence the
pin qwix<0.2). tfjax's provider (`Provider`) replaces what Qwix 0.1.8 gets wrong on tfjax's
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
  8. A kernel multiplied by two einsums of other contractions (latent attention's key_up and
     value_up: over the latent when training, over the heads' channels when decoding in the
     absorbed form, tfjax.ops.mla) would get a second pair of adapters of other shapes (Flax's
     ScopeParamShapeError): the einsum its adapters were not made for takes the kernel with
     them merged, W + (A B) alpha / r, the same product.
  9. A targeted kernel the model reads but no intercepted matmul multiplies (used elementwise,
     or by a primitive Qwix does not intercept) would silently get no adapters: refused by name.
Also by reading Qwix's source: its adapter dropout runs on every call (train or not); here
only with train=True. And adapters are computed in the matmul's compute dtype (A, B cast to
it, as tfjax's modules cast kernels), where Qwix promoted a bfloat16 model's projections to
the adapters' float32.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from qwix._src.core import dot_general as _qdot_general
from qwix._src.core import einsum as _qeinsum
from qwix._src.core import qarray as _qarray
from qwix._src.providers import lora as _qlora
from qwix._src.providers import ptq as _ptq
from qwix._src.utils import flax_util as _flax_util

from tfjax.lora import adapters as _adapters
from tfjax.lora.config import ADAPTER_SUFFIXES, METHODS, LoraConfig, tile_size_error
from tfjax.nn import moe as _moe


def apply_lora_linen(model: nn.Module, config: LoraConfig):
    """apply_lora of a Linen module: see there."""
    methods = [m for m in METHODS if callable(getattr(type(model), m, None))]
    return qwix.apply_lora_to_model(model, Provider(config), methods=methods)


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
# The Qwix provider.


def merged_axes(src: Sequence[int], dst: Sequence[int]) -> tuple[int | None, ...]:
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


class Provider(qwix.LoraProvider):
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
        self._read: set[str] = set()  # the kernels matching targets that the call read
        self._creating = False  # the call could create parameters (init)
        self._train = False

    # -- the call's ends -------------------------------------------------------------------

    def process_model_inputs(self, model, model_args, model_kwargs):
        self._origins.clear()
        self._seen, self._matched, self._read, self._creating = set(), set(), set(), False
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
        if self._creating and self._read - self._matched:
            missed = sorted(self._read - self._matched)
            raise ValueError(
                f"LoraConfig.targets={self.config.targets!r} matches {', '.join(missed[:4])}"
                f"{f', and {len(missed) - 4} more' if len(missed) > 4 else ''}: kernel(s) the "
                "model reads but multiplies by no einsum, dot_general or convolution on the "
                "kernel itself (what Qwix's LoRA intercepts), so they would get no adapters; "
                "leave them out of targets"
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
        path = "/".join((*module.path, name))
        if isinstance(module, _moe.Experts) and not name.endswith("_bias"):
            self._refuse_experts(path)
        # kernels and Gated DeltaNet's convolution weights (*_conv, multiplied elementwise):
        # refused at the call's end unless a matmul adapts them
        if name.endswith(("kernel", "_conv")) and self._targets.fullmatch(path):
            self._read.add(path)
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
                path, name = origin
                full = "/".join((*map(str, path), name))
                if name.endswith("kernel") and self._targets.fullmatch(full):
                    self._read.add(full)  # NNX's reads (Linen's: nn_param)
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
        rank = self.config.rank
        a_shape, b_shape, lora_str, a_axes, b_axes = _qlora._parse_einsum_str_for_lora(
            lhs.shape, rhs.shape, einsum_str, rank
        )
        made = self._made_adapters(name)
        if made is not None and (made[0].shape, made[1].shape) != (tuple(a_shape), tuple(b_shape)):
            return self._merged_einsum(name, einsum_str, lhs, rhs, *made, **kwargs)
        how = functools.partial(
            _qeinsum.get_how_to_quantize, einsum_str=einsum_str, ndims=(lhs.ndim, rhs.ndim)
        )
        rhs = self._maybe_quantized(name, rhs, how, lhs.dtype)
        out = super(qwix.LoraProvider, self).einsum(einsum_str, lhs, rhs, **kwargs)
        a, b = self._adapters(name, rhs.shape, a_shape, b_shape, a_axes, b_axes)
        dtype = self._dtype(lhs, rhs, out)
        x = self._dropout(lhs, name)
        # (x A) B: opt_einsum contracts x with A first, never forming A B
        delta = jnp.einsum(lora_str, x, a.astype(dtype), b.astype(dtype), **kwargs)
        return out.astype(dtype) + delta * jnp.asarray(self.config.scale, dtype)

    def _merged_einsum(self, name, einsum_str, lhs, rhs, a, b, **kwargs):
        """An einsum of the kernel `name` other than the one its adapters A, B were made for
        (latent attention's absorbed form contracts key_up_kernel over its heads' channels
        where the expanded form, which made them, contracts the latent; tfjax.ops.mla): the
        kernel with its adapters merged, W + (A B) alpha / r in its layout, the same product.
        Not training: no adapter dropout (the absorbed form only decodes)."""
        path = "/".join((*map(str, self._module_path(_flax_util.get_current_module())), name))
        kernel = rhs
        if isinstance(rhs, _ptq.WithAux):  # QLoRA: the base the adapters train on
            kernel = _qarray.dequantize(rhs.array).astype(lhs.dtype)
        delta = _adapters.kernel_delta(a, b, kernel.shape, self.config.rank, path)
        merged = kernel.astype(jnp.float32) + self.config.scale * delta
        return jnp.einsum(einsum_str, lhs, merged.astype(kernel.dtype), **kwargs)

    def _made_adapters(self, name):
        """The running module's adapters (A, B) of the kernel `name`; None before they are
        made."""
        module = _flax_util.get_current_module()
        names = [name + suffix for suffix in ADAPTER_SUFFIXES]
        if not all(module.has_variable("params", n) for n in names):
            return None
        return tuple(_flax_util.unbox(module.get_variable("params", n)) for n in names)

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
            self._dropout(lhs, name),
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
        delta = conv(self._dropout(lhs, name), a.astype(dtype)) @ b.astype(dtype)
        return out + delta * jnp.asarray(self.config.scale, dtype)

    def _dtype(self, lhs, rhs, out):
        """The matmul's result dtype without quantization: lhs's and the kernel's (as tfjax's
        modules promote both to the compute dtype, lhs's) for a quantized kernel."""
        return lhs.dtype if isinstance(rhs, _ptq.WithAux) else out.dtype

    def _dropout(self, x, name):
        """The adapters' input `x` of the kernel `name`, with LoraConfig.dropout in training."""
        rate = self.config.dropout
        key = self._dropout_key(name) if rate else None
        if key is None:
            return x
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))

    def _dropout_key(self, name):
        """The key of the running module's adapter dropout, None when not training."""
        return _flax_util.make_rng("dropout") if self._train else None

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
        axes = merged_axes(tuple(stored.shape), tuple(shape))
        rule = self._rules[0]

        def init(initializer, adapter_shape, adapter_axes):
            mapped = tuple(None if i is None else axes[i] for i in adapter_axes)
            return lambda key: rebox(box, initializer(key, adapter_shape, dtype), mapped)

        # Creating them draws keys from the module's "params" stream (Flax's scope.param); the
        # stream's counter is put back afterwards, so that the base kernels declared after
        # this one get the keys they get without LoRA: init with one key gives the base model's
        # values. The adapters' initialisers fold their keys (see Provider.__init__), so they
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
        how = self._quantization(path, rhs, how, qtype)
        # From the stored (param_dtype) values, in the matmul's layout.
        value = _ptq.WithAux(_qarray.quantize(stored.reshape(rhs.shape), how), how)
        axes = merged_axes(tuple(stored.shape), tuple(rhs.shape))
        module.put_variable("params", name, jax.tree.map(lambda v: rebox(boxed, v, axes), value))
        return value

    def _quantization(self, path, rhs, how, qtype):
        """Qwix's HowToQuantize of the kernel at `path` as the matmul operand `rhs` (`how`:
        Qwix's get_how_to_quantize of the matmul), its blocks checked against `rhs`."""
        rule = self._rules[0]
        how = how(
            for_lhs=False,
            qtype=qtype,
            tile_size=rule.tile_size,
            calibration_method=rule.weight_calibration_method,
        )
        for axis, size in how.tiled_axes.items():  # Qwix: "(32, 32) cannot be tiled as {0: 64}"
            if rhs.shape[axis] % size:
                raise ValueError(tile_size_error(self.config, {path: rhs.shape[axis]}))
        return how


def rebox(box, value, axes):
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
