"""Generation: greedy, temperature / top-k / top-p sampling and beam search, with a KV cache.

    tokens, scores = decode.generate(model, params, prompts, mask=mask, max_new_tokens=50,
                                     eos_id=eos)
    outputs = [row[:end] for row, end in zip(tokens, decode.first_eos(tokens, eos))]

The modules:
  generation  `generate` (what it takes and gives back: its docstring), `first_eos`, `lower` (the
              same program lowered ahead of time, for `tfjax.runner.aot`)
  options     the options' values (METHODS, BEAM_RULES, LAYOUTS, ...) and their checks
              (`check_options`, OptionError naming the option)
  search      the token loops: greedy, sampling, beam search ("gnmt" and "hf" rules)
  stepper     the model side: one step of the model over its KV cache
  layout      how the parameters are laid out for the token loop (`decode_layout`)
"""

from tfjax.decode.generation import PROGRAM_OPTIONS, first_eos, generate, lower
from tfjax.decode.layout import REPLICATE_FRACTION, decode_layout
from tfjax.decode.options import (
    BEAM_RULES,
    CACHES,
    DEFAULT_ALPHA,
    EARLY_STOPPING,
    LAYOUTS,
    METHODS,
    OptionError,
    check_options,
)

__all__ = [
    "BEAM_RULES",
    "CACHES",
    "DEFAULT_ALPHA",
    "EARLY_STOPPING",
    "LAYOUTS",
    "METHODS",
    "PROGRAM_OPTIONS",
    "REPLICATE_FRACTION",
    "OptionError",
    "check_options",
    "decode_layout",
    "first_eos",
    "generate",
    "lower",
]
