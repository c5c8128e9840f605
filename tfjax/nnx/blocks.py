"""Flax NNX building blocks (attention, FFNs and mixtures of experts, norms, embeddings,
positions, Block, Stack): thin shells over tfjax.ops' maths, configured by the same config
objects as tfjax.nn's Linen modules (AttentionConfig, MlpConfig, BlockConfig), with the same
parameter names, shapes, dtypes and logical axis names.

Letters: B batch, T length, S key/value length, N query heads, K key/value heads, H head dim,
D model width, F mlp width, V vocab, L layers.

One parameter layout: `nnx.to_pure_dict(nnx.state(module, nnx.Param))` is the Linen
module's `params` tree, so a Linen checkpoint loads into these modules and back. Each parameter's
logical axis names are its `out_sharding` metadata (`nnx.get_partition_spec`), the names the
Linen module gives `nn.get_partition_spec`. A parameter is placed on the mesh as it is created
only when a mesh is in context (`jax.set_mesh`, with the rules of `nn.logical_axis_rules`
mapping the names onto it), where the same rules put the Linen model's (`place`); without one
the names stay metadata, and creation needs no context manager.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tfjax.nnx.linear_attention import GatedDeltaNet
from tfjax.nnx.mla import LatentAttention
from tfjax.nnx.params import metadata, param, place  # noqa: F401 (re-exported)
from tfjax.ops import axes, embed, moe, multihead, residual
from tfjax.ops.cache import KVCache, write
from tfjax.ops.config import (
    AttentionConfig,
    BlockConfig,
    MlpConfig,
    MoeConfig,
    default_kernel_init,  # noqa: F401 (re-exported)
)
from tfjax.ops.linear_attention import gate_output
from tfjax.ops.moe import EXPERTS, expert_names, expert_sharding, stacked_init
from tfjax.ops.norms import NORMS, rms_norm_plus_one
from tfjax.ops.position import relative_position_bias
from tfjax.ops.remat import LAYER_INPUT, REMAT_POLICIES, check_stack


class AuxLoss(nnx.Variable):
    """The auxiliary losses a layer sows in a call (a router's), Linen's AUX_LOSSES collection:
    `nnx.to_pure_dict(nnx.pop(model, AuxLoss))` has that collection's tree (per layer, named
    scalars), which tfjax.runner.steps.with_aux_losses adds to the loss."""


def sow(module: nnx.Module, name: str, value) -> None:
    """Module.sow's AuxLoss: `value` kept as module's AuxLoss `name`, as the tuple (value,) that
    Linen's sow keeps. A call replaces the last call's value (a Linen apply starts its collection
    empty), so a model called twice without popping holds one call's losses, not two. Set
    directly: flax 0.12's Module.sow warns (deprecated) outside nnx.capture, and capture cannot
    see the blocks a scanned Stack merges inside its scan."""
    setattr(module, name, AuxLoss((value,)))


def _placed(module, names: dict):
    """`module` (an nnx.Linear or norm) with its parameters (attribute -> logical names)
    placed as `place` says."""
    for attr, n in names.items():
        variable = getattr(module, attr, None)
        if variable is not None:
            variable.set_value(place(variable.get_value(), n))
    return module


def dense(
    in_features,
    out_features,
    names,
    *,
    use_bias,
    kernel_init,
    dtype,
    param_dtype,
    rngs,
    dot_general=jax.lax.dot_general,
):
    """nnx.Linear (Linen's nn.Dense) whose kernel [in, out] and bias [out] carry `names`."""
    linear = nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        kernel_init=kernel_init,
        bias_init=nn.initializers.zeros,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_metadata=metadata(names),
        bias_metadata=metadata(names[1:]),
        dot_general=dot_general,
        rngs=rngs,
    )
    return _placed(linear, {"kernel": names, "bias": names[1:]})


class RMSNormPlusOne(nnx.Module):
    """`rms_norm_plus_one` with its offsets w as the parameter "scale" [D] (zeros at init)."""

    def __init__(
        self, width, *, epsilon=1e-6, dtype=None, param_dtype=jnp.float32, axis_name, rngs
    ):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = param(rngs, nn.initializers.zeros, (width,), param_dtype, (axis_name,))

    def __call__(self, x):
        """x: [.., D] -> [.., D]."""
        return rms_norm_plus_one(x.astype(self.dtype or x.dtype), self.scale[...], eps=self.epsilon)


def make_norm(kind: str, width: int, *, eps, dtype, param_dtype, rngs, axis_name=axes.NORM):
    """tfjax.nn.make_norm's norms in NNX: LayerNorm (scale and bias), RMSNorm (scale) or
    RMSNorm with (1 + scale) over the last axis [.., D] of `width`."""
    meta = metadata((axis_name,))
    common = dict(epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    names = {"scale": (axis_name,), "bias": (axis_name,)}
    if kind == "layer":
        norm = nnx.LayerNorm(width, scale_metadata=meta, bias_metadata=meta, **common)
        return _placed(norm, names)
    if kind == "rms":
        return _placed(nnx.RMSNorm(width, scale_metadata=meta, **common), names)
    if kind == "rms_plus_one":
        return RMSNormPlusOne(width, axis_name=axis_name, **common)
    raise ValueError(f"norm={kind!r} is unknown; allowed: {NORMS}")


class Attention(nnx.Module):
    """tfjax.nn.MultiHeadAttention in NNX: grouped-query self-attention (cross-attention with
    `context`), RoPE, windows, per-layer variants, soft caps and sinks as its AttentionConfig
    says, and the explicit KV cache (`cache=`, a tfjax.ops.KVCache) for decoding."""

    def __init__(
        self,
        config: AttentionConfig,
        width: int,  # D of the queries' input
        *,
        context_width: int | None = None,  # D' of the keys' and values' input; width when None
        kernel_init: Callable = default_kernel_init,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if config.head_dim is None and width % config.num_heads:
            raise ValueError(
                f"num_heads={config.num_heads} must divide the width {width} (or set head_dim)"
            )
        self.config, self.dtype = config, dtype
        n, kh, h = config.num_heads, config.kv_heads, config.head_width(width)
        d_kv = context_width or width
        out_features = config.out_features or width

        def kernel(shape, names):
            return param(rngs, kernel_init, shape, param_dtype, names)

        def bias(shape, names):
            return param(rngs, nn.initializers.zeros, shape, param_dtype, names)

        self.query_kernel = kernel((width, n, h), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.key_kernel = kernel((d_kv, kh, h), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.value_kernel = kernel((d_kv, kh, h), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.out_kernel = kernel((n, h, out_features), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        if config.output_gate:  # Qwen3.5: the output times sigmoid(x gate_kernel)
            self.gate_kernel = kernel((width, n, h), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        qkv_bias = config.use_bias if config.qkv_bias is None else config.qkv_bias
        if qkv_bias:
            self.query_bias = bias((n, h), (axes.HEADS, axes.HEAD_DIM))
            if config.output_gate:
                self.gate_bias = bias((n, h), (axes.HEADS, axes.HEAD_DIM))
            self.key_bias = bias((kh, h), (axes.KV_HEADS, axes.HEAD_DIM))
            self.value_bias = bias((kh, h), (axes.KV_HEADS, axes.HEAD_DIM))
        if config.use_bias:
            self.out_bias = bias((out_features,), (axes.EMBED,))
        if config.qk_norm:
            norm = dict(eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            kind, names = config.qk_norm_kind, axes.HEAD_DIM
            self.query_norm = make_norm(kind, h, axis_name=names, **norm)
            self.key_norm = make_norm(kind, h, axis_name=names, **norm)
        if config.sinks:
            self.sinks = bias((n,), (axes.HEADS,))

    def _bias(self, name):
        b = getattr(self, name, None)
        return None if b is None else b[...]

    def _project(self, name, x):
        """[B, T, D] -> [B, T, heads, H] by the `{name}_kernel` [D, heads, H] (and bias)."""
        kernel = getattr(self, f"{name}_kernel")[...]
        _, heads, head_dim = kernel.shape
        x, kernel = nnx.nn.dtypes.promote_dtype((x, kernel), dtype=self.dtype)
        return multihead.project(x, kernel, heads, head_dim, self._bias(f"{name}_bias"))

    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        bias=None,
        segment_ids=None,
        context_segment_ids=None,
        is_causal: bool = False,
        positions=None,
        dropout_rng=None,
        variant=None,
        cache: KVCache | None = None,
    ):
        """tfjax.nn.MultiHeadAttention's call (its arguments; `dropout_rng`, a key, in place of
        train=True and the "dropout" stream; no "cache" collection: decoding passes `cache`).

        Returns [B, T, D]; with `cache`, ([B, T, D], the updated cache).
        """
        self_attention = context is None
        context = x if self_attention else context
        if cache is not None and not self_attention:
            raise ValueError("Attention: a cache is for self-attention")
        multihead.check_variant(self.config, variant)
        offset = cache.index if cache is not None else 0
        if positions is None:
            positions = offset + jnp.arange(x.shape[1])
        # [B, T, N, H], [B, S, K, H]
        q, k, v = (
            self._project(n, y) for n, y in (("query", x), ("key", context), ("value", context))
        )
        q = nn.with_logical_constraint(q, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        if self.config.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        q, k, segment_ids, kv_segment_ids = multihead.prepare(
            q, k, self.config, self_attention, positions, variant, segment_ids, context_segment_ids
        )
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("Attention: decoding takes a mask, not segment_ids")
            cache = write(cache, k, v)
            k, v = cache.keys, cache.values
        rate = self.config.dropout_rate if dropout_rng is not None else 0.0
        out, _ = multihead.attend(
            q,
            k,
            v,
            self.config,
            positions=positions,
            self_attention=self_attention,
            decode_offset=offset if cache is not None else None,
            variant=variant,
            dropout_rate=rate,
            dropout_rng=dropout_rng if rate > 0.0 else None,
            sharding=axes.attention_sharding(),
            mask=mask,
            bias=bias,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            is_causal=is_causal,
            sinks=self.sinks[...] if self.config.sinks else None,
        )
        if self.config.output_gate:
            out = gate_output(out, self._project("gate", x))
        kernel = self.out_kernel[...]
        out, kernel = nnx.nn.dtypes.promote_dtype((out, kernel), dtype=self.dtype)
        # [B, T, D]
        out = multihead.project_out(out, kernel, kernel.shape[-1], self._bias("out_bias"))
        return out if cache is None else (out, cache)


class Mlp(nnx.Module):
    """tfjax.nn.Mlp / GatedMlp in NNX (by the config's activation): wo(act(wi(x))) or
    wo(act(wi_0(x), wi_1(x)))."""

    def __init__(
        self,
        config: MlpConfig,
        width: int,
        *,
        kernel_init=default_kernel_init,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config = config
        f = config.hidden_dim
        kw = dict(
            use_bias=config.use_bias,
            kernel_init=kernel_init,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        up = (axes.EMBED, axes.MLP)
        if config.gated:
            self.wi_0, self.wi_1 = dense(width, f, up, **kw), dense(width, f, up, **kw)
        else:
            self.wi = dense(width, f, up, **kw)
        self.wo = dense(f, width, (axes.MLP, axes.EMBED), **kw)

    def __call__(self, x, *, dropout_rng=None):
        """x: [B, T, D] -> [B, T, D]."""
        act = self.config.activation_fn()
        # [B, T, F]
        h = act(self.wi_0(x), self.wi_1(x)) if self.config.gated else act(self.wi(x))
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        h = dropout(h, self.config.dropout_rate, dropout_rng)
        # [B, T, D]
        return self.wo(h)


class Experts(nnx.Module):
    """tfjax.nn.moe.Experts in NNX: E expert MLPs, stacked ([E, ...] kernels "wi_0", "wi_1" or
    "wi", and "wo"; with use_bias "<name>_bias"), applied by tfjax.ops.moe's dropless dispatch."""

    def __init__(
        self,
        config: MoeConfig,
        width: int,
        *,
        kernel_init=default_kernel_init,
        param_dtype=jnp.float32,
        dtype=None,
        rngs: nnx.Rngs,
    ):
        c, self.config, self.dtype = config, config, dtype
        names = expert_names(c)  # not kept: a dict attribute is unhashable in NNX's graph def
        self.kernels = ("wi_0", "wi_1") if c.gated else ("wi",)
        shapes = {name: (c.num_experts, width, c.hidden_dim) for name in self.kernels}
        shapes["wo"] = (c.num_experts, c.hidden_dim, width)
        self.kernels += ("wo",)
        for name, shape in shapes.items():
            init = stacked_init(kernel_init)
            setattr(self, name, param(rngs, init, shape, param_dtype, names[name]))
            if c.use_bias:
                bias = f"{name}_bias"
                zeros = nn.initializers.zeros
                shape = (c.num_experts, shape[-1])
                setattr(self, bias, param(rngs, zeros, shape, param_dtype, names[bias]))

    def __call__(self, x, weights, experts):
        """x [N, D], weights [N, k], experts [N, k] -> [N, D]."""
        c = self.config
        kernels = {name: getattr(self, name)[...] for name in self.kernels}
        biases = None
        if c.use_bias:
            biases = {name: getattr(self, f"{name}_bias")[...] for name in self.kernels}
        return moe.sharded_experts_ffn(
            x.astype(self.dtype or x.dtype),
            weights,
            experts,
            kernels,
            biases,
            activation=c.activation_fn(),
            num_experts=c.num_experts,
            weigh_inputs=c.weigh_inputs,
            sharding=expert_sharding(expert_names(c)),
        )


class MoeMlp(nnx.Module):
    """tfjax.nn.MoeMlp in NNX: router, experts (dropless), optional shared experts. Each call
    sows the router's losses ("load_balance", "router_z" and their weighted sum "loss", names
    of Linen's AUX_LOSSES collection) as AuxLoss variables (`sow`)."""

    def __init__(
        self,
        config: MoeConfig,
        width: int,
        *,
        kernel_init=default_kernel_init,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        c, self.config, self.dtype = config, config, dtype
        kw = dict(kernel_init=kernel_init, param_dtype=param_dtype, rngs=rngs)
        # Computed in float32 or wider: the call casts its input up (see __call__).
        self.router = dense(
            width, c.num_experts, (axes.EMBED, None), use_bias=c.router_bias, dtype=None, **kw
        )
        if c.score_bias:  # float32 as Linen's; not trained (route stops its gradient)
            shape, zeros = (c.num_experts,), nn.initializers.zeros
            self.router_score_bias = param(rngs, zeros, shape, jnp.float32, (axes.ROUTER,))
        # The attribute is named as Linen's module (EXPERTS), which active_parameters reads.
        setattr(self, EXPERTS, Experts(c, width, dtype=dtype, **kw))
        if c.shared_dim:
            self.shared = Mlp(c.shared(), width, dtype=dtype, **kw)
            if c.shared_gate:
                self.shared_gate = dense(
                    width, 1, (axes.EMBED, None), use_bias=False, dtype=dtype, **kw
                )

    def __call__(self, x, *, dropout_rng=None):
        """x: [B, T, D] -> [B, T, D]; dropout_rng: the shared experts' (a key when training)."""
        c = self.config
        b, t, d = x.shape
        # [N, D]
        tokens = x.reshape(b * t, d)
        # The router in float32 or wider (ST-MoE's selective precision), as Linen's; [N, E]
        router_dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        logits = self.router(tokens.astype(router_dtype))
        score_bias = self.router_score_bias[...] if c.score_bias else None
        weights, experts, scores = moe.route(
            logits, c.top_k, score_bias=score_bias, **c.route_options()
        )
        for name, value in moe.aux_losses(logits, scores, experts, c).items():
            sow(self, name, value)
        y = getattr(self, EXPERTS)(tokens, weights, experts).reshape(b, t, d)
        if c.shared_dim:
            s = self.shared(x, dropout_rng=dropout_rng)
            if c.shared_gate:
                s = jax.nn.sigmoid(self.shared_gate(x)) * s
            y = y + s.astype(y.dtype)
        return y


def make_mlp(config, width, **kwargs):
    """The FFN of a BlockConfig's `mlp`: MoeMlp for a MoeConfig, else Mlp."""
    return (MoeMlp if isinstance(config, MoeConfig) else Mlp)(config, width, **kwargs)


def dropout(x, rate, key):
    """nnx.Dropout of `rate` with `key`; the identity when key is None (not training). Keys
    are passed down explicitly (folded per layer and site), so a scanned stack needs no RNG
    state inside its scan."""
    return nnx.Dropout(rate)(x, deterministic=key is None, rngs=key)


def fold_key(key, i):
    """The i-th key drawn from `key` (None: not training)."""
    return None if key is None else jax.random.fold_in(key, i)


class Block(nnx.Module):
    """tfjax.nn.Block in NNX: self-attention, cross-attention (config.cross_attention), FFN (an
    Mlp, or a MoeMlp for a MoeConfig), each a residual sub-layer (tfjax.ops.residual), from a
    BlockConfig."""

    def __init__(
        self,
        config: BlockConfig,
        width: int,
        *,
        context_width: int | None = None,  # D' of the encoder output (cross-attention); width
        kernel_init=default_kernel_init,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config = config
        kw = dict(kernel_init=kernel_init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=config.norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.linear_attention is not None:  # Qwen3.5's Gated DeltaNet layers
            self.self_attention = GatedDeltaNet(config.linear_attention, width, **kw)
        else:  # latent: DeepSeek's multi-head latent attention
            latent = config.attention.latent is not None
            kind = LatentAttention if latent else Attention
            self.self_attention = kind(config.attention, width, **kw)
        sublayers = ["self_attention", "mlp"]
        if config.cross_attention:
            cross = config.attention.for_cross_attention()
            self.cross_attention = Attention(cross, width, context_width=context_width, **kw)
            sublayers.append("cross_attention")
        self.mlp = make_mlp(config.mlp, width, **kw)
        for name in sublayers:
            setattr(self, f"{name}_norm", make_norm(config.norm, width, **norm))
            if config.norm_position == "sandwich":
                setattr(self, f"{name}_post_norm", make_norm(config.norm, width, **norm))
            if config.layer_scale is not None:
                init = nn.initializers.constant(config.layer_scale)
                setattr(
                    self,
                    f"{name}_layer_scale",
                    param(rngs, init, (width,), param_dtype, (axes.EMBED,)),
                )

    def _residual(self, x, f, name, key):
        scale = getattr(self, f"{name}_layer_scale", None)
        return residual.sublayer(
            x,
            f,
            norm_position=self.config.norm_position,
            norm=getattr(self, f"{name}_norm"),
            post_norm=getattr(self, f"{name}_post_norm", None),
            scale=None if scale is None else (lambda y: y * scale[...].astype(y.dtype)),
            dropout=lambda y: dropout(y, self.config.dropout_rate, key),
        )

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
        dropout_rng=None,
        variant=None,
        cache: KVCache | None = None,
    ):
        """tfjax.nn.Block's call (its arguments; `dropout_rng`, a key, in place of train=True).
        Returns [B, T, D]; with `cache`, ([B, T, D], the updated cache)."""
        if x.ndim != 3:
            raise ValueError(f"Block: x must be [B, T, D], got shape {x.shape}")
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))
        # The identity, named for the remat policies that save the layer's input by name.
        x = checkpoint_name(x, LAYER_INPUT)

        def self_attention(y):
            nonlocal cache
            if self.config.linear_attention is not None:  # its state, not keys, as `cache`
                y, cache = self.self_attention(y, segment_ids=segment_ids, cache=cache)
                return y
            y = self.self_attention(
                y,
                mask=mask,
                bias=bias,
                segment_ids=segment_ids,
                is_causal=self.config.causal,
                positions=positions,
                dropout_rng=fold_key(dropout_rng, 0),
                variant=variant,
                cache=cache,
            )
            if cache is not None:
                y, cache = y
            return y

        x = self._residual(x, self_attention, "self_attention", fold_key(dropout_rng, 1))
        if self.config.cross_attention:
            if context is None:
                raise ValueError("Block: cross_attention=True needs the encoder output `context`")
            x = self._residual(
                x,
                lambda y: self.cross_attention(
                    y,
                    context,
                    mask=context_mask,
                    segment_ids=segment_ids,
                    context_segment_ids=context_segment_ids,
                    dropout_rng=fold_key(dropout_rng, 4),
                ),
                "cross_attention",
                fold_key(dropout_rng, 5),
            )
        x = self._residual(
            x,
            lambda y: self.mlp(y, dropout_rng=fold_key(dropout_rng, 2)),
            "mlp",
            fold_key(dropout_rng, 3),
        )
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))
        return x if cache is None else (x, cache)


class Stack(nnx.Module):
    """tfjax.nn.Stack in NNX: `num_layers` blocks of one config, then a final norm (by default
    only for pre-norm and sandwich blocks).

    Unrolled, the blocks are attributes `layers_0`, `layers_1`, ...; scanned (scan_layers), one
    block `layers` whose parameters are stacked [L, ...] (created by nnx.vmap, their logical
    names led by "layers", as Linen's nn.scan names them), applied by `jax.lax.scan` over the
    split state: the parameters are the scan's inputs, never its carry, so no layer's copy of
    them is made, and no Python closure holds traced state.
    """

    def __init__(
        self,
        config: BlockConfig,
        num_layers: int,
        width: int,
        *,
        scan_layers: bool = False,
        remat_policy: str = "none",
        final_norm: bool | None = None,
        variants: tuple[int, ...] | None = None,
        context_width: int | None = None,
        kernel_init: Callable = default_kernel_init,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_stack(num_layers, remat_policy, variants)
        self.num_layers, self.scan_layers, self.remat_policy = num_layers, scan_layers, remat_policy
        self.variants = variants

        def block(rngs):
            return Block(
                config,
                width,
                context_width=context_width,
                kernel_init=kernel_init,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

        if scan_layers:
            make = nnx.vmap(
                block, in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS}
            )
            self.layers = nnx.split_rngs(splits=num_layers)(make)(rngs)
        else:
            for i in range(num_layers):
                setattr(self, f"layers_{i}", block(rngs))
        if final_norm is None:
            final_norm = config.norm_position in ("pre", "sandwich")
        if final_norm:
            self.final_norm = make_norm(
                config.norm,
                width,
                eps=config.norm_eps,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

    def __call__(self, x, context=None, *, cache=None, dropout_rng=None, **kwargs):
        """x: [B, T, D] -> [B, T, D]; `context` and the keyword arguments (Block's: mask, bias,
        context_mask, segment_ids, context_segment_ids, positions) go to every block;
        dropout_rng: a key when training (one per layer is folded from it).

        cache: the layers' KVCaches (a tuple of L, or one with [L, ...] leaves when scanned;
        tfjax.ops.init_cache makes them); then the call returns ([B, T, D], the caches).

        The layers' sown AuxLoss values come out of each layer's call (as the scan's stacked
        outputs when scanned: [L] per loss, Linen's nn.scan layout) and are put back on the
        layers, where `nnx.pop(model, AuxLoss)` finds them.
        """

        def layer(state, graphdef, y, variant, key, layer_cache):
            block = nnx.merge(graphdef, state)
            out = block(y, context, **kwargs, dropout_rng=key, variant=variant, cache=layer_cache)
            out, layer_cache = out if layer_cache is not None else (out, None)
            return out, layer_cache, nnx.pop(block, AuxLoss)

        if self.remat_policy != "none":
            layer = jax.checkpoint(
                layer,
                policy=REMAT_POLICIES[self.remat_policy],
                prevent_cse=not self.scan_layers,
                static_argnums=(1,),
            )
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)
            variants = None if self.variants is None else jnp.asarray(self.variants, jnp.int32)
            keys = None
            if dropout_rng is not None:
                keys = jax.vmap(lambda i: jax.random.fold_in(dropout_rng, i))(
                    jnp.arange(self.num_layers)
                )

            def body(y, xs):
                state, variant, key, layer_cache = xs
                y, layer_cache, aux = layer(state, graphdef, y, variant, key, layer_cache)
                return y, (layer_cache, aux)

            x, (cache, aux) = jax.lax.scan(body, x, (state, variants, keys, cache))
            nnx.update(self.layers, aux)
        else:
            caches = []
            for i in range(self.num_layers):
                block = getattr(self, f"layers_{i}")
                graphdef, state = nnx.split(block)
                v = None if self.variants is None else self.variants[i]
                layer_cache = None if cache is None else cache[i]
                x, layer_cache, aux = layer(
                    state, graphdef, x, v, fold_key(dropout_rng, i), layer_cache
                )
                nnx.update(block, aux)
                caches.append(layer_cache)
            cache = None if cache is None else tuple(caches)
        if hasattr(self, "final_norm"):
            x = self.final_norm(x)
        return x if cache is None else (x, cache)


class Embed(nnx.Module):
    """tfjax.nn.Embed in NNX: a [V, D] table; `embed(ids)` looks tokens up, `embed.attend(x)`
    gives logits x E^T (tfjax.ops.embed)."""

    def __init__(
        self,
        vocab_size,
        width,
        *,
        scale_by_sqrt_width=False,
        scale_dtype=None,
        init_stddev=None,
        dtype=None,
        param_dtype=jnp.float32,
        rngs,
    ):
        std = width**-0.5 if init_stddev is None else init_stddev
        self.scale_by_sqrt_width, self.scale_dtype, self.dtype = (
            scale_by_sqrt_width,
            scale_dtype,
            dtype,
        )
        self.embedding = param(
            rngs,
            nn.initializers.normal(std),
            (vocab_size, width),
            param_dtype,
            (axes.VOCAB, axes.EMBED),
        )

    def __call__(self, ids):
        """ids: [B, T] ints -> [B, T, D]."""
        return embed.lookup(
            self.embedding[...],
            ids,
            dtype=self.dtype,
            scale_by_sqrt_width=self.scale_by_sqrt_width,
            scale_dtype=self.scale_dtype,
        )

    def attend(self, x):
        """x: [B, T, D] -> [B, T, V] logits against the (shared) table."""
        x, table = nnx.nn.dtypes.promote_dtype((x, self.embedding[...]), dtype=self.dtype)
        return embed.attend(x, table)


class LearnedPositions(nnx.Module):
    """tfjax.nn.LearnedPositions in NNX: a learned [max_len, D] table, looked up."""

    def __init__(
        self, max_len, width, *, init_stddev=0.02, param_dtype=jnp.float32, dtype=None, rngs
    ):
        self.dtype = dtype or param_dtype
        self.embedding = param(
            rngs,
            nn.initializers.normal(init_stddev),
            (max_len, width),
            param_dtype,
            (None, axes.EMBED),
        )

    def __call__(self, positions):
        """positions: [T] or [B, T] ints -> [T, D] or [B, T, D]."""
        return embed.lookup(self.embedding[...], positions, dtype=self.dtype)


class RelativePositionBias(nnx.Module):
    """tfjax.nn.RelativePositionBias in NNX: T5's learned attention bias, one scalar per
    (bucket, head) in the [num_buckets, N] table "embedding" (tfjax.ops.relative_position_bias).
    Decoding passes the keys' positions (the cache's slots, 0 .. S - 1) in place of Linen's
    "cache" collection."""

    def __init__(
        self,
        num_heads,
        *,
        bidirectional: bool,
        num_buckets=32,
        max_distance=128,
        param_dtype=jnp.float32,
        rngs,
    ):
        self.bidirectional, self.num_buckets, self.max_distance = (
            bidirectional,
            num_buckets,
            max_distance,
        )
        self.embedding = param(
            rngs,
            nn.initializers.normal(1.0),
            (num_buckets, num_heads),
            param_dtype,
            (None, axes.HEADS),
        )

    def __call__(self, query_positions, key_positions=None):
        """query_positions: [T] or [B, T]; key_positions: [S] or [B, S], the queries' when None
        -> [B|1, N, T, S] float32."""
        return relative_position_bias(
            self.embedding[...],
            query_positions,
            query_positions if key_positions is None else key_positions,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
