"""Multimodal `...ForConditionalGeneration` checkpoints loaded as their text model
(`tfjax.interop.core.multimodal`), against transformers' Gemma3ForConditionalGeneration: text
logits, the text_config read, the vision tower skipped and counted, unknown keys refused, and
the export read back by Gemma3ForCausalLM.

Small random models (a 2-layer text model and a 1-layer SigLIP tower, no download); float32
logits must be within 1e-5 of a float64 copy of the reference.
"""

import copy
import json
import logging
import os

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import ATOL, V, apply, torch, transformers

from tfjax import interop
from tfjax.interop.core import multimodal, tables

IMAGE_IDS = {"boi_token_index": V - 3, "eoi_token_index": V - 2, "image_token_index": V - 1}


def _text_config():
    return transformers.Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=48,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        query_pre_attn_scalar=12,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _multimodal(tie: bool):
    """A Gemma3ForConditionalGeneration whose vision sizes differ from the text model's, its
    norm offsets random; `tie` is the wrapper's own tie_word_embeddings (its text_config says
    True either way)."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=_text_config().to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        tie_word_embeddings=tie,
        attn_implementation="eager",
        **IMAGE_IDS,
    )
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "language_model" in name and "norm" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return ref


@references.reference
def gemma3_multimodal():
    """Tied head, saved by save_pretrained (the Hub's key names: language_model.model.*)."""
    torch.manual_seed(21)
    return _multimodal(tie=True)


@pytest.fixture(scope="module")
def untied_in_memory(tmp_path_factory):
    """Untied head (the wrapper's tie_word_embeddings false, its text_config's true), written
    with transformers 5's in-memory key names (model.language_model.*, lm_head.weight)."""
    torch.manual_seed(22)
    ref = _multimodal(tie=False)
    directory = str(tmp_path_factory.mktemp("untied"))
    config = {**ref.config.to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]}
    interop.write_safetensors(ref.state_dict(), directory, config)
    return ref, directory


def _ids(shape=(2, 10), seed=0):
    """Text tokens only (none of the image ids)."""
    return np.random.RandomState(seed).randint(3, V - 3, shape)


def _logits(ref, ids):
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        return ref64(torch.tensor(ids), attention_mask=torch.ones(ids.shape)).logits.numpy()


@pytest.mark.parametrize("fixture", ["gemma3_multimodal", "untied_in_memory"])
def test_text_logits_match_the_multimodal_model(fixture, request):
    ref, path = request.getfixturevalue(fixture)
    model, params = interop.load(path)
    ids = _ids()
    np.testing.assert_allclose(apply(model, params, jnp.asarray(ids)), _logits(ref, ids), atol=ATOL)


def test_the_text_config_is_read_with_the_wrappers_top_level_keys(
    gemma3_multimodal, untied_in_memory
):
    """The text model's sizes are text_config's (not vision_config's), the head's tying the
    wrapper's own tie_word_embeddings; the special ids are where transformers keeps them."""
    (_, path), (untied, _) = gemma3_multimodal, untied_in_memory
    config = interop.read_config(path)
    text = config["text_config"]
    assert config["vision_config"]["hidden_size"] != text["hidden_size"]
    model, params = interop.load(path)
    got = (model.vocab_size, model.width, model.num_layers, model.num_heads, model.num_kv_heads)
    assert got == (V, 32, 2, 4, 2)
    assert (model.head_dim, model.mlp_dim, model.sliding_window) == (8, 48, 4)
    assert (model.rope_base, model.local_rope_base, model.attention_scalar) == (1000.0, 50.0, 12)
    assert model.attention_pattern == ("local", "global") and model.tie_embeddings
    assert "output_proj" not in params
    assert (text["pad_token_id"], text["bos_token_id"], text["eos_token_id"]) == (0, 1, 2)
    assert {k: config[k] for k in IMAGE_IDS} == IMAGE_IDS  # the wrapper's, at its top level
    assert untied.config.text_config.tie_word_embeddings and not untied.config.tie_word_embeddings
    untied_model, untied_params = interop.load(untied_in_memory[1])
    assert not untied_model.tie_embeddings and "output_proj" in untied_params


def test_a_hub_text_config_leaving_keys_out_reads_as_transformers_reads_it(gemma3_multimodal):
    """gemma-3-4b-it's config.json (transformers 4.50) names six text keys and no top-level
    tie_word_embeddings: the others are Gemma3TextConfig's defaults, read as transformers 5
    reads them (no model is built: the sizes are the published ones)."""
    config = interop.read_config(gemma3_multimodal[1])
    hub = {k: v for k, v in config.items() if k != "tie_word_embeddings"}
    hub["text_config"] = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    family = interop.ARCHITECTURES["Gemma3ForConditionalGeneration"].family
    got = tables.model_fields(family, hub)
    theirs = transformers.Gemma3Config(
        **{k: v for k, v in hub.items() if k not in ("architectures", "model_type")}
    )
    text = theirs.text_config
    want = {
        "vocab_size": text.vocab_size,
        "width": text.hidden_size,
        "mlp_dim": text.intermediate_size,
        "num_layers": text.num_hidden_layers,
        "num_heads": text.num_attention_heads,
        "num_kv_heads": text.num_key_value_heads,
        "head_dim": text.head_dim,
        "attention_scalar": text.query_pre_attn_scalar,
        "sliding_window": text.sliding_window,
        "max_len": text.max_position_embeddings,
        "norm_eps": text.rms_norm_eps,
        "rope_base": text.rope_parameters["full_attention"]["rope_theta"],
        "local_rope_base": text.rope_parameters["sliding_attention"]["rope_theta"],
        "tie_embeddings": theirs.tie_word_embeddings,
    }
    assert {k: got[k] for k in want} == want
    assert (got["vocab_size"], got["num_heads"], got["num_kv_heads"]) == (262_208, 8, 4)
    assert got["rope_scaling"].kind == "linear" and got["rope_scaling"].factor == 8.0
    kinds = {"sliding_attention": "local", "full_attention": "global"}
    pattern = got["attention_pattern"]
    assert [pattern[i % len(pattern)] for i in range(34)] == [kinds[t] for t in text.layer_types]


def test_the_vision_tower_is_skipped_and_counted(gemma3_multimodal, caplog):
    _, path = gemma3_multimodal
    state = interop.read_state_dict(path)
    vision = [k for k in state if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert len(vision) > 10
    with caplog.at_level(logging.INFO, logger="tfjax.interop.core.convert"):
        interop.load(path)
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert f"skipped {len(vision)} tensors" in line
    assert "vision_tower.*" in line and "multi_modal_projector.*" in line


def _with(path, tmp_path, extra=None, config_changes=None):
    """A copy of the checkpoint at `path` with `extra` tensors and config changes."""
    state = dict(interop.read_state_dict(path))
    state.update(extra or {})
    config = interop.read_config(path)
    for key, value in (config_changes or {}).items():
        config[key] = value
    interop.write_safetensors(state, tmp_path, config)
    return tmp_path


@pytest.mark.parametrize(
    "key", ["language_model.model.extra.weight", "vision_encoder.weight", "model.vision.bias"]
)
def test_any_other_unexpected_key_is_refused_by_name(gemma3_multimodal, tmp_path, key):
    _, path = gemma3_multimodal
    bad = _with(path, tmp_path, {key: np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=f"Gemma3ForConditionalGeneration: 1 unexpected .*{key}"):
        interop.load(bad)


def test_shapes_are_checked_before_any_tensor_is_read(gemma3_multimodal, tmp_path):
    """A misshapen text tensor is named from the headers (the run's check reads none)."""
    _, path = gemma3_multimodal
    key = "language_model.model.layers.1.mlp.up_proj.weight"
    bad = _with(path, tmp_path, {key: np.zeros((47, 32), np.float32)})
    from tfjax.interop import pretrained

    with pytest.raises(ValueError, match=f"{key}.*has shape \\(47, 32\\).*expects \\(48, 32\\)"):
        pretrained.check_pretrained(bad)


def test_a_run_streams_the_params_load_gives(gemma3_multimodal):
    from tfjax.interop import pretrained
    from tfjax.interop.core.rules import flatten

    _, path = gemma3_multimodal
    model, params = interop.load(path, scan_layers=True)
    assert pretrained.pretrained_model(path, scan_layers=True) == model
    streamed = dict(pretrained.stream_pretrained_params(path, model))
    flat = flatten(params)
    assert set(streamed) == set(flat)
    for k, v in streamed.items():
        assert np.array_equal(v, np.asarray(flat[k])), k


def test_config_refusals_name_the_key(gemma3_multimodal, tmp_path):
    _, path = gemma3_multimodal
    config = interop.read_config(path)
    loader = interop.ARCHITECTURES["Gemma3ForConditionalGeneration"]
    state = interop.read_state_dict(path)
    cases = {
        "no text_config object": {k: v for k, v in config.items() if k != "text_config"},
        "text_config.model_type='llama' is not supported": {
            **config,
            "text_config": {**config["text_config"], "model_type": "llama"},
        },
        "text_config.final_logit_softcapping=30.0 is not supported": {
            **config,
            "text_config": {**config["text_config"], "final_logit_softcapping": 30.0},
        },
        r"attn_logit_softcapping=5.0 is not supported": {
            **config,
            "text_config": {**config["text_config"], "attn_logit_softcapping": 5.0},
        },
    }
    for match, changed in cases.items():
        with pytest.raises(ValueError, match=f"Gemma3ForConditionalGeneration.*{match}"):
            loader(state, changed)


@pytest.mark.parametrize("fixture", ["gemma3_multimodal", "untied_in_memory"])
def test_the_export_is_a_text_only_causal_lm_with_the_same_logits(
    fixture, request, tmp_path, caplog
):
    ref, path = request.getfixturevalue(fixture)
    model, params = interop.load(path)
    with caplog.at_level(logging.INFO, logger="tfjax.interop"):
        interop.save(model, params, tmp_path)
    assert any("Gemma3ForCausalLM, a text-only model" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
    assert not any("vision" in k for k in interop.read_state_dict(tmp_path))
    back = transformers.Gemma3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    ids = _ids((2, 9), seed=3)
    np.testing.assert_allclose(_logits(back, ids), _logits(ref, ids), atol=1e-12, rtol=0)


def test_every_wrapper_names_a_text_family_and_has_a_row():
    rows = {a: r for r in interop.supported() for a in r.architectures}
    for wrapper in multimodal.WRAPPERS:
        assert wrapper.text in interop.ARCHITECTURES
        assert wrapper.architecture in rows
        family = interop.ARCHITECTURES[wrapper.architecture].family
        assert family.architecture == wrapper.architecture and family.skip
    with pytest.raises(ValueError, match="Nope: no family loads its text model NopeForCausalLM"):
        multimodal.with_wrappers(
            [interop.families.gemma.CONVERTS],
            [multimodal.Wrapper("Nope", "NopeForCausalLM", "nope", ("vision_tower",))],
        )


def test_the_fixture_is_the_multimodal_architecture(gemma3_multimodal):
    _, path = gemma3_multimodal
    config = interop.read_config(path)
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert any(k.startswith("language_model.model.") for k in interop.read_state_dict(path))
