"""Llama and the families with its layout, Mistral and Qwen 2 / 3
(tfjax.interop.families.llama), against transformers: logits, greedy generation (also of
padded prompts, with the KV cache), every RoPE scaling kind, round trips, and refusals."""

import json

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from interop_references import V, apply, tokens, torch, transformers

from tfjax import interop
from tfjax.interop import pretrained


@references.reference
def llama():
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=V,
        max_position_embeddings=48,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


# Llama 3.x and the other RoPE scalings on the llama fixture's shapes (head_dim 8, base 500:
# wavelengths 6, 30, 140 and 664 positions), each set so its scaling changes the numbers of the
# tests' 10 to 17 positions: dynamic grows past max_position_embeddings=8.
LLAMA_ROPES = {
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        48,
        True,
    ),
    "llama_yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12},
        48,
        False,
    ),
    "llama_dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 8, False),
    "llama_linear": ({"rope_type": "linear", "factor": 2.0}, 48, False),
}


def _llama_rope(name):
    """A Llama with a RoPE scaling (llama3's head tied to the embeddings, as Llama 3.2 1B)."""

    def build():
        rope, max_len, tied = LLAMA_ROPES[name]
        torch.manual_seed(5)
        config = _small_decoder_config(
            transformers.LlamaConfig,
            max_position_embeddings=max_len,
            rope_parameters={**rope, "rope_theta": 500.0},
            tie_word_embeddings=tied,
        )
        return transformers.LlamaForCausalLM(config).eval()

    build.__name__ = name
    return references.reference(build)


def _small_decoder_config(cls, **changes):
    """The llama fixture's sizes in another family's config class."""
    return cls(
        **{
            **dict(
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=V,
                max_position_embeddings=48,
                rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                initializer_range=0.2,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            ),
            **changes,
        }
    )


for _name in LLAMA_ROPES:
    globals()[f"_fixture_{_name}"] = _llama_rope(_name)
ROPE_FAMILIES = sorted(LLAMA_ROPES)


@references.reference
def qwen2():
    """Qwen 2.5: biases on q, k, v (random, so a missing one would show), untied head."""
    torch.manual_seed(6)
    ref = transformers.Qwen2ForCausalLM(_small_decoder_config(transformers.Qwen2Config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return ref


@references.reference
def qwen3():
    """Qwen 3: q/k norms (random scales), head_dim 16 != 32 / 4, tied head (as Qwen3-0.6B)."""
    torch.manual_seed(7)
    config = _small_decoder_config(transformers.Qwen3Config, head_dim=16, tie_word_embeddings=True)
    ref = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return ref


@references.reference
def mistral():
    """Mistral with a sliding window of 4: the tests' 10 to 17 positions reach past it."""
    torch.manual_seed(8)
    config = _small_decoder_config(transformers.MistralConfig, head_dim=8, sliding_window=4)
    return transformers.MistralForCausalLM(config).eval()


FAMILIES = ["llama", *ROPE_FAMILIES, "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(family, scan_layers, request):
    references.check_decoder_logits(*request.getfixturevalue(family), scan_layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_reference(family, request):
    references.check_greedy_generation(*request.getfixturevalue(family))


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_padded_prompts(family, scan_layers, side, request):
    """Prompts of 5, 2 and 4 tokens in one padded batch, with the KV cache: each row's
    continuation is the reference's for that prompt alone (left padding: also the reference's
    own left-padded batch, with its attention mask)."""
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    prompts, mask, got = references.check_padded_prompts(ref, model, params, side)
    # transformers' dynamic RoPE takes one length for a whole batch (its longest row's), so its
    # left-padded rows depend on each other; tfjax's rows match the reference's rows alone.
    if side == "left" and family != "llama_dynamic":
        with torch.no_grad():
            batched = ref.generate(
                torch.tensor(prompts),
                attention_mask=torch.tensor(mask.astype(np.int64)),
                max_new_tokens=got.shape[1],
                do_sample=False,
                eos_token_id=V + 5,
                pad_token_id=0,
            )[:, 5:].numpy()
        np.testing.assert_array_equal(got, batched)


def test_mistral_sliding_window_acts_in_the_compared_logits(mistral):
    """The Mistral fixture's comparisons exercise the window: without it, positions past the
    window (4) give other logits, the first four the same."""
    _, path = mistral
    model, params = interop.load(path)
    assert model.sliding_window == 4
    ids = jnp.asarray(tokens((1, 10)))
    windowed = apply(model, params, ids)
    full = apply(model.clone(sliding_window=None), params, ids)
    np.testing.assert_allclose(windowed[:, :4], full[:, :4], atol=1e-6)
    assert np.abs(windowed[:, 4:] - full[:, 4:]).max() > 1e-2


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_safetensors_is_bitwise(family, scan_layers, request, tmp_path):
    references.check_round_trip(request.getfixturevalue(family)[1], scan_layers, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    references.check_transformers_reads_export(*request.getfixturevalue(family), tmp_path)


# ----------------------------------------------------------------------------------------------
# Bad input: each error names the key, the file and what is allowed.


def test_config_with_wrong_kv_heads(llama):
    _, path = llama
    config = interop.read_config(path)
    config["num_key_value_heads"] = 4
    with pytest.raises(ValueError, match=r"k_proj\.weight' in .*has shape \(16, 32\).*\(32, 32\)"):
        interop.from_llama(path, config)
    config = interop.read_config(path)
    config["head_dim"] = 16  # a head_dim the weights do not have
    with pytest.raises(ValueError, match=r"q_proj\.weight' in .*has shape \(32, 32\).*\(64, 32\)"):
        interop.from_llama(path, config)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 500.0}},
            r"LlamaForCausalLM: rope_type='longrope' is not supported; allowed: \('default', "
            r"'linear', 'dynamic', 'llama3', 'yarn'\)",
        ),
        (
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
            r"rope_type='linear' with \['low_freq_factor'\] is not supported; it reads "
            r"\('factor',\)",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0}},
            r"rope_type='llama3' needs original_max_position_embeddings",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            r"partial_rotary_factor=0\.5 is not supported \(needs 1\.0\)",
        ),
        (
            "llama",
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            r"rope_parameters=.* differs from rope_scaling=",
        ),
        (
            "llama",
            {"hidden_act": "relu"},
            r"hidden_act='relu' is not supported; allowed: \('silu', 'swish', 'gelu'\)",
        ),
        ("llama", {"attention_bias": True}, r"attention_bias=True differs from mlp_bias=False"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 4},
            r"Qwen2ForCausalLM: use_sliding_window=True is not supported \(needs False\)",
        ),
        (
            "qwen3",
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"layer_types=\['full_attention', 'sliding_attention'\] is not supported",
        ),
        ("llama", {"pretraining_tp": 2}, r"pretraining_tp=2 is not supported \(needs 1\)"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    """Each refusal names the key, its value and what tfjax supports."""
    references.check_config_refused(request.getfixturevalue(family)[1], changes, message)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_window_that_use_sliding_window_turns_off_is_not_read(family, request):
    """Qwen2.5-7B's config.json: use_sliding_window false beside sliding_window 131072, which
    transformers sets to None; the model is the one the config without a window gives."""
    _, path = request.getfixturevalue(family)
    config = interop.read_config(path)
    model, params = interop.ARCHITECTURES[config["architectures"][0]](
        path, {**config, "use_sliding_window": False, "sliding_window": 131072}
    )
    assert model.sliding_window is None
    assert model == interop.ARCHITECTURES[config["architectures"][0]](path, config)[0]


# ----------------------------------------------------------------------------------------------
# Streaming: what a run's init_from reads (tfjax.runner.pretrained.load_params).


@pytest.mark.parametrize("scan_layers", [False, True])
def test_streamed_params_are_the_loaded_ones_read_one_tensor_at_a_time(
    llama, scan_layers, monkeypatch
):
    from flax import traverse_util

    from tfjax.interop.core import files

    _, path = llama
    model = pretrained.pretrained_model(path, scan_layers=scan_layers)
    loaded = traverse_util.flatten_dict(pretrained.pretrained_params(path, model))
    reads = []
    read = files.LazyStateDict.__getitem__
    monkeypatch.setattr(
        files.LazyStateDict, "__getitem__", lambda self, k: reads.append(k) or read(self, k)
    )
    stream = pretrained.stream_pretrained_params(path, model)
    first, array = next(stream)
    assert len(reads) <= 4, reads  # the first parameter's tensors (and none before the checks)
    streamed = {first: array, **dict(stream)}
    assert sorted(streamed) == sorted(loaded)
    for key, value in loaded.items():
        assert streamed[key].dtype == value.dtype and np.array_equal(streamed[key], value), key
    assert len(reads) == len(set(reads)) == len(interop.read_state_dict(path)), "each read once"


def test_streaming_checks_every_shape_before_reading_a_tensor(llama, monkeypatch, tmp_path):
    from tfjax.interop.core import files

    _, path = llama
    config = interop.read_config(path)
    config["intermediate_size"] = 64  # the last layer's MLP is checked before the first is read
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(f"{path}/model.safetensors")
    model = pretrained.pretrained_model(tmp_path)
    monkeypatch.setattr(files.LazyStateDict, "__getitem__", lambda self, k: pytest.fail(k))
    with pytest.raises(ValueError, match=r"gate_proj\.weight' in .*has shape \(48, 32\)"):
        next(pretrained.stream_pretrained_params(tmp_path, model))
