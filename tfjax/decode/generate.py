"""Generation: greedy, temperature / top-k / top-p sampling and beam search, with a KV cache.

Letters: B batch, K beams, L buffer length, P prompt length, V vocab.

    tokens, scores = decode.generate(model, params, prompts, mask=mask, max_new_tokens=50,
                                     eos_id=eos)
    outputs = [row[:end] for row, end in zip(tokens, decode.first_eos(tokens, eos))]

`model` is a `tfjax.models.decoder` model or a `tfjax.models.transformer` model, or an NNX
model of `tfjax.nnx.models`, which holds its parameters: `decode.generate(model, prompts, ...)`
runs it through `tfjax.nnx.functional` on the same code path (and explicit cache). A decoder
continues prompts [B, P]; `mask` [B, P] (bool or 0/1, as transformers' `attention_mask`) is
true on prompt tokens: each row's are one run of columns starting at column 0 (right padding)
or ending at column P-1 (left padding: such rows are moved to the left edge first); no mask
means no padding. Padding is never inferred from token ids: id 0 is an ordinary token ("!" in
GPT-2, Llama 3 and Qwen). A transformer reads source ids [B, S] and gives the target sequence;
its source padding (id 0, tfjax's own ids) is the model's own business, so it takes no mask.

`eos_id` is one id or several (Llama 3 and Qwen chat checkpoints end a turn at any of two or
three): a row ends at the first it generates. `tokens` [B, max_new_tokens] holds the generated
ids, the row's EOS included, then `pad_id` (0) as filler; since the filler may be an ordinary
token, callers cut each row at its first EOS of any id (`first_eos`). `scores` [B] is the sum of
their log-probabilities under the model (for beam search divided by the length penalty
((5 + length) / 6)^alpha of Wu et al., 2016, which the paper uses with beam 4 and alpha 0.6).

Beam search takes decoder prompts of one length (no padding). It has two sets of rules. "gnmt"
(the default): finished hypotheses are scored with the penalty above, and the search stops once
no live beam can beat the worst finished one even at full length. "hf": transformers'
`generate(num_beams=K, length_penalty=alpha, early_stopping=...)`, so that a converted
checkpoint gives the reference's output: a score is log-probability / length^alpha; of the 2K
best candidates only those among the best K may finish; at max_new_tokens the best K live ones
finish too; `early_stopping` True stops a row once K have finished, False once the best live
beam, scored at its current length, cannot beat the worst finished one, "never" scores it at
full length instead (when alpha > 0). alpha=None is 0.6 under "gnmt" and transformers' default
length_penalty, 1.0, under "hf".

Everything after the argument checks is one jitted `lax.while_loop`. With `use_cache=True`
each step feeds one token through the model's KV cache: the explicit cache of tfjax's models
(`model.init_cache`, a pytree the loop carries), or the "cache" collection of a model without
one (`use_cache="collection"` takes the collection always; both give the same tokens);
`use_cache=False` recomputes the whole prefix every step (the reference the tests compare
against, and the benchmark's baseline).
"""

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from tfjax import sharding
from tfjax.nn import axes

METHODS = ("greedy", "sample", "beam")
BEAM_RULES = ("gnmt", "hf")
DEFAULT_ALPHA = {"gnmt": 0.6, "hf": 1.0}  # alpha=None: the paper's; transformers' length_penalty
EARLY_STOPPING = (True, False, "never")  # transformers' values (beam_rules="hf")
CACHES = (True, False, "collection")  # use_cache's values
_NEG = -1e30  # a finite "minus infinity": keeps arithmetic on dead beams NaN-free


def _is_encoder_decoder(model) -> bool:
    return hasattr(model, "encode")


def _eos_ids(eos_id, vocab: int) -> tuple[int, ...]:
    """eos_id (an int or a sequence of ints) as a tuple of ids: hashable, a static jit argument."""
    ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else eos_id
    try:
        ids = tuple(ids)
    except TypeError:
        raise ValueError(f"eos_id={eos_id!r} must be an id or a sequence of ids") from None
    if not ids:
        raise ValueError("eos_id is empty; give at least one EOS id")
    for e in ids:
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < vocab:
            raise ValueError(f"eos_id={eos_id!r} holds {e!r}, not an id in [0, {vocab})")
    return tuple(dict.fromkeys(int(e) for e in ids))  # in order, each once


class OptionError(ValueError):
    """A decoding option outside what it allows; `option` is its keyword ("top_p")."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def check_options(
    *,
    method,
    max_new_tokens,
    beam_size=4,
    beam_rules="gnmt",
    early_stopping=False,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    layout="auto",
) -> None:
    """The checks of `generate`'s options that need no model or inputs (a command line makes
    them before loading anything): OptionError naming the option and what it allows."""
    if method not in METHODS:
        raise OptionError("method", f"method={method!r} is unknown; allowed: {METHODS}")
    _check_layout(layout)
    if beam_rules not in BEAM_RULES:
        raise OptionError(
            "beam_rules", f"beam_rules={beam_rules!r} is unknown; allowed: {BEAM_RULES}"
        )
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise OptionError(
            "early_stopping",
            f"early_stopping={early_stopping!r} is unknown; allowed: {EARLY_STOPPING}",
        )
    if method == "beam" and beam_rules == "gnmt" and early_stopping is not False:
        raise OptionError(
            "early_stopping",
            f"early_stopping={early_stopping!r} applies to beam_rules='hf' only (the 'gnmt' "
            "rules stop once no live beam can beat the worst finished one)",
        )
    if max_new_tokens < 1:
        raise OptionError(
            "max_new_tokens", f"max_new_tokens must be at least 1, got {max_new_tokens}"
        )
    if method == "beam" and beam_size < 1:
        raise OptionError("beam_size", f"beam_size must be at least 1, got {beam_size}")
    if method == "sample":
        if not temperature > 0:  # NaN too
            raise OptionError(
                "temperature", f"temperature must be > 0 for sampling, got {temperature}"
            )
        if top_k < 0:
            raise OptionError("top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise OptionError("top_p", f"top_p must be in (0, 1], got {top_p}")


def _check(
    model,
    width,
    *,
    method,
    max_new_tokens,
    eos_id,
    pad_id,
    beam_size,
    beam_rules,
    early_stopping,
    temperature,
    top_k,
    top_p,
):
    """Host-side validation of the options, for prompts of `width` columns: every message names
    the option and what is allowed. Returns eos_id as a tuple of ids."""
    check_options(
        method=method,
        max_new_tokens=max_new_tokens,
        beam_size=beam_size,
        beam_rules=beam_rules,
        early_stopping=early_stopping,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    vocab = model.vocab_size
    eos_ids = _eos_ids(eos_id, vocab)
    if not (isinstance(pad_id, (int, np.integer)) and 0 <= pad_id < vocab):
        raise ValueError(f"pad_id={pad_id!r} is not an id in [0, {vocab})")
    if not _is_encoder_decoder(model):
        total = width + max_new_tokens
        # A learned position table ends at max_len (RoPE goes on; a model without the field: as
        # learned)
        if getattr(model, "position", "learned") == "learned" and total > model.max_len:
            raise ValueError(
                f"prompt length {width} + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds the model's max_len={model.max_len}"
            )
    return eos_ids


def _check_mask_shape(model, inputs, mask):
    """The mask's shape and type, which a host can check without reading any array."""
    if mask is None:
        return
    if _is_encoder_decoder(model):
        raise ValueError(
            "mask applies to decoder prompts; an encoder-decoder model masks its source "
            "padding (id 0) itself: give mask=None"
        )
    if tuple(mask.shape) != tuple(inputs.shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; the inputs' is {inputs.shape}")
    if not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
        raise ValueError(f"mask must be bool or integer (0/1), got {mask.dtype}")


def _check_inputs(model, inputs, mask, method) -> np.ndarray:
    """Host-side validation of the ids and the mask; returns the prompt lengths [B] (of a
    decoder's prompts; all S for an encoder-decoder's sources)."""
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.integer):
        raise ValueError(f"inputs must be [B, P] integer ids, got {inputs.shape} {inputs.dtype}")
    if not inputs.shape[1]:
        raise ValueError(f"inputs {inputs.shape} have no tokens; give at least one per row")
    vocab = model.vocab_size
    if inputs.size and (inputs.min() < 0 or inputs.max() >= vocab):
        bad = inputs[(inputs < 0) | (inputs >= vocab)][0]
        raise ValueError(f"inputs hold token id {bad}, outside the vocabulary [0, {vocab})")
    if mask is None:
        return np.full(inputs.shape[0], inputs.shape[1])
    mask = np.asarray(mask)
    _check_mask_shape(model, inputs, mask)
    mask = mask.astype(bool)
    lengths = mask.sum(1)
    for row, m in enumerate(mask):
        # [start, end) of each run of prompt columns
        runs = np.flatnonzero(np.diff(np.concatenate([[False], m, [False]]))).reshape(-1, 2)
        if not len(runs):
            raise ValueError(f"mask row {row} is empty (all padding); give at least one token")
        if len(runs) > 1 or (runs[0, 0] and runs[0, 1] != len(m)):
            spans = ", ".join(f"{a}..{b - 1}" for a, b in runs)
            raise ValueError(
                f"mask row {row} is true on columns {spans} of 0..{len(m) - 1}: a row's prompt "
                "tokens must be one run from column 0 (right padding) or up to the last column "
                "(left padding)"
            )
    if method == "beam" and (lengths != inputs.shape[1]).any():
        raise ValueError("beam search needs prompts of equal length (no padding)")
    return lengths


def first_eos(tokens, eos_id) -> np.ndarray:
    """[B] the column of each row's first EOS (any of `eos_id`'s ids) in generated tokens
    [B, N], N where a row has none: row b's output is tokens[b, :first_eos[b]], what follows its
    EOS being filler."""
    tokens = np.asarray(tokens)
    is_eos = np.isin(tokens, (eos_id,) if np.isscalar(eos_id) else list(eos_id))
    return np.where(is_eos.any(1), is_eos.argmax(1), tokens.shape[1])


def _left_aligned(prompts, mask, pad_id):
    """Prompts [B, P] with each row's prompt tokens (mask [B, P]) moved to the left edge and
    `pad_id` after them, and their lengths [B]: the right-padded batch the loop reads, whose
    positions start at 0 in every row. Runs on the devices (the rows may be sharded)."""
    b, width = prompts.shape
    if mask is None:
        return prompts, jnp.full(b, width, jnp.int32)
    mask = mask.astype(bool)
    lengths = mask.sum(1, dtype=jnp.int32)
    lead = jnp.argmax(mask, 1)  # [B] the first prompt column: 0 unless left-padded
    # [B, P]: row b read from column (p + lead[b]) mod P
    columns = (jnp.arange(width)[None] + lead[:, None]) % width
    prompts = jnp.take_along_axis(prompts, columns, axis=1)
    return jnp.where(jnp.arange(width)[None] < lengths[:, None], prompts, pad_id), lengths


def _is_eos(tokens, eos_ids):
    """tokens [...] -> bool [...]: is each one of the EOS ids."""
    return functools.reduce(jnp.logical_or, [tokens == e for e in eos_ids])


# ----------------------------------------------------------------------------------------------
# The model side: a step function mapping the tokens at one position to next-token logits.


class _Stepper:
    """Wraps a model into init_state(batch) and step(state, tokens [B, T], i) -> logits.

    With the cache the state is the model's explicit KV cache (a model with `init_cache`, unless
    use_cache="collection") or its "cache" collection; without it the state is unused and
    `step` reruns the model on the whole buffer (given as `buffer`) and reads position i.
    """

    def __init__(self, model, params, length, use_cache, inputs=None, encoded=None):
        self.model, self.params, self.length, self.use_cache = model, params, length, use_cache
        explicit = use_cache and use_cache != "collection"
        self.explicit = explicit and hasattr(model, "init_cache")
        self.enc_dec = _is_encoder_decoder(model)
        self.inputs = inputs  # [B, S] source ids (encoder-decoder only)
        self.encoded = encoded  # [B, S, D] encoder output, computed once
        if self.enc_dec and encoded is None:
            self.encoded = model.apply({"params": params}, inputs, method="encode")

    def repeat(self, k):
        """The same stepper for K beams per row (source and encoder output repeated)."""
        if not self.enc_dec:
            return self
        rep = functools.partial(jnp.repeat, repeats=k, axis=0)
        return _Stepper(
            self.model,
            self.params,
            self.length,
            self.use_cache,
            rep(self.inputs),
            rep(self.encoded),
        )

    def _call(self, variables, tokens, decode, **kwargs):
        if self.enc_dec:
            args, kwargs = (self.encoded, self.inputs, tokens), dict(kwargs, method="decode")
        else:
            args = (tokens,)
        return self.model.apply(variables, *args, decode=decode, **kwargs)

    def init_state(self, batch):
        if not self.use_cache:
            return jnp.zeros((), jnp.int32)
        if self.explicit:
            return self.model.init_cache(batch, self.length)
        tokens = jnp.zeros((batch, self.length), jnp.int32)
        shapes = jax.eval_shape(
            lambda: self._call({"params": self.params}, tokens, True, mutable=["cache"])[1]
        )
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def prefill(self, state, tokens):
        """Feeds a prompt's first tokens [B, T] into the cache (nothing to do without one)."""
        if not self.use_cache or tokens.shape[1] == 0:
            return state
        return self.step(state, tokens, 0, None)[1]

    def step(self, state, tokens, i, buffer):
        """Logits [B, T, V] for `tokens` at positions i.. (cached) or for buffer[:, i]."""
        if self.explicit:
            (logits, _), state = self._call({"params": self.params}, tokens, True, cache=state)
            return logits, state
        if self.use_cache:
            (logits, _), mut = self._call(
                {"params": self.params, "cache": state}, tokens, True, mutable=["cache"]
            )
            return logits, mut["cache"]
        logits, _ = self._call({"params": self.params}, buffer, False)
        return lax.dynamic_slice_in_dim(logits, i, tokens.shape[1], axis=1), state

    def batch_axis(self, path) -> int:
        """The batch axis of the state's leaf at `path`: 1 behind a scanned stack's layer axis
        (the explicit cache's leaves, the collection's under "layers"), else 0."""
        if not getattr(self.model, "scan_layers", False):
            return 0
        return 1 if self.explicit or any(getattr(p, "key", None) == "layers" for p in path) else 0


# ----------------------------------------------------------------------------------------------
# Greedy and sampling.


def _filter_logits(logits, temperature, top_k, top_p):
    """Temperature, then top-k, then nucleus (top-p) filtering of [B, V] logits."""
    logits = logits / temperature
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, _NEG, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cutoff_index = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, _NEG, logits)
    return logits


def _sample_loop(
    stepper,
    buffer,
    lengths,
    min_length,
    *,
    max_new_tokens,
    eos_id,
    pad_id,
    method,
    temperature,
    top_k,
    top_p,
    rng,
):
    """Token-by-token loop; buffer [B, L] holds each prompt (lengths [B]), then pad_id."""
    b, total = buffer.shape
    full = lengths + max_new_tokens  # [B] a row is done at EOS or when it reaches this length
    start = min_length - 1  # the first position whose next token is not forced in every row
    state = stepper.init_state(b)
    state = stepper.prefill(state, buffer[:, :start])  # the prompts' shared part, in one call

    def cond(c):
        i, _, _, done, _ = c
        return (i < total - 1) & ~jnp.all((done | (i + 1 >= full)) & (i + 1 >= lengths))

    def body(c):
        i, buffer, state, done, scores = c
        # A shorter prompt's row has all its new tokens before the buffer's end: score no more.
        done = done | (i + 1 >= full)
        logits, state = stepper.step(state, lax.dynamic_slice_in_dim(buffer, i, 1, 1), i, buffer)
        logits = logits[:, 0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        if method == "greedy":
            nxt = jnp.argmax(logits, -1)
        else:
            filtered = _filter_logits(logits, temperature, top_k, top_p)
            nxt = jax.random.categorical(jax.random.fold_in(rng, i), filtered)
        forced = i + 1 < lengths
        prompt_next = lax.dynamic_slice_in_dim(buffer, i + 1, 1, 1)[:, 0]
        nxt = jnp.where(forced, prompt_next, jnp.where(done, pad_id, nxt)).astype(buffer.dtype)
        gained = jnp.take_along_axis(logp, nxt[:, None], -1)[:, 0]
        scores = scores + jnp.where(forced | done, 0.0, gained)
        done = done | (~forced & _is_eos(nxt, eos_id))
        buffer = lax.dynamic_update_slice_in_dim(buffer, nxt[:, None], i + 1, 1)
        return i + 1, buffer, state, done, scores

    init = (jnp.asarray(start), buffer, state, jnp.zeros(b, bool), jnp.zeros(b))
    _, buffer, _, _, scores = lax.while_loop(cond, body, init)
    return buffer, scores


# ----------------------------------------------------------------------------------------------
# Beam search.


def _length_penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def _gather_beams(tree, index, batch, beams, batch_axis):
    """Reorders every batched leaf of [B * K, ...] (or [layers, B * K, ...]: `batch_axis(path)`
    says which) by index [B, K].

    Each row picks among its own K beams (a gather batched over B), so with the batch sharded
    the reordering stays on each device; a gather by flat [B * K] indices made XLA all-gather
    the whole KV cache at every step.
    """

    def gather(path, x):
        axis = batch_axis(path)
        if x.ndim <= axis or x.shape[axis] != batch * beams:
            return x  # cache indices: not per example
        rows = x.reshape(x.shape[:axis] + (batch, beams) + x.shape[axis + 1 :])
        picked = jax.vmap(lambda r, i: jnp.take(r, i, axis=axis), in_axes=(axis, 0), out_axes=axis)(
            rows, index
        )
        return picked.reshape(x.shape)

    return jax.tree_util.tree_map_with_path(gather, tree)


def _beam_start(stepper, prompt, k, max_new_tokens, pad_id):
    """The stepper for K beams per row and the search's start: [B, K, L] beams that are all the
    prompt (then pad_id, what a finished beam keeps after its EOS) with only beam 0 alive, the
    cache holding the prompt but its last token, and K empty finished slots per row."""
    b, p = prompt.shape
    total = p + max_new_tokens
    stepper = stepper.repeat(k)
    seqs = jnp.full((b, k, total), pad_id, jnp.int32).at[:, :, :p].set(prompt[:, None])
    live_logp = jnp.tile(jnp.array([0.0] + [_NEG] * (k - 1)), (b, 1))
    state = stepper.init_state(b * k)
    state = stepper.prefill(state, seqs[:, :, : p - 1].reshape(b * k, -1))
    return stepper, seqs, live_logp, state, jnp.full_like(seqs, pad_id), jnp.full((b, k), _NEG)


def _candidates(stepper, state, seqs, live_logp, i):
    """The best 2K continuations of each row's K beams by summed log-probability (they always
    hold K that do not end): scores, origin beams, tokens and sequences [B, 2K, L]."""
    b, k, total = seqs.shape
    flat = seqs.reshape(b * k, total)
    logits, state = stepper.step(state, lax.dynamic_slice_in_dim(flat, i, 1, 1), i, flat)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)).reshape(b, k, -1)
    vocab = logp.shape[-1]
    # [B, K * V] -> [B, 2K]
    top_logp, top_idx = lax.top_k((live_logp[..., None] + logp).reshape(b, k * vocab), 2 * k)
    origin, token = top_idx // vocab, top_idx % vocab
    top_seqs = jnp.take_along_axis(seqs, origin[..., None], axis=1)
    top_seqs = lax.dynamic_update_slice_in_dim(top_seqs, token[..., None], i + 1, 2)
    return top_logp, origin, token, top_seqs, state


def _advance(state, fin_seqs, fin_scores, fin_cand, top_seqs, top_logp, origin, ends, axis):
    """The K best finished of the old and the new (`fin_cand` scores, _NEG: not finishing) and
    the K best live candidates (those that do not `end`), the cache reordered to follow them."""
    b, k = fin_scores.shape
    fin_scores, keep = lax.top_k(jnp.concatenate([fin_scores, fin_cand], 1), k)
    fin_seqs = jnp.take_along_axis(jnp.concatenate([fin_seqs, top_seqs], 1), keep[..., None], 1)
    live_logp, keep = lax.top_k(jnp.where(ends, _NEG, top_logp), k)
    seqs = jnp.take_along_axis(top_seqs, keep[..., None], axis=1)
    state = _gather_beams(state, jnp.take_along_axis(origin, keep, 1), b, k, axis)
    return seqs, live_logp, fin_seqs, fin_scores, state


def _gnmt_beam_loop(
    stepper, prompt, *, eos_id, pad_id, beam_size, alpha, max_new_tokens, early_stopping
):
    """Beam search by GNMT's rules (Wu et al.); see the module docstring."""
    del early_stopping  # these rules stop once no live beam can beat a finished one
    p, total = prompt.shape[1], prompt.shape[1] + max_new_tokens
    stepper, seqs, live_logp, state, fin_seqs, fin_scores = _beam_start(
        stepper, prompt, beam_size, max_new_tokens, pad_id
    )
    axis = stepper.batch_axis
    max_penalty = _length_penalty(max_new_tokens, alpha)

    def cond(c):
        i, _, live_logp, _, fin_scores, _ = c
        # Stop early once no live beam can beat the worst finished one, even at full length.
        best_possible = live_logp[:, 0] / max_penalty
        hopeless = jnp.all(fin_scores[:, -1] >= best_possible)
        return (i < total - 1) & ~hopeless

    def body(c):
        i, seqs, live_logp, fin_seqs, fin_scores, state = c
        top_logp, origin, token, top_seqs, state = _candidates(stepper, state, seqs, live_logp, i)
        is_eos = _is_eos(token, eos_id)
        # Finished: EOS candidates, scored with the length penalty.
        length = (i + 2 - p).astype(jnp.float32)
        fin_cand = jnp.where(is_eos, top_logp / _length_penalty(length, alpha), _NEG)
        seqs, live_logp, fin_seqs, fin_scores, state = _advance(
            state, fin_seqs, fin_scores, fin_cand, top_seqs, top_logp, origin, is_eos, axis
        )
        return i + 1, seqs, live_logp, fin_seqs, fin_scores, state

    init = (jnp.asarray(p - 1), seqs, live_logp, fin_seqs, fin_scores, state)
    _, seqs, live_logp, fin_seqs, fin_scores, _ = lax.while_loop(cond, body, init)
    # Rows where no beam finished return their best live beam, scored at full length.
    none_finished = fin_scores[:, 0] <= _NEG / 2
    best = jnp.where(none_finished[:, None], seqs[:, 0], fin_seqs[:, 0])
    score = jnp.where(none_finished, live_logp[:, 0] / max_penalty, fin_scores[:, 0])
    return best, score


def _hf_beam_loop(
    stepper, prompt, *, eos_id, pad_id, beam_size, alpha, max_new_tokens, early_stopping
):
    """Beam search by transformers' rules (its `_beam_search`); see the module docstring."""
    k, p = beam_size, prompt.shape[1]
    total = p + max_new_tokens
    stepper, seqs, live_logp, state, fin_seqs, fin_scores = _beam_start(
        stepper, prompt, k, max_new_tokens, pad_id
    )
    axis = stepper.batch_axis
    improvable = jnp.ones(prompt.shape[0], bool)  # may a finished hypothesis still change?
    best_rank = jnp.arange(2 * k) < k  # only the best K candidates may finish

    def finished(scores):
        return scores > _NEG / 2

    def cond(c):
        i, _, _, _, fin_scores, improvable, _ = c
        going = (i < total - 1) & jnp.any(improvable)
        if early_stopping is True:  # every row has K finished
            going = going & ~jnp.all(finished(fin_scores))
        return going

    def body(c):
        i, seqs, live_logp, fin_seqs, fin_scores, improvable, state = c
        top_logp, origin, token, top_seqs, state = _candidates(stepper, state, seqs, live_logp, i)
        # A candidate stops at EOS or at full length (then every one does).
        stops = _is_eos(token, eos_id) | (i + 2 >= total)
        length = (i + 2 - p).astype(jnp.float32)
        full = jnp.all(finished(fin_scores), -1) & (early_stopping is True)
        may_finish = stops & best_rank & (improvable & ~full)[:, None]
        fin_cand = jnp.where(may_finish, top_logp / length**alpha, _NEG)
        seqs, live_logp, fin_seqs, fin_scores, state = _advance(
            state, fin_seqs, fin_scores, fin_cand, top_seqs, top_logp, origin, stops, axis
        )
        # Can the best live beam still beat the worst finished one (any slot still empty: yes)?
        hoped = total - p if (early_stopping == "never" and alpha > 0) else i + 2 - p
        best_possible = live_logp[:, 0] / jnp.asarray(hoped, jnp.float32) ** alpha
        worst = jnp.where(jnp.all(finished(fin_scores), -1), fin_scores.min(-1), _NEG)
        improvable = improvable & (best_possible > worst)
        return i + 1, seqs, live_logp, fin_seqs, fin_scores, improvable, state

    init = (jnp.asarray(p - 1), seqs, live_logp, fin_seqs, fin_scores, improvable, state)
    _, _, _, fin_seqs, fin_scores, _, _ = lax.while_loop(cond, body, init)
    return fin_seqs[:, 0], fin_scores[:, 0]


# ----------------------------------------------------------------------------------------------
# The parameters' layout for the token loop.
#
# Training lays the parameters out for the train step (FSDP shards every kernel over the data
# axes, in float32). Read from that layout every step of the token loop would all-gather the
# whole model per generated token: neither libtpu nor XLA's GPU compiler hoists that
# loop-invariant gather out of the while loop. So `_generate` lays them out once per call,
# before the loop, as `layout` says:
#   "replicated": every device holds the whole model in the compute dtype (one all-gather of a
#       compute-dtype copy per call; the loop is data parallel and moves no weights);
#   "tensor": the kernels split over every mesh axis along their heads / mlp / vocab dimension
#       (the embed dimension whole), the rows replicated: the loop moves activations only
#       (a contraction split over devices sums its partial results in the compute dtype: in
#       bf16 the logits round otherwise than on one device; in float32 they are the same);
#   "auto": "replicated" when that copy takes at most REPLICATE_FRACTION of a device's memory,
#       else "tensor";
#   "as-given": the parameters as they come (storage dtype, training layout).
# Only kernels and embedding tables (an embed axis beside a heads / mlp / vocab axis, which
# every use casts to the compute dtype) are cast, so the outputs do not change; norms, biases,
# routers and relative-position tables keep their dtype.

LAYOUTS = ("auto", "replicated", "tensor", "as-given")
REPLICATE_FRACTION = 0.4
_SPLIT_AXES = (axes.HEADS, axes.KV_HEADS, axes.MLP, axes.VOCAB)  # what "tensor" shards


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise OptionError("layout", f"layout={layout!r} is unknown; allowed: {LAYOUTS}")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Per parameter leaf (flattened): the dtype to cast to (None: keep) and the sharding (None:
    unconstrained); `rules`: the logical rules the loop's activations follow (None: the
    caller's). Hashable: a static argument of the jitted `_generate`."""

    treedef: Any
    dtypes: tuple
    shardings: tuple
    sources: tuple  # the leaves' own shardings (None: not a NamedSharding)
    rules: tuple | None = None

    def apply(self, params):
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.treedef:
            raise ValueError(f"parameters {treedef} do not match the layout's {self.treedef}")
        out = []
        for x, dtype, where, source in zip(
            leaves, self.dtypes, self.shardings, self.sources, strict=True
        ):
            if dtype is not None:
                x = x.astype(dtype)
                if source is not None:  # cast where it lies: else the compiler gathers first
                    x = lax.with_sharding_constraint(x, source)
            out.append(x if where is None else lax.with_sharding_constraint(x, where))
        return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=8)
def _logical_names(model) -> list[tuple]:
    """Each parameter leaf's logical axis names, in tree order (() where it has none)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    args = (ids, ids) if _is_encoder_decoder(model) else (ids,)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)).get("params", {})
    specs = nn.get_partition_spec(boxed)
    return [
        tuple(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    ]


def _device_memory(device) -> int | None:
    """Bytes one device may allocate, from its runtime (None: a host CPU, or a compile-only
    device, for which the caller gives the target's memory)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # compile-only devices have no runtime
        limit = None
    return int(limit) if limit else None


def decode_layout(model, params, layout="auto", *, memory_bytes=None) -> _Layout | None:
    """How `generate` lays out `params` (arrays or ShapeDtypeStructs, unboxed) for its token
    loop (see the section's comment): None for "as-given". memory_bytes: of one device (None:
    what its runtime reports; none reported, as on a CPU, counts as room enough)."""
    _check_layout(layout)
    leaves, treedef = jax.tree.flatten(params)
    if layout == "as-given" or not leaves:
        return None
    names = _logical_names(model)
    if len(names) != len(leaves):  # a tree the model does not make (e.g. a wrapped model's)
        names = [()] * len(leaves)
    compute = jnp.dtype(getattr(model, "dtype", None) or jnp.float32)

    def cast(x, n):
        kernel = axes.EMBED in n and any(a in n for a in _SPLIT_AXES)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return compute if kernel and floating and x.dtype.itemsize > compute.itemsize else None

    dtypes = tuple(cast(x, n) for x, n in zip(leaves, names, strict=True))
    copy_bytes = sum(
        math.prod(x.shape) * jnp.dtype(d or x.dtype).itemsize
        for x, d in zip(leaves, dtypes, strict=True)
    )
    sources = tuple(
        x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
        for x in leaves
    )
    mesh = next((s.mesh for s in sources if s is not None), None)
    if mesh is None or mesh.size == 1:  # one device: the cast is the whole layout
        return _Layout(treedef, dtypes, (None,) * len(leaves), sources)
    if layout == "auto":
        if memory_bytes is None:
            memory_bytes = _device_memory(mesh.devices.flat[0])
        fits = memory_bytes is None or copy_bytes <= REPLICATE_FRACTION * memory_bytes
        layout = "replicated" if fits else "tensor"
    if layout == "replicated":
        replicated = (NamedSharding(mesh, PartitionSpec()),) * len(leaves)
        return _Layout(treedef, dtypes, replicated, sources)
    # Split a kernel axis over the whole mesh where every kernel's dimension of it divides.
    mesh_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    parts, split = mesh.size, mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
    dims = [
        (name, x.shape[d]) for x, n in zip(leaves, names, strict=True) for d, name in enumerate(n)
    ]
    splits = {a for a in _SPLIT_AXES if all(size % parts == 0 for name, size in dims if name == a)}

    def spec(n, ndim):
        dim = next((d for d, name in enumerate(n) if name in splits), None)
        return PartitionSpec(*(split if d == dim else None for d in range(ndim)))

    shardings = tuple(
        NamedSharding(mesh, spec(n, x.ndim)) for x, n in zip(leaves, names, strict=True)
    )
    # The rows replicated (absent names are not split), the activations split as the kernels.
    acts = {axes.ACT_MLP: {axes.MLP}, axes.ACT_VOCAB: {axes.VOCAB}}
    acts[axes.ACT_HEADS] = {axes.HEADS, axes.KV_HEADS}
    rules = tuple((act, split) for act, kernel in acts.items() if kernel <= splits)
    rules += ((axes.BATCH, None),)
    return _Layout(treedef, dtypes, shardings, sources, rules)


# ----------------------------------------------------------------------------------------------


# generate's keyword arguments that shape its compiled program.
PROGRAM_OPTIONS = (
    "max_new_tokens",
    "eos_id",
    "pad_id",
    "method",
    "beam_size",
    "alpha",
    "beam_rules",
    "early_stopping",
    "temperature",
    "top_k",
    "top_p",
)


@functools.partial(
    jax.jit,
    static_argnames=("model", *PROGRAM_OPTIONS, "use_cache", "min_length", "layout"),
)
def _generate(model, params, inputs, mask, rng, *, layout, **options):
    if layout is None:
        return _generate_body(model, params, inputs, mask, rng, **options)
    params = layout.apply(params)  # once, before the token loop
    rules = contextlib.nullcontext()
    if layout.rules is not None:  # the rows replicated, the activations split as the kernels
        rules = sharding.logical_context(layout.shardings[0].mesh, layout.rules)
    with rules:
        return _generate_body(model, params, inputs, mask, rng, **options)


def _generate_body(
    model,
    params,
    inputs,
    mask,
    rng,
    *,
    max_new_tokens,
    eos_id,
    pad_id,
    method,
    beam_size,
    alpha,
    beam_rules,
    early_stopping,
    temperature,
    top_k,
    top_p,
    use_cache,
    min_length,
):
    b, width = inputs.shape
    if _is_encoder_decoder(model):
        prompt_len = 1  # the start token 0
        stepper = _Stepper(model, params, max_new_tokens + 1, use_cache, inputs)
        prompt = jnp.zeros((b, 1), jnp.int32)
        lengths = jnp.ones(b, jnp.int32)
    else:
        prompt_len = width
        stepper = _Stepper(model, params, width + max_new_tokens, use_cache)
        prompt, lengths = _left_aligned(inputs.astype(jnp.int32), mask, pad_id)
    if method == "beam":
        beam_loop = _hf_beam_loop if beam_rules == "hf" else _gnmt_beam_loop
        seqs, scores = beam_loop(
            stepper,
            prompt,
            eos_id=eos_id,
            pad_id=pad_id,
            beam_size=beam_size,
            alpha=alpha,
            max_new_tokens=max_new_tokens,
            early_stopping=early_stopping,
        )
        return seqs[:, prompt_len:], scores
    buffer = jnp.pad(prompt, ((0, 0), (0, max_new_tokens)), constant_values=pad_id)
    buffer, scores = _sample_loop(
        stepper,
        buffer,
        lengths,
        min_length,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        method=method,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=rng,
    )
    # Each row's continuation starts right after its own prompt: [B, max_new_tokens].
    idx = lengths[:, None] + jnp.arange(max_new_tokens)[None]
    return jnp.take_along_axis(buffer, idx, axis=1), scores


def _functional(model, params, inputs):
    """(model, params, inputs) of generate's arguments: an NNX model, given as
    generate(model, inputs, ...), as its Functional and parameters (tfjax.nnx.functional)."""
    if not isinstance(model, nnx.Module):
        if inputs is None:
            raise TypeError("generate(model, params, inputs, ...): inputs are missing")
        return model, params, inputs
    if inputs is not None:
        raise TypeError(
            "an NNX model holds its parameters: generate(model, inputs, ...), without params"
        )
    from tfjax.nnx import functional

    return (*functional.split(model), params)


def generate(
    model: nn.Module | nnx.Module,
    params: Any,
    inputs=None,
    *,
    mask=None,
    max_new_tokens: int,
    eos_id: int | Sequence[int],
    pad_id: int = 0,
    method: str = "greedy",
    beam_size: int = 4,
    alpha: float | None = None,
    beam_rules: str = "gnmt",
    early_stopping: bool | str = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    rng=None,
    use_cache: bool | str = True,
    layout: str = "auto",
    check: bool = True,
):
    """Generates up to `max_new_tokens` tokens per row; see the module docstring.

    Args:
      model: a decoder (prompt -> continuation) or transformer (source -> target) model; or an
        NNX model (tfjax.nnx.models), called as generate(model, inputs, ...).
      params: its parameters (plain arrays or logically boxed); an NNX model's inputs.
      inputs: [B, P] prompts, or [B, S] source ids (an encoder-decoder's: 0 is its padding).
      mask: [B, P] bool or 0/1, true on prompt tokens (transformers' attention_mask): each row's
        are one run from column 0 (right padding) or up to column P-1 (left padding). None: no
        padding. Decoders only; beam search takes none or a full one.
      eos_id: the EOS id, or several: a row ends at the first of them it generates.
      pad_id: the filler of `tokens` after a row's EOS (cut rows at their EOS: `first_eos`).
      method: "greedy", "sample" (temperature, top_k, top_p) or "beam" (beam_size, alpha; None:
        0.6 for "gnmt", transformers' default length_penalty 1.0 for "hf").
      beam_rules: "gnmt" (the length penalty of Wu et al.) or "hf" (transformers' generate:
        alpha is its length_penalty, with its `early_stopping`: True, False or "never").
      rng: a PRNG key for sampling (the same key gives the same samples).
      use_cache: feed one token per step through the KV cache: the model's explicit one when it
        has `init_cache`, else its "cache" collection; "collection": the collection; False:
        recompute the prefix every step.
      layout: how the parameters are laid out for the token loop, once per call: "auto"
        (default), "replicated", "tensor" or "as-given" (see `decode_layout`).
      check: validate the inputs and the mask on the host first. False is for inputs and mask
        that are global arrays sharded over processes (the runner's eval), which no host can
        read whole: the lengths are then found on the devices from the mask; the options and
        the mask's shape are still checked, the ids and the mask's runs are the caller's
        responsibility.
    Returns:
      (tokens [B, max_new_tokens] int32, scores [B] float32).
    """
    model, params, inputs = _functional(model, params, inputs)
    options = dict(
        method=method,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        beam_size=beam_size,
        beam_rules=beam_rules,
        early_stopping=early_stopping,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    width = np.shape(inputs)[1] if np.ndim(inputs) == 2 else 0  # else _check_inputs says so
    options["eos_id"] = _check(model, width, **options)
    if check:
        min_length = int(_check_inputs(model, inputs, mask, method).min())
    else:
        _check_mask_shape(model, inputs, mask)
        # Unknown on the host: prompts are fed token by token from the start.
        min_length = inputs.shape[1] if mask is None else 1
    if method == "sample" and rng is None:
        raise ValueError('method="sample" needs an rng')
    if use_cache not in CACHES:
        raise ValueError(f"use_cache={use_cache!r} is unknown; allowed: {CACHES}")
    rng = jax.random.key(0) if rng is None else rng
    alpha = DEFAULT_ALPHA[beam_rules] if alpha is None else alpha
    params = nn.unbox(params)
    return _generate(
        model,
        params,
        jnp.asarray(inputs),
        None if mask is None else jnp.asarray(mask),
        rng,
        **options,
        alpha=alpha,
        use_cache=use_cache,
        min_length=min_length if not _is_encoder_decoder(model) else 1,
        layout=decode_layout(model, params, layout),
    )


def lower(model, params, inputs=None, *, mask=None, layout="auto", memory_bytes=None, **options):
    """`generate`'s jitted program lowered for abstract `params`, `inputs` and `mask` (None or
    a [B, P] bool ShapeDtypeStruct; ShapeDtypeStructs with shardings): compile it ahead of time
    for a target (`tfjax.runner.aot`) without any data. `options` are generate's
    PROGRAM_OPTIONS, with its defaults; `layout` as generate's, for devices of `memory_bytes`
    each (`decode_layout`). With a mask the prompts are taken as fed token by token from the
    start, as in the runner's eval. An NNX model as in `generate`: lower(model, inputs, ...)."""
    model, params, inputs = _functional(model, params, inputs)
    unknown = sorted(set(options) - set(PROGRAM_OPTIONS))
    if unknown:
        raise TypeError(f"lower: unknown options {unknown}; allowed: {PROGRAM_OPTIONS}")
    bound = inspect.signature(generate).bind(model, params, inputs, **options)
    bound.apply_defaults()
    options = {name: bound.arguments[name] for name in PROGRAM_OPTIONS}
    alpha = options.pop("alpha")
    options["eos_id"] = _check(model, inputs.shape[1], **options)  # as generate(check=False)
    _check_mask_shape(model, inputs, mask)
    options["alpha"] = DEFAULT_ALPHA[options["beam_rules"]] if alpha is None else alpha
    key = jax.eval_shape(lambda: jax.random.key(0))
    replicated = NamedSharding(inputs.sharding.mesh, PartitionSpec())
    return _generate.lower(
        model,
        params,
        inputs,
        mask,
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
        **options,
        use_cache=True,
        min_length=inputs.shape[1] if mask is None or _is_encoder_decoder(model) else 1,
        layout=decode_layout(model, nn.unbox(params), layout, memory_bytes=memory_bytes),
    )
