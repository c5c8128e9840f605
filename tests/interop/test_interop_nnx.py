"""tfjax.interop with the Flax NNX models (tfjax.nnx): a Hugging Face checkpoint loads into the
NNX model with the reference's logits (as the Linen model's are checked), unrolled and scanned,
for the decoder families; the NNX model exports back bit for bit; wrong uses are refused."""

import copy
import os

import flax
import interop_references as references
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields, with_random_lora_b
from flax import nnx
from interop_references import V, torch
from test_interop_gemma import gemma2, gemma3  # noqa: F401 (fixtures)
from test_interop_llama import llama, mistral, qwen3  # noqa: F401 (fixtures)
from test_interop_vit import hf_vit  # noqa: F401 (fixture)

from tfjax import interop, lora
from tfjax.interop import pretrained
from tfjax.nnx.models import decoder, load_params

gpt2 = references.gpt2
FAMILIES = ["gpt2", "llama", "mistral", "qwen3", "gemma2", "gemma3"]


def _nnx_logits(model, ids):
    """The NNX model's logits under jit (split / merge), as numpy."""
    graphdef, state = nnx.split(model)
    logits, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    return np.asarray(logits)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_nnx_logits_match_reference(family, scan_layers, request):
    """The logits equal a float64 copy of the reference's within the Linen interop tests'
    tolerance (unpadded rows: transformers' float64 Gemma gives NaN rows for a right-padded
    batch), and the Linen model's from the same file."""
    ref, path = request.getfixturevalue(family)
    model = interop.load(path, nnx=True, scan_layers=scan_layers)
    assert isinstance(model, decoder.Decoder)
    assert model.spec.scan_layers == scan_layers
    linen, params = interop.load(path, scan_layers=scan_layers)
    assert_params_identical(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)
    ids = references.tokens((2, 10))
    with torch.no_grad():
        want = copy.deepcopy(ref).double()(torch.tensor(ids)).logits.numpy()
    got = _nnx_logits(model, jnp.asarray(ids))
    assert got.shape == want.shape == (2, 10, V)
    np.testing.assert_allclose(got, want, atol=references.ATOL, rtol=0)
    np.testing.assert_allclose(
        got, references.apply(linen, params, jnp.asarray(ids)), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_nnx_round_trip_is_bitwise(family, scan_layers, request, tmp_path):
    """save(nnx model, dir) holds exactly the reference file's tensors under the same keys, and
    loads back (as NNX and as Linen) with the same fields and params, bit for bit."""
    _, path = request.getfixturevalue(family)
    model = interop.load(path, nnx=True, scan_layers=scan_layers)
    interop.save(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    original, exported = interop.read_state_dict(path), interop.read_state_dict(tmp_path)
    assert exported.keys() == original.keys()
    for k in original:
        assert np.array_equal(exported[k], original[k]), k
    again = interop.load(tmp_path, nnx=True, scan_layers=scan_layers)
    assert module_fields(again.spec) == module_fields(model.spec)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert_params_identical(nnx.to_pure_dict(nnx.state(again, nnx.Param)), params)
    linen, linen_params = interop.load(tmp_path, scan_layers=scan_layers)
    assert module_fields(linen) == module_fields(model.spec)
    assert_params_identical(linen_params, params)
    # export of the NNX model is the Linen export of its spec and params
    state, config = interop.export(model)
    linen_state, linen_config = interop.export(linen, linen_params)
    assert config == linen_config and state.keys() == linen_state.keys()


def test_an_nnx_model_built_from_its_spec_saves_and_loads_back(tmp_path):
    """An NNX model made directly (its `spec` a tfjax.specs dataclass, not a Linen model) saves
    as the Linen model of the same fields would, and loads back with the same logits."""
    model = decoder.Model(
        variant="gpt2-small",
        vocab_size=V,
        num_layers=2,
        width=32,
        num_heads=2,
        max_len=16,
        rngs=nnx.Rngs(0),
    )
    assert not isinstance(model.spec, flax.linen.Module)
    interop.save(model, tmp_path)
    again = interop.load(tmp_path, nnx=True)
    tokens = jnp.arange(8)[None] % V
    np.testing.assert_array_equal(_nnx_logits(again, tokens), _nnx_logits(model, tokens))
    assert_params_identical(
        nnx.to_pure_dict(nnx.state(again, nnx.Param)), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )


def test_nnx_rngs_seed_the_models_own_streams(gpt2):  # noqa: F811
    """rngs= seeds the NNX model's own streams (its dropout keys), not its parameters."""
    _, path = gpt2
    a = interop.load(path, nnx=True, rngs=nnx.Rngs(1))
    b = interop.load(path, nnx=True, rngs=nnx.Rngs(2))
    assert_params_identical(
        nnx.to_pure_dict(nnx.state(a, nnx.Param)), nnx.to_pure_dict(nnx.state(b, nnx.Param))
    )
    assert not np.array_equal(
        jax.random.key_data(a.rngs.default.key[...]), jax.random.key_data(b.rngs.default.key[...])
    )


def test_wrong_uses_are_refused(gpt2, tmp_path):  # noqa: F811
    _, path = gpt2
    linen, params = interop.load(path)
    model = interop.load(path, nnx=True)
    with pytest.raises(ValueError, match="rngs= is for the NNX model"):
        interop.load(path, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="holds its params; pass none"):
        interop.export(model, params)
    with pytest.raises(TypeError, match="needs its params"):
        interop.export(linen)
    with pytest.raises(TypeError, match=r"\(model, directory\) for an NNX model"):
        interop.save(model, params, tmp_path)
    with pytest.raises(TypeError, match=r"\(model, params, directory\) for a Linen one"):
        interop.save(linen, tmp_path)
    # params of another model are refused by path, before anything is put in
    small = jax.tree.map(lambda x: x[..., :1], params)
    with pytest.raises(ValueError, match=r"as_nnx: params\['.*'\] is float32\[.*1\]"):
        interop.as_nnx(linen, small)
    # a LoRA model's adapters are not exported silently
    lora_model = lora.apply_lora(
        model, lora.LoraConfig(rank=2), jnp.zeros((1, 4), jnp.int32), rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        interop.save(lora_model, tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_nnx_lora_adapters_export_for_peft(family, request, tmp_path):
    """An NNX LoRA model's adapters (random B, as after training) written by the runner's
    --adapters_only exporter (tfjax.runner.export.adapter_state, fed the NNX model's `spec`
    and params) and loaded by peft onto the reference: peft's logits are the NNX model's."""
    peft = pytest.importorskip("peft")
    from tfjax.runner import export

    ref, path = request.getfixturevalue(family)
    config = lora.LoraConfig(rank=2, alpha=4.0)
    ids = references.tokens((2, 9))
    model = interop.load(path, nnx=True)
    model = lora.apply_lora(model, config, jnp.asarray(ids), rngs=nnx.Rngs(0))
    params = with_random_lora_b(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    load_params(model, params)
    got = _nnx_logits(model, jnp.asarray(ids))

    state, targets = export.adapter_state(model.spec, params, pretrained.family_of(path)[0])
    tuned = peft.get_peft_model(
        copy.deepcopy(ref).double(),
        peft.LoraConfig(r=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=targets),
    )
    result = peft.set_peft_model_state_dict(
        tuned, {k: torch.tensor(np.asarray(v, np.float64)) for k, v in state.items()}
    )
    assert not result.unexpected_keys
    with torch.no_grad():
        want = tuned.eval()(torch.tensor(ids)).logits.numpy()
        before = copy.deepcopy(ref).double()(torch.tensor(ids)).logits.numpy()
    # The Linen path's peft check's tolerance (tests/runner/test_finetune.py): the adapters'
    # float32 matmuls round on top of the model's (1.2e-5 from float64 with jax 0.12).
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want - before).max() > 0.05  # the adapters act


@pytest.mark.parametrize("size", [None, (48, 40)])
def test_a_vit_loads_as_nnx_at_its_checkpoints_image_size(hf_vit, size):  # noqa: F811
    """A vision tower's NNX model is sized by the checkpoint's images (32 px), or by the
    image_size its positions are resampled to: the reference's logits either way."""
    ref, path = hf_vit
    model = interop.load(path, nnx=True, **({} if size is None else {"image_size": size}))
    h, w = size or (32, 32)
    images = np.random.RandomState(2).randn(2, 3, h, w).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.tensor(images), interpolate_pos_encoding=size is not None).logits.numpy()
    got = np.asarray(model(jnp.asarray(images.transpose(0, 2, 3, 1)))[0])
    np.testing.assert_allclose(got, want, atol=references.ATOL, rtol=0)
