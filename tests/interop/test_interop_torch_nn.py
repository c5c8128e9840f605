"""torch.nn.Transformer with embeddings and torch.nn.MultiheadAttention
(tfjax.interop.families.torch_nn) against PyTorch: outputs with masks, logits, greedy decoding,
bitwise round trips (also back into the torch module), and bad input."""

import math
import os

import interop_references as references
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_params_identical, module_fields
from interop_references import ATOL, V, assert_rows_end_at_eos, seq2seq_batch, torch

from tfjax import decode, interop


def test_mha_self_attention_with_masks():
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


def test_mha_cross_attention_other_width_no_bias():
    torch.manual_seed(6)
    ref = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=12, bias=False, batch_first=True)
    ref.eval()
    mha, params = interop.from_torch_mha(ref)
    assert not mha.config.use_bias and params["key_kernel"].shape == (12, 2, 8)
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


def test_mha_rejects_bias_kv():
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        interop.from_torch_mha(ref)


# ----------------------------------------------------------------------------------------------
# torch.nn.Transformer with embeddings.


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


def _logits_of(ref):
    """The torch module's logits as a function of numpy ids."""

    def logits(inputs, decoder_inputs):
        with torch.no_grad():
            return ref(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy()

    return logits


def _torch_seq2seq(shared, seed=9, std=0.25):
    torch.manual_seed(seed)
    return _TorchSeq2Seq(shared=shared, std=std).eval()


@pytest.mark.parametrize(("shared", "scan_layers"), [(True, False), (False, True)])
def test_transformer_logits_match_reference(shared, scan_layers):
    ref = _torch_seq2seq(shared)
    model, params = interop.from_torch_transformer(ref, num_heads=4, scan_layers=scan_layers)
    assert model.share_embeddings == shared and model.num_layers == 2 and model.mlp_dim == 48
    references.check_seq2seq_logits(model, params, _logits_of(ref))


def test_transformer_greedy_decoding_matches_reference():
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
    assert_rows_end_at_eos(np.asarray(got), want, eos)


def test_transformer_round_trip_is_bitwise(tmp_path):
    ref = _torch_seq2seq(shared=True)
    model, params = interop.from_torch_transformer(ref, num_heads=4)
    state = interop.to_torch_transformer(model, params)
    assert state.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert np.array_equal(state[k], v.numpy()), k
    interop.write_safetensors(state, tmp_path)
    model2, params2 = interop.from_torch_transformer(tmp_path, num_heads=4)
    assert module_fields(model2) == module_fields(model)
    assert_params_identical(params, params2)
    # The exported state dict loads back into the torch module.
    again = _TorchSeq2Seq(shared=True).eval()
    again.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    inputs, _, decoder_inputs = seq2seq_batch()
    with torch.no_grad():
        want = ref(torch.tensor(inputs), torch.tensor(decoder_inputs))
        np.testing.assert_array_equal(
            again(torch.tensor(inputs), torch.tensor(decoder_inputs)).numpy(), want.numpy()
        )


def test_transformer_bad_input(tmp_path):
    ref = _torch_seq2seq(shared=False)
    state = dict(ref.state_dict())
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide the width 32"):
        interop.from_torch_transformer(state, num_heads=5)
    # Weights of another size than the embedding says: the key, its shape and the expected one.
    interop.write_safetensors(
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


def test_transformer_default_final_norms():
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
    references.check_seq2seq_logits(model, params, _logits_of(ref))
    state = interop.to_torch_transformer(model, params)
    assert state.keys() == ref.state_dict().keys()
