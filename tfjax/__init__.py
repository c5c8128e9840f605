"""tfjax: the Transformer family as pure Flax modules, with a sharded JAX experiment runner.

`import tfjax` is light: it imports nothing (no JAX, no TensorFlow). Its submodules load when
first named, so `tfjax.train.restore_model(...)` works after a plain `import tfjax`; or import
what you use:

    from tfjax import nn                           # building blocks
    from tfjax.models import transformer, encoder, decoder, vit
"""

import importlib

__version__ = "0.1.0"

# Loaded on first use by __getattr__: tfjax.data and tfjax.train bring in the input pipeline.
_SUBMODULES = (
    "aot",
    "checkpoint",
    "chips",
    "data",
    "decode",
    "evaluation",
    "experiment",
    "host_memory",
    "interop",
    "metrics",
    "models",
    "nn",
    "optim",
    "plots",
    "preemption",
    "sharding",
    "steps",
    "tasks",
    "train",
    "workdirs",
)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
