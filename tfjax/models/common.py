"""What every Linen model file shares: the family's fields taken from its spec (tfjax.specs),
its layer stack, and, re-exported from tfjax.specs.common, what each flat field allows and its
check, the layers' configs of the flat fields, the explicit KV cache and input checks."""

import dataclasses
import importlib

import flax.linen as nn

from tfjax import nn as tnn
from tfjax.ops.config import BlockConfig
from tfjax.specs.common import (  # noqa: F401 (re-exported: their home before tfjax.specs)
    ALLOWED,
    ATTENTION_FIELDS,
    BLOCK_FIELDS,
    MLP_FIELDS,
    MOE_FIELDS,
    block_config,
    check_fields,
    check_tokens,
    from_variant,
    init_cache,
    shift_right,
    values,
)


def spec_fields(spec_cls) -> dict:
    """The class-body entries (annotations and defaults) that give a Linen module the fields of
    the spec dataclass `spec_cls`, so each field is defined once, in the spec:

        class Decoder(FromSpec, nn.Module):
            SPEC = specs.decoder.Decoder
            locals().update(common.spec_fields(SPEC))
    """
    namespace = {"__annotations__": {}}
    for f in dataclasses.fields(spec_cls):
        namespace["__annotations__"][f.name] = f.type
        if f.default is not dataclasses.MISSING:
            namespace[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f.name] = dataclasses.field(default_factory=f.default_factory)
    return namespace


class FromSpec:
    """A Linen family model's tie to its spec (class attribute SPEC, whose fields it has by
    `spec_fields`): `spec` builds the spec of its fields, which checks them when the module is
    made; `of(spec)` makes the module of a spec."""

    @property
    def spec(self):
        """The spec dataclass of this module's fields (tfjax.specs.<family>)."""
        return self.SPEC(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self.SPEC)})

    @classmethod
    def of(cls, spec):
        """The Linen module of the spec `spec` (its fields)."""
        return cls(**values(spec))

    def __post_init__(self):
        self.spec  # noqa: B018 (the spec's checks)
        super().__post_init__()


def linen_of(spec) -> nn.Module:
    """The Linen model of a family spec (tfjax.specs.<family>, as an NNX model's `spec` may be);
    a Linen model as it is."""
    if isinstance(spec, nn.Module):
        return spec
    family = importlib.import_module(f"tfjax.models.{type(spec).__module__.rsplit('.', 1)[-1]}")
    return getattr(family, type(spec).__name__).of(spec)


def stack(model, config: BlockConfig, name: str, num_layers=None, **options) -> tnn.Stack:
    """A family's layer stack of `config` blocks: its num_layers (unless given), scan_layers,
    remat_policy and dtypes; `options`: the Stack's others (kernel_init, final_norm, variants)."""
    return tnn.Stack(
        config,
        model.num_layers if num_layers is None else num_layers,
        scan_layers=model.scan_layers,
        remat_policy=model.remat_policy,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        name=name,
        **options,
    )


def embed(model, vocab_size: int, name: str | None, **options) -> tnn.Embed:
    """A family's [vocab_size, D] embedding table `name` (None: named by the setup attribute)
    of the Linen `model`'s width and dtypes; `options`: the Embed's others (init_stddev,
    scale_by_sqrt_width, ...)."""
    return tnn.Embed(
        vocab_size,
        model.width,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        name=name,
        **options,
    )


def learned_positions(model) -> tnn.LearnedPositions:
    """A family's learned position table, "pos_embed" (of the Linen `model`'s max_len, width,
    init_stddev and dtypes); made inside the model's compact method."""
    return tnn.LearnedPositions(
        model.max_len,
        model.width,
        model.init_stddev,
        model.param_dtype,
        model.dtype,
        name="pos_embed",
    )
