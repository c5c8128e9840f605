"""The GPT-like decoder family's presets (tfjax.specs.decoder.VARIANTS): each published size as
the decoder's fields. The table grows with every family, so it lives apart from the fields and
their checks (tfjax.specs.decoder)."""

from tfjax.ops.position import RopeScaling

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


# Llama 4's text model (the text_config of meta-llama/Llama-4-Scout-17B-16E's and
# -Maverick-17B-128E's config.json): 48 layers, three RoPE layers attending within chunks of
# 8,192 positions to one NoPE layer over the whole context (no_rope_layer_interval 4) whose
# queries grow with the length (floor_scale 8,192, attn_scale 0.1); experts of 8,192 (one a
# token, by sigmoid scores that scale its input) beside a shared expert of 8,192, dense layers
# of 16,384
_LLAMA4 = dict(
    _MODERN,
    vocab_size=202048,
    width=5120,
    num_layers=48,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=16384,
    rope_base=500_000.0,
    norm_eps=1e-5,
    attention_pattern=("local",) * 3 + ("global",),
    attention_chunk_size=8192,
    global_rope=False,
    attention_temperature_floor=8192,
    attention_temperature_scale=0.1,
    experts_per_token=1,
    expert_mlp_dim=8192,
    shared_expert_dim=8192,
    router_score="sigmoid",
    router_renormalize=False,
    router_weighs_inputs=True,
)

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
    # Llama 4's layers in miniature, for tests: chunked RoPE layers with unit q/k norms, then
    # a NoPE layer with the temperature; experts (sigmoid scores scaling their inputs) every
    # second layer beside a shared expert, dense layers between
    "llama4-tiny": dict(
        _LLAMA4,
        vocab_size=256,
        width=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_len=256,
        attention_pattern=("local", "global"),
        attention_chunk_size=8,
        attention_temperature_floor=4,
        qk_unit_norm=True,
        num_experts=4,
        experts_per_token=2,
        expert_mlp_dim=16,
        shared_expert_dim=16,
        moe_layer_step=2,
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
    # Llama 4 Scout: every layer 16 experts; its queries and keys normed on the RoPE layers,
    # whose frequencies Llama 3.1's scaling stretches (factor 8 of 8,192 positions)
    "llama-4-scout-17b-16e": dict(
        _LLAMA4,
        max_len=262144,
        rope_scaling=_llama3_rope(8.0),
        local_rope_scaling=_llama3_rope(8.0),  # the RoPE layers' (local ones')
        qk_unit_norm=True,
        num_experts=16,
    ),
    # Llama 4 Maverick: 128 experts in every second layer (interleave_moe_layer_step 2), the
    # others dense; no q/k norm, plain RoPE
    "llama-4-maverick-17b-128e": dict(_LLAMA4, max_len=1048576, num_experts=128, moe_layer_step=2),
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
