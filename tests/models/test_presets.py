"""Presets of published checkpoints: their parameter counts are the model cards'.

Counted from shapes alone (jax.eval_shape): nothing is allocated, so the 70B preset is cheap.
"""

import math

import jax
import jax.numpy as jnp
import pytest

from tfjax.models import decoder
from tfjax.nn import moe

# (billions, decimals the card gives, non-embedding billions or None), from each model card on
# huggingface.co (Llama 3.2 1B: the page's 1.24B; Meta's card table rounds it to 1.23B).
CARDS = {
    "llama-3.2-1b": (1.24, 2, None),
    "llama-3.2-3b": (3.21, 2, None),
    "llama-3.1-8b": (8.03, 2, None),
    "llama-3.1-70b": (70.6, 1, None),
    "mistral-7b": (7.24, 2, None),
    "qwen2.5-0.5b": (0.49, 2, 0.36),
    "qwen2.5-7b": (7.61, 2, 6.53),
    "qwen3-0.6b": (0.6, 1, 0.44),
    "qwen3-8b": (8.2, 1, 6.95),
}


def _count(model) -> int:
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("variant", sorted(CARDS))
def test_published_presets_have_the_model_cards_parameter_counts(variant):
    billions, decimals, non_embedding = CARDS[variant]
    model = decoder.Model(variant=variant)
    n = _count(model)
    # The cards round or truncate to their last decimal: within one unit of it.
    assert abs(n / 1e9 - billions) < 10**-decimals, n
    if non_embedding is not None:  # the token embedding, and the head when untied
        embeddings = model.vocab_size * model.width * (1 if model.tie_embeddings else 2)
        assert abs((n - embeddings) / 1e9 - non_embedding) < 0.01, n - embeddings


def test_every_published_preset_is_counted():
    assert {v for v in PUBLISHED if not v.startswith("gemma-")} == set(CARDS)
    moe = set(MOE_CARDS) | set(LLAMA4_CARDS)
    assert {v for v in decoder.VARIANTS if v.startswith(MOE_FAMILIES)} == moe


# Mixtures of experts: (total parameters, active per token, as the cards count them), exact
# from the checkpoints' config.json sizes, and the cards' rounded figures (billions, decimals).
# Mixtral and Qwen count every parameter a token uses; OpenAI's GPT-OSS card leaves out the
# embedding table ("active" 3.61B and 5.13B; its totals 20.91B and 116.83B) and counts the
# attention sinks (64 a layer). DeepSeek's card rounds to whole billions.
MOE_FAMILIES = ("mixtral-", "qwen3-30b", "gpt-oss-", "deepseek-v3", "qwen3.5-35b", "llama-4-")
MOE_CARDS = {
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248, (46.7, 12.9, 1)),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704, (30.5, 3.3, 1)),
    "gpt-oss-20b": (20_914_757_184, 3_608_307_264, (20.91, 3.61, 2)),
    "gpt-oss-120b": (116_829_156_672, 5_132_849_472, (116.83, 5.13, 2)),
    # DeepSeek-V3: "671B total, 37B activated for each token" (without its 14B
    # multi-token-prediction module); tfjax counts the routers' 256 correction biases a layer
    "deepseek-v3": (671_026_419_200, 37_552_297_472, (671, 37, 0)),
    # Qwen3.5-35B-A3B's text model (its name: 35B total, 3B activated; the published files add
    # a vision tower and a multi-token-prediction head); transformers' Qwen3_5MoeForCausalLM
    # built from the preset's exported config (meta device) has the same total
    "qwen3.5-35b-a3b": (34_660_610_688, 3_454_988_928, (35, 3, 0)),
}


@pytest.mark.parametrize("variant", sorted(MOE_CARDS))
def test_mixture_of_experts_presets_have_the_cards_total_and_active_parameters(variant):
    total, active, (card_total, card_active, decimals) = MOE_CARDS[variant]
    model = decoder.Model(variant=variant, scan_layers=True)  # one layer traced: quick
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"])) == total
    used = moe.active_parameters(shapes["params"], model.experts_per_token, model.num_experts)
    if variant.startswith("gpt-oss-"):
        used -= model.vocab_size * model.width  # the card's count: no embedding table
    assert used == active
    # The cards round or truncate to their last decimal (Qwen's 3.35B "3.3B"): within one unit.
    assert abs(total / 1e9 - card_total) < 10**-decimals
    assert abs(active / 1e9 - card_active) < 10**-decimals


# Llama 4: Meta's model cards (meta-llama/Llama-4-Scout-17B-16E, -Maverick-17B-128E) give "17B
# active, 109B total" and "17B active, 400B total", counting the whole
# Llama4ForConditionalGeneration: the text model (the preset; a token uses one routed and the
# shared expert a layer) and a vision tower with its projector, 871,932,416 more (transformers'
# model of the published config, text_config the preset's export, on the meta device: below),
# 108.64B and 401.58B in all, which the cards round (Maverick's to 0.4%). Exact: (text total,
# text active); the cards: (total, active) in billions.
LLAMA4_CARDS = {
    "llama-4-scout-17b-16e": (107_769_861_120, 17_172_894_720, (109, 17)),
    "llama-4-maverick-17b-128e": (400_711_848_960, 17_184_691_200, (400, 17)),
}
# The published checkpoints' vision_config (the two models share the tower).
LLAMA4_VISION = dict(
    hidden_size=1408,
    intermediate_size=5632,
    num_hidden_layers=34,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=4096,
    projector_output_dim=4096,
    vision_output_dim=4096,
)


@pytest.mark.parametrize("variant", sorted(LLAMA4_CARDS))
def test_llama4_presets_have_the_cards_parameters_with_the_vision_tower(variant):
    """The text model's total and active counts exactly; transformers' whole model of the
    preset's exported config (its language model as many parameters) within the cards'
    rounding."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tfjax import interop
    from tfjax.interop.core import tables
    from tfjax.interop.core.decoders import spelled_out

    total, active, (card_total, card_active) = LLAMA4_CARDS[variant]
    model = decoder.Model(variant=variant, scan_layers=True)  # a layer of each stack traced
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"])) == total
    used = moe.active_parameters(shapes["params"], model.experts_per_token, model.num_experts)
    assert used == active
    model = spelled_out(model.clone(scan_layers=False))
    family = interop.REGISTRY.exporter(model).family(model)
    text = tables.hf_config(family, model)
    assert decoder.Model(**tables.model_fields(family, text)) == model
    del text["architectures"]  # Llama4ForCausalLM's; here the text part of the whole model
    config = transformers.Llama4Config(text_config=text, vision_config=LLAMA4_VISION)
    with torch.device("meta"):
        reference = transformers.Llama4ForConditionalGeneration(config)
    assert sum(p.numel() for p in reference.language_model.parameters()) == total
    whole = sum(p.numel() for p in reference.parameters())
    assert abs(whole / 1e9 / card_total - 1) < 0.005, whole
    assert abs(active / 1e9 - card_active) < 1


# Every published decoder preset with a converter (the Gemma cards are checked in
# tests/interop/test_interop_gemma.py, the mixtures of experts in test_interop_moe.py).
PUBLISHED = sorted(
    v
    for v in decoder.VARIANTS
    if v.startswith(("llama-", "mistral-", "qwen", "gemma-"))
    and v not in MOE_CARDS
    and v not in LLAMA4_CARDS
    and not v.endswith("-tiny")  # test presets (qwen3.5-tiny)
)


@pytest.mark.parametrize("variant", PUBLISHED)
def test_published_presets_export_a_config_transformers_builds_with_the_same_count(variant):
    """The preset's exported config.json, built by transformers on the meta device (no memory),
    has as many parameters as the preset, and loads back as the same model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tfjax import interop
    from tfjax.interop.core import tables
    from tfjax.interop.core.decoders import spelled_out

    model = spelled_out(decoder.Model(variant=variant))
    family = interop.REGISTRY.exporter(model).family(model)
    config = tables.hf_config(family, model)
    assert decoder.Model(**tables.model_fields(family, config)) == model
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(reference).__name__ == config["architectures"][0]
    assert sum(p.numel() for p in reference.parameters()) == _count(model)
