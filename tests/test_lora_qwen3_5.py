"""LoRA on Qwen3.5 (Gated DeltaNet among gated full-attention layers): the default targets adapt
each projection a matmul multiplies, not the convolutions; a target naming a convolution is
refused by name."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from tfjax import lora
from tfjax.interop import pretrained as hf_pretrained
from tfjax.nnx.models import decoder as nnx_decoder

TOKENS = np.array([[1, 5, 9, 2, 30, 7, 7, 0]], np.int32)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """A tiny random Qwen3.5 checkpoint (linear, full attention): (model, params)."""
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_5")
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(path)
    model = hf_pretrained.pretrained_model(path)
    return model, hf_pretrained.pretrained_params(path, model)


def _adapted(params) -> dict[str, set[str]]:
    """{stack: the names of its adapted kernels}."""
    out = {}
    for k in flatten_dict(params):
        if k[-1].endswith("_lora_a"):
            name = "/".join(k[2:]).removesuffix("_lora_a")
            out.setdefault(k[0], set()).add(name)
    return out


def test_default_targets_adapt_the_projections_not_the_convolutions(qwen3_5):
    """Gated DeltaNet's query, key, value, gate, beta, dt and out kernels; the gated
    attention's query, key, value, gate and out kernels; the MLPs'. Not the convolutions."""
    model, params = qwen3_5
    adapted = lora.apply_lora(model, lora.LoraConfig(rank=2, targets=lora.DEFAULT_TARGETS))
    params = lora.init_params(adapted, params, jax.random.key(0), TOKENS)
    mlp = {"mlp/wi_0/kernel", "mlp/wi_1/kernel", "mlp/wo/kernel"}
    linear = ("query", "key", "value", "gate", "beta", "dt", "out")
    full = ("query", "key", "value", "gate", "out")
    assert _adapted(params) == {
        "decoder_0": mlp | {f"self_attention/{n}_kernel" for n in linear},
        "decoder_1": mlp | {f"self_attention/{n}_kernel" for n in full},
    }


def test_a_target_naming_a_convolution_is_refused_by_name(qwen3_5):
    """The convolution weights are multiplied elementwise (no matmul Qwix intercepts): a target
    naming one would leave it without adapters, so it is refused, named."""
    model, params = qwen3_5
    targets = ".*/self_attention/(query_conv|beta_kernel)"
    adapted = lora.apply_lora(model, lora.LoraConfig(rank=2, targets=targets))
    with pytest.raises(
        ValueError, match=r"matches decoder_0/layers_0/self_attention/query_conv: kernel\(s\)"
    ):
        lora.init_params(adapted, params, jax.random.key(0), TOKENS)
    # the NNX model's: refused when the adapters are made
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    fields = {k: v for k, v in fields.items() if k not in ("parent", "name")}
    with pytest.raises(
        ValueError,
        match=r"matches decoder_0/layers_0/self_attention/query_conv: convolution weights",
    ):
        lora.apply_lora(
            nnx_decoder.Model(**fields, rngs=nnx.Rngs(0)),
            lora.LoraConfig(rank=2, targets=targets),
            TOKENS,
            rngs=nnx.Rngs(1),
        )
