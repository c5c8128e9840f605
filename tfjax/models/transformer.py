"""The encoder-decoder Transformer of Vaswani et al. (2017), "Attention Is All You Need".

Letters: B batch, S source length, T target length, D model width, V vocab.

Post-LN blocks (LN(x + Dropout(F(x)))), ReLU FFN, sinusoidal positions added to embeddings
scaled by sqrt(d_model), one embedding matrix shared by source, target and the pre-softmax
projection (a shared source-target vocabulary, as in the paper), dropout on the embedding sums
and on every sub-layer's output.

    model = transformer.Model(variant="base", vocab_size=37000)
    logits, aux = model.apply(variables, inputs, targets)   # [B, S], [B, T] -> [B, T, V]
    hidden, aux = model.apply(variables, inputs, targets, apply_head=False)  # -> [B, T, D]
    logits = model.apply(variables, hidden, method="logits")                 # -> [B, T, V]

T5 (Raffel et al., 2020; its v1.1 layout, as in Flan-T5) is this model with other fields, see
`T5`: pre-LN stacks with RMSNorm, no biases, unscaled embeddings and no added positions, but a
learned relative position bias per stack (`position="relative"`, T5's buckets) computed once
and added to every layer's self-attention logits, unscaled attention logits
(`attention_scale=1`), a gated-GELU FFN and an output projection of its own.

`targets` are shifted right inside the model (0 is the start token), so logits at t predict
targets[t]. For generation call `encode` once, then `decode` token by token with decode=True,
with Flax's "cache" collection (mutable=["cache"]) or an explicit cache the caller holds, as in
tfjax.models.decoder (T5's relative bias then reads the cache's length from it):

    cache = model.init_cache(batch_size, max_target_length)
    (logits, states), cache = model.apply(variables, encoded, inputs, token, decode=True,
                                          cache=cache, method="decode")

The second form in the first example lets a loss make the logits in slices of T
(`loss.chunks`), never all [B, T, V] at once.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from tfjax import nn as tnn
from tfjax.allowed import one_of
from tfjax.models import common
from tfjax.models.common import check_tokens, from_variant, shift_right
from tfjax.nn import axes, masks
from tfjax.ops.cache import max_length, next_position

# "base" and "big" are Table 3 of the paper; "tiny" is for tests, "demo" for configs/translate.py's
# CPU experiment (trains in minutes on two cores), "small" a step between it and "base".
VARIANTS = {
    "tiny": dict(width=32, num_layers=2, num_heads=4, mlp_dim=64, dropout_rate=0.0),
    "demo": dict(width=128, num_layers=2, num_heads=4, mlp_dim=512, dropout_rate=0.1),
    "small": dict(width=256, num_layers=3, num_heads=4, mlp_dim=1024, dropout_rate=0.1),
    "base": dict(width=512, num_layers=6, num_heads=8, mlp_dim=2048, dropout_rate=0.1),
    "big": dict(width=1024, num_layers=6, num_heads=16, mlp_dim=4096, dropout_rate=0.3),
}
# T5 v1.1 (Raffel et al., 2020, its v1.1 release): what every size shares. Dropout as in the
# checkpoints' config.json, everywhere transformers' T5 applies it (attention weights, the FFN's
# hidden activations and each stack's output too).
T5 = dict(
    norm="rms",
    norm_position="pre",
    use_bias=False,
    position="relative",
    scale_embeddings=False,
    attention_scale=1.0,
    activation="geglu_tanh",
    head_dim=64,
    share_embeddings=True,
    tie_embeddings=False,
    norm_eps=1e-6,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    mlp_dropout_rate=0.1,
    output_dropout=True,
    vocab_size=32128,
)
# The published sizes of T5 v1.1 and Flan-T5 (Chung et al., 2022), which share them.
VARIANTS |= {
    "flan-t5-small": dict(T5, width=512, num_layers=8, num_heads=6, mlp_dim=1024),
    "flan-t5-base": dict(T5, width=768, num_layers=12, num_heads=12, mlp_dim=2048),
    "flan-t5-large": dict(T5, width=1024, num_layers=24, num_heads=16, mlp_dim=2816),
    "flan-t5-xl": dict(T5, width=2048, num_layers=24, num_heads=32, mlp_dim=5120),
    "flan-t5-xxl": dict(T5, width=4096, num_layers=24, num_heads=64, mlp_dim=10240),
}
POSITIONS = ("sinusoidal", "relative")


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring."""

    vocab_size: int  # V, shared by source and target
    width: int = 512  # D = d_model
    num_layers: int = 6  # N, in the encoder and in the decoder
    num_heads: int = 8  # h
    mlp_dim: int = 2048  # d_ff
    head_dim: int | None = None  # d_k = d_v; width // num_heads when None (T5: 64)
    dropout_rate: float = 0.1  # P_drop: embeddings and every residual sub-layer
    attention_dropout_rate: float = 0.0  # on attention weights (not in the paper; T5's rate)
    mlp_dropout_rate: float = 0.0  # on the FFN's hidden activations (not in the paper; T5's)
    output_dropout: bool = False  # dropout_rate also on each stack's output, after its final
    # norm (T5)
    activation: str = "relu"  # FFN activation (T5 v1.1: "geglu_tanh")
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm, T5)
    norm_position: str = "post"  # "post" as in the paper, "pre" for stabler deep stacks
    norm_eps: float = 1e-6  # norm epsilon
    use_bias: bool = True  # biases in the attention and FFN projections (T5: none)
    position: str = "sinusoidal"  # added sinusoids (the paper) or "relative" (T5's bias)
    relative_buckets: int = 32  # position="relative": buckets of T5's relative distances
    relative_max_distance: int = 128  # ... and the distance where the last bucket starts
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) (the paper; T5: no)
    attention_scale: float | None = None  # logit scale; head_dim**-0.5 when None (T5: 1)
    share_embeddings: bool = True  # one token embedding for source and target
    tie_embeddings: bool | None = None  # the output projection is the target embedding^T;
    # share_embeddings when None (the paper: one matrix for all three; T5 v1.1: no)
    logits_bias: bool = False  # a learned [V] bias added to the logits (Marian)
    final_norm: bool = False  # a LayerNorm after each post-norm stack (torch.nn.Transformer)
    scan_layers: bool = False  # nn.scan over layers
    remat_policy: str = "none"  # see tfjax.nn.blocks.REMAT_POLICIES
    implementation: str | None = None  # attention backend
    kernel_init: Callable = tnn.attention.default_kernel_init  # every projection kernel
    dtype: Any = None  # compute dtype (float32 when None)
    param_dtype: Any = jnp.float32  # storage dtype

    def __post_init__(self):
        common.check_fields(self, position=one_of(*POSITIONS))
        self.block_config()  # the layers' configs check the fields they take
        super().__post_init__()

    def block_config(self) -> tnn.BlockConfig:
        """The encoder layers' config: the flat fields translated (common.block_config); the
        decoder's is the same made causal and with cross-attention."""
        return common.block_config(self)

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """An empty explicit KV cache of the decoder's self-attention for `batch_size` rows of
        up to `length` target tokens, to pass as `cache=` to `decode` with decode=True (as
        decoder.Decoder.init_cache)."""
        config = self.block_config().attention
        return common.init_cache(self, config, batch_size, length, dtype=dtype, sharding=sharding)

    @property
    def tied(self) -> bool:
        """Whether the logits are the target embedding^T (no output_proj)."""
        return self.share_embeddings if self.tie_embeddings is None else self.tie_embeddings

    def setup(self):
        def embed(name):
            return tnn.Embed(
                self.vocab_size,
                self.width,
                scale_by_sqrt_width=self.scale_embeddings,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=name,
            )

        def stack(config, name):
            # Pre-norm stacks always have a final norm; post-norm ones with final_norm.
            final_norm = True if self.final_norm else None
            return common.stack(
                self, config, name, final_norm=final_norm, kernel_init=self.kernel_init
            )

        self.embed = embed("embed")
        if not self.share_embeddings:
            self.target_embed = embed("target_embed")
        if not self.tied:
            self.output_proj = tnn.ffn.dense(
                self.vocab_size,
                (axes.EMBED, axes.VOCAB),
                name="output_proj",
                use_bias=False,
                kernel_init=self.kernel_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )
        if self.logits_bias:
            self.output_bias = self.param(
                "output_bias",
                nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
                (self.vocab_size,),
                self.param_dtype,
            )
        if self.position == "relative":  # one bias per stack, shared by its layers
            bias = functools.partial(
                tnn.position.RelativePositionBias,
                self.num_heads,
                num_buckets=self.relative_buckets,
                max_distance=self.relative_max_distance,
                param_dtype=self.param_dtype,
            )
            self.encoder_position_bias = bias(bidirectional=True)
            self.decoder_position_bias = bias(bidirectional=False)
        config = self.block_config()
        self.encoder = stack(config, "encoder")
        self.decoder = stack(
            dataclasses.replace(config, causal=True, cross_attention=True), "decoder"
        )
        self.dropout = nn.Dropout(self.dropout_rate)
        self.decode_positions = tnn.position.DecodePositions()

    def _relative_bias(self, which, length, decode_positions=None, cache=None):
        """[1, N, T, S] T5 bias of the stack `which` (None for other positions). By arange
        positions also for packed rows: it depends on key - query offsets only, which are the
        same within each packed segment (pairs across segments are masked), and it stays
        [1, ...] instead of [B, ...]. Decoding: `decode_positions` [T] against the whole cache
        (the explicit `cache` gives its length; else the collection keeps it)."""
        if self.position != "relative":
            return None
        bias = getattr(self, f"{which}_position_bias")
        if cache is not None:
            return bias(decode_positions, jnp.arange(max_length(cache)))
        if decode_positions is not None:
            return bias(decode_positions, decode=True)
        return bias(jnp.arange(length))

    def _stack_output(self, x, train):
        return self.dropout(x, deterministic=not train) if self.output_dropout else x

    def _embed(self, embed, tokens, positions, train):
        # [B, T, D]
        x = embed(tokens)
        if self.position == "sinusoidal":
            x = x + tnn.sinusoidal(positions, self.width, dtype=x.dtype)
        return self.dropout(x, deterministic=not train)

    def logits(self, y):
        """The output projection: y [B, T, D] final decoder states -> [B, T, V] logits."""
        # [B, T, V]
        if self.tied:
            embed = self.embed if self.share_embeddings else self.target_embed
            logits = embed.attend(y)
        else:
            logits = self.output_proj(y)
        if self.logits_bias:
            logits = logits + self.output_bias.astype(logits.dtype)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def encode(self, inputs, *, inputs_segment_ids=None, inputs_positions=None, train=False):
        """inputs: [B, S] source ids (0 = padding) -> [B, S, D] encoder output."""
        check_tokens(inputs, "inputs")
        positions = jnp.arange(inputs.shape[1]) if inputs_positions is None else inputs_positions
        x = self._embed(self.embed, inputs, positions, train)
        if inputs_segment_ids is None:  # padding (id 0) attends to nothing, is never attended
            inputs_segment_ids = masks.padding_ids(inputs)
        bias = self._relative_bias("encoder", inputs.shape[1])
        x = self.encoder(x, bias=bias, segment_ids=inputs_segment_ids, train=train)
        return self._stack_output(x, train)

    def decode(
        self,
        encoded,
        inputs,
        decoder_inputs,
        *,
        targets=None,
        targets_segment_ids=None,
        inputs_segment_ids=None,
        targets_positions=None,
        train=False,
        decode=False,
        apply_head=True,
        cache=None,
    ):
        """Decoder logits for already-shifted decoder inputs.

        Args:
          encoded: [B, S, D] from `encode`.
          inputs: [B, S] source ids (for the cross-attention padding mask).
          decoder_inputs: [B, T] ids; one token per call when decode=True.
          targets: [B, T] unshifted targets, for the decoder's padding mask in training.
          apply_head: False gives the final decoder states in place of the logits.
          cache: decode=True: the explicit KV cache (`init_cache`) in place of the "cache"
            collection; positions continue from what it holds.
        Returns:
          ([B, T, V] logits, [B, T, D] final decoder states); with `cache`, (that, the
          updated cache).
        """
        check_tokens(decoder_inputs, "decoder_inputs")
        t = decoder_inputs.shape[1]
        if targets_positions is not None:
            positions = targets_positions
        elif cache is not None:
            positions = next_position(cache) + jnp.arange(t)
        elif decode:
            positions = self.decode_positions(t)
        else:
            positions = jnp.arange(t)
        embed = self.embed if self.share_embeddings else self.target_embed
        y = self._embed(embed, decoder_inputs, positions, train)
        # Segment ids, not [T, S] masks (the attention kernels compare them block by block):
        # packed rows' own, else 1 for tokens and 0 for padding. Decoding (no targets) has a
        # causal cache and masks only the padded source keys.
        if inputs_segment_ids is None:
            inputs_segment_ids = masks.padding_ids(inputs)
        if targets_segment_ids is None and targets is not None:
            targets_segment_ids = masks.padding_ids(targets)
        bias = self._relative_bias("decoder", t, positions if decode else None, cache)
        y = self.decoder(
            y,
            encoded,
            bias=bias,
            segment_ids=targets_segment_ids,
            context_segment_ids=inputs_segment_ids,
            train=train,
            decode=decode,
            cache=cache,
        )
        if cache is not None:
            y, cache = y
        y = self._stack_output(y, train)
        out = (self.logits(y) if apply_head else y), y
        return out if cache is None else (out, cache)

    def __call__(
        self,
        inputs,
        targets,
        *,
        inputs_segment_ids=None,
        targets_segment_ids=None,
        inputs_positions=None,
        targets_positions=None,
        train: bool = False,
        apply_head: bool = True,
    ):
        """Teacher-forced logits.

        Args:
          inputs: [B, S] source ids, 0 = padding.
          targets: [B, T] target ids, 0 = padding; shifted right inside.
          *_segment_ids, *_positions: [B, S] / [B, T] for packed rows.
          apply_head: False returns the final decoder states [B, T, D] in place of the logits
            (`logits(hidden)` gives the logits).
        Returns:
          ([B, T, V] logits, aux) with aux["encoded"] [B, S, D], aux["pre_logits"] [B, T, D].
        """
        check_tokens(targets, "targets")
        encoded = self.encode(
            inputs,
            inputs_segment_ids=inputs_segment_ids,
            inputs_positions=inputs_positions,
            train=train,
        )
        decoder_inputs = shift_right(targets, targets_segment_ids)
        logits, y = self.decode(
            encoded,
            inputs,
            decoder_inputs,
            targets=targets,
            targets_segment_ids=targets_segment_ids,
            inputs_segment_ids=inputs_segment_ids,
            targets_positions=targets_positions,
            train=train,
            apply_head=apply_head,
        )
        return logits, {"encoded": encoded, "pre_logits": y}


def Model(variant: str | None = None, **overrides) -> Transformer:  # noqa: N802 (a factory)
    """Transformer(**VARIANTS[variant], **overrides); `vocab_size` is required."""
    return from_variant(Transformer, VARIANTS, variant, overrides)
