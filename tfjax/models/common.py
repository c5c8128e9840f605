"""What every model file shares: building a module from a preset, and input checks."""

import dataclasses

import jax.numpy as jnp


def from_variant(cls, variants: dict, variant: str | None, overrides: dict):
    """cls(**variants[variant], **overrides), with errors that name the variant or field."""
    if variant is not None and variant not in variants:
        raise ValueError(
            f"{cls.__name__}: variant={variant!r} is unknown; allowed: {', '.join(variants)}"
        )
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"parent", "name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown field(s) {unknown}; allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {**(variants[variant] if variant else {}), **overrides}
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in ("parent", "name")
    )
    if missing:
        raise ValueError(f"{cls.__name__}: missing required field(s) {missing}")
    return cls(**kwargs)


def check_tokens(x, name: str):
    """Token ids must be a [B, T] integer array."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be [B, T] integer token ids, got shape {x.shape} {x.dtype}")


def shift_right(targets, segment_ids=None):
    """Decoder inputs: targets moved one step right with 0 (the start token) in front.

    With packed rows, each segment starts with 0 instead of the previous segment's last token.
    [B, T] -> [B, T].
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    if segment_ids is not None:
        prev = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(segment_ids == prev, shifted, 0)
    return shifted
