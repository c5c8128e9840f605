"""The model zoo: one file per family, presets as data.

from tfjax.models import transformer, encoder, decoder, vit
model = vit.Model(variant="B/16", num_classes=1000)
"""
