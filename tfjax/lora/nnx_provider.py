"""Flax NNX (tfjax.nnx): the same adapters, as nnx.LoRAParam.

    model = lora.apply_lora(model, config, tokens, rngs=nnx.Rngs(0))   # a copy, with adapters
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)  # adapters only
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # base + adapters: the Linen tree
    plain = interop.as_nnx(model.spec, lora.merge(params, config))  # merged, no adapters
    merged = lora.merge(lora.dequantized(params, float_params), config)  # QLoRA's
    state, targets = tfjax.runner.export.adapter_state(model.spec, params, family)  # peft's

One submodule, its targets matched against its own paths:
    model.decoder.layers_3.self_attention = lora.apply_lora(
        model.decoder.layers_3.self_attention, LoraConfig(targets="(query|value)_kernel"),
        x, rngs=nnx.Rngs(0))
A scanned stack's layer is one module holding every layer's parameters, run only inside the
stack's scan: it is refused; a targets regex on the whole model names it instead
("decoder/layers/self_attention/(query|value)_kernel").

Qwix's NNX path creates adapters on the module that runs the matmul, during a first call.
tfjax.nnx's stacks run each layer as nnx.merge(graphdef, state) (unrolled) or inside
jax.lax.scan (scanned): a copy, whose new attributes are lost, and inside scan a traced one.
So here the first call only records each targeted kernel's adapter shapes and logical names
(an abstract call, nnx.eval_shape: nothing is computed), and the adapters are then created
on the model's own modules: stacked [L, ...] under a scanned stack's `layers` (one A per
layer, as Linen's nn.scan makes them), which the scan slices as it slices the kernels. The
matmuls are then the Linen provider's (the same maths), the kernel identified by object
among the running module's nnx.Params (`module.query_kernel[...]` is the stored array itself;
numpy-held ones are converted in promote_dtype) and followed through promote_dtype and
reshape as in Linen. Qwix intercepts one method of an NNX model (__call__); the others of
METHODS (the head's `logits`, which the chunked loss calls alone) are intercepted here.
Adapter dropout (LoraConfig.dropout), in a training call only (train=True, or a tfjax.nnx
layer's call given its `dropout_rng`): tfjax.nnx's modules take explicit keys, not a "dropout"
stream, so each matmul's key is the `dropout_rng` of the innermost running module call that
takes one (a layer's own, inside a scanned stack too), else the key the model draws from the
call's `rngs` for its own dropout; folded with the kernel's path from that module.
QLoRA (base_dtype): apply_lora quantizes the copy's targeted kernels as Linen's init_params
does (bit for bit: the same WithAux(QArray) in the matmul's layout, each layer of a stack on its
own), so the model's Param state is Linen's QLoRA params tree. tfjax.nnx's attention reads its
kernels' shape ([D, N, H]), which a kernel stored as [D, N H] has not: the kernel's Param
(_QuantizedKernel) is read as a view of the float kernel's shape, whose reshape to the matmul's
layout gives the stored WithAux to the provider's (Linen's) quantized matmuls. The quantized
kernels carry no logical axis names and are not placed on a mesh in context (the adapters are):
under the runner (model.api=nnx) they are replicated where Linen's QLoRA shards them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import zlib
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src import model as _qmodel
from qwix._src.core import qarray as _qarray
from qwix._src.providers import ptq as _ptq
from qwix._src.utils import flax_util as _flax_util

from tfjax.lora.config import ADAPTER_SUFFIXES, METHODS, LoraConfig
from tfjax.lora.linen_provider import Provider, merged_axes
from tfjax.ops import axes as _axes


@dataclasses.dataclass(frozen=True)
class _Want:
    """One kernel's adapters, as the abstract call saw its matmul."""

    kernel_shape: tuple  # the kernel's stored shape in the call (one layer's, when stacked)
    shape: tuple  # the matmul's operand shape (a reshape of kernel_shape)
    a_shape: tuple
    b_shape: tuple
    a_axes: tuple  # per adapter axis, the operand axis whose logical name it takes
    b_axes: tuple


class _NnxProvider(Provider):
    """Provider on NNX modules: kernels found among the module's nnx.Params by object, and
    adapters read from nnx.LoRAParam attributes (or, in the first call, recorded as wanted)."""

    def __init__(self, config: LoraConfig):
        super().__init__(config)
        self.wants: dict[tuple, _Want] | None = None  # a dict while the first call records
        # QLoRA: how each targeted kernel is quantized, as the first call's matmuls ask
        self.hows: dict[tuple, _qarray.HowToQuantize] = {}
        self._call_key = None  # the training call's key of the adapters' dropout

    def process_model_inputs(self, model, model_args, model_kwargs):
        if self.config.dropout:
            self._call_key = _call_dropout_key(model, model_kwargs, self.config.dropout)
        return super().process_model_inputs(model, model_args, model_kwargs)

    def process_model_output(self, method_name, model_output):
        self._call_key = None
        return super().process_model_output(method_name, model_output)

    def _dropout_key(self, name):
        """In a training call: the `dropout_rng` of the innermost running tfjax.nnx module
        that takes one (one per layer, in a scanned stack too), else the call's own key;
        folded with the kernel's path from that module, so that each kernel's adapters drop
        their own inputs (as Linen's make_rng gives) and a layer's draws do not depend on
        whether its stack is scanned."""
        if self._call_key is None:
            return None
        path = (*_nnx_path(_flax_util.get_current_module()), name)
        key, owner = _module_dropout_key()
        if key is None:
            key = self._call_key
        else:
            path = path[len(_nnx_path(owner)) :]
        return jax.random.fold_in(key, zlib.crc32("/".join(path).encode()) & 0x7FFFFFFF)

    def _quantize(self, name, rhs, how, qtype):
        """QLoRA, in the first call: the kernel `name` quantized (abstractly) as its matmul
        asks, which apply_lora then does to its values; later a float kernel is refused."""
        module = _flax_util.get_current_module()
        path = "/".join((*_nnx_path(module), name))
        if self.wants is None:
            raise ValueError(
                f"LoraConfig.base_dtype={qtype!r}, but the kernel {path} holds float values: "
                "lora.apply_lora quantizes the NNX model's kernels; load a QLoRA model's "
                "params (its quantized kernels) into it"
            )
        how = self._quantization(path, rhs, how, qtype)
        self.hows[(_nnx_path(module), name)] = how
        return _ptq.WithAux(_qarray.quantize(rhs, how), how)

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

    def _made_adapters(self, name):
        module = _flax_util.get_current_module()
        a, b = (getattr(module, name + suffix, None) for suffix in ADAPTER_SUFFIXES)
        return None if a is None or b is None else (a[...], b[...])

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
    itself (a jax array or tracer), a view of it (numpy's, e.g. from jax.device_get), or a
    quantized kernel's WithAux holding its arrays (see _QuantizedKernel)."""
    if value is stored:
        return True
    if isinstance(value, _ptq.WithAux) and isinstance(stored, _ptq.WithAux):  # QLoRA's
        return _is_read_of(value.array.qvalue, stored.array.qvalue)
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


def apply_lora_nnx(model, config: LoraConfig, args, kwargs, rngs):
    """apply_lora of an NNX module: see there and this module's docstring."""
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
    # own first call is skipped (see this module's docstring).
    out = qwix.apply_lora_to_model(model, provider, rngs=rngs, skip_nnx_init=True)
    _intercept_other_methods(out, provider)
    provider.wants = {}
    try:
        nnx.eval_shape(lambda m: m(*args, **kwargs), out)
        wants = provider.wants
    finally:
        provider.wants = None
    _refuse_convolutions(out, config)
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
        if (path, name) in provider.hows:  # QLoRA
            setattr(module, name, _quantized(kernel, want, provider.hows[(path, name)]))
    provider.hows = {}
    return out


def _refuse_convolutions(model, config: LoraConfig) -> None:
    """Gated DeltaNet's convolution weights (*_conv) are multiplied elementwise, by no matmul
    Qwix intercepts: a target naming one would leave it without adapters, so it is refused by
    name (as the Linen provider refuses a kernel no matmul multiplies)."""
    targets = re.compile(config.targets)
    flat = flax.traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    named = sorted(
        path
        for path in ("/".join(map(str, k)) for k in flat)
        if path.endswith("_conv") and targets.fullmatch(path)
    )
    if named:
        raise ValueError(
            f"LoraConfig.targets={config.targets!r} matches {', '.join(named[:4])}"
            f"{f', and {len(named) - 4} more' if len(named) > 4 else ''}: convolution weights "
            "the model multiplies elementwise, by no einsum, dot_general or convolution (what "
            "Qwix's LoRA intercepts), so they would get no adapters; leave them out of targets"
        )


def _intercept_other_methods(model, provider):
    """Qwix's NNX path intercepts __call__ only; the other methods of METHODS (the head's
    `logits`, which the chunked loss calls alone) are intercepted here the same way, on the
    class Qwix made for this copy. A method called from an intercepted one runs inside its
    interception."""
    cls = type(model)
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


def _nnx_adapter(where, kernel, want, initializer, shape, adapter_axes, key) -> nnx.LoRAParam:
    """The adapter (A or B, of `shape`) of the nnx.Param `kernel`, which the call saw as
    `want.kernel_shape` (one layer's: `kernel` has a leading [L] in a scanned stack); each
    axis named as the kernel's axis it comes from (see Provider._adapters)."""
    lead = tuple(kernel.shape[: kernel.ndim - len(want.kernel_shape)])  # (L,) when stacked
    if tuple(kernel.shape[len(lead) :]) != want.kernel_shape:
        raise ValueError(
            f"{where}: its kernel is {tuple(kernel.shape)}, called as {want.kernel_shape}"
        )
    names = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
    axes = merged_axes(want.kernel_shape, want.shape)
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


# ----------------------------------------------------------------------------------------------
# Adapter dropout: the key of a training call.


def _call_dropout_key(model, kwargs, rate):
    """The key of a training call's adapter dropout, None when the call does not train: its
    `dropout_rng` (a tfjax.nnx block's or layer's call), or with train=True the key the model
    draws for its own dropout from `rngs` (else its own .rngs; read from a copy, so the model
    draws what it draws without LoRA)."""
    key = kwargs.get("dropout_rng")
    if key is not None:
        return key
    if kwargs.get("train") is not True:
        return None
    rngs = kwargs.get("rngs")
    if rngs is None:
        rngs = getattr(model, "rngs", None)
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(
            f"LoraConfig.dropout={rate}: a training call of the NNX {type(model).__name__} "
            "needs rngs=nnx.Rngs(dropout=key) for the adapters' dropout"
        )
    return nnx.clone(rngs).dropout()


def _module_dropout_key():
    """(`dropout_rng`, its module) of the innermost running tfjax.nnx module call that has
    one (its modules take their dropout key so, a key when training); (None, None) if none."""
    frame = inspect.currentframe()
    while frame is not None:
        local = frame.f_locals
        if isinstance(local.get("self"), nnx.Module) and local.get("dropout_rng") is not None:
            return local["dropout_rng"], local["self"]
        frame = frame.f_back
    return None, None


# ----------------------------------------------------------------------------------------------
# QLoRA: a kernel stored quantized in its matmul's layout, read in its own shape.


@flax.struct.dataclass
class _KernelView(_ptq.WithAux):
    """A quantized kernel (WithAux(QArray) in its matmul's layout, [D, N H] for query_kernel)
    as its module reads it: of the float kernel's shape ([D, N, H]: tfjax.nnx's attention takes
    N and H from it). Reshaped to the matmul's layout it is the stored WithAux again, which
    the provider's matmuls take (as Linen's modules hand it over, reshaped by Qwix's WithAux)."""

    kernel_shape: tuple = flax.struct.field(pytree_node=False, default=())  # one layer's
    matmul_ndim: int = flax.struct.field(pytree_node=False, default=2)

    @property
    def shape(self):
        stored = self.array.qvalue.shape  # [*L, ...]: a scanned stack's layers lead
        return (*stored[: len(stored) - self.matmul_ndim], *self.kernel_shape)

    @property
    def ndim(self):
        return len(self.shape)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if shape != tuple(self.array.qvalue.shape):
            raise ValueError(
                f"a quantized kernel {self.shape} is multiplied as {self.array.qvalue.shape}, "
                f"not {shape}"
            )
        return _ptq.WithAux(self.array, self.how)


class _QuantizedKernel(nnx.Param):
    """A QLoRA kernel's nnx.Param: its value Linen's QLoRA parameter (a WithAux, so the
    model's Param state is the Linen params tree), read by its module (`kernel[...]`) as a
    _KernelView. Float values loaded into it pass, and the matmul refuses them by name."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if not isinstance(value, _ptq.WithAux):
            return value
        meta = self.get_metadata()
        return _KernelView(value.array, value.how, meta["kernel_shape"], meta["matmul_ndim"])


def _quantized(kernel: nnx.Param, want: _Want, how) -> nnx.Param:
    """The float nnx.Param `kernel` quantized as Linen's QLoRA stores it (init_params): a
    WithAux(QArray) in its matmul's layout `want.shape`, each layer of a scanned stack [L, ...]
    on its own. Not placed on a mesh, and without logical axis names (see the module docstring)."""
    value = kernel.get_raw_value()
    lead = tuple(value.shape[: value.ndim - len(want.kernel_shape)])
    if lead:
        layers = value.reshape(-1, *want.shape)
        q = jax.vmap(lambda k: _qarray.quantize(k, how))(layers)
        q = jax.tree.map(lambda x: x.reshape(*lead, *x.shape[1:]), q)
    else:
        q = _qarray.quantize(value.reshape(want.shape), how)
    return _QuantizedKernel(
        _ptq.WithAux(q, how),
        kernel_shape=want.kernel_shape,
        matmul_ndim=len(want.shape),
    )
