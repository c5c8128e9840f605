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
partial_rotary_factor) by `layer_types`; each run of same-kind layers is its own stack. Llama 4
attends within chunks on its RoPE ("local") layers (attention_chunk_size, qk_unit_norm), has no
positions on its "global" ones (global_rope=False), whose queries it scales with the length
(attention_temperature_floor), and routes by sigmoid scores that scale the chosen experts'
inputs (router_weighs_inputs) in every moe_layer_step-th layer, the others dense. See
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
from tfjax.specs import common, decoder_presets

VARIANTS = decoder_presets.VARIANTS  # name -> fields

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
    "moe_layer_step",
    "router_weighs_inputs",
)
LLAMA4_ONLY = (  # the fields of Llama 4's layers: its converter exports a model that sets any
    "attention_chunk_size",
    "global_rope",
    "qk_unit_norm",
    "attention_temperature_floor",
    "attention_temperature_scale",
    "moe_layer_step",
    "router_weighs_inputs",
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
    attention_chunk_size: int | None = None  # attend only within the query's own chunk of this
    # many positions (Llama 4's attention_chunk_size; with attention_pattern, the "local"
    # layers only, as sliding_window)
    global_rope: bool = True  # False: attention_pattern's "global" layers have no positions
    # (NoPE; Llama 4's no_rope_layers zeros)
    qk_unit_norm: bool = False  # the RoPE layers' queries and keys divided by their RMS over
    # H, no weight (Llama 4's use_qk_norm)
    attention_temperature_floor: int | None = None  # the NoPE layers' queries times 1 +
    # attention_temperature_scale * log(1 + floor((p + 1) / this)) at position p (Llama 4's
    # floor_scale, with attn_temperature_tuning); none when None
    attention_temperature_scale: float = 0.1  # (Llama 4's attn_scale)
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
    moe_layer_step: int = 1  # with experts: only every this-many-th layer (layers step - 1,
    # 2 step - 1, ...) has them, the others a dense FFN of width mlp_dim (Llama 4's
    # interleave_moe_layer_step)
    router_weighs_inputs: bool = False  # the router's weights scale each chosen expert's
    # input, not its output (Llama 4)
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
            if "local" in pattern and (self.sliding_window, self.attention_chunk_size) == (
                None,
                None,
            ):
                raise ValueError(
                    f"attention_pattern={pattern!r} has local layers, which need sliding_window "
                    "or attention_chunk_size"
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
            moot = non_default(self, MOE_ONLY)
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
        self._check_llama4()

    def _check_llama4(self) -> None:
        """Llama 4's fields: NoPE global layers and the temperature need RoPE and global
        layers; moe_layer_step alone among the ways to mix dense layers in."""
        pattern = self.attention_pattern or ()
        if not self.global_rope and (self.position != "rope" or "global" not in pattern):
            raise ValueError(
                "global_rope=False needs position='rope' and global layers in attention_pattern "
                f"(got position={self.position!r}, attention_pattern={self.attention_pattern!r})"
            )
        if self.attention_temperature_floor is None:
            if non_default(self, ("attention_temperature_scale",)):
                raise ValueError(
                    "attention_temperature_scale set, but attention_temperature_floor=None: it "
                    "scales the temperature of NoPE layers (set attention_temperature_floor)"
                )
        elif self.global_rope:
            raise ValueError(
                "attention_temperature_floor applies to NoPE layers: set global_rope=False"
            )
        if self.qk_unit_norm and self.position != "rope":
            raise ValueError(f"qk_unit_norm applies to RoPE layers, not position={self.position!r}")
        if self.moe_layer_step > 1 and (self.first_dense_layers or self.linear_layers):
            raise ValueError(
                f"moe_layer_step={self.moe_layer_step} does not take first_dense_layers or "
                "linear_attention layers (one way of placing dense layers at a time)"
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

        Without attention_pattern: one variant (sliding_window, attention_chunk_size,
        rope_base, rope_scaling). The global layers attend to every position, with RoPE or
        (global_rope=False) without, the temperature and the norm of the NoPE layers.
        """
        everywhere = LayerAttention(
            self.sliding_window,
            self.rope_base,
            self.rope_scaling,
            chunk=self.attention_chunk_size,
            unit_qk_norm=self.qk_unit_norm,
        )
        if self.attention_pattern is None:
            return (everywhere,), None
        local = dataclasses.replace(
            everywhere,
            rope_base=self.rope_base if self.local_rope_base is None else self.local_rope_base,
            rope_scaling=self.local_rope_scaling,
        )
        nope = dict(rope=False, unit_qk_norm=False) if not self.global_rope else {}
        glob = dataclasses.replace(
            everywhere,
            sliding_window=None,
            chunk=None,
            temperature_floor=self.attention_temperature_floor,
            temperature_scale=self.attention_temperature_scale,
            **nope,
        )
        kinds = {"local": local, "global": glob}
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
            moe = dict(
                hidden_dim=self.expert_mlp_dim or mlp_dim, weigh_inputs=self.router_weighs_inputs
            )
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

    def moe_layer(self, i: int) -> bool:
        """Whether layer i's FFN is a mixture of experts (num_experts, first_dense_layers,
        moe_layer_step)."""
        late = i >= self.first_dense_layers
        return bool(self.num_experts) and late and (i + 1) % self.moe_layer_step == 0

    def stacks(self):
        """The layer stacks in order: (name, their config, first layer, number of layers); one,
        "decoder", unless first_dense_layers puts a "dense_decoder" before it, or layer_types
        mixes linear and full attention or moe_layer_step dense layers and experts (`_runs`)."""
        f = self.first_dense_layers
        if self.linear_layers or self.moe_layer_step > 1:
            return self._runs()
        rest = ("decoder", self.block_config(), f, self.num_layers - f)
        return [("dense_decoder", self.block_config(experts=False), 0, f), rest] if f else [rest]

    def _runs(self):
        """One stack per run of consecutive layers of one kind (their parameters differ: linear
        or full attention, dense FFN or experts): "decoder_0", "decoder_1", ... ("decoder" if
        only one)."""
        blocks = {moe: self.block_config(experts=moe) for moe in (False, True)}
        if self.linear_layers:
            linear = self.linear_attention_config()
            blocks |= {
                (moe, "linear"): dataclasses.replace(b, linear_attention=linear)
                for moe, b in blocks.items()
            }
        types = self.layer_types or ("full_attention",) * self.num_layers
        kinds = [
            (self.moe_layer(i), "linear") if t == "linear_attention" else self.moe_layer(i)
            for i, t in enumerate(types)
        ]
        runs, first = [], 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or kinds[i] != kinds[first]:
                runs.append([blocks[kinds[first]], first, i - first])
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


def non_default(model, names) -> list[str]:
    """The fields of `names` that `model` (a Decoder, or a model with its fields) sets to
    other than their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(Decoder)}
    return [name for name in names if getattr(model, name) != defaults[name]]


def Model(variant: str | None = None, **overrides) -> Decoder:  # noqa: N802 (a factory)
    """Decoder(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return common.from_variant(Decoder, VARIANTS, variant, overrides)
