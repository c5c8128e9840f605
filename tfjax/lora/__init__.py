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
provider, tfjax.lora.nnx_provider):

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

A mixture of experts (tfjax.nn.moe): its attention, its router (mlp/router/kernel), its
dense layers' MLPs (first_dense_layers) and its shared experts' (mlp/shared) are kernels like the
others; by default its attention, dense and shared MLPs are adapted. Latent attention
(DeepSeek, tfjax.ops.mla): query_down (or query), query_up, kv_down, key_up, value_up and out
by default. Its experts' stacked kernels [E, D, F] are multiplied by a grouped
matmul (tfjax.ops.moe.grouped_matmul: XLA's ragged_dot, Megablox or Tokamax), which Qwix 0.1.8's
LoRA does not intercept (its LoraProvider takes einsum, dot_general and conv; only its
quantized-training provider takes jax.lax.ragged_dot, and none a Pallas kernel): a target that
matches one is refused by name at init, rather than left without adapters.

With `base_dtype` ("int8" or "nf4") the targeted kernels are stored quantized (QLoRA):
`init_params` quantizes the float base once (an NNX model's `apply_lora` quantizes the kernels
it holds, as init_params would), and the model dequantizes them in its matmuls.
A quantized kernel is stored in the matmul's layout (query_kernel as [D, N H]) as a Qwix
`WithAux(QArray(qvalue, scale))` with logical names; train the adapters on it, and `merge` them
into the float base dequantized (`dequantized`): the kernels the adapters were trained on.
Each output channel's inputs (the matmul's contracting axis: D of query_kernel, N H of
out_kernel) are scaled in blocks of `tile_size` (Qwix's tile_size: one absmax scale per
block), by default base_dtype's own: nf4 in QLoRA's blocks of 64 (NF4_TILE_SIZE), int8 with
one scale per output channel (tile_size 0); a kernel whose inputs do not split into whole
blocks is refused by name (`check_tile_size` checks them all before any work).

The package: `config` (LoraConfig, QLoRA's checks), `adapters` (splitting, combining and merging
the params), `linen_provider` (the Qwix provider, apply_lora and init_params of a Linen model; its
docstring says what tfjax's provider fixes in Qwix's) and `nnx_provider` (an NNX model's).
"""

import flax.linen as _nn
from flax import nnx as _flax_nnx

from tfjax.lora.adapters import adapter_mask, combine, dequantized, is_adapter, merge, split
from tfjax.lora.config import (
    ADAPTER_SUFFIXES,
    BASE_DTYPES,
    DEFAULT_TARGETS,
    NF4_TILE_SIZE,
    LoraConfig,
    check_quantization_kept,
    check_tile_size,
)
from tfjax.lora.linen_provider import apply_lora_linen, init_params
from tfjax.lora.nnx_provider import apply_lora_nnx

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
    the paths from `model`. Training, merging and exporting: tfjax.lora.nnx_provider's docstring.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"apply_lora takes a LoraConfig, got {type(config).__name__}")
    if isinstance(model, _flax_nnx.Module):
        return apply_lora_nnx(model, config, example_args, example_kwargs, rngs)
    if not isinstance(model, _nn.Module):
        raise TypeError(
            f"apply_lora takes a flax.linen or flax.nnx Module, got {type(model).__name__}"
        )
    if example_args or example_kwargs or rngs is not None:
        raise TypeError(
            "apply_lora: example inputs and rngs are for an NNX model; a Linen model's adapters "
            "are made by lora.init_params"
        )
    return apply_lora_linen(model, config)
