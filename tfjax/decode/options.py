"""generate's options and their checks, on the host before anything is traced: each message
names the option (OptionError.option) and what it allows."""

import numpy as np

from tfjax.decode.stepper import is_encoder_decoder

METHODS = ("greedy", "sample", "beam")
BEAM_RULES = ("gnmt", "hf")
DEFAULT_ALPHA = {"gnmt": 0.6, "hf": 1.0}  # alpha=None: the paper's; transformers' length_penalty
EARLY_STOPPING = (True, False, "never")  # transformers' values (beam_rules="hf")
CACHES = (True, False, "collection")  # use_cache's values
# how the parameters are laid out for the token loop (tfjax.decode.layout)
LAYOUTS = ("auto", "replicated", "tensor", "as-given")


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
    check_layout(layout)
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


def check_against_model(model, width, *, max_new_tokens, eos_id, pad_id, **options):
    """Host-side validation of the options, for prompts of `width` columns: every message names
    the option and what is allowed; `options`: the others `check_options` takes (method,
    beam_size, beam_rules, early_stopping, temperature, top_k, top_p). Returns eos_id as a
    tuple of ids."""
    check_options(max_new_tokens=max_new_tokens, **options)
    vocab = model.vocab_size
    eos_ids = _eos_ids(eos_id, vocab)
    if not (isinstance(pad_id, (int, np.integer)) and 0 <= pad_id < vocab):
        raise ValueError(f"pad_id={pad_id!r} is not an id in [0, {vocab})")
    if not is_encoder_decoder(model):
        total = width + max_new_tokens
        # A learned position table ends at max_len (RoPE goes on; a model without the field: as
        # learned)
        if getattr(model, "position", "learned") == "learned" and total > model.max_len:
            raise ValueError(
                f"prompt length {width} + max_new_tokens {max_new_tokens} = {total} "
                f"exceeds the model's max_len={model.max_len}"
            )
    return eos_ids


def check_mask_shape(model, inputs, mask):
    """The mask's shape and type, which a host can check without reading any array."""
    if mask is None:
        return
    if is_encoder_decoder(model):
        raise ValueError(
            "mask applies to decoder prompts; an encoder-decoder model masks its source "
            "padding (id 0) itself: give mask=None"
        )
    if tuple(mask.shape) != tuple(inputs.shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; the inputs' is {inputs.shape}")
    if not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
        raise ValueError(f"mask must be bool or integer (0/1), got {mask.dtype}")


def check_inputs(model, inputs, mask, method) -> np.ndarray:
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
    check_mask_shape(model, inputs, mask)
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


def check_layout(layout):
    if layout not in LAYOUTS:
        raise OptionError("layout", f"layout={layout!r} is unknown; allowed: {LAYOUTS}")
