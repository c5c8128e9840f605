"""The GPT-like decoder family's spec: its flat fields, their checks, presets and what they
build (the layers' configs, the stacks, the KV cache's layout), without a framework;
tfjax.models.decoder (Linen) and tfjax.nnx.models.decoder (NNX) build their modules from it.

GPT-2: learned positions, pre-LN blocks with biases, tanh-GELU FFN, a final LayerNorm and the
output projection tied to the token embeddings. The modern variant (as in Llama): RMSNorm,
SwiGLU FFN, RoPE, grouped-query attention, no biases, untied output projection. Gemma 2 / 3
add a norm after each sub-layer too ("sandwich"), RMSNorm with (1 + w), embeddings scaled by
sqrt(D), GeGLU, soft caps on the attention and output logits (Gemma 2), and local
(sliding-window) and global layers in a repeating `attention_pattern`, each kind with its own
RoPE (Gemma 3). GPT-OSS adds attention sinks and biases everywhere; mixtures of experts
(num_experts > 0) route each token to experts_per_token of num_experts expert MLPs after
first_dense_layers dense layers. DeepSeek-V3 adds multi-head latent attention (kv_lora_rank:
keys and values from one latent per token, which is what its decoding cache holds;
tfjax.ops.mla) and routes by sigmoid scores with a correction bias, within the best groups of
experts, scaled (router_score_bias, router_groups, router_groups_kept, router_scale). Qwen3.5
mixes Gated DeltaNet linear-attention layers (tfjax.ops.linear_attention; a fixed-size
recurrent state in the cache) with gated full-attention layers (attention_output_gate,
partial_rotary_factor) by `layer_types`; each run of same-kind layers is its own stack. See
tfjax.models.decoder for the model.

    spec = decoder.Model("gpt2-small", vocab_size=50257)   # a checked, frozen Decoder
    spec.stacks(), spec.block_config(), spec.init_cache(batch_size, length)
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from tfjax.allowed import one_of
from tfjax.ops.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from tfjax.ops.config import BlockConfig, LatentAttention, LayerAttention
from tfjax.ops.linear_attention import LinearAttentionConfig, init_recurrent_state
from tfjax.ops.position import RopeScaling
from tfjax.specs import common

_MODERN = dict(
    position="rope",
    norm="rms",
    activation="swiglu",
    use_bias=False,
    tie_embeddings=False,
    dropout_rate=0.0,
)
_LLAMA3 = dict(
    _MODERN, num_kv_heads=8, vocab_size=128256, max_len=131072, rope_base=500_000.0, norm_eps=1e-5
)


def _llama3_rope(factor):
    """Llama 3.1 / 3.2's frequency scaling from their 8,192 pretraining positions."""
    return RopeScaling("llama3", factor, 8192, low_freq_factor=1.0, high_freq_factor=4.0)


_GEMMA = dict(
    position="rope",
    norm="rms_plus_one",
    norm_position="sandwich",
    activation="geglu_tanh",
    use_bias=False,
    tie_embeddings=True,
    dropout_rate=0.0,
    scale_embeddings=True,
    norm_eps=1e-6,
    head_dim=256,
    attention_scalar=256,
)
_GEMMA2 = dict(
    _GEMMA,
    vocab_size=256000,
    max_len=8192,
    attention_softcap=50.0,
    final_logit_softcap=30.0,
    sliding_window=4096,
    attention_pattern=("local", "global"),
)
_GEMMA3 = dict(
    _GEMMA,
    qk_norm=True,
    rope_base=1_000_000.0,
    local_rope_base=10_000.0,
    attention_pattern=("local",) * 5 + ("global",),
)
_QWEN2 = dict(_MODERN, rope_base=1_000_000.0, norm_eps=1e-6, qkv_bias=True)
_QWEN3 = dict(
    _MODERN,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_len=40960,
    rope_base=1_000_000.0,
    norm_eps=1e-6,
    qk_norm=True,
)
# Mistral 7B's shapes (Mixtral 8x7B's attention and embeddings too).
_MISTRAL_7B = dict(
    _MODERN,
    width=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    mlp_dim=14336,
    vocab_size=32000,
    max_len=32768,
    norm_eps=1e-5,
)

# GPT-OSS's layers (both sizes; openai/gpt-oss-20b and -120b's config.json).
_GPT_OSS_YARN = RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
_GPT_OSS = dict(
    _MODERN,
    width=2880,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    use_bias=True,
    attention_sinks=True,
    activation="swiglu_clamped",
    vocab_size=201088,
    max_len=131072,
    norm_eps=1e-5,
    rope_base=150_000.0,
    rope_scaling=_GPT_OSS_YARN,
    local_rope_scaling=_GPT_OSS_YARN,  # the sliding layers' RoPE is the full layers'
    sliding_window=128,
    attention_pattern=("local", "global"),
    mlp_dim=2880,
    experts_per_token=4,
    router_bias=True,
)

VARIANTS = {
    "tiny": dict(width=32, num_layers=2, num_heads=4, mlp_dim=128, max_len=256, dropout_rate=0.0),
    # configs/lm.py's CPU experiment (pydoc): trains in minutes on two cores
    "demo": dict(width=128, num_layers=4, num_heads=4, mlp_dim=512, max_len=256, dropout_rate=0.0),
    "gpt2-small": dict(width=768, num_layers=12, num_heads=12),
    "gpt2-medium": dict(width=1024, num_layers=24, num_heads=16),
    "gpt2-large": dict(width=1280, num_layers=36, num_heads=20),
    "gpt2-xl": dict(width=1600, num_layers=48, num_heads=25),
    "modern-tiny": dict(
        width=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=96, max_len=256, **_MODERN
    ),
    # a mixture of 8 experts (2 per token) in each layer, for tests and configs/lm.py:moe-tiny
    "moe-tiny": dict(
        width=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=96,
        max_len=256,
        num_experts=8,
        experts_per_token=2,
        expert_mlp_dim=32,
        **_MODERN,
    ),
    # DeepSeek-V3's layers in miniature, for tests: multi-head latent attention (queries
    # through a latent), a dense first layer, then experts routed by group-limited sigmoid
    # scores with a correction bias and a scale, and a shared expert
    "deepseek-tiny": dict(
        width=32,
        num_layers=3,
        num_heads=4,
        head_dim=8,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_rope_head_dim=4,
        v_head_dim=6,
        mlp_dim=64,
        max_len=256,
        num_experts=8,
        experts_per_token=2,
        expert_mlp_dim=16,
        shared_expert_dim=16,
        router_score="sigmoid",
        router_score_bias=True,
        router_groups=4,
        router_groups_kept=2,
        router_scale=2.5,
        first_dense_layers=1,
        norm_eps=1e-6,
        **_MODERN,
    ),
    # Qwen3.5's layers in miniature, for tests: three Gated DeltaNet linear-attention layers,
    # then one gated full-attention layer with RoPE on a quarter of each head, (1 + w) norms
    "qwen3.5-tiny": dict(
        _MODERN,
        width=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_len=256,
        norm="rms_plus_one",
        norm_eps=1e-6,
        qk_norm=True,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        attention_output_gate=True,
        partial_rotary_factor=0.25,
    ),
    "modern-small": dict(
        width=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        mlp_dim=2048,
        max_len=2048,
        **_MODERN,
    ),
    # Published checkpoints (interop.load reads their weights); sizes from each config.json.
    "llama-3.2-1b": dict(
        _LLAMA3,
        width=2048,
        num_layers=16,
        num_heads=32,
        mlp_dim=8192,
        tie_embeddings=True,
        rope_scaling=_llama3_rope(32.0),
    ),
    "llama-3.2-3b": dict(
        _LLAMA3,
        width=3072,
        num_layers=28,
        num_heads=24,
        mlp_dim=8192,
        tie_embeddings=True,
        rope_scaling=_llama3_rope(32.0),
    ),
    "llama-3.1-8b": dict(
        _LLAMA3,
        width=4096,
        num_layers=32,
        num_heads=32,
        mlp_dim=14336,
        rope_scaling=_llama3_rope(8.0),
    ),
    "llama-3.1-70b": dict(
        _LLAMA3,
        width=8192,
        num_layers=80,
        num_heads=64,
        mlp_dim=28672,
        rope_scaling=_llama3_rope(8.0),
    ),
    "mistral-7b": dict(_MISTRAL_7B, sliding_window=4096),  # v0.1
    "qwen2.5-0.5b": dict(
        _QWEN2,
        width=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        mlp_dim=4864,
        vocab_size=151936,
        max_len=32768,
        tie_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN2,
        width=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        mlp_dim=18944,
        vocab_size=152064,
        max_len=131072,
    ),
    "qwen3-0.6b": dict(
        _QWEN3, width=1024, num_layers=28, num_heads=16, mlp_dim=3072, tie_embeddings=True
    ),
    "qwen3-8b": dict(_QWEN3, width=4096, num_layers=36, num_heads=32, mlp_dim=12288),
    # Mixtures of experts (their parameter counts, total and per token, are the model cards':
    # tests/models/test_presets.py).
    "mixtral-8x7b": dict(  # Mistral 7B's layers, each FFN eight experts; no window
        _MISTRAL_7B, rope_base=1_000_000.0, num_experts=8, experts_per_token=2
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3,
        width=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        mlp_dim=6144,
        num_experts=128,
        experts_per_token=8,
        expert_mlp_dim=768,
    ),
    # GPT-OSS: attention sinks, biases everywhere, alternating 128-token windows (the first
    # layer local) with YaRN, experts of the clamped SwiGLU routed by a biased router.
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, num_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128),
    # Qwen3.5-35B-A3B (the text model; sizes from THUDM/slime's scripts/models/
    # qwen3.5-35B-A3B.sh, its Megatron config of the published checkpoint): 40 layers, three
    # Gated DeltaNet layers to one gated full-attention layer, RoPE on a quarter of each
    # head, every FFN 256 experts (8 a token) of 512 and a gated shared expert of 512
    "qwen3.5-35b-a3b": dict(
        _MODERN,
        width=2048,
        num_layers=40,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        vocab_size=248320,
        max_len=262144,
        rope_base=10_000_000.0,
        norm="rms_plus_one",
        norm_eps=1e-6,
        qk_norm=True,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 10,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        num_experts=256,
        experts_per_token=8,
        expert_mlp_dim=512,
        shared_expert_dim=512,
        shared_expert_gate=True,
    ),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json; its multi-token-prediction layer is
    # not part of the model): multi-head latent attention with YaRN (40 x 4,096 positions),
    # three dense layers, then 256 experts (8 a token, from the best 4 of 8 groups) and one
    # shared expert
    "deepseek-v3": dict(
        _MODERN,
        width=7168,
        num_layers=61,
        num_heads=128,
        head_dim=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mlp_dim=18432,
        vocab_size=129280,
        max_len=163840,
        norm_eps=1e-6,
        rope_base=10_000.0,
        rope_scaling=RopeScaling(
            "yarn",
            40.0,
            4096,
            beta_fast=32.0,
            beta_slow=1.0,
            attention_factor=1.0,  # mscale / mscale_all_dim: both 1.0
            mscale_all_dim=1.0,
        ),
        num_experts=256,
        experts_per_token=8,
        expert_mlp_dim=2048,
        shared_expert_dim=2048,
        router_score="sigmoid",
        router_score_bias=True,
        router_groups=8,
        router_groups_kept=4,
        router_scale=2.5,
        first_dense_layers=3,
    ),
    "gemma-2-2b": dict(
        _GEMMA2, width=2304, num_layers=26, num_heads=8, num_kv_heads=4, mlp_dim=9216
    ),
    "gemma-2-9b": dict(
        _GEMMA2, width=3584, num_layers=42, num_heads=16, num_kv_heads=8, mlp_dim=14336
    ),
    # the 27B scales queries by (width / num_heads)^-1/2, not head_dim^-1/2
    "gemma-2-27b": dict(
        _GEMMA2,
        width=4608,
        num_layers=46,
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        mlp_dim=36864,
        attention_scalar=144,
    ),
    "gemma-3-1b": dict(
        _GEMMA3,
        width=1152,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        mlp_dim=6912,
        vocab_size=262144,
        max_len=32768,
        sliding_window=512,
    ),
    # the text part of gemma-3-4b-pt (Gemma3ForConditionalGeneration's text_config)
    "gemma-3-4b": dict(
        _GEMMA3,
        width=2560,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        mlp_dim=10240,
        vocab_size=262208,
        max_len=131072,
        sliding_window=1024,
        rope_scaling=RopeScaling("linear", 8.0, 131072),
    ),
    # the text parts of gemma-3-12b-pt and gemma-3-27b-pt (the 27B: attention_scalar is
    # width / num_heads, as in Gemma 2 27B)
    "gemma-3-12b": dict(
        _GEMMA3,
        width=3840,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        mlp_dim=15360,
        vocab_size=262208,
        max_len=131072,
        sliding_window=1024,
        rope_scaling=RopeScaling("linear", 8.0, 131072),
    ),
    "gemma-3-27b": dict(
        _GEMMA3,
        width=5376,
        num_layers=62,
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        mlp_dim=21504,
        attention_scalar=168,
        vocab_size=262208,
        max_len=131072,
        sliding_window=1024,
        rope_scaling=RopeScaling("linear", 8.0, 131072),
    ),
}
POSITIONS = ("learned", "sinusoidal", "rope", "alibi")
NORM_POSITIONS = ("pre", "sandwich")
LAYER_KINDS = ("local", "global")  # attention_pattern's entries, in Stack variant order
LAYER_TYPES = ("full_attention", "linear_attention")  # layer_types' entries (Qwen3.5)
LINEAR_ONLY = (  # the fields that shape linear-attention layers (moot without one)
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
MOE_ONLY = (  # the fields that shape a mixture of experts (the loss weights are moot without)
    "experts_per_token",
    "expert_mlp_dim",
    "router_score",
    "router_renormalize",
    "router_bias",
    "router_score_bias",
    "router_groups",
    "router_groups_kept",
    "router_scale",
    "shared_expert_dim",
    "shared_expert_gate",
    "first_dense_layers",
)


@dataclasses.dataclass(**common.SPEC_OPTIONS)
class Decoder(common.FamilySpec):
    """The GPT-like decoder's fields (letters as in tfjax.models.decoder); see the module
    docstring."""

    CHOICES = dict(position=one_of(*POSITIONS), norm_position=one_of(*NORM_POSITIONS))

    vocab_size: int  # V
    width: int = 768  # D
    num_layers: int = 12  # L
    num_heads: int = 12  # N
    num_kv_heads: int | None = None  # K; num_heads when None
    head_dim: int | None = None  # H; width // num_heads when None (Qwen 3: larger)
    mlp_dim: int | None = None  # 4 * width when None
    max_len: int = 1024  # context length (the size of a learned position table; else nominal)
    position: str = "learned"  # "learned", "sinusoidal", "rope" or "alibi"
    rope_base: float = 10_000.0  # RoPE wavelength base
    rope_scaling: RopeScaling | None = None  # RoPE past the training length
    sliding_window: int | None = None  # attend only to the last this many positions (Mistral;
    # with attention_pattern, the "local" layers only)
    attention_pattern: tuple[str, ...] | None = None  # the layers' self-attention kinds,
    # repeated over the stack: "local" (sliding_window) or "global" (every position); Gemma 2:
    # ("local", "global"); None: every layer as sliding_window says
    local_rope_base: float | None = None  # RoPE base of the "local" layers (Gemma 3: 10,000);
    # rope_base when None (rope_base and rope_scaling are the "global" layers')
    local_rope_scaling: RopeScaling | None = None  # the "local" layers' RoPE
    # scaling; none when None
    kv_lora_rank: int | None = None  # multi-head latent attention (DeepSeek; tfjax.ops.mla):
    # keys and values from one latent of this rank per token, which is what the cache holds;
    # head_dim is then each head's unrotated query and key part (qk_nope_head_dim)
    q_lora_rank: int | None = None  # latent attention: queries through a latent of this rank;
    # straight from the input when None
    qk_rope_head_dim: int | None = None  # latent attention: each query and key head's rotated
    # part (the keys' shared by all heads)
    v_head_dim: int | None = None  # latent attention: each value head's width; head_dim when None
    layer_types: tuple[str, ...] | None = None  # one per layer: "full_attention" or
    # "linear_attention" (Gated DeltaNet, tfjax.ops.linear_attention; Qwen3.5); None: all full
    linear_num_key_heads: int | None = None  # linear layers: query/key heads K (needed with
    # linear layers, as the next three)
    linear_num_value_heads: int | None = None  # linear layers: value heads N (a multiple of K)
    linear_key_head_dim: int | None = None  # linear layers: Hk
    linear_value_head_dim: int | None = None  # linear layers: Hv
    linear_conv_kernel_dim: int | None = None  # linear layers: the convolution's width; 4 when
    # None
    attention_output_gate: bool = False  # full attention's output times sigmoid(x Wg) per head
    # (Qwen3.5's gated attention)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(H * this) channels of each head
    attention_scalar: float | None = None  # attention logits are q.k / sqrt(attention_scalar);
    # head_dim when None (Gemma's query_pre_attn_scalar)
    attention_softcap: float | None = None  # attention logits -> c * tanh(logits / c) (Gemma 2)
    attention_sinks: bool = False  # a learned logit per query head in each attention softmax's
    # denominator, with no value (GPT-OSS)
    final_logit_softcap: float | None = None  # output logits -> c * tanh(logits / c) (Gemma 2)
    activation: str = "gelu_tanh"  # GPT-2's GELU approximation
    swiglu_alpha: float = SWIGLU_ALPHA  # activation "swiglu_clamped": the gate's sigmoid gain
    swiglu_limit: float = SWIGLU_LIMIT  # "swiglu_clamped": the gate clamped above at this,
    # the other projection to [-limit, limit] (GPT-OSS's swiglu_limit)
    norm: str = "layer"  # "layer", "rms" or "rms_plus_one" (Gemma: x / rms(x) * (1 + w))
    norm_position: str = "pre"  # "pre" or "sandwich" (Gemma: a norm before and after each
    # sub-layer)
    norm_eps: float = 1e-5  # GPT-2's LayerNorm epsilon
    use_bias: bool = True  # biases in attention and FFN
    qkv_bias: bool | None = None  # biases on Q, K, V only (Qwen 2); use_bias when None
    qk_norm: bool = False  # RMSNorm of each query and key head over H (Qwen 3)
    tie_embeddings: bool = True  # output projection = token embeddings^T
    scale_embeddings: bool = False  # token embeddings times sqrt(D), rounded to param_dtype
    # (Gemma)
    dropout_rate: float = 0.1  # embeddings and residual sub-layers (GPT-2: 0.1)
    attention_dropout_rate: float = 0.0  # on attention weights
    init_stddev: float = 0.02  # GPT-2's init scale
    num_experts: int = 0  # E: a mixture of experts in each layer's FFN; 0: one MLP
    experts_per_token: int = 2  # k: the experts the router picks for each token
    expert_mlp_dim: int | None = None  # F of each expert; mlp_dim when None
    router_score: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3) of the router logits
    router_renormalize: bool = True  # the k chosen scores divided by their sum (norm_topk_prob)
    router_bias: bool = False  # a bias on the router logits (GPT-OSS)
    router_score_bias: bool = False  # a correction [E] added to the scores to choose experts
    # only, not trained (DeepSeek-V3's e_score_correction_bias)
    router_groups: int = 1  # the experts as this many groups (DeepSeek-V3's n_group) ...
    router_groups_kept: int | None = None  # ... of which the best this many may be chosen
    # (topk_group); all when None
    router_scale: float = 1.0  # the chosen weights times this (routed_scaling_factor)
    shared_expert_dim: int = 0  # width of the always-on shared experts' MLP; 0: none
    shared_expert_gate: bool = False  # the shared experts' output times a sigmoid gate
    # (Qwen2-MoE)
    first_dense_layers: int = 0  # with experts: the first this many layers have a dense FFN
    # of width mlp_dim (DeepSeek's first_k_dense_replace)
    load_balance_loss_weight: float = 0.0  # weight of the layers' mean load-balancing loss in
    # the training objective (transformers' router_aux_loss_coef; Switch: 0.01)
    router_z_loss_weight: float = 0.0  # weight of the layers' mean router z-loss (ST-MoE: 0.001)
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.ops.remat.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def check_family(self) -> None:
        """The attention pattern and its local layers' fields, and the experts' fields."""
        pattern = self.attention_pattern
        if pattern is not None:
            if not pattern or any(kind not in LAYER_KINDS for kind in pattern):
                raise ValueError(
                    f"attention_pattern={pattern!r}: each entry must be one of {LAYER_KINDS}"
                )
            if "local" in pattern and self.sliding_window is None:
                raise ValueError(
                    f"attention_pattern={pattern!r} has local layers, which need sliding_window"
                )
        elif (self.local_rope_base, self.local_rope_scaling) != (None, None):
            raise ValueError(
                "local_rope_base and local_rope_scaling need an attention_pattern (the layers "
                "they apply to)"
            )
        latent = ("q_lora_rank", "qk_rope_head_dim", "v_head_dim")
        if self.kv_lora_rank is None:
            moot = [name for name in latent if getattr(self, name) is not None]
            if moot:
                raise ValueError(
                    f"{', '.join(moot)} set, but kv_lora_rank=None: they shape multi-head latent "
                    "attention (set kv_lora_rank)"
                )
        elif self.qk_rope_head_dim is None:
            raise ValueError("kv_lora_rank needs qk_rope_head_dim (the heads' rotated part)")
        self._check_layer_types()
        if self.partial_rotary_factor != 1.0 and self.position != "rope":
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} applies to position='rope', "
                f"not {self.position!r}"
            )
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: no experts), got {self.num_experts}")
        if not self.num_experts:  # a mixture's options are refused, not ignored, without one
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            moot = [name for name in MOE_ONLY if getattr(self, name) != defaults[name]]
            if moot:
                raise ValueError(
                    f"{', '.join(moot)} set, but num_experts=0: they apply to "
                    "mixture-of-experts layers (set num_experts)"
                )
        if not 0 <= self.first_dense_layers < self.num_layers:
            raise ValueError(
                f"first_dense_layers={self.first_dense_layers} must be in [0, num_layers="
                f"{self.num_layers})"
            )

    def _check_layer_types(self) -> None:
        """layer_types: one known type per layer; linear layers need their sizes, and do not
        mix with attention_pattern, latent attention or first_dense_layers."""
        types = self.layer_types
        if types is not None:
            if not isinstance(types, tuple) or len(types) != self.num_layers:
                raise ValueError(
                    f"layer_types={types!r} must be a tuple of one type per layer "
                    f"(num_layers={self.num_layers})"
                )
            unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
            if unknown:
                raise ValueError(f"layer_types has {unknown}; allowed: {LAYER_TYPES}")
        if not self.linear_layers:
            moot = [name for name in LINEAR_ONLY if getattr(self, name) is not None]
            if moot:
                raise ValueError(
                    f"{', '.join(moot)} set, but layer_types has no linear_attention layer"
                )
            return
        missing = [name for name in LINEAR_ONLY[:4] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"linear_attention layers need {', '.join(missing)}")
        clash = dict(
            attention_pattern=self.attention_pattern,
            kv_lora_rank=self.kv_lora_rank,
            first_dense_layers=self.first_dense_layers or None,
        )
        clash = [f"{k}={v!r}" for k, v in clash.items() if v is not None]
        if clash:
            raise ValueError(f"linear_attention layers do not take {', '.join(clash)}")

    @property
    def linear_layers(self) -> bool:
        """Whether some layer is a linear-attention (Gated DeltaNet) layer."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def linear_attention_config(self) -> LinearAttentionConfig:
        """The linear-attention layers' config (their output norm's epsilon norm_eps)."""
        return LinearAttentionConfig(
            self.linear_num_key_heads,
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
            self.linear_conv_kernel_dim or 4,
            norm_eps=self.norm_eps,
        )

    def layer_variants(self):
        """(the attention variants of the stack's blocks, each layer's index into them or None).

        Without attention_pattern: one variant (sliding_window, rope_base, rope_scaling).
        """
        everywhere = LayerAttention(self.sliding_window, self.rope_base, self.rope_scaling)
        if self.attention_pattern is None:
            return (everywhere,), None
        local = LayerAttention(
            self.sliding_window,
            self.rope_base if self.local_rope_base is None else self.local_rope_base,
            self.local_rope_scaling,
        )
        kinds = {"local": local, "global": dataclasses.replace(everywhere, sliding_window=None)}
        pattern = self.attention_pattern
        per_layer = [kinds[pattern[i % len(pattern)]] for i in range(self.num_layers)]
        variants = tuple(dict.fromkeys(per_layer))  # the distinct ones, in order of first use
        if len(variants) == 1:
            return variants, None
        return variants, tuple(variants.index(v) for v in per_layer)

    def block_config(self, *, experts: bool = True) -> BlockConfig:
        """The layers' config: the flat fields translated (common.block_config), with the
        positions, layer variants and attention scale this family spells its own way; with
        num_experts, the mixture-of-experts layers' (experts=False: the first_dense_layers')."""
        mlp_dim = self.mlp_dim or 4 * self.width
        moe = None
        if self.num_experts and experts:
            moe = dict(hidden_dim=self.expert_mlp_dim or mlp_dim)
        return common.block_config(
            self,
            attention=dict(
                position=self.position if self.position in ("rope", "alibi") else None,
                variants=self.layer_variants()[0],
                scale=None if self.attention_scalar is None else self.attention_scalar**-0.5,
                **self._latent(),
            ),
            mlp=dict(hidden_dim=mlp_dim),
            moe=moe,
            causal=True,
        )

    def _latent(self) -> dict:
        """The attention config's latent attention (and the head_dim it needs), or nothing."""
        if self.kv_lora_rank is None:
            return {}
        latent = LatentAttention(
            self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim, self.q_lora_rank
        )
        return dict(latent=latent, head_dim=self.head_dim or self.width // self.num_heads)

    def embed_options(self) -> dict:
        """The token embedding's options besides its sizes and dtypes: init_stddev, and with
        scale_embeddings the sqrt(D) scale rounded to param_dtype (as Gemma's)."""
        return dict(
            scale_by_sqrt_width=self.scale_embeddings,
            scale_dtype=self.param_dtype if self.scale_embeddings else None,
            init_stddev=self.init_stddev,
        )

    def stacks(self):
        """The layer stacks in order: (name, their config, first layer, number of layers); one,
        "decoder", unless first_dense_layers puts a "dense_decoder" before it, or layer_types
        mixes linear and full attention (`_runs`)."""
        f = self.first_dense_layers
        if self.linear_layers:
            return self._runs()
        rest = ("decoder", self.block_config(), f, self.num_layers - f)
        return [("dense_decoder", self.block_config(experts=False), 0, f), rest] if f else [rest]

    def _runs(self):
        """With linear layers, one stack per run of consecutive layers of one type (their
        parameters differ): "decoder_0", "decoder_1", ... ("decoder" if only one)."""
        full = self.block_config()
        linear = dataclasses.replace(full, linear_attention=self.linear_attention_config())
        runs, first = [], 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or self.layer_types[i] != self.layer_types[first]:
                kind = linear if self.layer_types[first] == "linear_attention" else full
                runs.append([kind, first, i - first])
                first = i
        names = ["decoder"] if len(runs) == 1 else [f"decoder_{k}" for k in range(len(runs))]
        return [(name, *run) for name, run in zip(names, runs, strict=True)]

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """An empty explicit KV cache for `batch_size` rows of up to `length` tokens (prompt
        and generated), to pass as `cache=` with decode=True: a tfjax.ops.KVCache per layer, a
        tfjax.ops.LatentCache with kv_lora_rank (one with [L, ...] leaves when scan_layers; with
        first_dense_layers, a tuple of one per stack); linear-attention layers hold a
        tfjax.ops.RecurrentState (the layers' own in order; scanned, one per stack). dtype: of
        the keys and values (the compute dtype when None); sharding: of one layer's keys
        [B, S, K, H] (tfjax.ops.init_cache)."""
        config, caches = self.block_config().attention, []
        for _, block, _, n in self.stacks():
            if block.linear_attention is not None:  # a fixed-size recurrent state per layer
                dtype_ = dtype or self.dtype or jnp.float32
                caches.append(
                    init_recurrent_state(
                        block.linear_attention,
                        batch_size,
                        num_layers=n,
                        scanned=self.scan_layers,
                        dtype=dtype_,
                    )
                )
                continue
            caches.append(
                common.init_cache(
                    self, config, batch_size, length, dtype=dtype, sharding=sharding, num_layers=n
                )
            )
        return self.join_caches(caches)

    def stack_caches(self, cache) -> list:
        """The explicit KV `cache` (init_cache's) split into one per stack, in `stacks` order
        (a None each without one)."""
        stacks = self.stacks()
        if cache is None or len(stacks) == 1:
            return [cache] * len(stacks)
        # one per stack (scanned), or the layers' own
        return [
            cache[i] if self.scan_layers else cache[first : first + n]
            for i, (_, _, first, n) in enumerate(stacks)
        ]

    def join_caches(self, caches: list):
        """The stacks' KV caches (as `stack_caches` splits them) as one explicit cache."""
        if len(caches) == 1:
            return caches[0]
        return tuple(caches) if self.scan_layers else sum(caches, ())

    def check_length(self, length: int) -> None:
        """Refuses `length` tokens past the learned position table's last row."""
        if self.position == "learned" and length > self.max_len:
            raise ValueError(
                f"tokens are {length} long; max_len={self.max_len} (position='learned')"
            )


def Model(variant: str | None = None, **overrides) -> Decoder:  # noqa: N802 (a factory)
    """Decoder(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return common.from_variant(Decoder, VARIANTS, variant, overrides)
