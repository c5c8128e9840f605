"""The GPT-like decoder family (tfjax.models.decoder) as a Flax NNX module.

Letters: B batch, T length, D model width, V vocab.

The same fields, presets (`decoder.VARIANTS`) and checks as the Linen model: both are built
from the family's spec (tfjax.specs.decoder.Decoder, its `spec`), which holds, checks and
translates the fields into the layers' configs, so a field, preset or check added there holds
in both; this file adds only the NNX modules, which compute the same function with the same
parameter tree:

    from flax import nnx
    from tfjax.nnx.models import decoder
    model = decoder.Model(variant="qwen3-0.6b", rngs=nnx.Rngs(0))
    logits, aux = model(tokens)                    # [B, T] -> [B, T, V], {"pre_logits": ...}
    nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the Linen model's params tree

A Linen checkpoint's `params` load with `tfjax.nnx.models.load_params(model, params)`; the
NNX model's go to Linen as `nnx.to_pure_dict(nnx.state(model, nnx.Param))`. Decoding passes the
explicit KV cache (`model.init_cache`, `cache=`), as the Linen model's explicit form does; there
is no "cache" collection. A mixture of experts (num_experts > 0) sows its routers' losses as
`blocks.AuxLoss` variables: `nnx.to_pure_dict(nnx.pop(model, blocks.AuxLoss))` after a call is
the Linen model's `mutable=["aux_losses"]` collection.
"""

from flax import linen as nn
from flax import nnx

from tfjax.nnx import blocks, models
from tfjax.ops import axes, head
from tfjax.ops.activations import softcap
from tfjax.ops.cache import query_positions
from tfjax.ops.position import sinusoidal
from tfjax.specs import decoder as decoder_spec
from tfjax.specs.common import check_tokens

VARIANTS = decoder_spec.VARIANTS


class Decoder(nnx.Module):
    """GPT-like decoder in NNX; see the module docstring. `spec`: the tfjax.specs.decoder
    Decoder whose fields say what to build, or a Linen tfjax.models.decoder Decoder (unbound),
    whose fields and methods are its spec's; `.spec` is the family spec."""

    def __init__(self, spec: decoder_spec.Decoder, *, rngs: nnx.Rngs):
        self.spec = spec = models.family_spec(spec)
        dtypes = dict(dtype=spec.dtype, param_dtype=spec.param_dtype)
        init = nn.initializers.normal(spec.init_stddev)
        self.embed = blocks.Embed(
            spec.vocab_size, spec.width, rngs=rngs, **spec.embed_options(), **dtypes
        )
        if not spec.tie_embeddings:
            self.output_proj = blocks.dense(
                spec.width,
                spec.vocab_size,
                (axes.EMBED, axes.VOCAB),
                use_bias=False,
                kernel_init=init,
                rngs=rngs,
                dot_general=head.dot_general,  # its two gradients made together, as Linen's
                **dtypes,
            )
        if spec.position == "learned":
            self.pos_embed = blocks.LearnedPositions(
                spec.max_len, spec.width, init_stddev=spec.init_stddev, rngs=rngs, **dtypes
            )
        # One stack, "decoder"; with first_dense_layers a "dense_decoder" before it.
        variants = spec.layer_variants()[1]
        stacks = spec.stacks()
        for i, (name, config, first, n) in enumerate(stacks):
            stack = blocks.Stack(
                config,
                n,
                spec.width,
                scan_layers=spec.scan_layers,
                remat_policy=spec.remat_policy,
                final_norm=None if i == len(stacks) - 1 else False,
                variants=None if variants is None else variants[first : first + n],
                kernel_init=init,
                rngs=rngs,
                **dtypes,
            )
            setattr(self, name, stack)
        # Where training's dropout keys come from (the "dropout" stream, else "default").
        self.rngs = rngs.fork()

    def init_cache(self, batch_size: int, length: int, *, dtype=None, sharding=None):
        """The spec's `init_cache`: an empty explicit KV cache for `cache=`."""
        return self.spec.init_cache(batch_size, length, dtype=dtype, sharding=sharding)

    def logits(self, x):
        """The output head: x [B, T, D] final hidden states -> [B, T, V] logits."""
        # [B, T, V]
        logits = self.embed.attend(x) if self.spec.tie_embeddings else self.output_proj(x)
        if self.spec.final_logit_softcap is not None:
            logits = softcap(logits, self.spec.final_logit_softcap)
        return nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def __call__(
        self,
        tokens,
        *,
        segment_ids=None,
        positions=None,
        train: bool = False,
        apply_head: bool = True,
        cache=None,
        rngs: nnx.Rngs | None = None,
    ):
        """The Linen model's call: tokens [B, T] ids -> ([B, T, V] logits, aux) with
        aux["pre_logits"] [B, T, D]; with `cache` (decoding), (that, the updated cache).

        train: dropout on, its keys from `rngs` (else the model's own) "dropout" stream.
        """
        spec = self.spec
        check_tokens(tokens, "tokens")
        t = tokens.shape[1]
        spec.check_length(t)
        positions = query_positions(t, positions, cache)
        key = None
        if train:
            key = (rngs or self.rngs).dropout()
        # [B, T, D]
        x = self.embed(tokens)
        if spec.position == "learned":
            x = x + self.pos_embed(positions)
        elif spec.position == "sinusoidal":
            x = x + sinusoidal(positions, spec.width, dtype=x.dtype)
        x = blocks.dropout(x, spec.dropout_rate, blocks.fold_key(key, 0))
        pos = positions if positions.ndim == 2 else positions[None]
        caches = []
        for i, ((name, *_), stack_cache) in enumerate(
            zip(spec.stacks(), spec.stack_caches(cache), strict=True)
        ):
            x = getattr(self, name)(
                x,
                segment_ids=segment_ids,
                positions=pos,
                dropout_rng=blocks.fold_key(key, 1 + i),
                cache=stack_cache,
            )
            if cache is not None:
                x, stack_cache = x
                caches.append(stack_cache)
        if cache is not None:
            cache = spec.join_caches(caches)
        out = (self.logits(x) if apply_head else x), {"pre_logits": x}
        return out if cache is None else (out, cache)


def Model(variant: str | None = None, *, rngs: nnx.Rngs, **overrides) -> Decoder:  # noqa: N802
    """Decoder(spec=tfjax.specs.decoder.Model(variant, **overrides)): the family's presets,
    fields and checks; `vocab_size` is required."""
    return Decoder(decoder_spec.Model(variant, **overrides), rngs=rngs)
