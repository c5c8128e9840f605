"""tfjax.specs: the family specs without a framework. They import no Flax, refuse bad fields
by name, build every preset, and are what the Linen and NNX models of a family are built from
(one definition of each field)."""

import dataclasses
import importlib
import subprocess
import sys

import pytest

from tfjax.models.common import linen_of
from tfjax.specs import common

FAMILIES = {  # module -> (spec class, fields a preset needs besides)
    "decoder": ("Decoder", dict(vocab_size=64)),
    "encoder": ("Encoder", dict(vocab_size=64)),
    "transformer": ("Transformer", dict(vocab_size=64)),
    "vit": ("VisionTransformer", {}),
}


def _spec(family):
    return importlib.import_module(f"tfjax.specs.{family}")


def test_the_specs_import_no_flax():
    """In a fresh interpreter, importing every spec module (and tfjax.ops.axes, the logical
    names they share with the module systems) leaves Flax out of sys.modules."""
    modules = ", ".join(f"tfjax.specs.{f}" for f in FAMILIES) + ", tfjax.ops.axes"
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('flax')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_nnx_imports_neither_linen_layers_nor_linen_models():
    """tfjax.nnx builds from the specs: importing its families and Functional loads no
    tfjax.nn or tfjax.models module."""
    modules = ", ".join(f"tfjax.nnx.models.{f}" for f in FAMILIES) + ", tfjax.nnx.functional"
    code = (
        f"import sys, {modules}; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['tfjax', 'nn'], "
        "['tfjax', 'models'])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_builds_a_frozen_keyword_only_spec(family):
    module = _spec(family)
    name, required = FAMILIES[family]
    for variant in module.VARIANTS:
        spec = module.Model(variant, **required)
        assert type(spec).__name__ == name and isinstance(spec, getattr(module, name))
        assert spec.block_config() is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.width = 8
    with pytest.raises(TypeError):  # keyword-only
        getattr(module, name)(64)
    assert hash(spec) == hash(module.Model(variant, **required))


@pytest.mark.parametrize(
    "family, fields, message",
    [
        ("decoder", dict(width=0), r"Decoder\.width must be an integer >= 1, got 0"),
        ("decoder", dict(num_kv_heads=3), r"Decoder\.num_kv_heads=3 must divide"),
        ("decoder", dict(position="nope"), r"Decoder\.position"),
        ("decoder", dict(experts_per_token=4), r"experts_per_token set, but num_experts=0"),
        ("decoder", dict(attention_pattern=("local",)), "local layers, which need sliding_window"),
        ("decoder", dict(remat_policy="nope"), r"Decoder\.remat_policy"),
        ("encoder", dict(head="nope"), r"Encoder\.head"),
        ("encoder", dict(dropout_rate=1.0), r"Encoder\.dropout_rate"),
        ("transformer", dict(position="rope"), r"Transformer\.position"),
        ("transformer", dict(num_heads=5), r"Transformer\.num_heads=5 must divide"),
        ("vit", dict(pool="nope"), r"VisionTransformer\.pool"),
        ("vit", dict(posemb="sincos2d", width=30, num_heads=3), "must be a multiple of 4"),
        ("vit", dict(image_size=18), "image_size=18 is not divisible by patch_size=4"),
        ("vit", dict(channels=0), r"VisionTransformer\.channels"),
    ],
)
def test_bad_fields_are_refused_by_name(family, fields, message):
    module = _spec(family)
    variant = "tiny/4" if family == "vit" else "tiny"
    with pytest.raises(ValueError, match=message):
        module.Model(variant, **FAMILIES[family][1], **fields)


def test_unknown_variants_fields_and_missing_ones_are_named():
    decoder = _spec("decoder")
    with pytest.raises(ValueError, match=r"Decoder: variant='nope' is unknown"):
        decoder.Model("nope", vocab_size=64)
    with pytest.raises(ValueError, match=r"Decoder: unknown field\(s\) \['wdith'\]"):
        decoder.Model("tiny", vocab_size=64, wdith=3)
    with pytest.raises(ValueError, match=r"Decoder: missing required field\(s\) \['vocab_size'\]"):
        decoder.Model("tiny")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_linen_model_has_the_specs_fields_and_checks(family):
    """The Linen class's fields are the spec's (names, types, defaults: one definition), its
    `spec` the spec of its fields, and `Model` the spec's preset."""
    name, required = FAMILIES[family]
    linen = importlib.import_module(f"tfjax.models.{family}")
    spec_cls = getattr(_spec(family), name)
    linen_fields = {
        f.name: (f.type, f.default)
        for f in dataclasses.fields(getattr(linen, name))
        if f.name not in ("parent", "name")
    }
    assert linen_fields == {f.name: (f.type, f.default) for f in dataclasses.fields(spec_cls)}
    variant = "tiny/4" if family == "vit" else "tiny"
    model = linen.Model(variant, **required)
    assert model.spec == _spec(family).Model(variant, **required)
    assert common.values(model.spec) == {k: getattr(model, k) for k in linen_fields}
    with pytest.raises(ValueError, match=rf"{name}\.width must be an integer >= 1"):
        getattr(linen, name)(**required, width=0)
    assert linen_of(model.spec) == model and linen_of(model) is model
