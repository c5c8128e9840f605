"""Marian and Opus-MT (tfjax.interop.families.marian) against transformers: logits, greedy
generation, Opus-MT's ids (pad V - 1, EOS 0) with remap_ids=True, round trips, and
refusals."""

import functools

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, save_pretrained
from interop_references import (
    ATOL,
    V,
    apply,
    assert_rows_end_at_eos,
    marian_config,
    seq2seq_batch,
    torch,
    transformers,
)

from tfjax import decode, interop

marian = references.marian


@references.reference
def marian_untied():
    """Separate source and target embeddings and output projection. Random tied models repeat
    one token forever under greedy decoding; this one gives varied continuations."""
    torch.manual_seed(0)
    return transformers.MarianMTModel(marian_config(False, 0.1)).eval()


def _marian_logits(ref, inputs, decoder_inputs):
    with torch.no_grad():
        return ref(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor((inputs != 0).astype(np.int64)),
            decoder_input_ids=torch.tensor(decoder_inputs),
        ).logits.numpy()


@pytest.mark.parametrize(
    ("family", "scan_layers"), [("marian", False), ("marian", True), ("marian_untied", False)]
)
def test_logits_match_reference(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.share_embeddings == (family == "marian") and model.norm_position == "post"
    references.check_seq2seq_logits(model, params, functools.partial(_marian_logits, ref))


def test_from_in_memory_state_dict(marian):
    """transformers' in-memory state dict also holds the tied copies and the position tables."""
    ref, path = marian
    state = ref.state_dict()
    assert "lm_head.weight" in state and "model.encoder.embed_positions.weight" in state
    _, params = interop.from_marian(state, ref.config)
    _, from_file = interop.load(path)
    assert_params_identical(params, from_file)


def _marian_generate(ref, sources, max_new, eos, pad):
    """transformers' greedy continuation (without the start token, `pad`), checked to start
    with it."""
    with torch.no_grad():
        out = ref.generate(
            torch.tensor(sources),
            attention_mask=torch.tensor((sources != pad).astype(np.int64)),
            max_new_tokens=max_new,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos,
            **({"pad_token_id": 0, "decoder_start_token_id": 0} if pad == 0 else {}),
        ).numpy()  # Opus-MT: pad_token_id and decoder_start_token_id V - 1 from the config
    assert (out[:, 0] == pad).all()  # the start token
    return out[:, 1:]


def test_greedy_generation_matches_reference(marian_untied):
    ref, path = marian_untied
    model, params = interop.load(path)
    rs = np.random.RandomState(7)
    sources, max_new = rs.randint(3, V, (3, 6)), 12
    sources[2, 4:] = 0
    free = _marian_generate(ref, sources, max_new, V + 5, 0)  # no EOS: the full continuation
    assert len(set(free.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(free[0, max_new // 2])
    want = _marian_generate(ref, sources, max_new, eos, 0)
    got, _ = decode.generate(model, params, sources, max_new_tokens=max_new, eos_id=eos)
    got = np.asarray(got)
    assert_rows_end_at_eos(got, want, eos)
    assert eos in got[0]


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", ["marian", "marian_untied"])
def test_round_trip_through_safetensors_is_bitwise(family, scan_layers, request, tmp_path):
    references.check_round_trip(request.getfixturevalue(family)[1], scan_layers, tmp_path)


def test_exported_checkpoint_loads_in_transformers(marian, tmp_path):
    ref, path = marian
    model, params = interop.load(path)
    interop.save(model, params, tmp_path)
    references.quiet()
    again = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    inputs, _, decoder_inputs = seq2seq_batch()
    np.testing.assert_array_equal(
        _marian_logits(again, inputs, decoder_inputs), _marian_logits(ref, inputs, decoder_inputs)
    )


def test_opus_options_silu_and_final_logits_bias(tmp_path):
    """Opus-MT's options: swish FFN and a non-zero final_logits_bias."""
    torch.manual_seed(12)
    config = marian_config(True, 0.2)
    config.activation_function = "swish"
    ref = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        ref.final_logits_bias.copy_(torch.randn_like(ref.final_logits_bias))
    path = save_pretrained(ref, tmp_path / "ref")
    model, params = interop.load(path)
    assert model.activation == "silu" and model.logits_bias
    references.check_seq2seq_logits(model, params, functools.partial(_marian_logits, ref))
    interop.save(model, params, tmp_path / "out")
    exported, original = (interop.read_state_dict(tmp_path / d) for d in ("out", "ref"))
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k


# ----------------------------------------------------------------------------------------------
# Bad input: each error names the key, the file and what is allowed.


def test_config_sizes_not_matching_weights(marian):
    _, path = marian
    config = interop.read_config(path)
    config["d_model"] = 64
    with pytest.raises(ValueError, match=r"'model\.shared\.weight' in .*model\.safetensors.*64"):
        interop.from_marian(path, config)
    config = interop.read_config(path)
    config["encoder_layers"] = config["decoder_layers"] = 1  # the weights have a layer 1 too
    with pytest.raises(ValueError, match=r"unexpected key.*'model\.decoder\.layers\.1\."):
        interop.from_marian(path, config)
    config = interop.read_config(path)
    config["decoder_ffn_dim"] = 64
    with pytest.raises(ValueError, match=r"encoder_ffn_dim=48 differs from decoder_ffn_dim=64"):
        interop.from_marian(path, config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"activation_function": "tanh"}, r"activation_function='tanh' is not supported"),
        ({"scale_embedding": False}, r"scale_embedding=False"),
        (
            {"pad_token_id": 60, "decoder_start_token_id": 60},
            r"pad_token_id=60 .*uses token id 0 .*Pass remap_ids=True",
        ),
        ({"decoder_start_token_id": 5}, r"pad_token_id=0 and decoder_start_token_id=5; .*one id"),
        (
            {"tie_word_embeddings": False},
            r"share_encoder_decoder_embeddings=True differs from tie_word_embeddings=False",
        ),
    ],
)
def test_config_options_tfjax_lacks_are_errors(marian, changes, message):
    _, path = marian
    config = {**interop.read_config(path), **changes}
    with pytest.raises(ValueError, match=message):
        interop.from_marian(path, config)


def test_directory_without_weights(tmp_path, marian):
    _, path = marian
    with pytest.raises(FileNotFoundError, match=f"no weights in '{tmp_path}'"):
        interop.from_marian(tmp_path, interop.read_config(path))


# ----------------------------------------------------------------------------------------------
# Opus-MT's token ids: pad = decoder start = V - 1, EOS 0, loaded with remap_ids=True.


def _opus_config(shared: bool):
    config = marian_config(shared, 0.1)
    config.activation_function = "swish"
    config.pad_token_id = config.decoder_start_token_id = V - 1
    config.eos_token_id = 0
    return config


def _opus_model(shared: bool, seed: int = 0):
    torch.manual_seed(seed)
    ref = transformers.MarianMTModel(_opus_config(shared)).eval()
    with torch.no_grad():  # Opus-MT's are zero; random ones would show a misplaced entry
        ref.final_logits_bias.copy_(0.2 * torch.randn_like(ref.final_logits_bias))
    return ref


@references.reference
def opus():
    """Untied (varied greedy continuations; see marian_untied)."""
    return _opus_model(shared=False, seed=4)


def _opus_batch():
    """Marian ids: real tokens in [1, V - 1), EOS 0 ending each row, padding V - 1; and the
    decoder inputs (targets shifted right behind the start token V - 1)."""
    rs = np.random.RandomState(11)
    inputs, targets = rs.randint(1, V - 1, (2, 9)), rs.randint(1, V - 1, (2, 7))
    inputs[0, -1], inputs[1, 4], inputs[1, 5:] = 0, 0, V - 1
    targets[0, 3], targets[0, 4:], targets[1, -1] = 0, V - 1, 0
    return inputs, targets, np.pad(targets, ((0, 0), (1, 0)), constant_values=V - 1)[:, :-1]


def test_id_map_swaps_pad_and_zero():
    config = _opus_config(True)
    ids = interop.marian_id_map(config)
    assert ids[0] == V - 1 and ids[V - 1] == 0 and (ids[1 : V - 1] == np.arange(1, V - 1)).all()
    marian_ids = np.array([[5, 0, V - 1, V - 1]])
    tfjax_ids = interop.marian_to_tfjax_ids(marian_ids, config)
    assert tfjax_ids.tolist() == [[5, V - 1, 0, 0]]  # Marian's pad -> 0, its EOS 0 -> V - 1
    assert (interop.tfjax_to_marian_ids(tfjax_ids, config) == marian_ids).all()
    assert (interop.marian_id_map(marian_config(True, 0.1)) == np.arange(V)).all()


@pytest.mark.parametrize("shared", [True, False])
def test_opus_logits_match_reference(shared):
    ref = _opus_model(shared, seed=14)
    model, params = interop.from_marian(ref.state_dict(), ref.config, remap_ids=True)
    assert model.activation == "silu" and model.logits_bias and model.share_embeddings == shared
    inputs, targets, decoder_inputs = _opus_batch()
    with torch.no_grad():
        want = ref(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor((inputs != V - 1).astype(np.int64)),
            decoder_input_ids=torch.tensor(decoder_inputs),
        ).logits.numpy()
    to_tfjax = functools.partial(interop.marian_to_tfjax_ids, config=ref.config)
    got = apply(model, params, jnp.asarray(to_tfjax(inputs)), jnp.asarray(to_tfjax(targets)))
    # tfjax's logit i is Marian's logit for the token marian_id_map[i].
    want = want[..., interop.marian_id_map(ref.config)]
    mask = targets != V - 1
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def test_opus_greedy_generation_matches_reference(opus):
    ref, path = opus
    model, params = interop.load(path, remap_ids=True)
    rs = np.random.RandomState(7)
    sources, max_new = rs.randint(1, V - 1, (3, 6)), 12
    sources[:, -1] = 0  # EOS
    sources[2, 3], sources[2, 4:] = 0, V - 1
    free = _marian_generate(ref, sources, max_new, V + 5, V - 1)  # no EOS: the whole output
    assert len(set(free.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(free[0, max_new // 2])  # in Marian ids
    want = _marian_generate(ref, sources, max_new, eos, V - 1)
    tfjax_eos = int(interop.marian_to_tfjax_ids(eos, path))
    got, _ = decode.generate(
        model,
        params,
        interop.marian_to_tfjax_ids(sources, path),
        max_new_tokens=max_new,
        eos_id=tfjax_eos,
    )
    got = interop.tfjax_to_marian_ids(np.asarray(got), path)  # 0 after EOS -> Marian's pad
    assert_rows_end_at_eos(got, want, eos, pad=V - 1)
    assert eos in got[0]


def test_opus_export_swaps_ids_back(opus, tmp_path):
    ref, path = opus
    model, params = interop.load(path, remap_ids=True)
    state, config = interop.to_marian(model, params, pad_token_id=V - 1, eos_token_id=0)
    original = interop.read_state_dict(path)
    assert state.keys() == original.keys()
    for k in original:
        assert np.array_equal(state[k], original[k]), k
    assert config["pad_token_id"] == config["decoder_start_token_id"] == V - 1
    assert config["eos_token_id"] == 0
    # Default export: a valid Marian checkpoint in tfjax's ids (pad 0), which loads as is.
    interop.save(model, params, tmp_path)
    again, again_params = interop.load(tmp_path)
    assert_params_identical(again_params, params)


def test_id_errors_are_one_line_naming_the_architecture():
    with pytest.raises(ValueError, match=r"^MarianMTModel: the config has no 'vocab_size'$"):
        interop.marian_id_map({})
    with pytest.raises(ValueError, match=r"^MarianMTModel: pad_token_id=None and decoder_start"):
        interop.marian_id_map({"vocab_size": 10})
