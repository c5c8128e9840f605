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
import numpy as np

from tfjax import sharding
from tfjax.tasks import losses
from tfjax.tasks.decoding import DecodeEval, eos_ids, gather

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
    the [B, T, V] logits as the model gives them (measured in docs/performance.md, "What changed the
    CPU step")."""
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


def sample_prompts(tokens, weights, segment_ids, prompt_length: int, *, equal_lengths=False):
    """Each row's prompt, chosen by the weights, never by token ids (id 0 may be a real token):
    (prompts [N, W] int32, left-padded, with mask [N, W] bool true on prompt tokens) of host
    arrays tokens [B, T], weights [B, T] (> 0 on the loss's target tokens) and segment ids
    [B, T] (packed rows; None when unpacked), W = min(prompt_length, T).

    A row's real tokens are those up to its last weighted one (of its first segment when
    packed). Its prompt is what precedes its first weighted token after position 0 (the prompt
    of a prompt/completion row, the turns before a chat's first answer), or, when that is
    position 1 (plain text), its first prompt_length real tokens; a longer prompt keeps its last
    prompt_length tokens. Rows with nothing weighted after position 0 are dropped. With
    equal_lengths (beam search takes no padding) every prompt keeps the last tokens of the
    shortest one's length, and W is that length.
    """
    tokens, weights = np.asarray(tokens), np.asarray(weights) > 0
    if segment_ids is not None:
        segment_ids = np.asarray(segment_ids)
        weights = weights & (segment_ids == segment_ids[:, :1])
    prompts = []
    for row, weighted in zip(tokens, weights, strict=True):
        targets = np.flatnonzero(weighted[1:]) + 1
        if not targets.size:
            continue
        real = row[: targets[-1] + 1]
        prompts.append(real[:prompt_length] if targets[0] == 1 else real[: targets[0]])
    width = min(prompt_length, tokens.shape[1])
    if equal_lengths and prompts:
        width = min(width, *map(len, prompts))
    prompts = [p[max(len(p) - width, 0) :] for p in prompts]
    rows, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), bool)
    for r, p in enumerate(prompts):
        rows[r, width - len(p) :], mask[r, width - len(p) :] = p, True
    return rows, mask


@dataclasses.dataclass(frozen=True)
class SamplesEval(DecodeEval):
    """Continues the prompts of the first decode.num_samples rows of the first eval batch
    (`sample_prompts`: at most decode.prompt_length tokens each) with decode.method (sampling
    keyed by the seed and the step)."""

    decode_config: ml_collections.ConfigDict  # config.decode
    seed: int  # config.seed

    @classmethod
    def from_config(cls, config) -> SamplesEval | None:
        """Samples when the config's `decode` section asks for some (decode.num_samples > 0)."""
        d = config.get("decode")
        return cls(d, config.seed) if d is not None and d.num_samples else None

    def generate_args(self, exp, batch):
        """The prompts [N, W], taken to the host, with their mask among the keyword arguments,
        and at most decode.max_new_tokens (0: 32) new tokens each, within the model's max_len.
        Abstract prompts are replicated, num_samples rows of decode.prompt_length as decode()
        feeds at most.

        A batch without "weights" (hand-made ones, from before the loader gave them) counts
        every position as real and weighted: plain text, padding included."""
        d = self.decode_config
        tokens = batch["tokens"]
        if isinstance(tokens, jax.ShapeDtypeStruct):
            shape = (min(d.num_samples, tokens.shape[0]), min(d.prompt_length, tokens.shape[1]))
            rows = jax.ShapeDtypeStruct(shape, tokens.dtype, sharding=exp.replicated)
            mask = jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=exp.replicated)
        else:
            n = d.num_samples
            tokens = gather(tokens)[:n]
            weights = batch.get("weights")
            weights = np.ones(tokens.shape, bool) if weights is None else gather(weights)[:n]
            segment_ids = batch.get("tokens_segment_ids")
            segment_ids = None if segment_ids is None else gather(segment_ids)[:n]
            rows, mask = sample_prompts(
                tokens, weights, segment_ids, d.prompt_length, equal_lengths=d.method == "beam"
            )
        return rows, dict(
            mask=mask,
            max_new_tokens=min(d.max_new_tokens or 32, exp.model.max_len - rows.shape[1]),
            method=d.method,
            beam_size=d.beam_size,
            alpha=d.alpha,
            temperature=d.temperature,
            top_k=d.top_k,
            top_p=d.top_p,
            layout=d.layout,
        )

    def decode(self, exp, tokenizer, params, batch, *, step, index):
        """{"prompt", "output"} per prompt of the first batch (index 0); [] for the others. The
        prompt is shown whole, as the model read it (special tokens as text: a chat's earlier
        end-of-turn tokens too); the output ends before its first EOS of any of the tokenizer's
        EOS ids."""
        from tfjax import decode

        if index:
            return []
        rows, kwargs = self.generate_args(exp, batch)
        if not len(rows):
            return []
        rng = jax.random.fold_in(jax.random.key(self.seed), step)
        eos = eos_ids(tokenizer)
        with sharding.logical_context(exp.mesh, exp.rules):
            tokens, _ = decode.generate(exp.model, params, rows, eos_id=eos, rng=rng, **kwargs)
        tokens = gather(tokens)
        ends = decode.first_eos(tokens, eos)
        return [
            {"prompt": tokenizer.decode(r[m], whole=True), "output": tokenizer.decode(t[:e])}
            for r, m, t, e in zip(rows, kwargs["mask"], tokens, ends, strict=True)
        ]

    def finish(self, outputs):
        return {}, outputs


DECODE_EVAL = SamplesEval  # the decode-eval hook (`tfjax.tasks.decode_eval`)
