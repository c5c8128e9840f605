"""The token loops: greedy and sampling (temperature, top-k, top-p), and beam search by two
sets of rules. Each is one `lax.while_loop` over a `tfjax.decode.stepper.Stepper`.

Letters: B batch, K beams, L buffer length, P prompt length, V vocab.

Beam search takes decoder prompts of one length (no padding). It has two sets of rules. "gnmt"
(the default): finished hypotheses are scored with the length penalty ((5 + length) / 6)^alpha
of Wu et al., 2016 (which the paper uses with beam 4 and alpha 0.6), and the search stops once
no live beam can beat the worst finished one even at full length. "hf": transformers'
`generate(num_beams=K, length_penalty=alpha, early_stopping=...)`, so that a converted
checkpoint gives the reference's output: a score is log-probability / length^alpha; of the 2K
best candidates only those among the best K may finish; at max_new_tokens the best K live ones
finish too; `early_stopping` True stops a row once K have finished, False once the best live
beam, scored at its current length, cannot beat the worst finished one, "never" scores it at
full length instead (when alpha > 0). alpha=None is 0.6 under "gnmt" and transformers' default
length_penalty, 1.0, under "hf".
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30  # a finite "minus infinity": keeps arithmetic on dead beams NaN-free


def _is_eos(tokens, eos_ids):
    """tokens [...] -> bool [...]: is each one of the EOS ids."""
    return functools.reduce(jnp.logical_or, [tokens == e for e in eos_ids])


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


def sample_loop(
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


def gnmt_beam_loop(
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


def hf_beam_loop(
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
