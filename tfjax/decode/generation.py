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

Everything after the argument checks is one jitted `lax.while_loop` (`tfjax.decode.search`,
where beam search's two sets of rules, "gnmt" and "hf", are told), over the model's KV cache
(`use_cache`: `tfjax.decode.stepper`), with the parameters laid out once per call
(`layout`: `tfjax.decode.layout`).
"""

import contextlib
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tfjax import sharding
from tfjax.decode.layout import decode_layout
from tfjax.decode.options import (
    CACHES,
    DEFAULT_ALPHA,
    check_against_model,
    check_inputs,
    check_mask_shape,
)
from tfjax.decode.search import gnmt_beam_loop, hf_beam_loop, sample_loop
from tfjax.decode.stepper import Stepper, is_encoder_decoder

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
    if is_encoder_decoder(model):
        prompt_len = 1  # the start token 0
        stepper = Stepper(model, params, max_new_tokens + 1, use_cache, inputs)
        prompt = jnp.zeros((b, 1), jnp.int32)
        lengths = jnp.ones(b, jnp.int32)
    else:
        prompt_len = width
        stepper = Stepper(model, params, width + max_new_tokens, use_cache)
        prompt, lengths = _left_aligned(inputs.astype(jnp.int32), mask, pad_id)
    if method == "beam":
        beam_loop = hf_beam_loop if beam_rules == "hf" else gnmt_beam_loop
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
    buffer, scores = sample_loop(
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
    width = np.shape(inputs)[1] if np.ndim(inputs) == 2 else 0  # else check_inputs says so
    options["eos_id"] = check_against_model(model, width, **options)
    if check:
        min_length = int(check_inputs(model, inputs, mask, method).min())
    else:
        check_mask_shape(model, inputs, mask)
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
        min_length=min_length if not is_encoder_decoder(model) else 1,
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
    # as generate(check=False) checks
    options["eos_id"] = check_against_model(model, inputs.shape[1], **options)
    check_mask_shape(model, inputs, mask)
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
        min_length=inputs.shape[1] if mask is None or is_encoder_decoder(model) else 1,
        layout=decode_layout(model, nn.unbox(params), layout, memory_bytes=memory_bytes),
    )
