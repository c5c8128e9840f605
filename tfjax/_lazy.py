"""Submodules that load on first attribute access (`tfjax.runner.train` after `import tfjax`).

The names come from the package's files, not from a hand-kept list that can drift from them.
"""

import importlib
import pkgutil


def submodules(package: str, path, namespace: dict):
    """(__getattr__, __dir__) for a package whose submodules import when first named."""
    names = {m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_")}

    def __getattr__(name: str):
        if name in names:
            return importlib.import_module(f"{package}.{name}")  # also sets the attribute
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | names)

    return __getattr__, __dir__
