"""Transformer blocks and layer stacks.

Letters: B batch, T length, S context length, D model width.

A `Block` (configured by a BlockConfig) is self-attention (+ cross-attention when
`cross_attention`) + FFN (an Mlp, or a MoeMlp for a MoeConfig), each a residual sub-layer with
the norm placed per `norm_position` ("post", "pre" or "sandwich": tfjax.ops.residual).
`Stack` applies `num_layers` blocks of one config, unrolled (params `layers_0`, `layers_1`, ...)
or with `nn.scan` (params `layers`, with a leading layer axis); `unrolled_to_scanned` and
`scanned_to_unrolled` convert the parameters, and both layouts compute the same function.
"""

import re
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tfjax.nn import axes
from tfjax.nn.attention import MultiHeadAttention, default_kernel_init
from tfjax.nn.ffn import make_mlp
from tfjax.nn.linear_attention import GatedDeltaNet
from tfjax.nn.mla import LatentAttention
from tfjax.nn.moe import AUX_LOSSES, MoeMlp
from tfjax.nn.norms import make_norm
from tfjax.ops import residual
from tfjax.ops.cache import KVCache
from tfjax.ops.config import NORM_POSITIONS, BlockConfig, MoeConfig  # noqa: F401 (re-exported)
from tfjax.ops.remat import LAYER_INPUT, REMAT_POLICIES, check_stack  # noqa: F401 (re-exported)


def _norm(module, name: str) -> nn.Module:
    """The config's norm, in the dtypes of `module` (a Block or Stack, whose child it is)."""
    config = module.config
    return make_norm(
        config.norm,
        eps=config.norm_eps,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        name=name,
    )


class Block(nn.Module):
    """One Transformer layer: self-attention, optional cross-attention, FFN (a BlockConfig)."""

    config: BlockConfig  # what it computes
    kernel_init: Callable = default_kernel_init  # every projection's kernel
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    def _scaled(self, y, name):
        """y [B, T, D] times the sub-layer's learned per-channel gamma [D] (with layer_scale)."""
        if self.config.layer_scale is None:
            return y
        gamma = self.param(
            f"{name}_layer_scale",
            nn.with_logical_partitioning(
                nn.initializers.constant(self.config.layer_scale), (axes.EMBED,)
            ),
            (y.shape[-1],),
            self.param_dtype,
        )
        return y * gamma.astype(y.dtype)

    def _residual(self, x, sublayer, name, train):
        """One residual sub-layer with the norm before (pre), after (post) or both (sandwich)."""
        return residual.sublayer(
            x,
            sublayer,
            norm_position=self.config.norm_position,
            norm=lambda y: _norm(self, f"{name}_norm")(y),
            post_norm=lambda y: _norm(self, f"{name}_post_norm")(y),
            scale=lambda y: self._scaled(y, name),
            dropout=lambda y: nn.Dropout(self.config.dropout_rate)(y, deterministic=not train),
        )

    @nn.compact
    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        bias=None,
        context_mask=None,
        segment_ids=None,
        context_segment_ids=None,
        positions=None,
        train: bool = False,
        decode: bool = False,
        variant=None,
        cache: KVCache | None = None,
    ):
        """Args:
          x: [B, T, D].
          context: [B, S, D] encoder output (with cross_attention).
          mask: self-attention mask, boolean, broadcastable to [B, N, T, T].
          bias: self-attention's additive logit bias, broadcastable to [B, N, T, T] (T5's
            relative positions, computed once per stack).
          context_mask: cross-attention mask, broadcastable to [B, N, T, S].
          segment_ids: [B, T] ints for packed or padded rows (see dot_product_attention): the
            attention kernels take them without a [T, S] mask.
          context_segment_ids: [B, S] the context's ids, for cross-attention.
          positions: [B, T] positions for RoPE / ALiBi.
          variant: this layer's index into config.attention.variants (an int or a traced int).
          cache: decode=True: the self-attention's KVCache, in place of the "cache" collection.
        Returns:
          [B, T, D]; with `cache`, ([B, T, D], the updated cache).
        """
        if x.ndim != 3:
            raise ValueError(f"Block: x must be [B, T, D], got shape {x.shape}")
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))
        # The identity, named for the remat policies that save the layer's input by name.
        x = checkpoint_name(x, LAYER_INPUT)
        if self.config.linear_attention is not None:  # Qwen3.5's Gated DeltaNet layers
            attend = self._sublayer(GatedDeltaNet, self.config.linear_attention, "self_attention")
        else:
            attend = self._attention("self_attention", self.config.attention)

        def self_attention(y):
            nonlocal cache
            if self.config.linear_attention is not None:  # its state, not keys, as `cache`
                if decode and cache is None:
                    raise ValueError(
                        "Block: linear attention decodes with the explicit cache (cache=), not "
                        "the 'cache' collection"
                    )
                y, cache = attend(y, segment_ids=segment_ids, cache=cache)
                return y
            y = attend(
                y,
                mask=mask,
                bias=bias,
                segment_ids=segment_ids,
                is_causal=self.config.causal,
                positions=positions,
                train=train,
                decode=decode,
                variant=variant,
                cache=cache,
            )
            if cache is not None:
                y, cache = y
            return y

        x = self._residual(x, self_attention, "self_attention", train)
        if self.config.cross_attention:
            if context is None:
                raise ValueError("Block: cross_attention=True needs the encoder output `context`")
            cross = self._attention("cross_attention", self.config.attention.for_cross_attention())
            x = self._residual(
                x,
                lambda y: cross(
                    y,
                    context,
                    mask=context_mask,
                    segment_ids=segment_ids,
                    context_segment_ids=context_segment_ids,
                    train=train,
                ),
                "cross_attention",
                train,
            )
        ffn = MoeMlp if isinstance(self.config.mlp, MoeConfig) else make_mlp
        mlp = self._sublayer(ffn, self.config.mlp, "mlp")
        x = self._residual(x, lambda y: mlp(y, train=train), "mlp", train)
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))
        return x if cache is None else (x, cache)

    def _attention(self, name, config):
        # DeepSeek's multi-head latent attention (self-attention only)
        kind = LatentAttention if config.latent is not None else MultiHeadAttention
        return self._sublayer(kind, config, name)

    def _sublayer(self, kind, config, name):
        """The sub-layer module `kind` of `config`, named `name`, with the block's kernel init
        and dtypes."""
        return kind(
            config,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )


class Stack(nn.Module):
    """`num_layers` blocks of one config, then a final norm (by default only for pre-norm
    blocks)."""

    config: BlockConfig  # every layer's
    num_layers: int  # L
    scan_layers: bool = False  # nn.scan over layers: compile time flat in depth
    remat_policy: str = "none"  # rematerialisation per layer; see REMAT_POLICIES
    final_norm: bool | None = None  # a norm after the last layer; None: only for pre-norm blocks
    # (and sandwich ones)
    variants: tuple[int, ...] | None = None  # per layer, the index into the config's attention
    # variants (Gemma: local 0, global 1); None when it has one
    kernel_init: Callable = default_kernel_init  # every projection's kernel
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        check_stack(self.num_layers, self.remat_policy, self.variants)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, context=None, *, cache=None, **kwargs):
        """x: [B, T, D] -> [B, T, D]; `context` and the other keyword arguments (Block's: mask,
        bias, context_mask, segment_ids, context_segment_ids, positions, train, decode) go to
        every block.

        cache: decode=True: the layers' KVCaches (a tuple of L, or one with [L, ...] leaves when
        scanned; tfjax.ops.init_cache makes them), in place of the "cache" collection; then the
        call returns ([B, T, D], the updated caches).
        """

        def layer(block, y, variant=None, layer_cache=None):
            out = block(y, context, **kwargs, variant=variant, cache=layer_cache)
            return out if layer_cache is not None else (out, None)

        if self.remat_policy != "none":
            policy = REMAT_POLICIES[self.remat_policy]
            layer = nn.remat(layer, policy=policy, prevent_cse=not self.scan_layers)
        if self.scan_layers:
            x, cache = self._scanned(layer, x, cache)
        else:
            caches = []
            for i in range(self.num_layers):
                v = None if self.variants is None else self.variants[i]
                block = self._block(f"layers_{i}")
                x, layer_cache = layer(block, x, v, None if cache is None else cache[i])
                caches.append(layer_cache)
            cache = None if cache is None else tuple(caches)
        final_norm = self.final_norm
        if final_norm is None:
            final_norm = self.config.norm_position in ("pre", "sandwich")
        if final_norm:
            x = _norm(self, "final_norm")(x)
        return x if cache is None else (x, cache)

    def _block(self, name):
        return Block(self.config, self.kernel_init, self.dtype, self.param_dtype, name=name)

    def _scanned(self, layer, x, cache):
        """The layers by nn.scan: parameters (and the caches) stacked [L, ...]."""
        # Each layer's variant index is a scanned input (a traced int: attention picks its
        # variant by lax.switch), so the parameters stay stacked [L, ...] whatever varies.
        variants = None if self.variants is None else jnp.asarray(self.variants, jnp.int32)
        scanned = nn.scan(
            lambda block, y, xs: layer(block, y, *xs),
            variable_axes={"params": 0, "cache": 0, "intermediates": 0, AUX_LOSSES: 0},
            split_rngs={"params": True, "dropout": True},
            length=self.num_layers,
            metadata_params={nn.PARTITION_NAME: axes.LAYERS},
        )
        return scanned(self._block("layers"), x, (variants, cache))


_LAYER = re.compile(r"^layers_(\d+)$")


def unrolled_to_scanned(params):
    """Stacks every {"layers_0": t0, "layers_1": t1, ...} into {"layers": stack(t0, t1, ...)}."""
    if not isinstance(params, dict):
        return params
    out, layers = {}, {}
    for key, value in params.items():
        m = _LAYER.match(key)
        if m:
            layers[int(m.group(1))] = value
        else:
            out[key] = unrolled_to_scanned(value)
    if layers:
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"layer keys are not 0..n-1: {sorted(layers)}")
        out["layers"] = jax.tree.map(
            lambda *xs: jnp.stack(xs), *(layers[i] for i in range(len(layers)))
        )
    return out


def scanned_path(path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """A parameter's path in the unrolled layout -> (its path once stacked, its layer), the
    mapping `unrolled_to_scanned` applies to a whole tree ("layers_3" -> "layers", 3); layer
    None for a parameter outside the stack."""
    for i, key in enumerate(path):
        m = _LAYER.match(key)
        if m:
            return (*path[:i], "layers", *path[i + 1 :]), int(m.group(1))
    return path, None


def scanned_to_unrolled(params):
    """The inverse of `unrolled_to_scanned`: {"layers": stacked} -> {"layers_i": slice i}."""
    if not isinstance(params, dict):
        return params
    out = {}
    for key, value in params.items():
        if key == "layers":
            n = jax.tree.leaves(value)[0].shape[0]
            for i in range(n):
                out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], value)
        else:
            out[key] = scanned_to_unrolled(value)
    return out
