"""Flax NNX modules over tfjax.ops' maths: the same layers and families as tfjax.nn and
tfjax.models (Linen), with the same configs, presets and parameter trees.

    from flax import nnx
    from tfjax.nnx.models import decoder
    model = decoder.Model(variant="qwen3-0.6b", rngs=nnx.Rngs(0))
    logits, aux = model(tokens)

The four families (tfjax.nnx.models: decoder, encoder, transformer, vit), unrolled or
scanned, from the layers of tfjax.nnx.blocks.
"""

from tfjax import _lazy

__getattr__, __dir__ = _lazy.submodules(__name__, __path__, globals())
