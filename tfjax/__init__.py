"""tfjax: the Transformer family as pure Flax modules, with a sharded JAX experiment runner.

`import tfjax` is light: it needs JAX and Flax only (no TensorFlow). Import what you use:

    from tfjax import nn                           # building blocks
    from tfjax.models import transformer, encoder, decoder, vit
"""

__version__ = "0.1.0"
