"""GPT-2 (tfjax.interop.families.gpt2) against transformers: logits, greedy and beam search
generation, a state dict and a torch .bin file, round trips, and errors that name the key and
the file."""

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical
from interop_references import ATOL, V, apply, greedy_reference, tokens, torch, until_eos

from tfjax import decode, interop

gpt2 = references.gpt2
bert_mlm = references.bert_mlm


@pytest.mark.parametrize("scan_layers", [False, True])
def test_logits_match_reference(gpt2, scan_layers):
    references.check_decoder_logits(*gpt2, scan_layers)


def test_beam_search_with_hf_rules_matches_generate(gpt2):
    """beam_rules="hf" for a decoder-only model: transformers' beams for equal-length prompts,
    with an EOS the reference emits mid-way (so finished and live beams compete)."""
    ref, path = gpt2
    model, params = interop.load(path)
    prompts, max_new = tokens((2, 5), seed=7), 10
    eos = int(greedy_reference(ref, prompts, max_new, eos=V + 5)[0, 3])
    for early_stopping, length_penalty in ((False, 1.0), (True, 0.6), ("never", 2.0)):
        out = references.reference_generate(
            ref,
            prompts,
            max_new,
            eos,
            num_beams=3,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            return_dict_in_generate=True,
            output_scores=True,
        )
        want = out.sequences[:, prompts.shape[1] :].numpy()
        got, scores = decode.generate(
            model,
            params,
            prompts,
            max_new_tokens=max_new,
            eos_id=eos,
            method="beam",
            beam_size=3,
            alpha=length_penalty,
            beam_rules="hf",
            early_stopping=early_stopping,
        )
        for row_got, row_want in zip(np.asarray(got), want, strict=True):
            assert until_eos(row_got, eos) == until_eos(row_want, eos), early_stopping
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=1e-5)


def test_greedy_generation_matches_reference(gpt2):
    references.check_greedy_generation(*gpt2)


def test_from_state_dict_and_torch_bin(gpt2, tmp_path):
    """An in-memory state dict (lm_head tied and present) and a pytorch_model.bin file."""
    ref, path = gpt2
    config = interop.read_config(path)
    model, params = interop.from_gpt2(ref.state_dict(), config)
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    _, from_bin = interop.from_gpt2(str(tmp_path), config)
    assert_params_identical(params, from_bin)
    ids = tokens((1, 7))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(apply(model, params, jnp.asarray(ids)), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_round_trip_through_safetensors_is_bitwise(gpt2, scan_layers, tmp_path):
    references.check_round_trip(gpt2[1], scan_layers, tmp_path)


def test_exported_checkpoint_loads_in_transformers(gpt2, tmp_path):
    references.check_transformers_reads_export(*gpt2, tmp_path)


# ----------------------------------------------------------------------------------------------
# Bad input: each error names the file and the key.


def test_other_architecture_names_missing_keys(bert_mlm, gpt2):
    _, bert_path = bert_mlm
    _, gpt2_path = gpt2
    with pytest.raises(ValueError, match=r"missing from .*model\.safetensors.*transformer\.h\.0"):
        interop.from_gpt2(bert_path, interop.read_config(gpt2_path))


def test_config_sizes_not_matching_weights_name_key_and_file(gpt2):
    _, path = gpt2
    config = interop.read_config(path)
    config["n_embd"] = 64
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' in .*model\.safetensors"):
        interop.from_gpt2(path, config)
    config = interop.read_config(path)
    config["n_layer"] = 1  # fewer layers than the weights: layer 1 is unexpected
    with pytest.raises(ValueError, match=r"unexpected key.*transformer\.h\.1\."):
        interop.from_gpt2(path, config)


def test_unexpected_key_and_untied_head_are_errors(gpt2):
    ref, path = gpt2
    config = interop.read_config(path)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["transformer.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected key.*'transformer\.extra\.weight'"):
        interop.from_gpt2(state, config)
    del state["transformer.extra.weight"]
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # no longer the tied matrix
    with pytest.raises(ValueError, match=r"'lm_head\.weight'.*differs from 'transformer\.wte"):
        interop.from_gpt2(state, config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"activation_function": "tanh"},
            r"GPT2LMHeadModel: activation_function='tanh' is not supported; allowed: "
            r"\('gelu_new', 'gelu_pytorch_tanh', 'gelu', 'relu'\)",
        ),
        (
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx=True is not supported \(needs False\)",
        ),
        ({"n_layer": None}, r"GPT2LMHeadModel: the config has no 'n_layer'"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(gpt2, changes, message):
    """Each refusal names the key, its value and what tfjax supports."""
    references.check_config_refused(gpt2[1], changes, message)
