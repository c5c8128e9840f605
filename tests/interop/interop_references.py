"""What the per-family interop tests share: small random reference models saved as
`save_pretrained` writes them (no download), inputs, and the checks several families run.

`reference` turns a function that builds a transformers model into a module fixture of
(reference, its saved directory), built once a session however many test files use it; a
test file uses a reference built here by naming it (`gpt2 = references.gpt2`). The checks
compare tfjax in float32 with the reference (float64 where said) within ATOL, and round trips
bit for bit.
"""

import copy
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
from tfjax.interop.core import tables  # noqa: E402
from tfjax.models import vit  # noqa: E402

V = 61
ATOL = 1e-5
_BUILT = {}  # name -> (reference, directory), for the whole session


def reference(build):
    """A module fixture named as `build`: (build(), the directory it is saved in), built once
    a session."""
    name = build.__name__

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        if name not in _BUILT:
            ref = build()
            _BUILT[name] = ref, save_pretrained(ref, tmp_path_factory.mktemp(name))
        return _BUILT[name]

    fixture.__doc__ = build.__doc__
    return fixture


def quiet():
    transformers.logging.set_verbosity_error()


def tokens(shape, seed=0, low=3):
    return np.random.RandomState(seed).randint(low, V, shape)


def apply(model, params, *args, **kwargs):
    """The model's first output under jit, as numpy."""
    out, _ = jax.jit(lambda p, *a: model.apply({"params": p}, *a, **kwargs))(params, *args)
    return np.asarray(out)


def padded_batch():
    """Rows of 10 tokens, the second right-padded after 6; returns (tokens, attention mask)."""
    ids = tokens((2, 10))
    ids[1, 6:] = 0
    return ids, ids != 0


def reference_generate(ref, prompts, max_new, eos, **options):
    """transformers' generate from unpadded prompts: greedy, unless `options` say otherwise."""
    with torch.no_grad():
        return ref.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            **options,
        )


def greedy_reference(ref, prompts, max_new, eos):
    """transformers' greedy continuation of unpadded prompts."""
    return reference_generate(ref, prompts, max_new, eos)[:, prompts.shape[1] :].numpy()


def until_eos(row, eos):
    row = list(row)
    return row[: row.index(eos) + 1] if eos in row else row


def assert_rows_end_at_eos(got, want, eos, pad=0):
    """Each row of `got` is `want`'s up to its first EOS, and `pad` after it."""
    for row_got, row_want in zip(got, want, strict=True):
        expected = until_eos(row_want, eos)
        assert list(row_got[: len(expected)]) == expected
        assert (row_got[len(expected) :] == pad).all()


# ----------------------------------------------------------------------------------------------
# References several test files read.


@reference
def gpt2():
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
    return transformers.GPT2LMHeadModel(config).eval()


def bert_config():
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


@reference
def bert_mlm():
    torch.manual_seed(2)
    return transformers.BertForMaskedLM(bert_config()).eval()


def marian_config(shared: bool, init_std: float):
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


@reference
def marian():
    """Shared embeddings (one matrix three ways, as Opus-MT)."""
    torch.manual_seed(8)
    ref = transformers.MarianMTModel(marian_config(True, 0.2)).eval()
    with torch.no_grad():  # norms that are not the identity, so a swapped norm would show
        for name, p in ref.named_parameters():
            if "layer_norm" in name:
                p.copy_(float(name.endswith("weight")) + 0.3 * torch.randn_like(p))
    return ref


def seq2seq_batch():
    """Source [2, 9] with row 1 padded after 5, targets [2, 7] with row 0 padded after 4, and
    the decoder inputs (targets shifted right behind the start token 0)."""
    rs = np.random.RandomState(11)
    inputs, targets = rs.randint(3, V, (2, 9)), rs.randint(3, V, (2, 7))
    inputs[1, 5:] = 0
    targets[0, 4:] = 0
    return inputs, targets, np.pad(targets, ((0, 0), (1, 0)))[:, :-1]


# ----------------------------------------------------------------------------------------------
# Checks several families run.


def check_decoder_logits(ref, path, scan_layers):
    """A right-padded batch's logits match a float64 copy of the reference where the mask is
    on."""
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers
    ids, mask = padded_batch()
    # The reference in float64: tfjax's float32 logits are compared with the exact ones, not
    # with another float32 rounding (both are ~2.5e-6 from them; once, in a full suite run,
    # the two float32 results differed by 1.5e-4, which did not recur).
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        want = ref64(
            torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits.numpy()
    got = apply(model, params, jnp.asarray(ids))
    assert got.shape == want.shape
    # Causal attention: real tokens never see the right padding; compare where the mask is on.
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def check_greedy_generation(ref, path):
    """12 new tokens after 5, token for token, with an EOS the reference emits mid-way in row 0
    (so stopping is exercised too)."""
    model, params = interop.load(path)
    prompts, max_new = tokens((3, 5), seed=7), 12
    free = greedy_reference(ref, prompts, max_new, eos=V + 5)
    eos = int(free[0, max_new // 2])
    want = greedy_reference(ref, prompts, max_new, eos=eos)
    got, _ = decode.generate(model, params, prompts, max_new_tokens=max_new, eos_id=eos)
    got = np.asarray(got)
    assert len(set(free.ravel().tolist())) > 3, "degenerate reference; raise the init scale"
    assert_rows_end_at_eos(got, want, eos)  # tfjax pads after EOS with 0
    assert eos in got[0]


def check_padded_prompts(ref, model, params, side):
    """Prompts of 5, 2 and 4 tokens in one batch padded on `side` (padding: the mask says, the
    ids are an ordinary token's), with the KV cache: each row's 9 new tokens (an EOS no row
    emits: all are compared) are the reference's for that prompt alone. Returns (the prompts,
    their mask, tfjax's output)."""
    ids, max_new, lengths = tokens((3, 5), seed=11), 9, (5, 2, 4)
    prompts, mask = np.full_like(ids, V - 1), np.zeros(ids.shape, bool)
    for row, n in enumerate(lengths):
        columns = slice(None, n) if side == "right" else slice(5 - n, None)
        prompts[row, columns], mask[row, columns] = ids[row, :n], True
    want = [
        greedy_reference(ref, ids[r : r + 1, :n], max_new, eos=V + 5)[0]
        for r, n in enumerate(lengths)
    ]
    eos = min(set(range(3, V)) - set(np.concatenate(want).tolist()))
    got, _ = decode.generate(model, params, prompts, mask=mask, max_new_tokens=max_new, eos_id=eos)
    for row, n in enumerate(lengths):
        assert list(np.asarray(got)[row]) == list(want[row]), (row, n)
    return prompts, mask, np.asarray(got)


def check_seq2seq_logits(model, params, reference_logits, *, jit=True):
    """The model's logits on seq2seq_batch() are `reference_logits(inputs, decoder_inputs)`
    where the targets are not padding (padded target rows differ by design: tfjax masks them
    fully). `jit=False` runs op by op: quicker for many small models, whose ops compile once."""
    inputs, targets, decoder_inputs = seq2seq_batch()
    want = reference_logits(inputs, decoder_inputs)
    if jit:
        got = apply(model, params, jnp.asarray(inputs), jnp.asarray(targets))
    else:
        got = np.asarray(model.apply({"params": params}, inputs, targets)[0])
    assert got.shape == want.shape == (2, 7, V)
    mask = targets != 0
    np.testing.assert_allclose(got[mask], want[mask], atol=ATOL, rtol=0)


def check_nnx_logits(path):
    """interop.as_nnx of the checkpoint at `path` gives Linen's logits on a padded batch (the
    NNX model compiled, as Linen's apply is); returns (model, params, nnx_model)."""
    from flax import nnx

    model, params = interop.load(path)
    nnx_model = interop.as_nnx(model, params)
    ids, _ = padded_batch()
    want = apply(model, params, jnp.asarray(ids))
    got = np.asarray(nnx.jit(lambda m, x: m(x)[0])(nnx_model, jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-6 * max(1.0, np.abs(want).max()), rtol=1e-6)
    return model, params, nnx_model


def check_round_trip(path, scan_layers, tmp_path):
    """save then load gives the same model and params bit for bit, and the export holds exactly
    the reference file's tensors (bitwise), under the same keys."""
    model, params = interop.load(path, scan_layers=scan_layers)
    interop.save(model, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    model2, params2 = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    original = interop.read_state_dict(path)
    exported = interop.read_state_dict(tmp_path)
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k


def check_transformers_reads_export(ref, path, tmp_path):
    """transformers' from_pretrained of the export gives the reference's logits exactly."""
    model, params = interop.load(path)
    interop.save(model, params, tmp_path)
    quiet()
    again = type(ref).from_pretrained(tmp_path).eval()
    # A fresh copy of the reference: dynamic RoPE keeps the longest length it has seen (the
    # generation tests reach 17 > max_position_embeddings) and would use its frequencies here.
    original = type(ref).from_pretrained(path).eval()
    ids = tokens((2, 9))
    with torch.no_grad():
        want = original(torch.tensor(ids)).logits.numpy()
        got = again(torch.tensor(ids)).logits.numpy()
    np.testing.assert_array_equal(got, want)


def check_config_refused(path, changes, message):
    """The loader of the config's architecture refuses the changed config, naming the key, its
    value and what tfjax supports."""
    config = {**interop.read_config(path), **changes}
    with pytest.raises(ValueError, match=message):
        interop.ARCHITECTURES[config["architectures"][0]](path, config)


# ----------------------------------------------------------------------------------------------
# Vision towers: tfjax in float32 gives a float64 copy of the reference's last_hidden_state and
# pooler_output within ATOL.

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=28)


def randomised(ref, std=0.3):
    """Norms, biases, layer scales, tokens, the probe and the position embeddings random (the
    projections keep transformers' small init, so activations stay near 1), so a swapped or
    missing one shows in the outputs."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim >= 2 and "position" not in name and "token" not in name:
                continue
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
            p.copy_(base + std * torch.randn_like(p))
    return ref


def tower(cls, config, seed):
    torch.manual_seed(seed)
    return randomised(cls(config).eval())


@reference
def dinov2():
    config = transformers.Dinov2Config(**SMALL, patch_size=7, layerscale_value=0.5)
    return tower(transformers.Dinov2Model, config, 0)


def images(h, w, seed=0):
    return np.random.RandomState(seed).randn(2, 3, h, w).astype(np.float32)  # NCHW


def tower_reference(ref, pixels, **kwargs):
    """(last_hidden_state, pooler_output) of a float64 copy of the reference."""
    ref64 = copy.deepcopy(ref).double()
    with torch.no_grad():
        out = ref64(torch.tensor(pixels, dtype=torch.float64), **kwargs)
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def tower_outputs(model, params, pixels):
    """(aux["encoded"], the pooled output) of a tfjax tower."""
    fn = jax.jit(lambda p, x: model.apply({"params": p}, x))
    pooled, aux = fn(params, jnp.asarray(pixels.transpose(0, 2, 3, 1)))
    return np.asarray(aux["encoded"]), np.asarray(pooled)


def check_tower_outputs(ref, path, scan_layers):
    model, params = interop.load(path, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers and model.num_classes is None
    pixels = images(28, 28)
    encoded, pooled = tower_outputs(model, params, pixels)
    want_encoded, want_pooled = tower_reference(ref, pixels)
    np.testing.assert_allclose(encoded, want_encoded, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)


def check_tower_at_image_size(ref, path, size, **reference_kwargs):
    """At another image size the outputs are the reference's interpolated ones."""
    model, params = interop.load(path, image_size=size, scan_layers=True)
    pixels = images(*size, seed=1)
    encoded, pooled = tower_outputs(model, params, pixels)
    want_encoded, want_pooled = tower_reference(ref, pixels, **reference_kwargs)
    np.testing.assert_allclose(encoded, want_encoded, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)


def check_tower_round_trip(ref, path, scan_layers, tmp_path):
    """save then load is bitwise; the export holds the reference file's tensors bitwise (CLIP
    and SigLIP under the "vision_model." prefix that hub files carry, which transformers reads
    as well); transformers reads the export."""
    model, params = interop.load(path, scan_layers=scan_layers)
    interop.save(model, params, tmp_path)
    model2, params2 = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    original = interop.read_state_dict(path)
    exported = {
        k.removeprefix("vision_model."): v for k, v in interop.read_state_dict(tmp_path).items()
    }
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k
    if scan_layers:
        return
    quiet()
    again = type(ref).from_pretrained(tmp_path).eval()
    pixels = images(28, 28, seed=3)
    with torch.no_grad():
        a, b = ref(torch.tensor(pixels)), again(torch.tensor(pixels))
    np.testing.assert_array_equal(a.pooler_output.numpy(), b.pooler_output.numpy())
    np.testing.assert_array_equal(a.last_hidden_state.numpy(), b.last_hidden_state.numpy())


def check_loader_refuses(path, edited, message):
    """The loader of the checkpoint's architecture, given its state dict and `edited(config)`,
    refuses with `message`."""
    state, config = interop.read_state_dict(path), interop.read_config(path)
    loader = interop.ARCHITECTURES[config["architectures"][0]]
    with pytest.raises(ValueError, match=message):
        loader(state, edited(config))


def parameter_count(model, size) -> int:
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3), jnp.float32))
    )
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))


def check_preset_is_transformers_count(variant, registers):
    """The preset's exported config.json, built by transformers on the meta device, has exactly
    the preset's parameter count and loads back as the same model."""
    model = vit.Model(variant, num_registers=registers)
    family = interop.REGISTRY.exporter(model).family(model)
    size = vit.TRAINED_IMAGE_SIZES[variant]
    config = tables.hf_config(family, model) | {"image_size": size, "num_channels": 3}
    assert vit.Model(**tables.model_fields(family, config)) == model
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        reference = getattr(transformers, config["architectures"][0])(hf_config)
    want = sum(p.numel() for p in reference.parameters())
    assert parameter_count(model, size) == want
