"""Family specs without a framework: one module per family (decoder, encoder, transformer,
vit), each a frozen dataclass of the family's flat fields with their checks, its presets
(VARIANTS), a `Model(variant, **overrides)` factory, and what the module systems build from it
(the layers' configs, the stacks, the KV cache's layout). tfjax.models (Linen) and tfjax.nnx
(NNX) build their modules from a spec. Imports no Flax.

    from tfjax.specs import decoder
    spec = decoder.Model("gpt2-small", vocab_size=50257)
"""
