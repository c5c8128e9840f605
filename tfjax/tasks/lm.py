"""Causal language modelling (GPT-like decoders): predict every next token.

Batch: "tokens" i32 [B, T] and "weights" f32 [B, T] (1.0 on the tokens the loss trains, 0.0 on
padding and untrained tokens such as prompts), with packing also "tokens_segment_ids" and
"tokens_positions" [B, T]. Model output: logits [B, T, V], logits[:, t] predicting
tokens[:, t + 1]. A position is predicted when the next token has weight > 0 (padding comes
from the weights, never from a token id: id 0 is "!" in GPT-2, Llama 3, Qwen) and, in packed rows,
belongs to the same example. Metrics: loss, perplexity (from the unsmoothed NLL), accuracy;
with config.decode.num_samples the evaluation also continues that many eval prompts
(`SamplesEval`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from tfjax import sharding
from tfjax.tasks import losses
from tfjax.tasks.decoding import DecodeEval, gather

UNIT = "tokens"


def model_inputs(batch):
    """(tokens,), and with packing their segment ids and positions (also the mlm task's)."""
    kwargs = {}
    if "tokens_segment_ids" in batch:
        kwargs = dict(segment_ids=batch["tokens_segment_ids"], positions=batch["tokens_positions"])
    return (batch["tokens"],), kwargs


def _next(a, *, fill):
    """[B, T] -> [B, T]: a[:, t + 1] at position t, `fill` at the last position."""
    return jnp.pad(a[:, 1:], ((0, 0), (0, 1)), constant_values=fill)


def labels_and_weights(batch):
    """([B, T] labels, [B, T] weights): the next token of every position, weighted by the next
    token's batch["weights"] > 0 (0 after the last position); in packed rows a position whose
    next token starts another example has weight 0. All T positions keep their logits, the last
    one weighted 0, rather than slicing it off: a position of weight 0 adds nothing to any sum
    or to the gradient, so the sums are those of logits[:, :-1] against tokens[:, 1:], made from
    the [B, T, V] logits as the model gives them (measured in README, "What changed the CPU
    step")."""
    if "weights" not in batch:
        raise KeyError(
            'lm batches need "weights" f32 [B, T] (1.0 on the tokens the loss trains, 0.0 on '
            "padding), as tfjax.data loaders make them; for hand-made batches of tfjax "
            "tokenizer ids, where 0 is padding, (tokens != 0) is that mask"
        )
    labels = _next(batch["tokens"], fill=0)
    weights = _next(batch["weights"], fill=0) > 0
    if "tokens_segment_ids" in batch:
        seg = batch["tokens_segment_ids"]
        weights = weights & (seg == _next(seg, fill=-1))
    return labels, weights


loss_and_stats = losses.cross_entropy_loss(labels_and_weights)
summarize = losses.token_metrics


def units_per_batch(batch):
    return batch["tokens"].shape[0] * batch["tokens"].shape[1]


@dataclasses.dataclass(frozen=True)
class SamplesEval(DecodeEval):
    """Continues the first decode.num_samples rows of the first eval batch: each prompt is the
    row's first decode.prompt_length tokens, continued with decode.method (sampling keyed by
    the seed and the step)."""

    decode_config: ml_collections.ConfigDict  # config.decode
    seed: int  # config.seed

    @classmethod
    def from_config(cls, config) -> SamplesEval | None:
        """Samples when the config's `decode` section asks for some (decode.num_samples > 0)."""
        d = config.get("decode")
        return cls(d, config.seed) if d is not None and d.num_samples else None

    def generate_args(self, exp, batch):
        """The prompts, taken to the host (rows ending in padding dropped), and at most
        decode.max_new_tokens (0: 32) new tokens each, within the model's max_len. Abstract
        prompts are replicated, num_samples rows as decode() feeds at most."""
        d = self.decode_config
        tokens = batch["tokens"]
        if isinstance(tokens, jax.ShapeDtypeStruct):
            shape = (min(d.num_samples, tokens.shape[0]), min(d.prompt_length, tokens.shape[1]))
            rows = jax.ShapeDtypeStruct(shape, tokens.dtype, sharding=exp.replicated)
        else:
            rows = gather(tokens)[: d.num_samples, : d.prompt_length]
            rows = rows[(rows != 0).all(1)]  # a prompt must not end in padding
        return rows, dict(
            max_new_tokens=min(d.max_new_tokens or 32, exp.model.max_len - rows.shape[1]),
            method=d.method,
            beam_size=d.beam_size,
            alpha=d.alpha,
            temperature=d.temperature,
            top_k=d.top_k,
            top_p=d.top_p,
        )

    def decode(self, exp, tokenizer, params, batch, *, step, index):
        """{"prompt", "output"} per prompt of the first batch (index 0); [] for the others."""
        from tfjax import decode

        if index:
            return []
        rows, kwargs = self.generate_args(exp, batch)
        if not len(rows):
            return []
        rng = jax.random.fold_in(jax.random.key(self.seed), step)
        with sharding.logical_context(exp.mesh, exp.rules):
            tokens, _ = decode.generate(
                exp.model, params, rows, eos_id=tokenizer.eos_id, rng=rng, **kwargs
            )
        tokens = gather(tokens)
        return [
            {"prompt": tokenizer.decode(r), "output": tokenizer.decode(t)}
            for r, t in zip(rows, tokens, strict=True)
        ]

    def finish(self, outputs):
        return {}, outputs


DECODE_EVAL = SamplesEval  # the decode-eval hook (`tfjax.tasks.decode_eval`)
