"""tfjax: the Transformer family as pure Flax modules, with a sharded JAX experiment runner.

`import tfjax` is light: it imports nothing (no JAX, no TensorFlow). Its submodules load when
first named, so `tfjax.runner.train.restore_model(...)` works after a plain `import tfjax`; or
import what you use:

    from tfjax import nn                           # building blocks
    from tfjax.models import transformer, encoder, decoder, vit
    from tfjax.runner import train                 # the experiment runner

The library (nn, models, decode, sharding, interop, data, tasks, progress) never imports the
runner (`tfjax.runner`: set-up, loop, checkpoints, metrics, compile for a target).
"""

from tfjax import _lazy

__version__ = "0.1.0"

__getattr__, __dir__ = _lazy.submodules(__name__, __path__, globals())
