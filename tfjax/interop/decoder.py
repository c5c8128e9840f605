"""The decoder families' export helpers under their former module name, for code written
before interop had one module per Hugging Face family (tests/models/test_presets.py).

New code: `core.decoders.spelled_out`, and `interop.REGISTRY.exporter(model).family(model)`.
"""

from tfjax.interop import REGISTRY
from tfjax.interop.core.decoders import spelled_out
from tfjax.interop.core.tables import Family
from tfjax.models import decoder


def export_family(model: decoder.Decoder) -> Family:
    """The Hugging Face family (config table) a tfjax decoder exports as, by its fields."""
    return REGISTRY.exporter(model).family(model)


__all__ = ["export_family", "spelled_out"]
