"""The model families as Flax NNX modules (so far: decoder)."""
