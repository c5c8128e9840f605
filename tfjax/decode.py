"""Generation: greedy, temperature / top-k / top-p sampling and beam search, with a KV cache.

Letters: B batch, K beams, L buffer length, P prompt length, V vocab.

    tokens, scores = decode.generate(model, params, inputs, max_new_tokens=50, eos_id=eos)

`model` is a `tfjax.models.decoder` model (inputs: prompts [B, P], padded with 0 on the right
or the left (left-padded rows are moved to the left edge first); the result continues each
prompt) or a `tfjax.models.transformer` model (inputs: source ids
[B, S]; the result is the target sequence). `tokens` [B, max_new_tokens] holds the generated
ids, 0 (padding) after an EOS; `scores` [B] the sum of their log-probabilities under the model
(for beam search divided by the length penalty ((5 + length) / 6)^alpha of Wu et al., 2016,
which the paper uses with beam 4 and alpha 0.6).

Beam search has two sets of rules. "gnmt" (the default): finished hypotheses are scored with
the penalty above, and the search stops once no live beam can beat the worst finished one even
at full length. "hf": transformers' `generate(num_beams=K, length_penalty=alpha,
early_stopping=...)`, so that a converted checkpoint gives the reference's output: a score is
log-probability / length^alpha; of the 2K best candidates only those among the best K may
finish; at max_new_tokens the best K live ones finish too; `early_stopping` True stops a row
once K have finished, False once the best live beam, scored at its current length, cannot beat
the worst finished one, "never" scores it at full length instead (when alpha > 0). alpha=None
is 0.6 under "gnmt" and transformers' default length_penalty, 1.0, under "hf".

Everything after the argument checks is one jitted `lax.while_loop`. With `use_cache=True`
each step feeds one token through the model's KV cache: the explicit cache of tfjax's models
(`model.init_cache`, a pytree the loop carries), or the "cache" collection of a model without
one (`use_cache="collection"` takes the collection always; both give the same tokens);
`use_cache=False` recomputes the whole prefix every step (the reference the tests compare
against, and the benchmark's baseline).
"""

import functools
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

METHODS = ("greedy", "sample", "beam")
BEAM_RULES = ("gnmt", "hf")
DEFAULT_ALPHA = {"gnmt": 0.6, "hf": 1.0}  # alpha=None: the paper's; transformers' length_penalty
EARLY_STOPPING = (True, False, "never")  # transformers' values (beam_rules="hf")
CACHES = (True, False, "collection")  # use_cache's values
_NEG = -1e30  # a finite "minus infinity": keeps arithmetic on dead beams NaN-free


def _is_encoder_decoder(model) -> bool:
    return hasattr(model, "encode")


def _check(
    model,
    inputs,
    *,
    method,
    max_new_tokens,
    eos_id,
    beam_size,
    beam_rules,
    early_stopping,
    temperature,
    top_k,
    top_p,
):
    """Host-side validation: every message names the option and what is allowed."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; allowed: {METHODS}")
    if beam_rules not in BEAM_RULES:
        raise ValueError(f"beam_rules={beam_rules!r} is unknown; allowed: {BEAM_RULES}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"early_stopping={early_stopping!r} is unknown; allowed: {EARLY_STOPPING}")
    if method == "beam" and beam_rules == "gnmt" and early_stopping is not False:
        raise ValueError(
            f"early_stopping={early_stopping!r} applies to beam_rules='hf' only (the 'gnmt' "
            "rules stop once no live beam can beat the worst finished one)"
        )
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.integer):
        raise ValueError(f"inputs must be [B, P] integer ids, got {inputs.shape} {inputs.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    vocab = model.vocab_size
    if inputs.size and (inputs.min() < 0 or inputs.max() >= vocab):
        bad = inputs[(inputs < 0) | (inputs >= vocab)][0]
        raise ValueError(f"inputs hold token id {bad}, outside the vocabulary [0, {vocab})")
    if not 0 <= eos_id < vocab:
        raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {vocab})")
    lengths = _lengths(inputs)
    if (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise ValueError(f"inputs row {row} is empty (all padding); give at least one token")
    if method == "beam" and beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    if method == "sample":
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not _is_encoder_decoder(model):
        total = inputs.shape[1] + max_new_tokens
        # A learned position table ends at max_len (RoPE goes on; a model without the field: as
        # learned)
        if getattr(model, "position", "learned") == "learned" and total > model.max_len:
            raise ValueError(
                f"prompt length {inputs.shape[1]} + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds the model's max_len={model.max_len}"
            )
        if method == "beam" and (lengths != inputs.shape[1]).any():
            raise ValueError("beam search needs prompts of equal length (no padding)")
    return lengths


def left_aligned(prompts) -> np.ndarray:
    """Prompts [B, P] with each row's leading padding (0) moved to its end: a left-padded batch
    as the right-padded one the decoder reads (positions then start at 0 in every row)."""
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or not prompts.size:
        return prompts  # _check names what is wrong with it
    nonzero = prompts != 0
    lead = np.where(nonzero.any(1), np.argmax(nonzero, 1), 0)  # [B] leading zeros per row
    if not lead.any():
        return prompts
    # [B, P]: row b read from column (p + lead[b]) mod P
    columns = (np.arange(prompts.shape[1])[None] + lead[:, None]) % prompts.shape[1]
    return np.take_along_axis(prompts, columns, axis=1)


def _lengths(inputs):
    """Length of each right-padded row: one past its last non-zero id."""
    nonzero = np.asarray(inputs) != 0
    return np.where(nonzero.any(1), nonzero.shape[1] - np.argmax(nonzero[:, ::-1], 1), 0)


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
    stepper, buffer, lengths, min_length, *, eos_id, method, temperature, top_k, top_p, rng
):
    """Token-by-token loop; buffer [B, L] holds each prompt (lengths [B]), right-padded."""
    b, total = buffer.shape
    start = min_length - 1  # the first position whose next token is not forced in every row
    state = stepper.init_state(b)
    state = stepper.prefill(state, buffer[:, :start])  # the prompts' shared part, in one call

    def cond(c):
        i, _, _, done, _ = c
        return (i < total - 1) & ~jnp.all(done & (i + 1 >= lengths))

    def body(c):
        i, buffer, state, done, scores = c
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
        nxt = jnp.where(forced, prompt_next, jnp.where(done, 0, nxt)).astype(buffer.dtype)
        gained = jnp.take_along_axis(logp, nxt[:, None], -1)[:, 0]
        scores = scores + jnp.where(forced | done, 0.0, gained)
        done = done | (~forced & (nxt == eos_id))
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


def _beam_start(stepper, prompt, k, max_new_tokens):
    """The stepper for K beams per row and the search's start: [B, K, L] beams that are all the
    prompt with only beam 0 alive, the cache holding the prompt but its last token, and K empty
    finished slots per row."""
    b, p = prompt.shape
    total = p + max_new_tokens
    stepper = stepper.repeat(k)
    seqs = jnp.zeros((b, k, total), jnp.int32).at[:, :, :p].set(prompt[:, None])
    live_logp = jnp.tile(jnp.array([0.0] + [_NEG] * (k - 1)), (b, 1))
    state = stepper.init_state(b * k)
    state = stepper.prefill(state, seqs[:, :, : p - 1].reshape(b * k, -1))
    return stepper, seqs, live_logp, state, jnp.zeros_like(seqs), jnp.full((b, k), _NEG)


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


def _gnmt_beam_loop(stepper, prompt, *, eos_id, beam_size, alpha, max_new_tokens, early_stopping):
    """Beam search by GNMT's rules (Wu et al.); see the module docstring."""
    del early_stopping  # these rules stop once no live beam can beat a finished one
    p, total = prompt.shape[1], prompt.shape[1] + max_new_tokens
    stepper, seqs, live_logp, state, fin_seqs, fin_scores = _beam_start(
        stepper, prompt, beam_size, max_new_tokens
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
        is_eos = token == eos_id
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


def _hf_beam_loop(stepper, prompt, *, eos_id, beam_size, alpha, max_new_tokens, early_stopping):
    """Beam search by transformers' rules (its `_beam_search`); see the module docstring."""
    k, p = beam_size, prompt.shape[1]
    total = p + max_new_tokens
    stepper, seqs, live_logp, state, fin_seqs, fin_scores = _beam_start(
        stepper, prompt, k, max_new_tokens
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
        stops = (token == eos_id) | (i + 2 >= total)
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


# generate's keyword arguments that shape its compiled program.
PROGRAM_OPTIONS = (
    "max_new_tokens",
    "eos_id",
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
    static_argnames=("model", *PROGRAM_OPTIONS, "use_cache", "min_length"),
)
def _generate(
    model,
    params,
    inputs,
    lengths,
    rng,
    *,
    max_new_tokens,
    eos_id,
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
        prompt = inputs.astype(jnp.int32)
    if method == "beam":
        beam_loop = _hf_beam_loop if beam_rules == "hf" else _gnmt_beam_loop
        seqs, scores = beam_loop(
            stepper,
            prompt,
            eos_id=eos_id,
            beam_size=beam_size,
            alpha=alpha,
            max_new_tokens=max_new_tokens,
            early_stopping=early_stopping,
        )
        return seqs[:, prompt_len:], scores
    buffer = jnp.pad(prompt, ((0, 0), (0, max_new_tokens)))
    buffer, scores = _sample_loop(
        stepper,
        buffer,
        lengths,
        min_length,
        eos_id=eos_id,
        method=method,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng=rng,
    )
    # Each row's continuation starts right after its own prompt: [B, max_new_tokens].
    idx = lengths[:, None] + jnp.arange(max_new_tokens)[None]
    return jnp.take_along_axis(buffer, idx, axis=1), scores


def generate(
    model: nn.Module,
    params: Any,
    inputs,
    *,
    max_new_tokens: int,
    eos_id: int,
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
    check: bool = True,
):
    """Generates up to `max_new_tokens` tokens per row; see the module docstring.

    Args:
      model: a decoder (prompt -> continuation) or transformer (source -> target) model.
      params: its parameters (plain arrays or logically boxed).
      inputs: [B, P] prompts padded with 0 (right or left), or [B, S] source ids.
      method: "greedy", "sample" (temperature, top_k, top_p) or "beam" (beam_size, alpha; None:
        0.6 for "gnmt", transformers' default length_penalty 1.0 for "hf").
      beam_rules: "gnmt" (the length penalty of Wu et al.) or "hf" (transformers' generate:
        alpha is its length_penalty, with its `early_stopping`: True, False or "never").
      rng: a PRNG key for sampling (the same key gives the same samples).
      use_cache: feed one token per step through the KV cache: the model's explicit one when it
        has `init_cache`, else its "cache" collection; "collection": the collection; False:
        recompute the prefix every step.
      check: validate the inputs on the host first. False is for inputs that are global arrays
        sharded over processes (the runner's eval), which no host can read whole; the options
        are still checked, the ids are then the caller's responsibility.
    Returns:
      (tokens [B, max_new_tokens] int32, scores [B] float32).
    """
    options = dict(
        method=method,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        beam_size=beam_size,
        beam_rules=beam_rules,
        early_stopping=early_stopping,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    if check:
        if not _is_encoder_decoder(model):
            inputs = left_aligned(inputs)
        lengths = _check(model, inputs, **options)
        min_length = int(lengths.min())
    else:
        _check(model, np.ones((1, inputs.shape[1]), np.int32), **options)
        nonzero = inputs != 0  # _lengths on the devices
        lengths = jnp.where(nonzero.any(1), inputs.shape[1] - jnp.argmax(nonzero[:, ::-1], 1), 0)
        min_length = 1  # unknown on the host: prompts are fed token by token from the start
    if method == "sample" and rng is None:
        raise ValueError('method="sample" needs an rng')
    if use_cache not in CACHES:
        raise ValueError(f"use_cache={use_cache!r} is unknown; allowed: {CACHES}")
    rng = jax.random.key(0) if rng is None else rng
    alpha = DEFAULT_ALPHA[beam_rules] if alpha is None else alpha
    return _generate(
        model,
        nn.unbox(params),
        jnp.asarray(inputs),
        jnp.asarray(lengths, jnp.int32),
        rng,
        **options,
        alpha=alpha,
        use_cache=use_cache,
        min_length=min_length if not _is_encoder_decoder(model) else 1,
    )


def lower(model, params, inputs, **options):
    """`generate`'s jitted program lowered for abstract `params` and `inputs` (ShapeDtypeStructs
    with shardings): compile it ahead of time for a target (`tfjax.runner.aot`) without any data.
    `options` are generate's PROGRAM_OPTIONS, with its defaults. Prompts are taken as fed token
    by token from the start, as in the runner's eval."""
    from jax.sharding import NamedSharding, PartitionSpec

    unknown = sorted(set(options) - set(PROGRAM_OPTIONS))
    if unknown:
        raise TypeError(f"lower: unknown options {unknown}; allowed: {PROGRAM_OPTIONS}")
    bound = inspect.signature(generate).bind(model, params, inputs, **options)
    bound.apply_defaults()
    options = {name: bound.arguments[name] for name in PROGRAM_OPTIONS}
    alpha = options.pop("alpha")
    _check(model, np.ones((1, inputs.shape[1]), np.int32), **options)  # as generate(check=False)
    options["alpha"] = DEFAULT_ALPHA[options["beam_rules"]] if alpha is None else alpha
    mesh = inputs.sharding.mesh
    lengths = NamedSharding(mesh, PartitionSpec(*inputs.sharding.spec[:1]))  # as the rows
    key = jax.eval_shape(lambda: jax.random.key(0))
    return _generate.lower(
        model,
        params,
        inputs,
        jax.ShapeDtypeStruct(inputs.shape[:1], jnp.int32, sharding=lengths),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
        **options,
        use_cache=True,
        min_length=1,
    )
