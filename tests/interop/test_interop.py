"""tfjax.interop against the PyTorch references: logits, greedy generation, round trips, errors.

Small random Hugging Face models are built and saved locally (no download); each converted
model must give the reference's numbers within 1e-5 in float32.
"""

import copy
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tfjax import decode, interop  # noqa: E402
from tfjax.interop import core  # noqa: E402
from tfjax.interop.core import posemb  # noqa: E402

V = 61
ATOL = 1e-5


def _quiet():
    transformers.logging.set_verbosity_error()


def _tokens(shape, seed=0, low=3):
    return np.random.RandomState(seed).randint(low, V, shape)


def _apply(model, params, *args, **kwargs):
    out, _ = jax.jit(lambda p, *a: model.apply({"params": p}, *a, **kwargs))(params, *args)
    return np.asarray(out)


# ----------------------------------------------------------------------------------------------
# Reference checkpoints, built once.


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=V,
        n_positions=48,
        layer_norm_epsilon=1e-4,
        initializer_range=0.3,  # large weights: varied greedy continuations
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    ref = transformers.GPT2LMHeadModel(config).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
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
    ref = transformers.LlamaForCausalLM(config).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("llama"))


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


def _llama_rope_fixture(name):
    """A Llama with a RoPE scaling (llama3's head tied to the embeddings, as Llama 3.2 1B)."""

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        rope, max_len, tied = LLAMA_ROPES[name]
        torch.manual_seed(5)
        config = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=max_len,
            rms_norm_eps=1e-5,
            rope_parameters={**rope, "rope_theta": 500.0},
            tie_word_embeddings=tied,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        ref = transformers.LlamaForCausalLM(config).eval()
        return ref, save_pretrained(ref, tmp_path_factory.mktemp(name))

    return fixture


for _name in LLAMA_ROPES:
    globals()[f"_fixture_{_name}"] = _llama_rope_fixture(_name)
ROPE_FAMILIES = sorted(LLAMA_ROPES)


def _small_decoder_config(cls, **changes):
    """The llama fixture's sizes in another family's config class."""
    return cls(
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
        **changes,
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Qwen 2.5: biases on q, k, v (random, so a missing one would show), untied head."""
    torch.manual_seed(6)
    ref = transformers.Qwen2ForCausalLM(_small_decoder_config(transformers.Qwen2Config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen 3: q/k norms (random scales), head_dim 16 != 32 / 4, tied head (as Qwen3-0.6B)."""
    torch.manual_seed(7)
    config = _small_decoder_config(transformers.Qwen3Config, head_dim=16, tie_word_embeddings=True)
    ref = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Mistral with a sliding window of 4: the tests' 10 to 17 positions reach past it."""
    torch.manual_seed(8)
    config = _small_decoder_config(transformers.MistralConfig, head_dim=8, sliding_window=4)
    ref = transformers.MistralForCausalLM(config).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("mistral"))


DECODERS = ["gpt2", "llama", *ROPE_FAMILIES, "mistral", "qwen2", "qwen3"]


def _bert_config():
    return transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        vocab_size=V,
        max_position_embeddings=24,
        num_labels=3,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def bert_mlm(tmp_path_factory):
    torch.manual_seed(2)
    ref = transformers.BertForMaskedLM(_bert_config()).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("bert_mlm"))


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory):
    torch.manual_seed(3)
    ref = transformers.BertForSequenceClassification(_bert_config()).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("bert_cls"))


@pytest.fixture(scope="module")
def hf_vit(tmp_path_factory):
    torch.manual_seed(4)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        image_size=32,
        patch_size=8,
        num_labels=5,
    )
    ref = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # position embeddings that matter, so resampling errors would show
        pe = ref.vit.embeddings.position_embeddings
        pe.copy_(torch.randn_like(pe))
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("vit"))


def _marian_config(shared: bool, init_std: float):
    return transformers.MarianConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        activation_function="relu",  # the paper's FFN
        scale_embedding=True,
        share_encoder_decoder_embeddings=shared,
        tie_word_embeddings=shared,
        pad_token_id=0,  # tfjax's padding and decoder start token
        decoder_start_token_id=0,
        eos_token_id=2,
        forced_eos_token_id=None,
        init_std=init_std,
    )


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """Shared embeddings (one matrix three ways, as Opus-MT)."""
    torch.manual_seed(8)
    ref = transformers.MarianMTModel(_marian_config(True, 0.2)).eval()
    with torch.no_grad():  # norms that are not the identity, so a swapped norm would show
        for name, p in ref.named_parameters():
            if "layer_norm" in name:
                p.copy_(float(name.endswith("weight")) + 0.3 * torch.randn_like(p))
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("marian"))


@pytest.fixture(scope="module")
def marian_untied(tmp_path_factory):
    """Separate source and target embeddings and output projection. Random tied models repeat
    one token forever under greedy decoding; this one gives varied continuations."""
    torch.manual_seed(0)
    ref = transformers.MarianMTModel(_marian_config(False, 0.1)).eval()
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("marian_untied"))


# ----------------------------------------------------------------------------------------------
# Decoders.


def _padded_batch():
    """Rows of 10 tokens, the second right-padded after 6; returns (tokens, attention mask)."""
    tokens = _tokens((2, 10))
    tokens[1, 6:] = 0
    return tokens, tokens != 0


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", DECODERS)
def test_decoder_logits_match_reference(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers
    tokens, mask = _padded_batch()
    # The reference in float64: tfjax's float32 logits are compared with the exact ones, not
    # with another float32 rounding (both are ~2.5e-6 from them; once, in a full suite run,
    # the two float32 results differed by 1.5e-4, which did not recur).
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        want = ref64(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    got = _apply(model, params, jnp.asarray(tokens))
    assert got.shape == want.shape
    # Causal attention: real tokens never see the right padding; compare where the mask is on.
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def _greedy_reference(ref, prompts, max_new, eos):
    with torch.no_grad():
        out = ref.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[:, prompts.shape[1] :].numpy()


def _until_eos(row, eos):
    row = list(row)
    return row[: row.index(eos) + 1] if eos in row else row


def test_decoder_beam_search_with_hf_rules_matches_generate(gpt2):
    """beam_rules="hf" for a decoder-only model: transformers' beams for equal-length prompts,
    with an EOS the reference emits mid-way (so finished and live beams compete)."""
    ref, path = gpt2
    model, params = interop.load(path)
    prompts, max_new = _tokens((2, 5), seed=7), 10
    eos = int(_greedy_reference(ref, prompts, max_new, eos=V + 5)[0, 3])
    for early_stopping, length_penalty in ((False, 1.0), (True, 0.6), ("never", 2.0)):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor(prompts),
                attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                max_new_tokens=max_new,
                do_sample=False,
                num_beams=3,
                eos_token_id=eos,
                pad_token_id=0,
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
            assert _until_eos(row_got, eos) == _until_eos(row_want, eos), early_stopping
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), rtol=1e-5)


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_greedy_generation_matches_reference(family, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path)
    prompts, max_new = _tokens((3, 5), seed=7), 12
    # A token the reference emits mid-way in row 0 is the EOS, so stopping is exercised too.
    free = _greedy_reference(ref, prompts, max_new, eos=V + 5)
    eos = int(free[0, max_new // 2])
    want = _greedy_reference(ref, prompts, max_new, eos=eos)
    got, _ = decode.generate(model, params, prompts, max_new_tokens=max_new, eos_id=eos)
    got = np.asarray(got)
    assert len(set(free.ravel().tolist())) > 3, "degenerate reference; raise the init scale"
    for row_got, row_want in zip(got, want, strict=True):
        expected = _until_eos(row_want, eos)
        assert list(row_got[: len(expected)]) == expected
        assert (row_got[len(expected) :] == 0).all()  # tfjax pads after EOS with 0
    assert eos in got[0]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", DECODERS[1:])
def test_decoder_greedy_generation_of_padded_prompts(family, scan_layers, side, request):
    """Prompts of 5, 2 and 4 tokens in one padded batch, with the KV cache: each row's
    continuation is the reference's for that prompt alone (left padding: also the reference's
    own left-padded batch, with its attention mask)."""
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    tokens, max_new = _tokens((3, 5), seed=11), 9
    lengths = (5, 2, 4)
    prompts = np.zeros_like(tokens)
    for row, n in enumerate(lengths):
        if side == "right":
            prompts[row, :n] = tokens[row, :n]
        else:
            prompts[row, 5 - n :] = tokens[row, :n]
    want = [
        _greedy_reference(ref, tokens[r : r + 1, :n], max_new, eos=V + 5)[0]
        for r, n in enumerate(lengths)
    ]
    # An EOS no row emits: all 9 tokens of every row are compared.
    eos = min(set(range(3, V)) - set(np.concatenate(want).tolist()))
    got, _ = decode.generate(model, params, prompts, max_new_tokens=max_new, eos_id=eos)
    for row, n in enumerate(lengths):
        assert list(np.asarray(got)[row]) == list(want[row]), (row, n)
    # transformers' dynamic RoPE takes one length for a whole batch (its longest row's), so its
    # left-padded rows depend on each other; tfjax's rows match the reference's rows alone.
    if side == "left" and family != "llama_dynamic":
        with torch.no_grad():
            batched = ref.generate(
                torch.tensor(prompts),
                attention_mask=torch.tensor((prompts != 0).astype(np.int64)),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=V + 5,
                pad_token_id=0,
            )[:, 5:].numpy()
        np.testing.assert_array_equal(np.asarray(got), batched)


def test_gpt2_from_state_dict_and_torch_bin(gpt2, tmp_path):
    """An in-memory state dict (lm_head tied and present) and a pytorch_model.bin file."""
    ref, path = gpt2
    config = interop.read_config(path)
    model, params = interop.from_gpt2(ref.state_dict(), config)
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    _, from_bin = interop.from_gpt2(str(tmp_path), config)
    assert_params_identical(params, from_bin)
    tokens = _tokens((1, 7))
    with torch.no_grad():
        want = ref(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_apply(model, params, jnp.asarray(tokens)), want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# BERT.


@pytest.mark.parametrize("scan_layers", [False, True])
def test_bert_mlm_logits_match_reference(bert_mlm, scan_layers):
    ref, path = bert_mlm
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.head == "mlm" and model.norm_eps == 1e-12
    tokens, mask = _padded_batch()
    with torch.no_grad():
        want = ref(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    got = _apply(model, params, jnp.asarray(tokens))
    # Padded query rows differ by design (tfjax masks them fully); real tokens must agree.
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def test_bert_classifier_logits_match_reference(bert_cls):
    ref, path = bert_cls
    model, params = interop.load(path)
    assert model.head == "classifier" and model.num_classes == 3
    tokens, mask = _padded_batch()
    types = (np.arange(10) >= 4).astype(np.int64)[None].repeat(2, 0)
    with torch.no_grad():
        want = ref(
            torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            token_type_ids=torch.tensor(types),
        ).logits.numpy()
    got = _apply(model, params, jnp.asarray(tokens), token_types=jnp.asarray(types))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_bert_reads_tf_era_gamma_beta_names(bert_mlm):
    ref, path = bert_mlm
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in ref.state_dict().items()
    }
    _, renamed = interop.from_bert(state, interop.read_config(path))
    _, direct = interop.load(path)
    assert_params_identical(renamed, direct)


# ----------------------------------------------------------------------------------------------
# ViT.


def _images(h, w, seed=0):
    return np.random.RandomState(seed).randn(2, 3, h, w).astype(np.float32)


def _vit_logits(model, params, images_nchw):
    return _apply(model, params, jnp.asarray(images_nchw.transpose(0, 2, 3, 1)))


def test_hf_vit_logits_match_reference(hf_vit):
    ref, path = hf_vit
    model, params = interop.load(path, scan_layers=True)
    images = _images(32, 32)
    with torch.no_grad():
        want = ref(torch.tensor(images)).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("size", [(48, 40), (24, 24)])
def test_hf_vit_resampled_posemb_matches_interpolate_pos_encoding(hf_vit, size):
    ref, path = hf_vit
    model, params = interop.from_hf_vit(path, image_size=size)
    assert params["pos_embed"].shape == (1, 1 + (size[0] // 8) * (size[1] // 8), 32)
    images = _images(*size, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor(images), interpolate_pos_encoding=True).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("size_in", "size_out"), [(4, 7), (7, 4), (3, 13), (6, 6)])
def test_bicubic_matrix_matches_torch_interpolate(size_in, size_out):
    x = np.random.RandomState(0).randn(1, 2, size_in, size_in).astype(np.float32)
    want = torch.nn.functional.interpolate(
        torch.tensor(x), size=(size_out, size_out), mode="bicubic", align_corners=False
    ).numpy()[0]
    m = posemb.bicubic_matrix(size_in, size_out)
    got = np.einsum("Hh,chw,Ww->cHW", m, x[0].astype(np.float64), m)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _timm_state(hf_state):
    """HF ViT weights under timm's documented VisionTransformer key names (qkv fused)."""
    s = {k: v.numpy() for k, v in hf_state.items()}
    out = {
        "cls_token": s["vit.embeddings.cls_token"],
        "pos_embed": s["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": s["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": s["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": s["vit.layernorm.weight"],
        "norm.bias": s["vit.layernorm.bias"],
        "head.weight": s["classifier.weight"],
        "head.bias": s["classifier.bias"],
    }
    for i in range(2):
        h = f"vit.encoder.layer.{i}."
        att = f"{h}attention.attention."
        for part in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{part}"] = np.concatenate(
                [s[f"{att}{n}.{part}"] for n in ("query", "key", "value")]
            )
            out[f"blocks.{i}.attn.proj.{part}"] = s[f"{h}attention.output.dense.{part}"]
            out[f"blocks.{i}.norm1.{part}"] = s[f"{h}layernorm_before.{part}"]
            out[f"blocks.{i}.norm2.{part}"] = s[f"{h}layernorm_after.{part}"]
            out[f"blocks.{i}.mlp.fc1.{part}"] = s[f"{h}intermediate.dense.{part}"]
            out[f"blocks.{i}.mlp.fc2.{part}"] = s[f"{h}output.dense.{part}"]
    return out


def test_timm_vit_keys_match_hf_reference(hf_vit):
    ref, path = hf_vit
    # transformers 5 renames ViT modules in memory; the saved file keeps the hub key names.
    hf_state = {k: torch.from_numpy(v) for k, v in interop.read_state_dict(path).items()}
    model, params = interop.from_timm_vit(
        _timm_state(hf_state), image_size=40, num_heads=4, norm_eps=1e-12
    )
    assert (model.width, model.num_layers, model.mlp_dim, model.num_classes) == (32, 2, 40, 5)
    images = _images(40, 40, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor(images), interpolate_pos_encoding=True).logits.numpy()
    np.testing.assert_allclose(_vit_logits(model, params, images), want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention.


def test_torch_mha_self_attention_with_masks():
    torch.manual_seed(5)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    mha, params = interop.from_torch_mha(ref)
    x = np.random.RandomState(0).randn(2, 6, 16).astype(np.float32)
    pad = np.zeros((2, 6), bool)
    pad[1, 4:] = True  # torch: True = ignore this key
    causal = np.triu(np.ones((6, 6), bool), 1)
    with torch.no_grad():
        want = ref(
            *(torch.tensor(x),) * 3,
            key_padding_mask=torch.tensor(pad),
            attn_mask=torch.tensor(causal),
            need_weights=False,
        )[0].numpy()
    mask = jnp.asarray(~pad)[:, None, None, :] & jnp.asarray(~causal)[None, None]
    got = np.asarray(mha.apply({"params": params}, jnp.asarray(x), mask=mask))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    exported = interop.to_torch_mha(mha, params)
    assert exported.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert np.array_equal(exported[k], v.numpy()), k


def test_torch_mha_cross_attention_other_width_no_bias():
    torch.manual_seed(6)
    ref = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=12, bias=False, batch_first=True)
    ref.eval()
    mha, params = interop.from_torch_mha(ref)
    assert not mha.use_bias and params["key_kernel"].shape == (12, 2, 8)
    rs = np.random.RandomState(1)
    x, ctx = rs.randn(2, 5, 16).astype(np.float32), rs.randn(2, 7, 12).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.tensor(x), torch.tensor(ctx), torch.tensor(ctx), need_weights=False)[0]
    got = mha.apply({"params": params}, jnp.asarray(x), jnp.asarray(ctx))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=ATOL, rtol=0)
    # The state dict route needs num_heads and gives the same parameters.
    _, from_state = interop.from_torch_mha(ref.state_dict(), num_heads=2)
    assert_params_identical(params, from_state)
    exported = interop.to_torch_mha(mha, params)
    assert sorted(exported) == sorted(ref.state_dict())


def test_torch_mha_rejects_bias_kv():
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        interop.from_torch_mha(ref)


# ----------------------------------------------------------------------------------------------
# Encoder-decoder: MarianMTModel and torch.nn.Transformer.


def _seq2seq_batch():
    """Source [2, 9] with row 1 padded after 5, targets [2, 7] with row 0 padded after 4, and
    the decoder inputs (targets shifted right behind the start token 0)."""
    rs = np.random.RandomState(11)
    inputs, targets = rs.randint(3, V, (2, 9)), rs.randint(3, V, (2, 7))
    inputs[1, 5:] = 0
    targets[0, 4:] = 0
    return inputs, targets, np.pad(targets, ((0, 0), (1, 0)))[:, :-1]


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
def test_marian_logits_match_reference(family, scan_layers, request):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.share_embeddings == (family == "marian") and model.norm_position == "post"
    inputs, targets, decoder_inputs = _seq2seq_batch()
    want = _marian_logits(ref, inputs, decoder_inputs)
    got = _apply(model, params, jnp.asarray(inputs), jnp.asarray(targets))
    assert got.shape == want.shape == (2, 7, V)
    # Padded target rows differ by design (tfjax masks them fully); real tokens must agree.
    mask = targets != 0
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def test_marian_from_in_memory_state_dict(marian):
    """transformers' in-memory state dict also holds the tied copies and the position tables."""
    ref, path = marian
    state = ref.state_dict()
    assert "lm_head.weight" in state and "model.encoder.embed_positions.weight" in state
    _, params = interop.from_marian(state, ref.config)
    _, from_file = interop.load(path)
    assert_params_identical(params, from_file)


def test_marian_greedy_generation_matches_reference(marian_untied):
    ref, path = marian_untied
    model, params = interop.load(path)
    rs = np.random.RandomState(7)
    sources, max_new = rs.randint(3, V, (3, 6)), 12
    sources[2, 4:] = 0

    def reference(eos):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor(sources),
                attention_mask=torch.tensor((sources != 0).astype(np.int64)),
                max_new_tokens=max_new,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=0,
                decoder_start_token_id=0,
            ).numpy()
        assert (out[:, 0] == 0).all()  # the start token
        return out[:, 1:]

    free = reference(V + 5)  # no EOS: the full continuation
    assert len(set(free.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(free[0, max_new // 2])
    want = reference(eos)
    got, _ = decode.generate(model, params, sources, max_new_tokens=max_new, eos_id=eos)
    got = np.asarray(got)
    for row_got, row_want in zip(got, want, strict=True):
        expected = _until_eos(row_want, eos)
        assert list(row_got[: len(expected)]) == expected
        assert (row_got[len(expected) :] == 0).all()
    assert eos in got[0]


class _TorchSeq2Seq(torch.nn.Module):
    """The paper's model in plain PyTorch: nn.Embedding * sqrt(D) + interleaved sinusoids (as in
    PyTorch's tutorial), a post-LN ReLU nn.Transformer without final norms, and the output
    projection (the embedding matrix when shared)."""

    def __init__(self, *, shared, std=0.25, width=32, heads=4, mlp=48, layers=2):
        super().__init__()
        self.width = width
        self.embed = torch.nn.Embedding(V, width)
        if not shared:
            self.target_embed = torch.nn.Embedding(V, width)
            self.output = torch.nn.Linear(width, V, bias=False)
        kw = dict(
            dim_feedforward=mlp, dropout=0.0, activation="relu", batch_first=True, norm_first=False
        )
        layer = torch.nn.TransformerEncoderLayer(width, heads, **kw)
        encoder = torch.nn.TransformerEncoder(layer, layers, norm=None, enable_nested_tensor=False)
        decoder = torch.nn.TransformerDecoder(
            torch.nn.TransformerDecoderLayer(width, heads, **kw), layers, norm=None
        )
        self.transformer = torch.nn.Transformer(
            width, heads, custom_encoder=encoder, custom_decoder=decoder, batch_first=True
        )
        pos = torch.arange(64, dtype=torch.float32)[:, None]
        angles = pos * 10_000.0 ** (-torch.arange(0, width, 2, dtype=torch.float32) / width)
        pe = torch.stack([torch.sin(angles), torch.cos(angles)], -1).reshape(64, width)
        self.register_buffer("pe", pe, persistent=False)
        with torch.no_grad():  # every layer different, norms not the identity
            for name, p in self.named_parameters():
                base = float(name.endswith("weight") and ".norm" in name)
                p.copy_(base + std * torch.randn_like(p))

    def forward(self, inputs, decoder_inputs):
        scale = math.sqrt(self.width)
        target_embed = getattr(self, "target_embed", self.embed)
        x = self.embed(inputs) * scale + self.pe[: inputs.shape[1]]
        y = target_embed(decoder_inputs) * scale + self.pe[: decoder_inputs.shape[1]]
        t = decoder_inputs.shape[1]
        y = self.transformer(
            x,
            y,
            tgt_mask=torch.triu(torch.ones(t, t, dtype=torch.bool), 1),
            src_key_padding_mask=inputs == 0,
            memory_key_padding_mask=inputs == 0,
            tgt_is_causal=True,
        )
        if hasattr(self, "output"):
            return self.output(y)
        return y @ self.embed.weight.T


def _torch_seq2seq(shared, seed=9, std=0.25):
    torch.manual_seed(seed)
    return _TorchSeq2Seq(shared=shared, std=std).eval()


@pytest.mark.parametrize(("shared", "scan_layers"), [(True, False), (False, True)])
def test_torch_transformer_logits_match_reference(shared, scan_layers):
    ref = _torch_seq2seq(shared)
    model, params = interop.from_torch_transformer(ref, num_heads=4, scan_layers=scan_layers)
    assert model.share_embeddings == shared and model.num_layers == 2 and model.mlp_dim == 48
    inputs, targets, decoder_inputs = _seq2seq_batch()
    with torch.no_grad():
        want = ref(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy()
    got = _apply(model, params, jnp.asarray(inputs), jnp.asarray(targets))
    mask = targets != 0
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def test_torch_transformer_greedy_decoding_matches_reference():
    """The torch module has no generate: a greedy loop over the whole prefix is the reference."""
    ref = _torch_seq2seq(shared=False, seed=11, std=0.1)  # larger weights repeat one token
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    rs = np.random.RandomState(3)
    sources, max_new = rs.randint(3, V, (3, 6)), 10
    sources[1, 3:] = 0
    tokens = torch.zeros((3, 1), dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_new):
            logits = ref(torch.tensor(sources), tokens)[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    want = tokens[:, 1:].numpy()
    assert len(set(want.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(want[0, max_new // 2])  # rows stop at their first EOS; tfjax pads with 0 after
    got, _ = decode.generate(model, params, sources, max_new_tokens=max_new, eos_id=eos)
    for row_got, row_want in zip(np.asarray(got), want, strict=True):
        expected = _until_eos(row_want, eos)
        assert list(row_got[: len(expected)]) == expected
        assert (row_got[len(expected) :] == 0).all()


def test_torch_transformer_round_trip_is_bitwise(tmp_path):
    ref = _torch_seq2seq(shared=True)
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    state = interop.to_torch_transformer(model, params)
    assert state.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert np.array_equal(state[k], v.numpy()), k
    core.write_safetensors(state, tmp_path)
    model2, params2 = interop.from_torch_transformer(tmp_path, num_heads=4)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    # The exported state dict loads back into the torch module.
    again = _TorchSeq2Seq(shared=True).eval()
    again.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    inputs, _, decoder_inputs = _seq2seq_batch()
    with torch.no_grad():
        want = ref(torch.tensor(inputs), torch.tensor(decoder_inputs))
        np.testing.assert_array_equal(
            again(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy(), want.numpy()
        )


# ----------------------------------------------------------------------------------------------
# Export and round trips.


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize(
    "family",
    [*DECODERS, "bert_mlm", "bert_cls", "hf_vit", "marian", "marian_untied"],
)
def test_round_trip_through_safetensors_is_bitwise(family, scan_layers, request, tmp_path):
    _, path = request.getfixturevalue(family)
    model, params = interop.load(path, scan_layers=scan_layers)
    interop.save(model, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    model2, params2 = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    # The export holds exactly the reference file's tensors (bitwise), under the same keys.
    original = interop.read_state_dict(path)
    exported = interop.read_state_dict(tmp_path)
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k


@pytest.mark.parametrize("family", [*DECODERS, "bert_cls"])
def test_exported_checkpoint_loads_in_transformers(family, request, tmp_path):
    ref, path = request.getfixturevalue(family)
    model, params = interop.load(path)
    interop.save(model, params, tmp_path)
    _quiet()
    again = type(ref).from_pretrained(tmp_path).eval()
    # A fresh copy of the reference: dynamic RoPE keeps the longest length it has seen (the
    # generation tests reach 17 > max_position_embeddings) and would use its frequencies here.
    original = type(ref).from_pretrained(path).eval()
    tokens = _tokens((2, 9))
    with torch.no_grad():
        want = original(torch.tensor(tokens)).logits.numpy()
        got = again(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_array_equal(got, want)


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


def test_llama_config_with_wrong_kv_heads(llama):
    _, path = llama
    config = interop.read_config(path)
    config["num_key_value_heads"] = 4
    with pytest.raises(ValueError, match=r"k_proj\.weight' in .*has shape \(16, 32\).*\(32, 32\)"):
        interop.from_llama(path, config)
    config = interop.read_config(path)
    config["head_dim"] = 16  # a head_dim the weights do not have
    with pytest.raises(ValueError, match=r"q_proj\.weight' in .*has shape \(32, 32\).*\(64, 32\)"):
        interop.from_llama(path, config)


def test_directory_without_weights(tmp_path, gpt2):
    with pytest.raises(FileNotFoundError, match=f"no weights in '{tmp_path}'.*model.safetensors"):
        interop.read_state_dict(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        interop.load(tmp_path)
    _, path = gpt2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        interop.from_gpt2(tmp_path / "nope", interop.read_config(path))


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


def test_unknown_architecture(tmp_path, gpt2):
    _, path = gpt2
    config = interop.read_config(path)
    config["architectures"] = ["FSMTForConditionalGeneration"]  # fairseq's WMT models
    core.write_safetensors(dict(interop.read_state_dict(path)), tmp_path, config)
    with pytest.raises(ValueError, match=r"config\.json: architectures=.*FSMT.*has no converter"):
        interop.load(tmp_path)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "gpt2",
            {"activation_function": "tanh"},
            r"GPT2LMHeadModel: activation_function='tanh' is not supported; allowed: "
            r"\('gelu_new', 'gelu_pytorch_tanh', 'gelu', 'relu'\)",
        ),
        (
            "gpt2",
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx=True is not supported \(needs False\)",
        ),
        ("gpt2", {"n_layer": None}, r"GPT2LMHeadModel: the config has no 'n_layer'"),
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
        (
            "bert_mlm",
            {"hidden_act": "relu"},
            r"BertForMaskedLM: hidden_act='relu' is not supported; allowed: \('gelu',\) "
            r"\(the masked-LM head",
        ),
        (
            "bert_cls",
            {"position_embedding_type": "relative_key"},
            r"position_embedding_type='relative_key' is not supported \(needs 'absolute'\)",
        ),
        ("bert_cls", {"is_decoder": True}, r"is_decoder=True is not supported"),
        ("hf_vit", {"qkv_bias": False}, r"qkv_bias=False is not supported \(needs True\)"),
        ("hf_vit", {"hidden_act": "relu"}, r"hidden_act='relu' is not supported \(needs 'gelu'\)"),
    ],
)
def test_config_values_tfjax_lacks_are_errors(family, changes, message, request):
    """Each refusal names the key, its value and what tfjax supports."""
    _, path = request.getfixturevalue(family)
    config = {**interop.read_config(path), **changes}
    with pytest.raises(ValueError, match=message):
        interop.ARCHITECTURES[config["architectures"][0]](path, config)


def test_export_refuses_models_the_architecture_cannot_hold(gpt2, bert_mlm, marian):
    model, params = interop.load(gpt2[1])
    with pytest.raises(ValueError, match=r"has no activation_function for .*activation='swiglu'"):
        interop.to_gpt2(model.clone(activation="swiglu"), params)
    with pytest.raises(ValueError, match=r"one n_head for .*num_heads=4 and num_kv_heads=2"):
        interop.to_gpt2(model.clone(num_kv_heads=2), params)
    with pytest.raises(ValueError, match=r"needs a model with position='rope', norm='rms'"):
        interop.to_llama(model, params)
    model, params = interop.load(bert_mlm[1])
    with pytest.raises(ValueError, match=r"no hidden_act for .*'relu'; supported: \('gelu',\)"):
        interop.to_bert(model.clone(activation="relu"), params)
    model, params = interop.load(marian[1])
    with pytest.raises(ValueError, match=r"needs a model with .*norm_eps=1e-05.*got .*1e-06"):
        interop.to_marian(model.clone(norm_eps=1e-6), params)


def test_exported_marian_loads_in_transformers(marian, tmp_path):
    ref, path = marian
    model, params = interop.load(path)
    interop.save(model, params, tmp_path)
    _quiet()
    again = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    inputs, _, decoder_inputs = _seq2seq_batch()
    np.testing.assert_array_equal(
        _marian_logits(again, inputs, decoder_inputs), _marian_logits(ref, inputs, decoder_inputs)
    )


def test_encoder_decoder_other_architecture_names_file_and_keys(gpt2, marian):
    _, gpt2_path = gpt2
    ref, marian_path = marian
    with pytest.raises(ValueError, match=r"missing from .*model\.safetensors.*'model\.decoder\."):
        interop.from_marian(gpt2_path, interop.read_config(marian_path))
    with pytest.raises(ValueError, match=r"no token embedding 'embed\.weight' in .*safetensors"):
        interop.from_torch_transformer(marian_path, num_heads=4)
    # A Marian state dict read as torch.nn.Transformer with the embedding named: no layers.
    with pytest.raises(ValueError, match=r"no keys under transformer\.encoder\.layers\."):
        interop.from_torch_transformer(ref.state_dict(), num_heads=4, embed="model.shared.weight")


def test_marian_config_sizes_not_matching_weights(marian):
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
def test_marian_config_options_tfjax_lacks_are_errors(marian, changes, message):
    _, path = marian
    config = {**interop.read_config(path), **changes}
    with pytest.raises(ValueError, match=message):
        interop.from_marian(path, config)


def test_torch_transformer_bad_input(tmp_path):
    ref = _torch_seq2seq(shared=False)
    state = dict(ref.state_dict())
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide the width 32"):
        interop.from_torch_transformer(state, num_heads=5)
    # Weights of another size than the embedding says: the key, its shape and the expected one.
    core.write_safetensors(
        {**state, "transformer.encoder.layers.1.linear2.weight": torch.zeros(32, 40)}, tmp_path
    )
    with pytest.raises(
        ValueError,
        match=r"'transformer\.encoder\.layers\.1\.linear2\.weight' in .*model\.safetensors has "
        r"shape \(32, 40\).*\(32, 48\)",
    ):
        interop.from_torch_transformer(tmp_path, num_heads=4)
    with pytest.raises(ValueError, match=r"unexpected key.*'output\.bias'"):
        interop.from_torch_transformer({**state, "output.bias": torch.zeros(V)}, num_heads=4)
    with pytest.raises(FileNotFoundError, match=r"no weights in .*empty.*model\.safetensors"):
        os.makedirs(tmp_path / "empty")
        interop.from_torch_transformer(tmp_path / "empty", num_heads=4)


def test_marian_directory_without_weights(tmp_path, marian):
    _, path = marian
    with pytest.raises(FileNotFoundError, match=f"no weights in '{tmp_path}'"):
        interop.from_marian(tmp_path, interop.read_config(path))


# ----------------------------------------------------------------------------------------------
# With the model options logits_bias, final_norm and the "silu" activation.


def test_marian_opus_options_silu_and_final_logits_bias(tmp_path):
    """Opus-MT's options: swish FFN and a non-zero final_logits_bias."""
    torch.manual_seed(12)
    config = _marian_config(True, 0.2)
    config.activation_function = "swish"
    ref = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        ref.final_logits_bias.copy_(torch.randn_like(ref.final_logits_bias))
    path = save_pretrained(ref, tmp_path / "ref")
    model, params = interop.load(path)
    assert model.activation == "silu" and model.logits_bias
    inputs, targets, decoder_inputs = _seq2seq_batch()
    want = _marian_logits(ref, inputs, decoder_inputs)
    got = _apply(model, params, jnp.asarray(inputs), jnp.asarray(targets))
    mask = targets != 0
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)
    interop.save(model, params, tmp_path / "out")
    exported, original = (interop.read_state_dict(tmp_path / d) for d in ("out", "ref"))
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k


def test_torch_transformer_default_final_norms():
    """nn.Transformer's own stacks end in a LayerNorm each: final_norm=True."""
    torch.manual_seed(13)
    ref = _TorchSeq2Seq(shared=True)
    # norm_first=False and relu by default: the paper's layout, plus the two final norms.
    ref.transformer = torch.nn.Transformer(32, 4, 2, 2, 48, dropout=0.0, batch_first=True)
    ref.transformer.encoder.use_nested_tensor = False  # a prototype API that warns
    with torch.no_grad():
        for p in ref.transformer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ref.eval()
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    assert model.final_norm
    inputs, targets, decoder_inputs = _seq2seq_batch()
    with torch.no_grad():
        want = ref(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy()
    got = _apply(model, params, jnp.asarray(inputs), jnp.asarray(targets))
    mask = targets != 0
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)
    state = interop.to_torch_transformer(model, params)
    assert state.keys() == ref.state_dict().keys()


# ----------------------------------------------------------------------------------------------
# Opus-MT's token ids: pad = decoder start = V - 1, EOS 0, loaded with remap_ids=True.


def _opus_config(shared: bool):
    config = _marian_config(shared, 0.1)
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


@pytest.fixture(scope="module")
def opus(tmp_path_factory):
    """Untied (varied greedy continuations; see marian_untied)."""
    ref = _opus_model(shared=False, seed=4)
    return ref, save_pretrained(ref, tmp_path_factory.mktemp("opus"))


def _opus_batch():
    """Marian ids: real tokens in [1, V - 1), EOS 0 ending each row, padding V - 1; and the
    decoder inputs (targets shifted right behind the start token V - 1)."""
    rs = np.random.RandomState(11)
    inputs, targets = rs.randint(1, V - 1, (2, 9)), rs.randint(1, V - 1, (2, 7))
    inputs[0, -1], inputs[1, 4], inputs[1, 5:] = 0, 0, V - 1
    targets[0, 3], targets[0, 4:], targets[1, -1] = 0, V - 1, 0
    return inputs, targets, np.pad(targets, ((0, 0), (1, 0)), constant_values=V - 1)[:, :-1]


def test_marian_id_map_swaps_pad_and_zero():
    config = _opus_config(True)
    ids = interop.marian_id_map(config)
    assert ids[0] == V - 1 and ids[V - 1] == 0 and (ids[1 : V - 1] == np.arange(1, V - 1)).all()
    marian = np.array([[5, 0, V - 1, V - 1]])
    tfjax_ids = interop.marian_to_tfjax_ids(marian, config)
    assert tfjax_ids.tolist() == [[5, V - 1, 0, 0]]  # Marian's pad -> 0, its EOS 0 -> V - 1
    assert (interop.tfjax_to_marian_ids(tfjax_ids, config) == marian).all()
    assert (interop.marian_id_map(_marian_config(True, 0.1)) == np.arange(V)).all()


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
    got = _apply(model, params, jnp.asarray(to_tfjax(inputs)), jnp.asarray(to_tfjax(targets)))
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

    def reference(eos):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor(sources),
                attention_mask=torch.tensor((sources != V - 1).astype(np.int64)),
                max_new_tokens=max_new,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
            ).numpy()  # pad_token_id and decoder_start_token_id V - 1 from the config
        assert (out[:, 0] == V - 1).all()  # the start token
        return out[:, 1:]

    free = reference(V + 5)  # no EOS: the full continuation
    assert len(set(free.ravel().tolist())) > 5, "degenerate reference; change the seed"
    eos = int(free[0, max_new // 2])  # in Marian ids
    want = reference(eos)
    tfjax_eos = int(interop.marian_to_tfjax_ids(eos, path))
    got, _ = decode.generate(
        model,
        params,
        interop.marian_to_tfjax_ids(sources, path),
        max_new_tokens=max_new,
        eos_id=tfjax_eos,
    )
    got = interop.tfjax_to_marian_ids(np.asarray(got), path)  # 0 after EOS -> Marian's pad
    for row_got, row_want in zip(got, want, strict=True):
        expected = _until_eos(row_want, eos)
        assert list(row_got[: len(expected)]) == expected
        assert (row_got[len(expected) :] == V - 1).all()
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


def test_marian_id_errors_are_one_line_naming_the_architecture():
    with pytest.raises(ValueError, match=r"^MarianMTModel: the config has no 'vocab_size'$"):
        interop.marian_id_map({})
    with pytest.raises(ValueError, match=r"^MarianMTModel: pad_token_id=None and decoder_start"):
        interop.marian_id_map({"vocab_size": 10})


def test_mistral_sliding_window_acts_in_the_compared_logits(mistral):
    """The Mistral fixture's comparisons exercise the window: without it, positions past the
    window (4) give other logits, the first four the same."""
    _, path = mistral
    model, params = interop.load(path)
    assert model.sliding_window == 4
    tokens = jnp.asarray(_tokens((1, 10)))
    windowed = _apply(model, params, tokens)
    full = _apply(model.clone(sliding_window=None), params, tokens)
    np.testing.assert_allclose(windowed[:, :4], full[:, :4], atol=1e-6)
    assert np.abs(windowed[:, 4:] - full[:, 4:]).max() > 1e-2
