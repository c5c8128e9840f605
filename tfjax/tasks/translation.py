"""Translation with an encoder-decoder: teacher-forced next-token prediction of the targets.

Batch: "inputs" i32 [B, S], "targets" i32 [B, T] (each ends with eos; 0 = padding), with
packing also "{inputs,targets}_{segment_ids,positions}". The model shifts the targets right
itself, so logits [B, T, V] predict `targets` position by position. Metrics: loss, token
accuracy, perplexity; with config.decode the evaluation also decodes every eval batch and
reports corpus BLEU (`BleuEval`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from tfjax import sharding
from tfjax.tasks import losses
from tfjax.tasks.decoding import DecodeEval, eos_ids, gather

UNIT = "tokens"
_PACKED = ("inputs_segment_ids", "targets_segment_ids", "inputs_positions", "targets_positions")


def model_inputs(batch):
    kwargs = {k: batch[k] for k in _PACKED if k in batch}
    return (batch["inputs"], batch["targets"]), kwargs


def labels_and_weights(batch):
    """([B, T] targets, [B, T] weights: 1 on every real target token, 0 on padding)."""
    targets = batch["targets"]
    return targets, targets != 0


loss_and_stats = losses.cross_entropy_loss(labels_and_weights)
summarize = losses.token_metrics


def units_per_batch(batch):
    """Source and target tokens."""
    return batch["inputs"].shape[0] * (batch["inputs"].shape[1] + batch["targets"].shape[1])


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU (13a tokenisation, as WMT reports) of detokenised text."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


@dataclasses.dataclass(frozen=True)
class BleuEval(DecodeEval):
    """Decodes every eval batch's sources (decode.method greedy or beam; "sample" decodes
    greedily: BLEU scores one best output) and scores the outputs with corpus BLEU."""

    decode_config: ml_collections.ConfigDict  # config.decode
    unpacked_eval_rows = True  # one sentence pair per row: each source is decoded alone
    metrics = ("bleu",)

    @classmethod
    def from_config(cls, config) -> BleuEval | None:
        """BLEU of decoded eval batches whenever the config has a `decode` section."""
        return cls(config.decode) if config.get("decode") is not None else None

    def generate_args(self, exp, batch):
        """The batch's sources, at most decode.max_new_tokens new tokens each (0: the targets'
        length), decoded greedily or by beam search."""
        d = self.decode_config
        return batch["inputs"], dict(
            max_new_tokens=d.max_new_tokens or batch["targets"].shape[1],
            method="greedy" if d.method == "sample" else d.method,
            beam_size=d.beam_size,
            alpha=d.alpha,
            layout=d.layout,
        )

    def decode(self, exp, tokenizer, params, batch, *, step, index):
        """{"output", "reference"}: detokenised strings of the batch's real rows (padding rows
        dropped)."""
        from tfjax import decode

        inputs, kwargs = self.generate_args(exp, batch)
        eos = eos_ids(tokenizer)
        with sharding.logical_context(exp.mesh, exp.rules):
            tokens, _ = decode.generate(
                exp.model, params, inputs, eos_id=eos, check=False, **kwargs
            )
        tokens, targets = gather(tokens), gather(batch["targets"])
        real = (targets != 0).any(1)
        ends = decode.first_eos(tokens, eos)
        return [
            {"output": tokenizer.decode(t[:e]), "reference": tokenizer.decode(r)}
            for t, e, r in zip(tokens[real], ends[real], targets[real], strict=True)
        ]

    def finish(self, outputs):
        bleu = corpus_bleu([o["output"] for o in outputs], [o["reference"] for o in outputs])
        return {"bleu": bleu}, outputs[: self.decode_config.num_samples]


DECODE_EVAL = BleuEval  # the decode-eval hook (`tfjax.tasks.decode_eval`)
