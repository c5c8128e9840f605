"""Transformer blocks and layer stacks.

Letters: B batch, T length, S context length, D model width.

A `Block` is self-attention (+ cross-attention when `cross_attention`) + FFN, each a residual
sub-layer with the norm placed per `norm_position`:
  "post": x = LN(x + Dropout(F(x)))      Vaswani et al. (2017), BERT
  "pre":  x = x + Dropout(F(LN(x)))      GPT-2, ViT, Llama (the stack adds a final norm)
  "sandwich": x = x + Dropout(LN'(F(LN(x))))  Gemma 2 / 3: a norm before and after (as "pre")
`Stack` applies `num_layers` copies of a block, unrolled (params `layers_0`, `layers_1`, ...)
or with `nn.scan` (params `layers`, with a leading layer axis); `unrolled_to_scanned` and
`scanned_to_unrolled` convert the parameters, and both layouts compute the same function.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tfjax.nn import axes
from tfjax.nn.attention import LayerAttention, MultiHeadAttention
from tfjax.nn.attention import default_kernel_init as _attention_init
from tfjax.nn.ffn import ALL_ACTIVATIONS, make_mlp
from tfjax.nn.norms import NORMS, make_norm
from tfjax.nn.position import RopeScaling

NORM_POSITIONS = ("pre", "post", "sandwich")
LAYER_INPUT = "layer_input"  # checkpoint_name of each block's input, the residual stream
# What the backward pass of each layer finds saved from its forward pass; everything else is
# recomputed from the layer's input. The "offload_" policies move what they save from the
# accelerator's memory to the host's (pinned) memory during the forward pass and back during
# the backward pass (TPU and GPU; the host link carries those bytes twice per step). On the CPU
# backend JAX lowers those transfers as nothing, and that is kept, not refused: there the
# device memory is the host memory, so what offloading promises already holds, and an offload
# policy runs as its twin ("offload_dots_no_batch" as "dots_no_batch", "offload_layer_inputs"
# as "full") with the same numbers, so a TPU config's CPU smoke run works unchanged.
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep x @ W
    # x @ W outputs (the projections; not attention's scores) go to host memory instead
    "offload_dots_no_batch": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"
    ),
    # recompute the whole block, as "full", from its input kept in host memory
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


class Block(nn.Module):
    """One Transformer layer: self-attention, optional cross-attention, FFN."""

    num_heads: int  # N
    mlp_dim: int  # F
    num_kv_heads: int | None = None  # K; num_heads when None (grouped-query when smaller)
    head_dim: int | None = None  # H; width // num_heads when None
    activation: str = "relu"  # FFN: "relu", "gelu", "gelu_tanh", "quick_gelu", "swiglu", "geglu"
    norm: str = "layer"  # "layer" (LayerNorm), "rms" (RMSNorm) or "rms_plus_one" (Gemma's)
    norm_eps: float = 1e-6  # norm epsilon (BERT 1e-12, GPT-2 1e-5)
    norm_position: str = "pre"  # "pre" (x + F(LN(x))), "post" (LN(x + F(x)), the paper) or
    # "sandwich" (x + LN'(F(LN(x))), Gemma)
    causal: bool = False  # self-attention sees only earlier positions (decoders)
    cross_attention: bool = False  # attend to an encoder's output (encoder-decoder)
    dropout_rate: float = 0.0  # residual dropout on each sub-layer's output (paper: 0.1)
    attention_dropout_rate: float = 0.0  # dropout on the attention weights
    mlp_dropout_rate: float = 0.0  # dropout on the FFN's hidden activations
    use_bias: bool = True  # biases in attention and FFN projections
    qkv_bias: bool | None = None  # biases on Q, K, V only (Qwen 2); use_bias when None
    qk_norm: bool = False  # RMSNorm of each query and key head (Qwen 3)
    position: str | None = None  # None, "rope" or "alibi" in self-attention
    rope_base: float = 10_000.0  # RoPE wavelength base
    rope_scaling: RopeScaling | None = None  # RoPE past the training length (Llama 3.1)
    sliding_window: int | None = None  # self-attention sees only the last this many positions
    attention_variants: tuple[LayerAttention, ...] = ()  # per-layer alternatives of
    # (sliding_window, rope_base, rope_scaling), picked by the call's `variant`; () for none
    attention_scale: float | None = None  # attention logit scale; head_dim**-0.5 when None
    attention_softcap: float | None = None  # attention logits -> c * tanh(logits / c) (Gemma 2)
    layer_scale: float | None = None  # init of a learned [D] gamma multiplying each sub-layer's
    # output before the residual add (CaiT, DINOv2); none when None
    implementation: str | None = None  # attention backend; see dot_product_attention
    kernel_init: Callable = _attention_init  # every projection's kernel
    dtype: Any = None  # compute dtype; the input's when None
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        for field, value, allowed in (
            ("norm", self.norm, NORMS),
            ("norm_position", self.norm_position, NORM_POSITIONS),
            ("activation", self.activation, ALL_ACTIVATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{field}={value!r} is unknown; allowed: {allowed}")
        super().__post_init__()

    def _norm(self, name):
        return make_norm(
            self.norm, eps=self.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )

    def _attention(self, name, position, sliding_window=None, variants=()):
        return MultiHeadAttention(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            use_bias=self.use_bias,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            qk_norm_kind="rms_plus_one" if self.norm == "rms_plus_one" else "rms",
            norm_eps=self.norm_eps,
            dropout_rate=self.attention_dropout_rate,
            position=position,
            rope_base=self.rope_base,
            rope_scaling=self.rope_scaling,
            sliding_window=sliding_window,
            variants=variants,
            scale=self.attention_scale,
            softcap=self.attention_softcap,
            implementation=self.implementation,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _scaled(self, y, name):
        """y [B, T, D] times the sub-layer's learned per-channel gamma [D] (with layer_scale)."""
        if self.layer_scale is None:
            return y
        gamma = self.param(
            f"{name}_layer_scale",
            nn.with_logical_partitioning(nn.initializers.constant(self.layer_scale), (axes.EMBED,)),
            (y.shape[-1],),
            self.param_dtype,
        )
        return y * gamma.astype(y.dtype)

    def _residual(self, x, sublayer, name, train):
        """One residual sub-layer with the norm before (pre), after (post) or both (sandwich)."""
        if self.norm_position in ("pre", "sandwich"):
            y = sublayer(self._norm(f"{name}_norm")(x))
            if self.norm_position == "sandwich":
                y = self._norm(f"{name}_post_norm")(y)
            y = self._scaled(y, name)
            return x + nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.Dropout(self.dropout_rate)(self._scaled(sublayer(x), name), deterministic=not train)
        return self._norm(f"{name}_norm")(x + y)

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
          variant: this layer's index into attention_variants (an int or a traced int).
        Returns:
          [B, T, D].
        """
        if x.ndim != 3:
            raise ValueError(f"Block: x must be [B, T, D], got shape {x.shape}")
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))
        # The identity, named for the remat policies that save the layer's input by name.
        x = checkpoint_name(x, LAYER_INPUT)
        attend = self._attention(
            "self_attention", self.position, self.sliding_window, self.attention_variants
        )
        x = self._residual(
            x,
            lambda y: attend(
                y,
                mask=mask,
                bias=bias,
                segment_ids=segment_ids,
                is_causal=self.causal,
                positions=positions,
                train=train,
                decode=decode,
                variant=variant,
            ),
            "self_attention",
            train,
        )
        if self.cross_attention:
            if context is None:
                raise ValueError("Block: cross_attention=True needs the encoder output `context`")
            cross = self._attention("cross_attention", None)
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
        mlp = make_mlp(
            self.activation,
            mlp_dim=self.mlp_dim,
            dropout_rate=self.mlp_dropout_rate,
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="mlp",
        )
        x = self._residual(x, lambda y: mlp(y, train=train), "mlp", train)
        return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))


def _fields(module: nn.Module) -> dict:
    """A module's dataclass fields, without Flax's parent and name."""
    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.init and f.name not in ("parent", "name")
    }


class Stack(nn.Module):
    """`num_layers` blocks of one kind, then a final norm (by default only for pre-norm blocks)."""

    num_layers: int  # L
    block: Block  # the template of every layer (its name is ignored)
    scan_layers: bool = False  # nn.scan over layers: compile time flat in depth
    remat_policy: str = "none"  # rematerialisation per layer; see REMAT_POLICIES
    final_norm: bool | None = None  # a norm after the last layer; None: only for pre-norm blocks
    # (and sandwich ones)
    variants: tuple[int, ...] | None = None  # per layer, the index into the block's
    # attention_variants (Gemma: local 0, global 1); None when the block has none

    def __post_init__(self):
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r} is unknown; allowed: {tuple(REMAT_POLICIES)}"
            )
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {self.num_layers}")
        if self.variants is not None and len(self.variants) != self.num_layers:
            raise ValueError(
                f"variants has {len(self.variants)} entries; it needs one per layer "
                f"(num_layers={self.num_layers})"
            )
        super().__post_init__()

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
    ):
        """x: [B, T, D] -> [B, T, D]; the other arguments are passed to every block."""

        def layer(block, y, variant=None):
            return block(
                y,
                context,
                mask=mask,
                bias=bias,
                context_mask=context_mask,
                segment_ids=segment_ids,
                context_segment_ids=context_segment_ids,
                positions=positions,
                train=train,
                decode=decode,
                variant=variant,
            )

        policy = REMAT_POLICIES[self.remat_policy]
        if self.remat_policy != "none":
            layer = nn.remat(layer, policy=policy, prevent_cse=not self.scan_layers)
        kwargs = _fields(self.block)
        if self.scan_layers:
            # Each layer's variant index is a scanned input (a traced int: attention picks its
            # variant by lax.switch), so the parameters stay stacked [L, ...] whatever varies.
            variants = None if self.variants is None else jnp.asarray(self.variants, jnp.int32)
            scanned = nn.scan(
                lambda block, y, v: (layer(block, y, v), None),
                variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.num_layers,
                metadata_params={nn.PARTITION_NAME: axes.LAYERS},
            )
            x, _ = scanned(Block(**kwargs, name="layers"), x, variants)
        else:
            for i in range(self.num_layers):
                v = None if self.variants is None else self.variants[i]
                x = layer(Block(**kwargs, name=f"layers_{i}"), x, v)
        final_norm = self.final_norm
        if final_norm is None:
            final_norm = self.block.norm_position in ("pre", "sandwich")
        if final_norm:
            b = self.block
            x = make_norm(
                b.norm, eps=b.norm_eps, dtype=b.dtype, param_dtype=b.param_dtype, name="final_norm"
            )(x)
        return x


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
