"""Generation with a KV cache (being split into modules)."""

from tfjax.decode.generate import *  # noqa: F403
from tfjax.decode.generate import _filter_logits  # noqa: F401
