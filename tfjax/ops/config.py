"""What a Transformer layer computes, as frozen (hashable) dataclasses: one per kind of sub-layer.

Every option is declared, documented and validated here once; the modules (tfjax.nn) take a
config, and each model family translates its flat fields into them (tfjax.models.common).
Variations are `dataclasses.replace` of a config: cross-attention, for instance, is the
self-attention config without positions or a window.

    attention = AttentionConfig(num_heads=8, num_kv_heads=2, position="rope")
    block = BlockConfig(attention, MlpConfig(hidden_dim=1024, activation="swiglu"), norm="rms")
"""

import dataclasses
import math

import jax

from tfjax.ops.activations import (
    ALL_ACTIVATIONS,
    GATED_ACTIVATIONS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    by_name,
)
from tfjax.ops.attention import check_implementation, check_softcap, check_window
from tfjax.ops.linear_attention import LinearAttentionConfig
from tfjax.ops.norms import NORMS
from tfjax.ops.position import RopeScaling

# The projections' kernel initializer unless a layer or family says otherwise (Glorot uniform,
# as Flax's Dense): one object, which tfjax.nn's, tfjax.nnx's layers and the specs default to.
default_kernel_init = jax.nn.initializers.xavier_uniform()

POSITIONS = (None, "rope", "alibi")
QK_NORMS = ("rms", "rms_plus_one")
NORM_POSITIONS = ("pre", "post", "sandwich")


def _check_choice(owner, field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}: {field}={value!r} is unknown; allowed: {allowed}")


def _check_swiglu(owner, config) -> None:
    """swiglu_alpha and swiglu_limit: positive numbers, set only for "swiglu_clamped"."""
    for field in ("swiglu_alpha", "swiglu_limit"):
        value = getattr(config, field)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{owner}: {field} must be a positive number, got {value!r}")
    defaults = (config.swiglu_alpha, config.swiglu_limit) == (SWIGLU_ALPHA, SWIGLU_LIMIT)
    if config.activation != "swiglu_clamped" and not defaults:
        raise ValueError(
            f"{owner}: swiglu_alpha={config.swiglu_alpha}, swiglu_limit={config.swiglu_limit} "
            f"apply to activation='swiglu_clamped', not {config.activation!r}"
        )


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What may differ between the self-attention of a stack's layers while their parameters
    have one shape: Gemma's local (sliding-window) and global layers, each with its RoPE;
    Llama 4's chunked RoPE layers and its NoPE layers (tfjax.ops.multihead.rotate)."""

    sliding_window: int | None = None  # keys within the last this many positions; all when None
    rope_base: float = 10_000.0  # RoPE wavelength base
    rope_scaling: RopeScaling | None = None  # RoPE past the training length (Llama 3.1)
    chunk: int | None = None  # keys only in the query's own chunk of this many positions
    # (masks.chunk_mask; Llama 4's attention_chunk_size); all when None
    rope: bool = True  # False: no RoPE in these layers though the config's position is "rope"
    # (Llama 4's NoPE layers)
    unit_qk_norm: bool = False  # q and k divided by their RMS over H, no weight, after RoPE
    # (Llama 4's use_qk_norm; the config's norm_eps)
    temperature_floor: int | None = None  # q times 1 + temperature_scale * log(1 + floor((p +
    # 1) / this)) at position p (Llama 4's NoPE layers: floor_scale); none when None
    temperature_scale: float = 0.1  # (Llama 4's attn_scale)

    def __post_init__(self):
        check_window(self.sliding_window, "sliding_window")
        check_window(self.chunk, "chunk")
        check_window(self.temperature_floor, "temperature_floor")
        scale = self.temperature_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale >= 0:
            raise ValueError(f"LayerAttention: temperature_scale must be >= 0, got {scale!r}")


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (MLA; DeepSeek-V2 / V3; tfjax.ops.mla): keys and values of
    every head come up from one shared latent of `kv_rank` per token, which (with one rotated
    key part of `rope_dim` shared by all heads) is all a decoding cache holds. Each query and
    key head is [its own part of head_dim (not rotated) | rope_dim (RoPE)]; each value head is
    value_dim wide. Queries come from the input directly or through a latent of `q_rank`."""

    kv_rank: int  # R: the shared latent of keys and values (kv_lora_rank)
    rope_dim: int  # Hr: the rotated part of each query and key head (qk_rope_head_dim)
    value_dim: int | None = None  # Hv: each value head's width (v_head_dim); head_dim when None
    q_rank: int | None = None  # Rq: queries through a latent of this rank (q_lora_rank);
    # straight from the input when None
    norm_eps: float = 1e-6  # the latents' RMSNorms (DeepSeek's: fixed at 1e-6)

    def __post_init__(self):
        for field in ("kv_rank", "rope_dim", "value_dim", "q_rank"):
            value = getattr(self, field)
            if value is None and field in ("value_dim", "q_rank"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LatentAttention: {field} must be an int >= 1, got {value!r}")
        if self.rope_dim % 2:
            raise ValueError(f"LatentAttention: rope_dim={self.rope_dim} must be even (RoPE pairs)")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Multi-head attention with grouped-query heads (tfjax.nn.MultiHeadAttention)."""

    num_heads: int  # N
    num_kv_heads: int | None = None  # K; num_heads when None, 1 for multi-query attention
    head_dim: int | None = None  # H; width // num_heads when None
    out_features: int | None = None  # output width; the input width when None
    use_bias: bool = True  # biases on the Q, K, V and output projections
    qkv_bias: bool | None = None  # biases on Q, K, V only (Qwen 2); use_bias when None
    qk_norm: bool = False  # RMSNorm of each query and key head over H, before RoPE (Qwen 3)
    qk_norm_kind: str = "rms"  # qk_norm's norm: "rms" or "rms_plus_one" (Gemma 3)
    norm_eps: float = 1e-6  # qk_norm's epsilon
    position: str | None = None  # None, "rope" or "alibi" (self-attention only)
    variants: tuple[LayerAttention, ...] = (LayerAttention(),)  # window and RoPE of the
    # self-attention; several for layers that differ (Gemma's local and global), one picked by
    # each call's `variant` (a stack's `variants` index them per layer)
    scale: float | None = None  # logit scale; head_dim**-0.5 when None (Gemma: a config's)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
    sinks: bool = False  # a learned logit per query head ("sinks" [N]) joins each softmax's
    # denominator, adding no value (GPT-OSS); not taken by cuDNN
    dropout_rate: float = 0.0  # dropout on the attention weights
    implementation: str | None = None  # backend: "xla", "cudnn", "splash", "chunked" or None
    # (chosen per call; see tfjax.ops.attention)
    latent: LatentAttention | None = None  # multi-head latent attention (DeepSeek): head_dim
    # is then each head's unrotated query and key part (qk_nope_head_dim)
    output_gate: bool = False  # the output times sigmoid(x Wg) per head before its projection
    # ("gate_kernel" [D, N, H]; Qwen3.5's gated attention, whose q_proj holds both)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(H * this) channels of each
    # query and key head only (Qwen3.5: 0.25)

    def __post_init__(self):
        kv = self.kv_heads
        if self.num_heads <= 0 or kv <= 0 or self.num_heads % kv:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                f"(allowed: the divisors of {self.num_heads})"
            )
        _check_choice("AttentionConfig", "position", self.position, POSITIONS)
        _check_choice("AttentionConfig", "qk_norm_kind", self.qk_norm_kind, QK_NORMS)
        variants = self.variants
        if not (
            isinstance(variants, tuple)
            and variants
            and all(isinstance(v, LayerAttention) for v in variants)
        ):
            raise ValueError(
                f"AttentionConfig: variants must be a non-empty tuple of LayerAttention, got "
                f"{self.variants!r}"
            )
        check_softcap(self.softcap)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"AttentionConfig: dropout_rate must be in [0, 1), got {self.dropout_rate}"
            )
        check_implementation(self.implementation)
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise ValueError(
                f"AttentionConfig: partial_rotary_factor must be a number in (0, 1], got {factor!r}"
            )
        if self.latent is not None:
            self._check_latent()

    def _check_latent(self) -> None:
        """What multi-head latent attention takes: RoPE, every head its own key (from the
        latent), one variant, no biases, per-head norms, soft cap or sinks."""
        if not isinstance(self.latent, LatentAttention):
            raise ValueError("AttentionConfig: latent must be a LatentAttention or None")
        have = dict(
            position=self.position,
            num_kv_heads=self.kv_heads,
            variants=len(self.variants),
            use_bias=self.use_bias,
            qkv_bias=bool(self.qkv_bias),
            qk_norm=self.qk_norm,
            softcap=self.softcap,
            sinks=self.sinks,
            output_gate=self.output_gate,
            partial_rotary_factor=self.partial_rotary_factor,
        )
        want = dict(
            position="rope",
            num_kv_heads=self.num_heads,
            variants=1,
            use_bias=False,
            qkv_bias=False,
            qk_norm=False,
            softcap=None,
            sinks=False,
            output_gate=False,
            partial_rotary_factor=1.0,
        )
        wrong = [f"{k}={have[k]!r} (needs {want[k]!r})" for k in want if have[k] != want[k]]
        if self.head_dim is None:
            wrong.append("head_dim=None (needs the heads' unrotated width, qk_nope_head_dim)")
        if wrong:
            raise ValueError(f"AttentionConfig: latent attention does not take {', '.join(wrong)}")

    @property
    def kv_heads(self) -> int:
        """K: num_kv_heads, or num_heads when None."""
        return self.num_kv_heads or self.num_heads

    def head_width(self, width: int) -> int:
        """H for inputs of `width`: head_dim, or width // num_heads when None."""
        return self.head_dim or width // self.num_heads

    def rotary_dim(self, head_dim: int) -> int:
        """The channels of each [.., head_dim] query and key head that RoPE rotates (as
        transformers: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def logit_options(self) -> dict:
        """What shapes the logits, as dot_product_attention's arguments of the same names."""
        return dict(scale=self.scale, softcap=self.softcap)

    def for_cross_attention(self) -> "AttentionConfig":
        """This config without what only self-attention has: positions and a window."""
        return dataclasses.replace(self, position=None, variants=(LayerAttention(),))


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """The position-wise FFN (tfjax.nn.Mlp, or GatedMlp for a gated activation)."""

    hidden_dim: int  # F
    activation: str = "relu"  # "relu", "gelu" (exact erf), "gelu_tanh", "silu", "quick_gelu";
    # gated: "swiglu" (Llama), "geglu", "geglu_tanh" (Gemma), "swiglu_clamped" (GPT-OSS)
    dropout_rate: float = 0.0  # on the hidden activations; 0 in Vaswani et al.
    use_bias: bool = True  # biases on the projections (Llama has none)
    swiglu_alpha: float = SWIGLU_ALPHA  # "swiglu_clamped": the gate's sigmoid gain
    swiglu_limit: float = SWIGLU_LIMIT  # "swiglu_clamped": the gate clamped above at this,
    # the other projection to [-limit, limit]

    def __post_init__(self):
        _check_choice("MlpConfig", "activation", self.activation, ALL_ACTIVATIONS)
        _check_swiglu("MlpConfig", self)

    @property
    def gated(self) -> bool:
        """Whether the activation gates a second projection (GatedMlp)."""
        return self.activation in GATED_ACTIVATIONS

    def activation_fn(self):
        """The activation as a function (tfjax.ops.activations.by_name)."""
        return by_name(
            self.activation, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit
        )


ROUTER_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts FFN (tfjax.nn.MoeMlp): per token a router picks `top_k` of
    `num_experts` expert MLPs and sums their outputs, weighted by its scores; every routed token
    is computed (dropless: no capacity, nothing dropped). The maths: tfjax.ops.moe.

    Mixtral, Qwen3-MoE: softmax scores, renormalized. GPT-OSS: softmax of the chosen logits,
    which is the same (renormalized), with a router bias, expert biases and "swiglu_clamped".
    DeepSeek-V3: sigmoid scores with a correction bias for choosing (score_bias), experts
    chosen from the best groups only (groups, groups_kept), renormalized, scaled (scale), a
    shared expert. Llama 4: sigmoid scores, not renormalised, that scale the experts' inputs
    (weigh_inputs), a shared expert.
    """

    num_experts: int  # E
    top_k: int  # k: experts per token
    hidden_dim: int  # F: each expert's width
    activation: str = "swiglu"  # the experts' (and the shared experts'); see MlpConfig
    swiglu_alpha: float = SWIGLU_ALPHA  # "swiglu_clamped"'s gain and clamp; see MlpConfig
    swiglu_limit: float = SWIGLU_LIMIT
    use_bias: bool = False  # biases on the experts' projections (GPT-OSS)
    router_score: str = "softmax"  # the router's scores of its logits: "softmax" (over the E
    # experts) or "sigmoid" (each on its own, DeepSeek-V3)
    renormalize: bool = True  # the chosen k scores divided by their sum (Mixtral; Qwen-MoE's
    # norm_topk_prob); False: the scores as they are (Qwen1.5/2-MoE)
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)
    score_bias: bool = False  # a correction [E] ("router_score_bias") added to the scores to
    # choose the experts, not to weigh them; not trained (DeepSeek-V3's e_score_correction_bias,
    # which its training adjusts for balance outside the gradient)
    groups: int = 1  # G: the experts as G groups of E / G, each scored by its two best scores
    # (DeepSeek-V3's n_group)
    groups_kept: int | None = None  # the experts of only this many best groups may be chosen;
    # all when None (DeepSeek-V3's topk_group)
    scale: float = 1.0  # the chosen weights times this (DeepSeek-V3's routed_scaling_factor)
    shared_dim: int = 0  # F of the always-on shared experts, one MLP (DeepSeek: the number of
    # shared experts times their width; Qwen2-MoE's shared_expert_intermediate_size); 0: none
    shared_gate: bool = False  # the shared experts' output times sigmoid(x w) (Qwen2-MoE)
    weigh_inputs: bool = False  # the router's weights scale each chosen expert's input, not
    # its output: sum_j expert_j(w_j x) (Llama 4)
    load_balance_weight: float = 0.0  # weight of the load-balancing loss in the objective
    router_z_weight: float = 0.0  # weight of the router z-loss in the objective

    def __post_init__(self):
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoeConfig: top_k={self.top_k} must be in [1, num_experts={self.num_experts}] "
                "(num_experts >= 1)"
            )
        if self.hidden_dim < 1 or self.shared_dim < 0:
            raise ValueError(
                f"MoeConfig: hidden_dim={self.hidden_dim} must be >= 1 and "
                f"shared_dim={self.shared_dim} >= 0"
            )
        _check_choice("MoeConfig", "activation", self.activation, ALL_ACTIVATIONS)
        _check_swiglu("MoeConfig", self)
        _check_choice("MoeConfig", "router_score", self.router_score, ROUTER_SCORES)
        self._check_groups()
        if isinstance(self.scale, bool) or not (
            isinstance(self.scale, int | float) and math.isfinite(self.scale) and self.scale > 0
        ):
            raise ValueError(f"MoeConfig: scale must be a positive number, got {self.scale!r}")
        if self.shared_gate and not self.shared_dim:
            raise ValueError("MoeConfig: shared_gate=True needs shared experts (shared_dim > 0)")
        for field in ("load_balance_weight", "router_z_weight"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"MoeConfig: {field} must be >= 0, got {getattr(self, field)}")

    def _check_groups(self) -> None:
        g, kept, e = self.groups, self.groups_kept, self.num_experts
        if g < 1 or e % g:
            raise ValueError(f"MoeConfig: groups={g} must divide num_experts={e}")
        if kept is not None and not 1 <= kept <= g:
            raise ValueError(f"MoeConfig: groups_kept={kept} must be in [1, groups={g}] or None")
        if g > 1 and e // g < 2 and kept is not None and kept < g:
            raise ValueError(
                f"MoeConfig: groups={g} of {e} experts leaves groups of one; a group is scored "
                "by its two best experts (groups of at least 2)"
            )
        if kept is not None and self.top_k > kept * (e // g):
            raise ValueError(
                f"MoeConfig: top_k={self.top_k} exceeds the {kept * (e // g)} experts of the "
                f"groups_kept={kept} groups"
            )

    def route_options(self) -> dict:
        """tfjax.ops.moe.route's options of this router (not its score_bias array)."""
        return dict(
            score=self.router_score,
            renormalize=self.renormalize,
            groups=self.groups,
            groups_kept=self.groups_kept,
            scale=self.scale,
        )

    @property
    def gated(self) -> bool:
        """Whether the experts' activation gates a second projection (wi_0 and wi_1)."""
        return self.activation in GATED_ACTIVATIONS

    def shared(self) -> MlpConfig:
        """The shared experts' MLP."""
        return MlpConfig(
            self.shared_dim,
            self.activation,
            use_bias=self.use_bias,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )

    def activation_fn(self):
        """The experts' activation as a function (tfjax.ops.activations.by_name)."""
        return by_name(
            self.activation, swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit
        )


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One Transformer layer (tfjax.nn.Block): self-attention, optional cross-attention, FFN,
    each a residual sub-layer with the norm placed per `norm_position`."""

    attention: AttentionConfig  # the self-attention (cross-attention: for_cross_attention())
    mlp: MlpConfig | MoeConfig  # the FFN: one MLP, or a mixture of experts
    norm: str = "layer"  # "layer" (LayerNorm), "rms" (RMSNorm) or "rms_plus_one" (Gemma's)
    norm_eps: float = 1e-6  # norm epsilon (BERT 1e-12, GPT-2 1e-5)
    norm_position: str = "pre"  # "pre" (x + F(LN(x))), "post" (LN(x + F(x)), the paper) or
    # "sandwich" (x + LN'(F(LN(x))), Gemma)
    causal: bool = False  # self-attention sees only earlier positions (decoders)
    cross_attention: bool = False  # attend to an encoder's output (encoder-decoder)
    dropout_rate: float = 0.0  # residual dropout on each sub-layer's output (paper: 0.1)
    layer_scale: float | None = None  # init of a learned [D] gamma multiplying each sub-layer's
    # output before the residual add (CaiT, DINOv2); none when None
    linear_attention: LinearAttentionConfig | None = None  # the layer mixes tokens by Gated
    # DeltaNet linear attention (tfjax.ops.linear_attention; Qwen3.5's "linear_attention"
    # layers) in place of `attention`, which is then unused

    def __post_init__(self):
        if self.linear_attention is not None:
            if not isinstance(self.linear_attention, LinearAttentionConfig):
                raise ValueError("BlockConfig: linear_attention must be a LinearAttentionConfig")
            if self.cross_attention:
                raise ValueError("BlockConfig: linear_attention does not take cross_attention")
        for field, classes in (("attention", (AttentionConfig,)), ("mlp", (MlpConfig, MoeConfig))):
            if not isinstance(getattr(self, field), classes):
                names = " or ".join(c.__name__ for c in classes)
                raise ValueError(f"BlockConfig: {field} must be a {names}")
        _check_choice("BlockConfig", "norm", self.norm, NORMS)
        _check_choice("BlockConfig", "norm_position", self.norm_position, NORM_POSITIONS)
